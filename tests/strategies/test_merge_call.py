"""merge_call: one merge_fn in cross-replica context, regrouped
arguments, each replica's part back; disagreeing replicas get an error."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import crossreplica as cr


@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_fn_runs_once_in_cross_replica_context_with_regrouped_args(n):
    strategy = cr.MirroredStrategy(num_replicas=n)
    shared = object()
    calls = []

    def merge_fn(s, per_replica, same, *, scale):
        calls.append(threading.get_ident())
        assert s is strategy
        assert cr.in_cross_replica_context() and cr.get_replica_context() is None
        assert cr.get_strategy() is strategy
        assert same is shared
        values = per_replica.values if n > 1 else (per_replica,)
        assert [int(v) for v in values] == list(range(n))
        scales = scale.values if n > 1 else (scale,)
        total = sum(int(v) * k for v, k in zip(values, scales))
        # a PerReplica result hands each replica its own part; a plain one is shared
        parts = cr.PerReplica([f"part-{i}" for i in range(n)]) if n > 1 else "part-0"
        return parts, total

    def fn():
        rid = cr.replica_id()
        part, total = cr.get_replica_context().merge_call(
            merge_fn, args=(torch.tensor(rid), shared), kwargs={"scale": 10 * rid})
        return part, total, cr.get_replica_context().replica_id_in_sync_group

    out = strategy.run(fn)
    assert len(calls) == 1
    results = [cr.select_replica(i, out) for i in range(n)] if n > 1 else [out]
    expected_total = sum(10 * i * i for i in range(n))
    assert results == [(f"part-{i}", expected_total, i) for i in range(n)]


def test_merge_call_result_with_mirrored_and_nests():
    strategy = cr.MirroredStrategy(num_replicas=2)

    def merge_fn(s, x):
        total = s.reduce("sum", x)
        return {"sum": cr.Mirrored([total, total.clone()]), "tag": "same"}

    def fn():
        return cr.get_replica_context().merge_call(merge_fn, args=(torch.tensor([1.0, cr.replica_id()]),))

    out = strategy.run(fn)
    assert out["tag"] == "same"
    for v in out["sum"].values:
        assert torch.equal(v, torch.tensor([2.0, 1.0]))


def test_several_merge_calls_and_collectives_interleave():
    strategy = cr.MirroredStrategy(num_replicas=3)

    def fn():
        ctx = cr.get_replica_context()
        a = ctx.merge_call(lambda s, v: s.reduce("max", v), args=(torch.tensor(float(ctx.replica_id_in_sync_group)),))
        b = cr.all_reduce(torch.tensor(1.0))
        c = ctx.merge_call(lambda s, v: s.reduce("sum", v), args=(a * b,))
        return c

    out = strategy.run(fn)
    # max over replicas is 2, the all-reduced one is 3: every replica passes 6, summed over 3.
    # merge_fn's single result is the same object on every replica, so run returns it unwrapped.
    assert torch.equal(out, torch.tensor(18.0))


@pytest.mark.parametrize("counts", [(1, 2), (2, 1), (0, 1), (1, 1, 0, 1)])
def test_different_number_of_merge_calls_is_an_error(counts):
    strategy = cr.MirroredStrategy(num_replicas=len(counts), timeout_seconds=20)

    def fn():
        for _ in range(counts[cr.replica_id()]):
            cr.get_replica_context().merge_call(lambda s: None)
        return cr.replica_id()

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"replicas made a different number of merge_call\(\) calls") as info:
        strategy.run(fn)
    assert time.monotonic() - start < 3
    assert isinstance(info.value, cr.CollectiveMismatchError)
    assert "<returned from the replica function>" in str(info.value)
    # usable afterwards
    assert strategy.run(cr.replica_id).values == tuple(range(len(counts)))


def test_merge_call_against_collective_is_a_mismatch():
    strategy = cr.MirroredStrategy(num_replicas=2)

    def fn():
        if cr.replica_id() == 0:
            return cr.get_replica_context().merge_call(lambda s: 1)
        return cr.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(cr.CollectiveMismatchError, match=r"(?s)replica 0: merge_call\(\).*replica 1: all_reduce\("):
        strategy.run(fn)
    assert time.monotonic() - start < 3


def test_merge_fn_that_raises():
    strategy = cr.MirroredStrategy(num_replicas=2)

    def merge_fn(s):
        raise ValueError("merge failed")

    with pytest.raises(ValueError, match=r"merge failed"):
        strategy.run(lambda: cr.get_replica_context().merge_call(merge_fn))
    assert strategy.run(lambda: 5) == 5


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"merge_fn": 3}, TypeError, r"merge_fn must be callable; got 3"),
    ({"merge_fn": print, "args": 3}, TypeError, r"args must be a tuple of positional arguments; got 3"),
    ({"merge_fn": print, "kwargs": [1]}, TypeError, r"kwargs must be a dict or None; got \[1\]"),
])
def test_merge_call_bad_arguments(kwargs, exc, match):
    strategy = cr.OneDeviceStrategy()
    with pytest.raises(exc, match=match):
        strategy.run(lambda: cr.get_replica_context().merge_call(**kwargs))


def test_merge_call_single_replica_strategy():
    strategy = cr.OneDeviceStrategy()
    out = strategy.run(lambda x: cr.get_replica_context().merge_call(lambda s, v: v * 2, args=(x,)),
                       args=(torch.tensor(3),))
    assert torch.equal(out, torch.tensor(6))


def test_raising_replica_releases_a_replica_waiting_in_merge_call():
    strategy = cr.MirroredStrategy(num_replicas=3)  # default timeout: only a release ends this fast

    def fn():
        if cr.replica_id() == 2:
            raise ValueError("replica 2 fails before merging")
        return cr.get_replica_context().merge_call(lambda s: 1)

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"replica 2 raised ValueError: replica 2 fails before merging") as info:
        strategy.run(fn)
    assert time.monotonic() - start < 3
    assert info.value.replica_id == 2
    assert strategy.run(lambda: cr.get_replica_context().merge_call(lambda s: 7)) == 7


def test_replica_missing_from_merge_call_times_out():
    strategy = cr.MirroredStrategy(num_replicas=2, timeout_seconds=0.3)

    def fn():
        if cr.replica_id() == 1:
            time.sleep(1.0)
            return None
        return cr.get_replica_context().merge_call(lambda s: 1)

    start = time.monotonic()
    with pytest.raises(cr.CollectiveTimeoutError, match=r"merge_call\(\) timed out after 0\.3s: replicas \[1\] never arrived"):
        strategy.run(fn)
    assert time.monotonic() - start < 4


@pytest.mark.parametrize("merging_replica_arrives", ["first", "last"])
def test_merge_call_against_collective_in_either_arrival_order(merging_replica_arrives):
    strategy = cr.MirroredStrategy(num_replicas=2, timeout_seconds=20)
    delay = {"first": (0.0, 0.2), "last": (0.2, 0.0)}[merging_replica_arrives]

    def fn():
        time.sleep(delay[cr.replica_id()])
        if cr.replica_id() == 0:
            return cr.get_replica_context().merge_call(lambda s, *a: "merged")
        return cr.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(cr.CollectiveMismatchError, match=r"(?s)replica 0: merge_call\(\).*replica 1: all_reduce\("):
        strategy.run(fn)
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("make", [lambda: cr.MirroredStrategy(num_replicas=2), cr.OneDeviceStrategy],
                         ids=["mirrored", "one_device"])
def test_run_from_merge_fn_is_an_immediate_error(make):
    strategy = make()  # default timeout (300 s): only an immediate error ends this fast

    def fn():
        return cr.get_replica_context().merge_call(lambda s: s.run(lambda: 1))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"strategy\.run was called while a run of the same strategy is in "
                                           r"progress \(from a replica function or merge_fn\)"):
        strategy.run(fn)
    assert time.monotonic() - start < 3
    assert strategy.run(lambda: 2) == 2


def test_collective_inside_merge_fn_is_a_replica_context_error():
    strategy = cr.MirroredStrategy(num_replicas=2)

    def fn():
        return cr.get_replica_context().merge_call(lambda s: cr.all_reduce(torch.ones(1)))

    start = time.monotonic()
    with pytest.raises(cr.ReplicaContextError, match=r"cr\.all_reduce must be called inside a replica function, but was "
                                                     r"called in cross-replica context \(strategy\.scope\(\) or merge_fn\)"):
        strategy.run(fn)
    assert time.monotonic() - start < 3
