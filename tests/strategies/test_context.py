"""Strategy and replica contexts: the scope stack, replica contexts and their properties."""

from __future__ import annotations

import threading

import pytest
import torch

import crossreplica as cr


def test_default_strategy_outside_any_scope():
    s = cr.get_strategy()
    assert isinstance(s, cr.OneDeviceStrategy)
    assert s.num_replicas_in_sync == 1
    assert cr.get_strategy() is s  # one default, not a new one per call
    assert not cr.has_strategy()
    assert not cr.in_cross_replica_context()
    ctx = cr.get_replica_context()  # TF's default replica context: one replica
    assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1 and ctx.strategy is s


@pytest.mark.parametrize("make", [cr.OneDeviceStrategy, lambda: cr.MirroredStrategy(num_replicas=2)],
                         ids=["one_device", "mirrored"])
def test_scope_is_cross_replica_context(make):
    strategy = make()
    with strategy.scope() as s:
        assert s is strategy
        assert cr.get_strategy() is strategy
        assert cr.has_strategy()
        assert cr.in_cross_replica_context()
        assert cr.get_replica_context() is None
        with strategy.scope():  # re-entering the same strategy is fine
            assert cr.get_strategy() is strategy
    assert not cr.has_strategy()


def test_scope_is_thread_local():
    strategy = cr.MirroredStrategy(num_replicas=2)
    seen = []
    with strategy.scope():
        t = threading.Thread(target=lambda: seen.append((cr.has_strategy(), cr.get_strategy() is strategy)))
        t.start()
        t.join()
    assert seen == [(False, False)]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("how", ["num_replicas", "devices"])
def test_replica_context_inside_run(n, how):
    strategy = (cr.MirroredStrategy(num_replicas=n) if how == "num_replicas"
                else cr.MirroredStrategy(devices=["cpu"] * n))

    def fn():
        ctx = cr.get_replica_context()
        return (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.strategy is strategy,
                ctx.devices, cr.get_strategy() is strategy, cr.has_strategy(), cr.in_cross_replica_context())

    out = strategy.run(fn)
    results = list(strategy.experimental_local_results(out))
    assert results == [(i, n, True, (torch.device("cpu"),), True, True, False) for i in range(n)]
    assert not cr.has_strategy()


def test_one_device_replica_context():
    strategy = cr.OneDeviceStrategy("cpu")
    ctx = strategy.run(cr.get_replica_context)
    assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert ctx.devices == (torch.device("cpu"),)
    assert repr(ctx) == "ReplicaContext(replica_id_in_sync_group=0, num_replicas_in_sync=1)"


def test_replica_context_all_reduce_and_all_gather():
    strategy = cr.MirroredStrategy(num_replicas=3)

    def fn():
        ctx = cr.get_replica_context()
        x = torch.tensor([float(ctx.replica_id_in_sync_group)])
        return ctx.all_reduce("max", x), ctx.all_reduce(cr.ReduceOp.SUM, {"a": x}), ctx.all_gather(x, 0)

    for mx, sm, g in strategy.experimental_local_results(strategy.run(fn)):
        assert torch.equal(mx, torch.tensor([2.0]))
        assert torch.equal(sm["a"], torch.tensor([3.0]))
        assert torch.equal(g, torch.tensor([0.0, 1.0, 2.0]))


def test_nested_scopes_of_different_strategies_raise():
    a, b = cr.MirroredStrategy(num_replicas=2), cr.OneDeviceStrategy()
    with a.scope():
        with pytest.raises(ValueError, match=r"cannot enter the scope of OneDeviceStrategy\(.*\) inside the scope of "
                                             r"MirroredStrategy\(.*\); mixing strategies is not supported"):
            with b.scope():
                pass
        assert cr.get_strategy() is a
    with b.scope():
        with pytest.raises(ValueError, match=r"cannot enter the scope of MirroredStrategy"):
            b_run_other = a.run(lambda: None)  # noqa: F841 - run enters a's scope
    assert not cr.has_strategy()


def test_run_inside_a_replica_function_is_an_error():
    strategy = cr.MirroredStrategy(num_replicas=2)
    with pytest.raises(cr.ReplicaContextError, match=r"strategy\.run was called inside a replica function"):
        strategy.run(lambda: strategy.run(lambda: None))


@pytest.mark.parametrize("api, call", [
    ("reduce", lambda s: s.reduce("sum", torch.ones(1))),
    ("gather", lambda s: s.gather(torch.ones(1), 0)),
])
def test_cross_replica_apis_inside_a_replica_function(api, call):
    strategy = cr.MirroredStrategy(num_replicas=2)
    with pytest.raises(cr.ReplicaContextError,
                       match=rf"strategy\.{api} must be called in cross-replica context \(outside strategy\.run\)"):
        strategy.run(lambda: call(strategy))


def test_context_stack_is_clean_after_a_failing_run():
    strategy = cr.MirroredStrategy(num_replicas=2)
    with pytest.raises(ValueError, match=r"replica \d raised ValueError: x"):
        strategy.run(lambda: (_ for _ in ()).throw(ValueError("x")))
    assert not cr.has_strategy()
    # the replica threads' own stacks are clean too: the next run sees one frame
    out = strategy.run(lambda: (cr.get_replica_context() is not None, cr.in_cross_replica_context()))
    assert out == (True, False)
