"""The rest of tf.distribute's surface, for code ported from TF: experimental_run_v2, TF's
CrossShardOptimizer order and reduction names, cross_replica_average's seed forms, integer
mesh axes, gather's shape errors, broadcast_to, the worker vocabulary, non-slot updates,
and variables (local results, creation inside a replica function, replica devices).

Replica-side checks run over every engine (the run_replicas fixture); strategy-side checks
run in one process (OneDeviceStrategy, MirroredStrategy) and across worker processes
(MultiWorkerMirroredStrategy via crossreplica.testing.run_workers), against values
computed here with plain torch.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from harness import run_layout as run_main

import crossreplica as cr

# (engine, workers, replicas per worker)
LAYOUTS = [
    pytest.param(("threads", 1, 4), id="threads-1x4"),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]


def _per_replica(strategy, fn):
    """A PerReplica with ``fn(global replica id)`` for each local replica."""
    return strategy.experimental_distribute_values_from_function(lambda ctx: fn(ctx.replica_id_in_sync_group))


# ------------------------------------------------------------------ 1. experimental_run_v2


@pytest.mark.parametrize("make", [lambda: cr.OneDeviceStrategy(), lambda: cr.MirroredStrategy(3)],
                         ids=["one-device", "mirrored"])
def test_experimental_run_v2_is_run(make):
    s = make()
    xs = _per_replica(s, lambda r: torch.tensor([float(r), 1.0]))
    fn = lambda x, k=1.0: cr.all_reduce(x * k, "sum")  # noqa: E731
    a = s.experimental_local_results(s.experimental_run_v2(fn, args=(xs,), kwargs={"k": 2.0}))
    b = s.experimental_local_results(s.run(fn, args=(xs,), kwargs={"k": 2.0}))
    n = s.num_replicas_in_sync
    expected = torch.tensor([2.0 * sum(range(n)), 2.0 * n])
    assert all(torch.equal(x, expected) and torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(TypeError, match="fn must be callable"):
        s.experimental_run_v2(3)


# ------------------------------------------------------------------ 2. CrossShardOptimizer in TF's order

GROUPS = [[0, 1], [2, 3]]


def _tf_order_step(x, reduction):
    w = torch.nn.Parameter(torch.zeros(2))
    opt = cr.CrossShardOptimizer(torch.optim.SGD([w], lr=1.0), reduction, "shard_opt", GROUPS)
    (w * x).sum().backward()
    opt.step()
    return w.detach(), opt.name, opt.reduction.name


@pytest.mark.parametrize("reduction,op", [("weighted_sum", "SUM"), ("weighted_mean", "MEAN"),
                                          ("sum", "SUM"), ("MEAN", "MEAN")])
def test_cross_shard_optimizer_takes_tfs_positional_order(run_replicas, reduction, op):
    xs = [torch.tensor([float(r + 1), 2.0 * r]) for r in range(4)]
    outs = run_replicas(_tf_order_step, 4, xs, [reduction] * 4)
    for r, (w, name, got_op) in enumerate(outs):
        group = GROUPS[r // 2]
        grad = sum(xs[i] for i in group) / (len(group) if op == "MEAN" else 1)
        torch.testing.assert_close(w, -grad)
        assert (name, got_op) == ("shard_opt", op)


def test_cross_shard_optimizer_name_and_keyword_forms():
    params = [torch.nn.Parameter(torch.zeros(1))]
    opt = cr.CrossShardOptimizer(torch.optim.SGD(params, lr=0.1))
    assert opt.name == "CrossShardOptimizer" and opt.reduction is cr.ReduceOp.MEAN
    kw = cr.CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), reduction="sum", group_assignment=[[0]],
                                bytes_per_pack=64, name="mine")
    assert (kw.name, kw.reduction, kw.bytes_per_pack) == ("mine", cr.ReduceOp.SUM, 64)
    assert pickle.loads(pickle.dumps(kw)).name == "mine" and copy.deepcopy(kw).name == "mine"
    with pytest.raises(TypeError, match=r"name must be a str or None .*group_assignment=\[\[0, 1\]\]"):
        cr.CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), "mean", [[0, 1]])
    with pytest.raises(ValueError, match="'weighted_mean' / 'weighted_sum'.*sum_over_batch_size"):
        cr.CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), "sum_over_batch_size")


# ------------------------------------------------------------------ 3. cross_replica_average forms

AVERAGE_FORMS = {
    "short": lambda x: cr.cross_replica_average(x, 2),
    "keyword": lambda x: cr.cross_replica_average(x, num_shards_per_group=2),
    "tf-positional": lambda x: cr.cross_replica_average(x, 4, 2),
    "tf-keywords": lambda x: cr.cross_replica_average(x, num_shards=4, num_shards_per_group=2),
    "distributed_group_size": lambda x: cr.cross_replica_average(x, 4, distributed_group_size=2),
    "distributed_group_size-kw": lambda x: cr.cross_replica_average(x, num_shards=None, distributed_group_size=2),
}


def _average_forms(x):
    return {name: form(x) for name, form in AVERAGE_FORMS.items()}


def test_cross_replica_average_seed_forms(run_replicas):
    xs = [torch.tensor([float(r) ** 2, 1.0 - r]) for r in range(4)]
    outs = run_replicas(_average_forms, 4, xs)
    for r, out in enumerate(outs):
        group = range(2 * (r // 2), 2 * (r // 2) + 2)
        expected = sum(xs[i] for i in group) / 2
        for name in AVERAGE_FORMS:
            torch.testing.assert_close(out[name], expected, msg=name)


def _bad_average(case):
    x = torch.ones(2)
    if case == "num_shards":
        cr.cross_replica_average(x, 8, 2)
    elif case == "both":
        cr.cross_replica_average(x, num_shards_per_group=2, distributed_group_size=2)
    elif case == "topology":
        cr.cross_replica_average(x, 4, 2, physical_shape=[2, 2], tile_shape=[1, 1])
    elif case == "missing":
        cr.cross_replica_average(x, num_shards=4)
    else:
        cr.cross_replica_average(x, 4, 3)


@pytest.mark.parametrize("case,error,match", [
    ("num_shards", ValueError, r"num_shards=8, but 4 replicas are in sync"),
    ("both", ValueError, "num_shards_per_group or distributed_group_size, not both"),
    ("topology", ValueError, "TPU topology"),
    ("missing", TypeError, "needs the group size"),
    ("indivisible", ValueError, "mod num_shards_per_group: 3 should be 0"),
])
def test_cross_replica_average_bad_forms(case, error, match):
    with pytest.raises(error, match=match):
        cr.MirroredStrategy(4).run(_bad_average, args=(case,))


# ------------------------------------------------------------------ 4. integer mesh axes

MESH = cr.Mesh({"data": 2, "model": 2})


def _mesh_reductions(x):
    return {"ints": cr.all_reduce(x, "sum", mesh=MESH, axes=(0,)),
            "int": cr.cross_replica_sum(x, mesh=MESH, axes=1),
            "mixed": cr.all_reduce(x, "max", mesh=MESH, axes=[0, "model"])}


def test_integer_mesh_axes(run_replicas):
    xs = [torch.tensor([float(r + 1), 10.0 * r]) for r in range(4)]
    outs = run_replicas(_mesh_reductions, 4, xs)
    for r, out in enumerate(outs):
        d, m = divmod(r, 2)
        torch.testing.assert_close(out["ints"], xs[m] + xs[2 + m])  # over "data"
        torch.testing.assert_close(out["int"], xs[2 * d] + xs[2 * d + 1])  # over "model"
        torch.testing.assert_close(out["mixed"], torch.stack(xs).amax(0))


def test_mesh_group_assignment_by_index():
    assert MESH.group_assignment(1) == MESH.group_assignment("model") == ((0, 1), (2, 3))
    assert MESH.group_assignment((0,)) == MESH.group_assignment(["data"]) == ((0, 2), (1, 3))
    assert MESH.group_assignment([1, 0]) == MESH.group_assignment(("model", "data"))
    for bad in (2, -1, (0, 5)):
        with pytest.raises(ValueError, match=r"out of range for Mesh.*indices are 0\.\.1 \(0='data', 1='model'\)"):
            MESH.group_assignment(bad)
    with pytest.raises(ValueError, match="must not repeat"):
        MESH.group_assignment((0, "data"))
    with pytest.raises(ValueError, match="not an axis"):
        MESH.group_assignment((True,))


# ------------------------------------------------------------------ 5-8. strategy-side surface


def _surface_main(strategy) -> dict:
    ext = strategy.extended
    n, local = strategy.num_replicas_in_sync, len(ext.worker_devices)
    out: dict = {"vocab": [ext.worker_rank, ext.num_workers, ext.is_chief, ext.should_checkpoint,
                           ext.should_save_summary, ext.experimental_should_init, ext.num_hosts,
                           ext.num_replicas_per_host, len(ext.worker_devices), len(ext.parameter_devices),
                           len(ext.non_slot_devices([]))]}
    xs = _per_replica(strategy, lambda r: torch.full((2,), float(r)))
    out["run_v2"] = [t.tolist() for t in strategy.experimental_local_results(
        strategy.experimental_run_v2(lambda x: cr.all_reduce(x, "sum"), args=(xs,)))]
    # 5. gather: mismatched non-axis shapes name the shapes (on every worker)
    bad = _per_replica(strategy, lambda r: torch.zeros(2, 3 if r != n - 1 else 4))
    try:
        strategy.gather(bad, 0)
        out["gather_error"] = None
    except ValueError as e:
        out["gather_error"] = str(e)
    uneven = _per_replica(strategy, lambda r: torch.full((r + 1, 2), float(r)))
    out["gather"] = strategy.gather(uneven, 0).tolist()
    # 6. broadcast_to: numbers unchanged, one distinct copy per replica
    with strategy.scope():
        step = cr.Variable(0, dtype=torch.int64, name="step")
    out["number"] = [ext.broadcast_to(v, step) for v in (1, 2.5, True)]
    t = torch.arange(3.0)
    copies = ext.broadcast_to(t, step)
    copies.values[0].add_(100)
    out["copies"] = [c.tolist() for c in copies.values]
    out["distinct"] = len({c.data_ptr() for c in copies.values}) == local and t.tolist() == [0.0, 1.0, 2.0]
    # 8. non-slot updates: each copy once, in its update context
    res = ext.update_non_slot(ext.non_slot_devices([step]), lambda: step.assign_add(1, read_value=False))
    res = ext.update_non_slot(ext.non_slot_devices([step]), lambda k: step.assign_add(k).value() * 1,
                              args=(cr.Mirrored([torch.tensor(10)] * local),), group=False)
    out["step"] = [c.item() for c in step.values]
    out["update_results"] = [r.item() for r in res]
    # 9. local results of a variable
    out["local_results"] = [v.item() for v in strategy.experimental_local_results(step)]
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strategy_surface(layout):
    _, workers, per_worker = layout
    n = workers * per_worker
    for w, res in enumerate(run_main(_surface_main, layout)):
        chief = w == 0
        assert res["vocab"] == [w, workers, chief, chief, chief, True, workers, per_worker, per_worker,
                                per_worker, per_worker]
        assert res["run_v2"] == [[float(sum(range(n)))] * 2] * per_worker
        assert res["gather_error"] is not None
        assert f"same shape except along axis=0; got [2, 3] on replicas {list(range(n - 1))}; " \
               f"[2, 4] on replicas [{n - 1}]" in res["gather_error"]
        assert res["gather"] == torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)]).tolist()
        assert res["number"] == [1, 2.5, True] and [type(v) for v in res["number"]] == [int, float, bool]
        assert res["copies"] == [[100.0, 101.0, 102.0]] + [[0.0, 1.0, 2.0]] * (per_worker - 1)
        assert res["distinct"]
        assert res["step"] == [11] * per_worker and res["update_results"] == [11] * per_worker
        assert res["local_results"] == [11] * per_worker


def test_worker_vocabulary_on_one_device():
    ext = cr.OneDeviceStrategy().extended
    assert (ext.worker_rank, ext.num_workers, ext.is_chief, ext.should_checkpoint, ext.should_save_summary,
            ext.num_hosts, ext.num_replicas_per_host) == (0, 1, True, True, True, 1, 1)
    assert ext.parameter_devices == ext.non_slot_devices(None) == (torch.device("cpu"),)


def test_update_non_slot_on_one_device_returns_the_result():
    s = cr.OneDeviceStrategy()
    with s.scope():
        v = cr.Variable(torch.zeros(2))
    assert torch.equal(s.extended.update_non_slot(s.extended.non_slot_devices([v]),
                                                  lambda: v.assign_add(torch.ones(2)).value() * 2),
                       torch.full((2,), 2.0))
    assert s.extended.update_non_slot("cpu", lambda a, b: a + b, args=(1,), kwargs={"b": 2}) == 3


def test_update_non_slot_bad_input():
    s = cr.MirroredStrategy(2)
    ext = s.extended
    devices = ext.non_slot_devices([])
    with pytest.raises(TypeError, match="fn must be callable"):
        ext.update_non_slot(devices, 3)
    with pytest.raises(TypeError, match="args must be a tuple"):
        ext.update_non_slot(devices, lambda: None, args=1)
    with pytest.raises(TypeError, match="PerReplica"):
        ext.update_non_slot(devices, lambda x: None, args=(cr.PerReplica([1, 2]),))
    with pytest.raises(ValueError, match="Mirrored of 3 values, but colocate_with names 2 devices"):
        ext.update_non_slot(devices, lambda x: None, args=(cr.Mirrored([1, 2, 3]),))
    with pytest.raises(ValueError, match="at least one device"):
        ext.update_non_slot((), lambda: None)
    with pytest.raises(TypeError, match="var_list must be a list"):
        ext.non_slot_devices("v")
    with pytest.raises(cr.ReplicaContextError, match="update_non_slot must be called in cross-replica"):
        s.run(lambda: ext.update_non_slot(devices, lambda: None))


def test_update_of_a_variable_runs_on_each_copy_in_its_update_context():
    s = cr.MirroredStrategy(3)
    with s.scope():
        w = cr.Variable(torch.ones(2))
        lr = cr.Variable(0.5)
    out = s.extended.update(w, lambda v, g: v.sub_(lr.value() * g), args=(cr.Mirrored([torch.ones(2)] * 3),),
                            group=False)
    assert [c.tolist() for c in w.values] == [[0.5, 0.5]] * 3 and all(o is c for o, c in zip(out, w.values))
    s.extended.update(w, lambda v: lr.assign_add(1.0))  # each copy of lr once
    assert [c.item() for c in lr.values] == [1.5] * 3


def test_broadcast_to_a_mirrored_destination_that_shares_one_tensor():
    s = cr.MirroredStrategy(3)
    shared = torch.zeros(2)
    out = s.extended.broadcast_to(torch.ones(2), cr.Mirrored([shared] * 3))
    out.values[1].mul_(5)
    assert [c.tolist() for c in out.values] == [[1.0, 1.0], [5.0, 5.0], [1.0, 1.0]]
    assert s.extended.broadcast_to(7, "cpu") == 7
    per_device = s.extended.broadcast_to(torch.ones(2), s.extended.worker_devices)  # one per replica
    assert len(per_device.values) == 3 and len({c.data_ptr() for c in per_device.values}) == 3
    t = torch.ones(1)
    on_cpu = s.extended.broadcast_to(t, "cpu")  # a device string: one copy there, not the caller's tensor
    assert len(on_cpu.values) == 1 and on_cpu.values[0] is not t


def test_sync_batch_norm_takes_distributed_group_size():
    bn = cr.nn.SyncBatchNorm(3, distributed_group_size=2)
    assert bn.num_shards_per_group == 2
    with pytest.raises(ValueError, match="not both"):
        cr.nn.SyncBatchNorm(3, num_shards_per_group=2, distributed_group_size=2)


# ------------------------------------------------------------------ 9. variables and devices


def _create_in_replica(x):
    v = cr.Variable(x * 10.0, aggregation="sum", name="made_inside")
    v.assign_add(x)
    return v.value().detach().clone(), v.name, id(v)


def test_variable_created_in_a_replica_function(run_replicas):
    xs = [torch.tensor([float(r + 1), -1.0]) for r in range(4)]
    outs = run_replicas(_create_in_replica, 4, xs)
    expected = xs[0] * 10.0 + sum(xs)  # replica 0's initial value, then the SUM of every update
    for value, name, _ in outs:
        torch.testing.assert_close(value, expected)
        assert name == "made_inside"


def test_a_variable_created_on_one_device():
    s = cr.OneDeviceStrategy()
    v = s.run(lambda: cr.Variable(torch.ones(2), name="single"))
    assert isinstance(v, cr.Variable) and v.name == "single" and v.distribute_strategy is s


def test_replicas_of_one_process_share_the_created_variable():
    s = cr.MirroredStrategy(3)
    v = s.run(lambda: cr.Variable(torch.tensor(float(cr.replica_id())), aggregation="mean"))
    assert isinstance(v, cr.Variable) and s.experimental_local_results(v) == v.values
    assert [c.item() for c in v.values] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="synchronization=ON_READ needs an aggregation"):
        s.run(lambda: cr.Variable(1.0, synchronization="on_read"))


def test_replica_context_devices_are_the_logical_devices():
    s = cr.MirroredStrategy(devices=["cpu"] * 6, logical_devices_per_replica=3)
    devices = s.experimental_local_results(s.run(lambda: cr.get_replica_context().devices))
    assert [tuple(d) for d in devices] == [tuple(g) for g in s.extended.logical_devices]
    assert all(len(d) == 3 for d in devices)
    one = cr.OneDeviceStrategy()
    assert one.run(lambda: cr.get_replica_context().devices) == (torch.device("cpu"),)
