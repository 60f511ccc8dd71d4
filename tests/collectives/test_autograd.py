"""Gradients of the differentiable collectives.

A collective's backward is itself a collective, so it must run inside the
replica function. The tests therefore build one GLOBAL function of every
replica's input: its forward runs the collective on every replica (keeping
each replica's graph), its backward runs ``torch.autograd.grad`` on every
replica through that graph. ``torch.autograd.gradcheck`` checks it against
finite differences, and a vector-Jacobian product is compared with autograd
of a plain-torch reference on the same inputs.
"""

from __future__ import annotations

import functools

import pytest
import torch

import crossreplica as cr

_strategies: dict[int, cr.MirroredStrategy] = {}


def _strategy(n):
    if n not in _strategies:
        _strategies[n] = cr.MirroredStrategy(num_replicas=n, timeout_seconds=30)
    return _strategies[n]


class GlobalCollective(torch.autograd.Function):
    """``[x_0, ..., x_{n-1}] -> [y_0, ..., y_{n-1}]`` with ``y_r = collective(x_r)`` on replica r."""

    @staticmethod
    def forward(ctx, strategy, collective, *xs):
        def fwd(x):
            x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                y = collective(x)
            return x, y

        pairs = strategy.experimental_local_results(strategy.run(fwd, args=(cr.PerReplica(list(xs)),)))
        ctx.strategy, ctx.pairs = strategy, list(pairs)
        return tuple(y.detach().clone() for _, y in pairs)

    @staticmethod
    def backward(ctx, *grads):
        def bwd(pair, g):
            x, y = pair
            with torch.enable_grad():
                (gx,) = torch.autograd.grad(y, x, g.contiguous(), retain_graph=True)
            return gx

        strategy = ctx.strategy
        out = strategy.run(bwd, args=(cr.PerReplica(ctx.pairs), cr.PerReplica(list(grads))))
        return (None, None, *strategy.experimental_local_results(out))


def _in_groups(groups, n, per_group):
    """Reference helper: applies ``per_group(list of member inputs) -> list of member outputs``."""
    def ref(xs):
        outs = [None] * n
        for g in groups:
            for r, y in zip(g, per_group([xs[m] for m in g])):
                outs[r] = y
        return outs
    return ref


def _reduce(fn, xs, k):
    return [functools.reduce(fn, xs)] * k


def _mean(xs, k):
    return [functools.reduce(torch.add, xs) / len(xs)] * k


G4 = [[0, 1], [2, 3]]
G4_REVERSED = [[3, 1], [2, 0]]

CASES = [
    # name, n, shape_of(r), collective, reference over a group
    ("all_reduce-sum", 2, lambda r: (2, 3), lambda x: cr.all_reduce(x, "sum"),
     lambda xs: _reduce(torch.add, xs, len(xs)), None),
    ("all_reduce-sum-groups", 4, lambda r: (3,), lambda x: cr.all_reduce(x, "sum", G4),
     lambda xs: _reduce(torch.add, xs, len(xs)), G4),
    ("all_reduce-mean", 4, lambda r: (2, 2), lambda x: cr.all_reduce(x, "mean"), lambda xs: _mean(xs, len(xs)), None),
    ("cross_replica_mean-groups", 4, lambda r: (3,), lambda x: cr.cross_replica_mean(x, [0, 1, 0, 1]),
     lambda xs: _mean(xs, len(xs)), [[0, 2], [1, 3]]),
    ("all_reduce-max", 4, lambda r: (5,), lambda x: cr.all_reduce(x, "max"),
     lambda xs: _reduce(torch.maximum, xs, len(xs)), None),
    ("all_reduce-min-groups", 4, lambda r: (5,), lambda x: cr.all_reduce(x, "min", G4),
     lambda xs: _reduce(torch.minimum, xs, len(xs)), G4),
    ("all_gather-dim0", 3, lambda r: (2, 2), lambda x: cr.all_gather(x, 0), lambda xs: [torch.cat(xs, 0)] * len(xs), None),
    ("all_gather-dim1-groups", 4, lambda r: (2, 2), lambda x: cr.all_gather(x, 1, G4_REVERSED),
     lambda xs: [torch.cat(xs, 1)] * len(xs), G4_REVERSED),
    ("all_gather-uneven", 3, lambda r: (r + 1, 2), lambda x: cr.all_gather(x, 0),
     lambda xs: [torch.cat(xs, 0)] * len(xs), None),
    ("all_gather-uneven-groups", 4, lambda r: (r % 3 + 1, 2), lambda x: cr.all_gather(x, 0, G4_REVERSED),
     lambda xs: [torch.cat(xs, 0)] * len(xs), G4_REVERSED),
    ("reduce_scatter-sum", 2, lambda r: (4, 3), lambda x: cr.reduce_scatter(x, "sum", 0),
     lambda xs: list(functools.reduce(torch.add, xs).chunk(len(xs), 0)), None),
    ("reduce_scatter-mean-dim1-groups", 4, lambda r: (2, 4), lambda x: cr.reduce_scatter(x, "mean", 1, G4_REVERSED),
     lambda xs: list((functools.reduce(torch.add, xs) / len(xs)).chunk(len(xs), 1)), G4_REVERSED),
    ("all_to_all", 2, lambda r: (4, 2), lambda x: cr.all_to_all(x, 0, 1),
     lambda xs: [torch.cat([x.chunk(len(xs), 0)[p] for x in xs], 1) for p in range(len(xs))], None),
    ("all_to_all-groups", 4, lambda r: (2, 4), lambda x: cr.all_to_all(x, 1, 0, G4_REVERSED),
     lambda xs: [torch.cat([x.chunk(len(xs), 1)[p] for x in xs], 0) for p in range(len(xs))], G4_REVERSED),
    ("broadcast", 3, lambda r: (3,), lambda x: cr.broadcast(x, 1), lambda xs: [xs[1]] * len(xs), None),
    ("broadcast-groups", 4, lambda r: (2,), lambda x: cr.broadcast(x, 0, G4_REVERSED),
     lambda xs: [xs[0]] * len(xs), G4_REVERSED),
    ("collective_permute-cycle", 3, lambda r: (2,), lambda x: cr.collective_permute(x, [(0, 1), (1, 2), (2, 0)]),
     lambda xs: [xs[2], xs[0], xs[1]], None),
    ("collective_permute-partial", 4, lambda r: (2,), lambda x: cr.collective_permute(x, [(0, 3), (2, 1)]),
     lambda xs: [torch.zeros_like(xs[0]), xs[2], torch.zeros_like(xs[2]), xs[0]], None),
    ("one-replica-all_gather", 1, lambda r: (2, 2), lambda x: cr.all_gather(x, 0), lambda xs: [xs[0]], None),
]


def _reference(n, per_group, groups):
    if groups is None:
        return per_group
    return _in_groups(groups, n, per_group)


@pytest.mark.parametrize("name, n, shape_of, collective, per_group, groups", CASES, ids=[c[0] for c in CASES])
def test_gradients(name, n, shape_of, collective, per_group, groups):
    strategy = _strategy(n)
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    xs = tuple(torch.randn(shape_of(r), generator=gen, dtype=torch.float64, requires_grad=True) for r in range(n))
    reference = _reference(n, per_group, groups)

    def global_fn(*inputs):
        return GlobalCollective.apply(strategy, collective, *inputs)

    outs = global_fn(*xs)
    ref_outs = reference(list(xs))
    for o, e in zip(outs, ref_outs):
        assert o.shape == e.shape and torch.equal(o, e)

    assert torch.autograd.gradcheck(global_fn, xs, eps=1e-6, atol=1e-7)

    cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    got = torch.autograd.grad(outs, xs, cotangents)
    # reference outputs that are constants (zeros of a permute) contribute nothing
    live = [(o, c) for o, c in zip(ref_outs, cotangents) if o.requires_grad]
    expected = torch.autograd.grad([o for o, _ in live], xs, [c for _, c in live], allow_unused=True)
    for g, e, x in zip(got, expected, xs):
        e = torch.zeros_like(x) if e is None else e
        assert torch.allclose(g, e, rtol=1e-12, atol=1e-12)


def _train_step(x, w):
    # a realistic use: backward inside the replica function, through a collective
    w = w.detach().requires_grad_(True)
    loss = cr.all_gather((x * w).sum(0, keepdim=True), 0).pow(2).sum()
    loss.backward()
    return w.grad


def test_backward_inside_replica_function_matches_reference():
    n = 4
    strategy = _strategy(n)
    xs = [torch.randn(r + 1, 3, dtype=torch.float64) for r in range(n)]
    w = torch.randn(3, dtype=torch.float64)
    grads = strategy.experimental_local_results(strategy.run(_train_step, args=(cr.PerReplica(xs), w)))
    # reference: the global objective is the sum of every replica's loss; each
    # replica's loss sees every replica's copy of w through the gather
    ws = [w.clone().requires_grad_(True) for _ in range(n)]
    loss = torch.cat([(xs[m] * ws[m]).sum(0, keepdim=True) for m in range(n)], 0).pow(2).sum()
    expected = torch.autograd.grad(n * loss, ws)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, rtol=1e-12, atol=1e-12)


def test_non_float_outputs_are_not_differentiable():
    strategy = _strategy(2)

    def fn(x):
        y = x.detach().requires_grad_(True)
        out = cr.all_reduce({"f": y, "i": torch.ones(2, dtype=torch.int64)})
        return out["f"].requires_grad, out["i"].requires_grad

    out = strategy.run(fn, args=(cr.PerReplica([torch.ones(2), torch.ones(2)]),))
    assert out == (True, False)


def test_gradient_of_prod_is_a_clear_error():
    strategy = _strategy(2)

    def fn(x):
        y = x.detach().requires_grad_(True)
        cr.all_reduce(y, "prod").sum().backward()

    with pytest.raises(RuntimeError, match=r"the gradient of all_reduce with op=prod is not implemented"):
        strategy.run(fn, args=(cr.PerReplica([torch.ones(2), torch.ones(2)]),))
