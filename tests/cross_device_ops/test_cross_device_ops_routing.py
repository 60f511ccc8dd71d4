"""Every cross-device reduction of a strategy goes through its cross_device_ops.

strategy.reduce, ReplicaContext.all_reduce and CrossShardOptimizer.step reach a
custom CrossDeviceOps (one that records its calls), ReductionToOneDevice's
accumulation_fn is called wherever it reduces, and CommunicationOptions'
timeout_seconds bounds the wait for a late replica. Each check runs on every
engine: ``main(strategy)`` runs once per worker in cross-replica context (the
whole job in-process for "threads"), and builds its strategy with the ops under
test; numbers are compared with plain torch, summed in replica order.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from plain_torch import one_device_training

import crossreplica as cr
import crossreplica.testing as crt

N = 4
LATE = 3.0  # seconds the late replica sleeps
SHORT = 0.5  # the reductions' timeout_seconds


class Recording(cr.CrossDeviceOps):
    """Reduces as the default does, and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def reduce_implementation(self, reduce_op, values, devices, options, reducer):
        self.calls.append((str(reduce_op), len(values)))
        return cr.AllReduceCrossDeviceOps().reduce_implementation(reduce_op, values, devices, options, reducer)


class Counting:
    """An accumulation_fn: the sum in replica order (TF's add_n), counting its calls."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        self.sizes.append(len(xs))
        out = xs[0].clone()
        for x in xs[1:]:
            out = out + x
        return out


def _like(base, cdo, **kw):
    """A strategy with the layout of ``base`` (this worker's) and ``cdo`` as its ops."""
    if isinstance(base, cr.MultiWorkerMirroredStrategy):
        return cr.MultiWorkerMirroredStrategy(len(base.extended.worker_devices), timeout_seconds=60,
                                              cross_device_ops=cdo, **kw)
    return cr.MirroredStrategy(base.num_replicas_in_sync, devices=["cpu"] * base.num_replicas_in_sync,
                               cross_device_ops=cdo, timeout_seconds=60)


def run_main(engine, main, n=N):
    """``main(strategy)``'s result on each worker of an ``n``-replica job on ``engine``."""
    if engine == "threads":
        return [main(cr.MirroredStrategy(n, devices=["cpu"] * n))]
    workers, rpw = crt.layout(n)
    return crt.run_workers(main, workers, rpw)


def sequential(xs):
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = acc + x
    return acc


def value_of(r: int) -> torch.Tensor:
    return torch.randn(5, generator=torch.Generator().manual_seed(100 + r))


# ------------------------------------------------------------------ the replica functions

def _all_reduce(x):
    ctx = cr.get_replica_context()
    return ctx.all_reduce("sum", x), ctx.all_reduce("mean", {"v": x, "n": 1.0})


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3)


def _batch(r: int):
    g = torch.Generator().manual_seed(r)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _train_step(model):
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch(cr.replica_id())
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _routing_main(base):
    """Every reduction of a strategy built with a recording CrossDeviceOps."""
    rec = Recording()
    s = _like(base, rec)
    ids = s.extended.local_replica_ids
    values = cr.PerReplica([value_of(r) for r in ids])
    out = {"reduce": s.reduce("sum", values), "reduce_calls": list(rec.calls)}
    rec.calls.clear()
    summed, mean = s.run(_all_reduce, (values,))
    out["all_reduce"] = [list(s.experimental_local_results(summed)),
                         [m["v"] for m in s.experimental_local_results(mean)],
                         [m["n"] for m in s.experimental_local_results(mean)]]
    out["all_reduce_calls"] = list(rec.calls)
    rec.calls.clear()
    params = s.run(_train_step, (s.mirror(_model()),))
    out["step"] = [list(s.experimental_local_results(x)) for x in params]
    out["step_calls"] = list(rec.calls)
    # the default ops: the engine's fast path, the same numbers
    d = _like(base, None)
    params = d.run(_train_step, (d.mirror(_model()),))
    out["default_step"] = [list(d.experimental_local_results(x)) for x in params]
    # ReductionToOneDevice(accumulation_fn=f): f on every reduction, with every replica's value
    f = Counting()
    r = _like(base, cr.ReductionToOneDevice(accumulation_fn=f))
    out["one_device"] = [r.reduce("sum", values), list(r.experimental_local_results(r.run(_all_reduce, (values,))[0]))]
    params = r.run(_train_step, (r.mirror(_model()),))
    out["one_device_step"] = [list(r.experimental_local_results(x)) for x in params]
    out["f_sizes"] = list(f.sizes)
    return out


def _reference_step():
    """Plain torch: each replica's gradient, their mean in replica order, one SGD step."""
    global_batch = tuple(torch.cat(t) for t in zip(*(_batch(r) for r in range(N))))
    return one_device_training(_model(), functools.partial(torch.optim.SGD, lr=0.1), [global_batch],
                               lambda m, x, y: torch.nn.functional.mse_loss(m(x), y), replicas=N).params


def test_every_reduction_goes_through_cross_device_ops(engine):
    workers = run_main(engine, _routing_main)
    expected = sequential([value_of(r) for r in range(N)])
    reference = _reference_step()
    local = N // len(workers)
    for out in workers:
        # strategy.reduce: one reduction of the worker's local values
        assert torch.equal(out["reduce"], expected)
        assert out["reduce_calls"] == [("sum", local)]
        # ReplicaContext.all_reduce: one batch_reduce per call (merge_call), per worker
        summed, mean, ones = out["all_reduce"]
        assert all(torch.equal(t, expected) for t in summed)
        assert all(torch.equal(t, expected / N) for t in mean)
        assert all(torch.equal(t, torch.tensor(1.0)) for t in ones)
        assert out["all_reduce_calls"] == [("sum", local), ("mean", local), ("mean", local)]
        # CrossShardOptimizer.step: the gradients (one pack) through the ops
        assert out["step_calls"] == [("mean", local)]
        for got in (out["step"], out["default_step"], out["one_device_step"]):
            for copies, ref in zip(got, reference):
                assert all(torch.equal(c, ref) for c in copies)
        # accumulation_fn: reduce, all_reduce (three values) and step, each with every replica's value
        assert torch.equal(out["one_device"][0], expected)
        assert all(torch.equal(t, expected) for t in out["one_device"][1])
        assert out["f_sizes"] == [N] * 5


# ------------------------------------------------------------------ implementations that return a tensor


class AddN(cr.CrossDeviceOps):
    """TF's signatures, returning plain tensors as TF's add_n does (TF's contract: a tensor or
    a DistributedValues): the reduction over every replica, in replica order."""

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return cr.get_strategy().extended.reduce_values(reduce_op, list(per_replica_value.values))

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return [self.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs]


class PlainTensor(cr.CrossDeviceOps):
    """crossreplica's signature; ``reduce_implementation`` returns the reducer's tensor itself
    (``batch_reduce`` is the base class's, one by one)."""

    def reduce_implementation(self, reduce_op, values, devices, options, reducer):
        return reducer.reduce_values(reduce_op, values)


def _tensor_results_main(base):
    out = {}
    for name, cdo in (("tf", AddN()), ("crossreplica", PlainTensor())):
        s = _like(base, cdo)
        values = cr.PerReplica([value_of(r) for r in s.extended.local_replica_ids])
        summed, mean = s.run(_all_reduce, (values,))
        to = s.extended.reduce_to("sum", values, "cpu")
        batch = s.extended.batch_reduce_to("mean", [(values, "cpu"), (values, values)])
        assert isinstance(to, cr.Mirrored) and all(isinstance(m, cr.Mirrored) for m in batch)
        out[name] = {"reduce": s.reduce("sum", values), "reduce_mean": s.reduce("mean", values),
                     "all_reduce": list(s.experimental_local_results(summed)),
                     "all_reduce_mean": [m["v"] for m in s.experimental_local_results(mean)],
                     "reduce_to": list(to.values), "batch_reduce_to": [list(m.values) for m in batch],
                     "distinct": len({id(t) for t in batch[1].values}) == len(batch[1].values)}
    return out


def test_ops_whose_implementation_returns_a_tensor_work_everywhere(engine):
    expected = sequential([value_of(r) for r in range(N)])
    for worker in run_main(engine, _tensor_results_main):
        for name, out in worker.items():
            assert torch.equal(out["reduce"], expected), name
            assert torch.equal(out["reduce_mean"], expected / N), name
            assert all(torch.equal(t, expected) for t in out["all_reduce"]), name
            assert all(torch.equal(t, expected / N) for t in out["all_reduce_mean"]), name
            assert [torch.equal(t, expected) for t in out["reduce_to"]] == [True], name
            one, per_replica = out["batch_reduce_to"]
            assert len(one) == 1 and len(per_replica) == len(out["all_reduce"]), name  # one per local replica
            assert all(torch.equal(t, expected / N) for t in one + per_replica), name
            assert out["distinct"], name  # one copy of its own per destination


# ------------------------------------------------------------------ timeouts

def _late(x):
    """The last replica comes late to a reduction bounded by SHORT seconds."""
    ctx = cr.get_replica_context()
    if ctx.replica_id_in_sync_group == ctx.num_replicas_in_sync - 1:
        time.sleep(LATE)
    start = time.monotonic()
    try:
        ctx.all_reduce("sum", x, options=cr.CommunicationOptions(timeout_seconds=SHORT))
    except cr.errors.CollectiveTimeoutError as e:
        return "timeout", time.monotonic() - start, e.missing, str(e)
    return "ok", time.monotonic() - start, (), ""


def _timeout_main(base):
    s = _like(base, Recording())
    ids = s.extended.local_replica_ids
    return list(s.experimental_local_results(s.run(_late, (cr.PerReplica([torch.ones(2) * r for r in ids]),))))


@pytest.mark.parametrize("n", [2, 4])
def test_timeout_seconds_bounds_a_late_replica(engine, n):
    workers = run_main(engine, _timeout_main, n)
    outcomes = [o for w in workers for o in w]
    assert len(outcomes) == n
    for kind, waited, missing, message in outcomes[:-1]:  # the late one may find the failure or not
        assert kind == "timeout", message
        assert n - 1 in missing, message
        assert waited < LATE, f"waited {waited:.1f}s, beyond the late replica's arrival: {message}"
        assert f"{SHORT:g}s" in message


def _late_step(model):
    if cr.replica_id() == cr.num_replicas() - 1:
        time.sleep(LATE)
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 communication_options=cr.CommunicationOptions(timeout_seconds=SHORT))
    model(torch.ones(1, 5)).sum().backward()
    start = time.monotonic()
    try:
        opt.step()
    except cr.errors.CollectiveTimeoutError as e:
        return "timeout", time.monotonic() - start, e.missing
    return "ok", time.monotonic() - start, ()


def _late_step_main(base):
    s = _like(base, None)  # the default ops: the timeout takes the merge_call path
    return list(s.experimental_local_results(s.run(_late_step, (s.mirror(_model()),))))


def test_optimizer_timeout_seconds_is_honoured(engine):
    outcomes = [o for w in run_main(engine, _late_step_main, 2) for o in w]
    kind, waited, missing = outcomes[0]
    assert kind == "timeout" and missing == (1,) and waited < LATE


# ------------------------------------------------------------------ accumulation_fn, in-process

def test_accumulation_fn_is_called_in_and_out_of_scope():
    f = Counting()
    ops = cr.ReductionToOneDevice(accumulation_fn=f)
    values = cr.PerReplica([value_of(r) for r in range(3)])
    expected = sequential(list(values.values))
    assert torch.equal(ops.reduce("sum", values, "cpu").values[0], expected)  # no scope
    with cr.MirroredStrategy(2, devices=["cpu"] * 2).scope():  # a scope of another size
        assert torch.equal(ops.reduce("mean", values, "cpu").values[0], expected / 3)
    with cr.MirroredStrategy(3, devices=["cpu"] * 3).scope():
        assert torch.equal(ops.batch_reduce("sum", [(values, "cpu")])[0].values[0], expected)
        ops.reduce("max", values, "cpu")  # not an accumulation: the strategy's reduction
    assert f.sizes == [3, 3, 3]


def test_accumulation_fn_must_return_a_tensor():
    ops = cr.ReductionToOneDevice(accumulation_fn=lambda xs: 1.0)
    with pytest.raises(ValueError, match="accumulation_fn must return a tensor"):
        ops.reduce("sum", cr.PerReplica([torch.ones(1), torch.ones(1)]), "cpu")


# ------------------------------------------------------------------ which path, in-process

def test_default_ops_keep_the_engine_path():
    default = cr.AllReduceCrossDeviceOps()
    assert default.replica_reductions_on_engine()
    assert not default.replica_reductions_on_engine(cr.CommunicationOptions(timeout_seconds=1))

    class Sub(cr.AllReduceCrossDeviceOps):
        pass

    assert not Sub().replica_reductions_on_engine()
    assert not cr.ReductionToOneDevice().replica_reductions_on_engine()


def _grad_through(x):
    x = x.clone().requires_grad_(True)
    y = cr.get_replica_context().all_reduce("mean", x * x)
    y.sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("cdo", [None, Recording(), cr.ReductionToOneDevice(accumulation_fn=Counting())])
def test_replica_all_reduce_is_differentiable_the_same_way(cdo):
    s = cr.MirroredStrategy(3, devices=["cpu"] * 3, cross_device_ops=cdo)
    xs = [value_of(r) for r in range(3)]
    ys, grads = s.run(_grad_through, (cr.PerReplica(xs),))
    expected = sequential([x * x for x in xs]) / 3
    for r, (y, g) in enumerate(zip(ys.values, grads.values)):
        assert torch.equal(y, expected)
        # d/dx_r of sum over replicas of mean(x*x): 3 replicas' cotangents of 1, averaged
        assert torch.equal(g, 2 * xs[r] * (sequential([torch.ones(5)] * 3) / 3))


def _group_step(model):
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group_assignment=[[0, 1], [2, 3]])
    x, y = _batch(cr.replica_id())
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_group_assignment_stays_on_the_engine():
    rec = Recording()
    s = cr.MirroredStrategy(4, devices=["cpu"] * 4, cross_device_ops=rec)
    s.run(_group_step, (s.mirror(_model()),))
    assert rec.calls == []  # the TPU-style cross_replica_sum family: the engine's


def test_overlapped_optimizer_goes_through_custom_ops_at_step():
    rec = Recording()
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2, cross_device_ops=rec)

    def step(model):
        opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
        x, y = _batch(cr.replica_id())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    got = s.run(step, (s.mirror(_model()),))
    d = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    want = d.run(step, (d.mirror(_model()),))
    assert rec.calls == [("mean", 2)]
    for a, b in zip(got, want):  # per parameter, every replica's copy
        assert all(torch.equal(p, q) for p, q in zip(a.values, b.values))


def test_communication_options_are_checked():
    with pytest.raises(ValueError, match="communication_options must be a cr.CommunicationOptions"):
        cr.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 1})
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="options must be a cr.CommunicationOptions"):
        s.run(lambda: cr.get_replica_context().all_reduce("sum", torch.ones(1), options=5))


# ------------------------------------------------------------------ options reach the ops

class SeesOptions(cr.AllReduceCrossDeviceOps):
    """The default's arithmetic (a subclass, so replica reductions take the merge_call path);
    records the options every batch reduction gets."""

    def __init__(self) -> None:
        self.options: list = []

    def batch_reduce_implementation(self, reduce_op, pairs, options, reducer):
        self.options.append(options)
        return super().batch_reduce_implementation(reduce_op, pairs, options, reducer)


def _packed_all_reduce(xs):
    opts = cr.CommunicationOptions(bytes_per_pack=16)
    return cr.get_replica_context().all_reduce("sum", list(xs), options=opts)


def test_bytes_per_pack_reaches_the_ops_batch_reduce():
    ops = SeesOptions()
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2, cross_device_ops=ops)
    xs = [[value_of(10 * r + i) for i in range(4)] for r in range(2)]
    out = s.run(_packed_all_reduce, (cr.PerReplica(xs),))
    assert [o.bytes_per_pack for o in ops.options] == [16]
    for i, leaf in enumerate(out):
        assert all(torch.equal(t, sequential([xs[0][i], xs[1][i]])) for t in leaf.values)


def test_multi_worker_communication_options_are_the_default(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    ops = SeesOptions()
    opts = cr.CommunicationOptions(bytes_per_pack=64, timeout_seconds=20)
    s = cr.MultiWorkerMirroredStrategy(2, cross_device_ops=ops, communication_options=opts)
    try:
        assert s.extended.timeout == 20 and s.extended.cross_device_ops is ops
        values = cr.PerReplica([value_of(0), value_of(1)])
        s.extended.batch_reduce_to("sum", [(values, "cpu")])
        out = s.run(_all_reduce, (values,))[0]
        assert ops.options == [opts] * 3  # batch_reduce_to, then all_reduce's sum and mean
        assert all(torch.equal(t, sequential(list(values.values))) for t in s.experimental_local_results(out))
    finally:
        s.close()


def _porting_step(x):
    ctx = cr.get_replica_context()
    options = cr.CommunicationOptions(timeout_seconds=30)
    return ctx.all_reduce(cr.ReduceOp.SUM, x, options=options)


def test_porting_guide_example_matches_plain_torch():
    add_n = Counting()  # the guide's add_n, counted
    strategy = cr.MirroredStrategy(4, devices=["cpu"] * 4,
                                   cross_device_ops=cr.ReductionToOneDevice(accumulation_fn=add_n))
    xs = [torch.full((3,), float(r)) for r in range(4)]
    per_replica = strategy.run(_porting_step, args=(cr.PerReplica(xs),))
    total = strategy.reduce(cr.ReduceOp.MEAN, per_replica, axis=None)
    assert add_n.sizes == [4, 4]  # once in all_reduce, once in reduce
    assert torch.equal(total, sequential([sequential(xs)] * 4) / 4)


def _late_worker_main(base):
    """In cross-replica context: the last worker comes late to a reduce_to bounded by SHORT."""
    s = _like(base, Recording())
    values = cr.PerReplica([torch.ones(2) * r for r in s.extended.local_replica_ids])
    if s.extended.worker_rank == s.extended.num_workers - 1:
        time.sleep(LATE)
    start = time.monotonic()
    try:
        s.extended.reduce_to("sum", values, "cpu", options=cr.CommunicationOptions(timeout_seconds=SHORT))
    except cr.errors.CollectiveTimeoutError as e:
        return "timeout", time.monotonic() - start, e.missing
    return "ok", time.monotonic() - start, ()


@pytest.mark.multiprocess
def test_timeout_seconds_bounds_a_late_worker_in_cross_replica_context():
    first = crt.run_workers(_late_worker_main, 2, 2)[0]
    kind, waited, missing = first
    assert kind == "timeout" and set(missing) == {2, 3} and waited < LATE
