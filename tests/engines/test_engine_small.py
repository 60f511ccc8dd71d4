"""Small all-reduces among many replicas: the leader's one-buffer outputs (threads engine)."""

import functools

import pytest
import torch

import crossreplica as cr
from crossreplica.engines.base import Call, Kind
from crossreplica.engines.kinds import AllReduceParams
from crossreplica.engines.threads import ThreadsEngine

_FOLD = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


def _reduce_then_modify(xs, op, groups):
    rid = cr.replica_id()
    outs = cr.all_reduce(xs, op, groups)
    first = [o.clone() for o in outs]
    for o in outs:  # each replica changes its own outputs in place...
        o.add_(rid)
    cr.all_reduce(torch.zeros(1))  # ...before any other replica reads its own
    return first, [o.clone() for o in outs]


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("grouped", [False, True])
def test_outputs_are_exact_and_private(run_replicas, op, grouped):
    n = 9
    gen = torch.Generator().manual_seed(0)
    xs = [[torch.randn(5, 3, generator=gen), torch.randn((), generator=gen), torch.randn(0, generator=gen),
           torch.randint(-9, 9, (4,), generator=gen, dtype=torch.int64)] for _ in range(n)]
    if op == "mean":  # mean needs floating point
        xs = [x[:3] for x in xs]
    groups = [[0, 4, 8], [1, 2, 3], [5, 6, 7]] if grouped else None
    results = run_replicas(_reduce_then_modify, n, xs, [op] * n, [groups] * n)
    for r, (first, later) in enumerate(results):
        group = next(g for g in groups if r in g) if grouped else range(n)
        for t, (out, mine) in enumerate(zip(first, later)):
            ref = functools.reduce(_FOLD[op], [xs[m][t] for m in sorted(group)])
            if op == "mean":
                ref = ref / len(group)
            assert torch.equal(out, ref), (r, t)
            assert torch.equal(mine, ref + r), (r, t)  # no other replica's change reached it


def _bools(x):
    return cr.all_reduce(x, "max"), cr.all_reduce(x, "min")


def test_bool_outputs(run_replicas):
    n = 8
    xs = [torch.tensor([r == 3, True, False, r % 2 == 0]) for r in range(n)]
    for any_, all_ in run_replicas(_bools, n, xs):
        assert torch.equal(any_, torch.stack(xs).any(0)) and torch.equal(all_, torch.stack(xs).all(0))


def _modify_under_autograd(x):
    x = x.clone().requires_grad_(True)
    y = cr.all_reduce(x * 1.0)
    y.mul_(2)  # in place on the output of a differentiable collective
    y.sum().backward()
    return y.detach(), x.grad


def test_outputs_of_a_differentiable_call_can_be_modified_in_place(run_replicas):
    n = 8
    xs = [torch.randn(6, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    ref = functools.reduce(torch.add, xs) * 2
    for y, grad in run_replicas(_modify_under_autograd, n, xs):
        assert torch.equal(y, ref)
        assert torch.equal(grad, torch.full((6,), 2.0 * n))  # the backward is the all-reduce of 2s


def test_the_engine_checks_a_means_overflow_once_for_every_replica():
    cpu = torch.device("cpu")
    engine = ThreadsEngine([cpu] * 4, timeout=5)
    every = ((0, 1, 2, 3),)

    def call(dtype=torch.float32, op=cr.ReduceOp.MEAN, inplace=False, groups=every, numel=1024):
        return Call.of(Kind.ALL_REDUCE, groups, AllReduceParams(op, inplace), [torch.zeros(numel, dtype=dtype)])

    assert engine.checks_mean_overflow(call())
    assert engine.checks_mean_overflow(call(torch.float64)) and engine.checks_mean_overflow(call(torch.complex64))
    assert not engine.checks_mean_overflow(call(torch.bfloat16))  # summed in float32: checked per replica
    assert not engine.checks_mean_overflow(call(op=cr.ReduceOp.SUM))
    assert not engine.checks_mean_overflow(call(inplace=True))
    assert not engine.checks_mean_overflow(call(groups=((0, 1), (2, 3))))
    assert engine.checks_mean_overflow(call(numel=1 << 20))  # the parallel path: each sharer checks its share
    engine.close()
