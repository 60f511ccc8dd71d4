"""The engines' asynchronous in-place all-reduce (``Engine.execute_async``): started
calls finish with the synchronous path's bytes, in any order of waits, around other
collectives, and a replica that fails, is late, returns early or disagrees releases
the others (the threads engine's rounds: ``engines/async_rounds.py``)."""

import functools
import time

import pytest
import torch

import crossreplica as cr
from crossreplica.engines.base import AllReduceParams, Call, Kind
from crossreplica.engines.wire import start_on_wire
from crossreplica.reduce_op import ReduceOp

SIZES = [7, 300_000, 1_000_003]  # less than a chunk, several chunks, a ragged last chunk


def _start(x: torch.Tensor, op: ReduceOp = ReduceOp.MEAN):
    rctx = cr.get_replica_context()
    groups = (tuple(range(rctx.num_replicas_in_sync)),)
    return start_on_wire(rctx.engine, rctx.replica_id_in_sync_group,
                         Call.of(Kind.ALL_REDUCE, groups, AllReduceParams(op, inplace=True), [x]), [x])


def _several(xs, op, wait_order):
    """Starts one call per tensor, then a synchronous collective, then waits in ``wait_order``."""
    ys = [x.clone() for x in xs]
    pendings = [_start(y, op) for y in ys]
    total = cr.all_reduce(torch.ones(3), "sum")  # an ordinary round while the calls are under way
    outs = [None] * len(ys)
    for k in wait_order:
        outs[k] = pendings[k].wait()[0]
    return [o is y for o, y in zip(outs, ys)], ys, total


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX])
def test_started_calls_give_the_synchronous_bytes(run_replicas, n, op):
    per = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * r + k)) for k, s in enumerate(SIZES)]
           for r in range(n)]
    orders = [[2, 0, 1] if r % 2 else [0, 1, 2] for r in range(n)]
    results = run_replicas(_several, n, per, [op] * n, orders)
    fold = torch.maximum if op is ReduceOp.MAX else torch.add
    for same, ys, total in results:
        assert all(same)  # in place: the outputs are the tensors handed in
        assert torch.equal(total, torch.full((3,), float(n)))
        for k in range(len(SIZES)):
            ref = functools.reduce(fold, [per[r][k] for r in range(n)])
            if op is ReduceOp.MEAN:
                ref = ref / n
            assert torch.equal(ys[k], ref)


def _raises_after_starting(x):
    pending = _start(x.clone())
    if cr.replica_id() == 1:
        raise RuntimeError("replica 1 failed with a call under way")
    pending.wait()
    return True


def test_failing_replica_releases_a_waiting_one(run_replicas, time_bound):
    t0 = time.monotonic()
    with pytest.raises(Exception, match="replica 1 failed"):
        run_replicas(_raises_after_starting, 2, [torch.ones(1000)] * 2)
    assert time.monotonic() - t0 < time_bound(10)


def _late(x):
    if cr.replica_id() == 1:
        time.sleep(4)
    _start(x.clone()).wait()
    return True


def _fails_within(fn, error, match, timeout, bound):
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2, timeout_seconds=timeout)
    t0 = time.monotonic()
    with pytest.raises(error, match=match):
        s.run(fn, args=(torch.ones(10),))
    assert time.monotonic() - t0 < bound


def test_late_replica_times_out_naming_it():
    _fails_within(_late, cr.CollectiveTimeoutError, r"replicas \[1\] never arrived", timeout=1.0, bound=8)


def _returns_early(x):
    if cr.replica_id() == 1:
        return True  # never starts the call replica 0 waits for
    _start(x.clone()).wait()
    return True


def test_replica_returning_early_is_a_mismatch():
    _fails_within(_returns_early, cr.CollectiveMismatchError, r"replicas \[1\] returned", timeout=30.0, bound=5)


def _disagree(x):
    _start(torch.ones(10 + cr.replica_id())).wait()
    return True


def test_disagreeing_calls_are_a_mismatch():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2, timeout_seconds=30.0)
    with pytest.raises(cr.CollectiveMismatchError, match="replica 1: all_reduce"):
        s.run(_disagree, args=(torch.ones(1),))
    # the next run starts clean
    assert all(s.experimental_local_results(s.run(_several, args=([torch.ones(5)], ReduceOp.SUM, [0])))[0][0])


def test_threads_engine_takes_the_asynchronous_rounds():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)

    def fn():
        x = torch.full((4,), float(cr.replica_id()))
        pending = _start(x, ReduceOp.SUM)
        return pending._finish is not None, pending.wait()[0]  # not finished when started
    for started, out in s.experimental_local_results(s.run(fn)):
        assert started and torch.equal(out, torch.ones(4))


def _started_unfinished(x):
    pending = _start(x.clone(), ReduceOp.SUM)
    started = pending._finish is not None  # not finished when started: the call overlaps
    return started, pending.wait()[0]


def test_four_replicas_overlap_on_every_engine(run_replicas):
    """Threads: the asynchronous rounds; processes, 2 workers x 2 replicas: the hierarchical
    engine's leader starts one async all-gather for its worker."""
    xs = [torch.full((5,), float(r)) for r in range(4)]
    for started, out in run_replicas(_started_unfinished, 4, xs):
        assert started and torch.equal(out, torch.full((5,), 6.0))
