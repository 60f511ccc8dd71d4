"""TF parity: what TF code does with a strategy, its ``extended`` and its cross-device ops that
crossreplica now does the same way (issue 21, item 3).

Variables as destinations (TF's optimizer pattern), cross-device ops refused in a replica
function, ``call_for_each_replica``'s optional arguments, TF's ``reduce_implementation``
signature, ``worker_devices`` inside a logical device, ``extended`` outliving its strategy,
``cr.all_to_all`` with TF's keywords and ``cr.save`` into a missing directory. Behaviour both engines share runs on threads and
on worker processes (LAYOUTS), against values computed here with plain torch.
"""

from __future__ import annotations

import os
import re
from fractions import Fraction

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


def _grad(r: int) -> torch.Tensor:
    return torch.tensor([float(r + 1), -2.0 * r, 0.5])


# ------------------------------------------------------------------ 1. a cr.Variable as destinations


def _optimizer_pattern_main(strategy) -> dict:
    """TF's optimizer: batch_reduce_to(SUM, [(grad, var)]) then extended.update(var, fn, ...)."""
    ext = strategy.extended
    with strategy.scope():
        w = cr.Variable(torch.ones(3), name="w")
        b = cr.Variable(torch.zeros(3), name="b")
    grads = _per_replica(strategy, _grad)
    reduced = ext.batch_reduce_to("sum", [(grads, w), (grads, b)])
    for g, var in zip(reduced, (w, b)):
        ext.update(var, lambda v, g: v.sub_(0.5 * g), args=(g,))
    one = ext.reduce_to("mean", grads, w)
    ops = ext.cross_device_ops
    with strategy.scope():
        direct = ops.reduce("sum", grads, w)
        (batched,) = ops.batch_reduce("max", [(grads, w)])
        copies = ops.broadcast(torch.arange(3.0), w)
    return {"w": [c.tolist() for c in w.values], "b": [c.tolist() for c in b.values],
            "reduced": [[c.tolist() for c in m.values] for m in reduced],
            "mean": [c.tolist() for c in one.values], "direct": [c.tolist() for c in direct.values],
            "max": [c.tolist() for c in batched.values], "broadcast": [c.tolist() for c in copies.values],
            "devices": [str(c.device) for c in one.values] == [str(c.device) for c in w.values],
            "distinct": len({c.data_ptr() for c in copies.values}) == len(w.values)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_variable_as_destinations_and_the_optimizer_pattern(layout):
    _, workers, per_worker = layout
    n = workers * per_worker
    total = sum(_grad(r) for r in range(n))
    expect = {"w": (torch.ones(3) - 0.5 * total).tolist(), "b": (-0.5 * total).tolist(),
              "sum": total.tolist(), "mean": (total / n).tolist(),
              "max": torch.stack([_grad(r) for r in range(n)]).amax(0).tolist()}
    for res in run_main(_optimizer_pattern_main, layout):
        assert res["w"] == [expect["w"]] * per_worker and res["b"] == [expect["b"]] * per_worker
        assert res["reduced"] == [[expect["sum"]] * per_worker] * 2
        assert res["direct"] == [expect["sum"]] * per_worker
        torch.testing.assert_close(torch.tensor(res["mean"]), torch.tensor([expect["mean"]] * per_worker))
        assert res["max"] == [expect["max"]] * per_worker
        assert res["broadcast"] == [[0.0, 1.0, 2.0]] * per_worker
        assert res["devices"] and res["distinct"]


def test_bad_destinations_still_name_the_variable_option():
    s = cr.MirroredStrategy(2)
    with pytest.raises(ValueError, match=r"destinations must be .*cr\.Variable.*got int: 3"):
        s.extended.reduce_to("sum", cr.PerReplica([torch.ones(1)] * 2), 3)


# ------------------------------------------------------------------ 2. cross-device ops in a replica function


@pytest.mark.parametrize("method", ["reduce", "batch_reduce", "broadcast"])
@pytest.mark.parametrize("ops", [cr.AllReduceCrossDeviceOps(), cr.ReductionToOneDevice()], ids=repr)
def test_cross_device_ops_refuse_a_replica_context(method, ops):
    s = cr.MirroredStrategy(2)
    calls = {"reduce": lambda x: ops.reduce("sum", x, x),
             "batch_reduce": lambda x: ops.batch_reduce("sum", [(x, x)]),
             "broadcast": lambda x: ops.broadcast(x, x)}
    with pytest.raises(RuntimeError, match=rf"{type(ops).__name__}\.{method} must be called in "
                                           r"cross-replica context.*merge_call"):
        s.run(calls[method], args=(cr.PerReplica([torch.ones(2), torch.ones(2)]),))


def test_cross_device_ops_work_in_a_merge_fn():
    s = cr.MirroredStrategy(3)
    ops = cr.ReductionToOneDevice()

    def fn(x):
        return cr.get_replica_context().merge_call(lambda strategy, v: ops.reduce("sum", v, "cpu").values[0],
                                                    args=(x,))

    xs = [torch.tensor([1.0, float(r)]) for r in range(3)]
    out = s.run(fn, args=(cr.PerReplica(xs),))
    assert all(torch.equal(o, xs[0] + xs[1] + xs[2]) for o in s.experimental_local_results(out))


# ------------------------------------------------------------------ 3. call_for_each_replica


@pytest.mark.parametrize("replicas", [1, 3])
def test_call_for_each_replica_takes_optional_args_and_regroups_like_run(replicas):
    s = cr.MirroredStrategy(replicas)
    ext = s.extended
    xs = _per_replica(s, lambda r: torch.tensor([float(r), 1.0]))

    def fn(x=None, k=1.0):
        return cr.all_reduce(x * k, "sum")

    forms = [ext.call_for_each_replica(fn, args=(xs,)),
             ext.call_for_each_replica(fn, args=(xs,), kwargs=None),
             ext.call_for_each_replica(fn, args=(xs,), kwargs={}),
             ext.call_for_each_replica(fn, (xs,), {"k": 1.0}),
             ext.call_for_each_replica(fn, kwargs={"x": xs})]
    expected = torch.tensor([float(sum(range(replicas))), float(replicas)])
    reference = s.run(fn, args=(xs,))
    for out in forms:
        assert type(out) is type(reference)
        assert all(torch.equal(o, expected) for o in s.experimental_local_results(out))
    none = ext.call_for_each_replica(lambda: cr.replica_id(), args=None, kwargs=None)
    assert type(none) is type(s.run(lambda: cr.replica_id()))
    assert list(s.experimental_local_results(none)) == list(range(replicas))
    with pytest.raises(TypeError, match="kwargs must be a dict or None"):
        ext.call_for_each_replica(fn, kwargs=[1])


# ------------------------------------------------------------------ 5. TF's reduce_implementation signature


class TFSignatureOps(cr.CrossDeviceOps):
    """A user's subclass written for TF: four arguments, no reducer."""

    def __init__(self):
        self.seen: list = []

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self.seen.append(("reduce", type(per_replica_value).__name__, destinations))
        total = sum(v.double() for v in per_replica_value.values)  # a reduction of its own: in float64
        return cr.Mirrored([total.to(torch.float32) * 10])


class TFSignatureBatchOps(cr.AllReduceCrossDeviceOps):
    """Overrides TF's batch_reduce_implementation and calls the parent as TF code does."""

    def __init__(self):
        self.seen: list = []

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.seen.append([type(v).__name__ for v, _ in value_destination_pairs])
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self.seen.append("reduce")
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)


def test_a_subclass_with_tfs_reduce_implementation_signature():
    ops = TFSignatureOps()
    s = cr.MirroredStrategy(2, cross_device_ops=ops)
    xs = cr.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])])
    expected = (xs.values[0] + xs.values[1]) * 10
    assert torch.equal(s.extended.reduce_to("sum", xs, "cpu").values[0], expected)
    assert ops.seen == [("reduce", "PerReplica", "cpu")]
    # the default batch_reduce_implementation goes through the TF-style reduce_implementation
    out = s.extended.batch_reduce_to("sum", [(xs, "cpu"), (xs, xs)])
    assert all(torch.equal(m.values[0], expected) for m in out)
    assert torch.equal(s.reduce("sum", xs), expected)


def test_a_subclass_with_tfs_batch_reduce_implementation_signature():
    ops = TFSignatureBatchOps()
    s = cr.MirroredStrategy(3, cross_device_ops=ops)
    xs = cr.PerReplica([torch.tensor([1.0, float(r)]) for r in range(3)])
    total = xs.values[0] + xs.values[1] + xs.values[2]
    out = s.extended.batch_reduce_to("sum", [(xs, "cpu"), (xs, xs)])
    assert ops.seen == [["PerReplica", "PerReplica"]]
    assert torch.equal(out[0].values[0], total) and [torch.equal(v, total) for v in out[1].values] == [True] * 3
    assert torch.equal(s.extended.reduce_to("mean", xs, "cpu").values[0], total / 3)
    assert ops.seen[-1] == "reduce"


def test_the_library_signature_still_gets_the_reducer():
    class Mine(cr.AllReduceCrossDeviceOps):
        def reduce_implementation(self, reduce_op, values, devices, options, reducer=None):
            assert isinstance(values, list) and reducer is not None
            return super().reduce_implementation(reduce_op, values, devices, options, reducer)

    s = cr.MirroredStrategy(2, cross_device_ops=Mine())
    xs = cr.PerReplica([torch.ones(2), 2 * torch.ones(2)])
    assert torch.equal(s.reduce("sum", xs), torch.full((2,), 3.0))


# ------------------------------------------------------------------ 6. worker_devices inside a logical device


def test_worker_devices_follow_the_active_logical_device():
    s = cr.MirroredStrategy(2)
    ext = s.extended
    cpu, meta = torch.device("cpu"), torch.device("meta")
    ext.set_logical_devices([(cpu, meta), (cpu, meta)])  # on a CPU machine: a second device to tell apart

    def fn():
        outside = ext.worker_devices
        with ext.experimental_logical_device(1):
            inside = ext.worker_devices
            with ext.experimental_logical_device(0):
                nested = ext.worker_devices
        return outside, inside, nested, ext.worker_devices

    for outside, inside, nested, after in s.experimental_local_results(s.run(fn)):
        assert outside == nested == after == (cpu, cpu)
        assert inside == (meta, meta)
    assert ext.worker_devices == (cpu, cpu)
    other = cr.MirroredStrategy(3).extended  # another strategy's devices are its own, in the block too
    out = s.run(lambda: _in_logical_device(ext, 1, lambda: other.worker_devices))
    assert out == (cpu,) * 3  # the same tuple on both replicas: regrouped to itself


def _in_logical_device(ext, j, fn):
    with ext.experimental_logical_device(j):
        return fn()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_worker_devices_follow_the_active_logical_device_on_cuda():
    s = cr.MirroredStrategy(devices=["cpu", "cuda:0", "cpu", "cuda:0"], logical_devices_per_replica=2)

    def fn():
        with s.extended.experimental_logical_device(1):
            return s.extended.worker_devices, torch.zeros(1).device

    for inside, made in s.experimental_local_results(s.run(fn)):
        assert inside == (torch.device("cuda:0"),) * 2 and made.type == "cuda"
    assert s.extended.worker_devices == (torch.device("cpu"),) * 2


# ------------------------------------------------------------------ 7. extended outliving its strategy


def test_extended_works_after_the_strategy_is_dropped():
    import gc

    ext = cr.MirroredStrategy(2).extended
    gc.collect()
    xs = cr.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    out = ext.reduce_to("sum", xs, "cpu")
    assert torch.equal(out.values[0], torch.tensor([4.0, 6.0]))
    (batched,) = ext.batch_reduce_to("mean", [(xs, xs)])
    assert [v.tolist() for v in batched.values] == [[2.0, 3.0]] * 2
    ran = ext.call_for_each_replica(lambda x: cr.all_reduce(x, "sum"), args=(xs,))
    assert [v.tolist() for v in ran.values] == [[4.0, 6.0]] * 2


# ------------------------------------------------------------------ 9. cr.save into a missing directory


def _save_main(strategy, root) -> dict:
    path = os.path.join(root, "a", "b", "ck.pt")
    cr.save(path, {"w": torch.arange(3.0), "step": 7}, strategy=strategy)
    loaded = cr.load(path, strategy=strategy)
    return {"exists": os.path.isfile(path), "w": loaded["w"].tolist(), "step": loaded["step"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_creates_missing_directories(layout, tmp_path):
    root = str(tmp_path / "run")
    for res in run_main(_save_main, layout, root):
        assert res == {"exists": True, "w": [0.0, 1.0, 2.0], "step": 7}
    assert sorted(os.listdir(tmp_path / "run" / "a" / "b")) == ["ck.pt"]


def test_save_names_a_directory_it_cannot_create(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"cr.save: cannot create the directory .*file/sub"):
        cr.save(blocker / "sub" / "ck.pt", {"x": torch.ones(1)}, strategy=cr.OneDeviceStrategy())


# ------------------------------------------------------------------ 8. all_to_all with TF's keywords

TF_GROUPS = [[0, 2], [1, 3]]


def _tf_all_to_all(x):
    return {"tf": cr.all_to_all(x, concat_dimension=1, split_dimension=0, split_count=4),
            "tf-grouped": cr.all_to_all(x, concat_dimension=0, split_dimension=1, split_count=2,
                                        group_assignment=TF_GROUPS),
            "mixed": cr.all_to_all(x, split_dim=0, concat_dimension=1),
            "ours": cr.all_to_all(x, 0, 1)}


def test_all_to_all_takes_tfs_keywords(run_replicas):
    xs = [torch.arange(24.0).reshape(4, 6) + 100 * r for r in range(4)]
    outs = run_replicas(_tf_all_to_all, 4, xs)
    for r, out in enumerate(outs):
        whole = torch.cat([x.chunk(4, 0)[r] for x in xs], 1)
        group = next(g for g in TF_GROUPS if r in g)
        grouped = torch.cat([xs[m].chunk(2, 1)[group.index(r)] for m in group], 0)
        assert torch.equal(out["tf"], whole) and torch.equal(out["ours"], whole)
        assert torch.equal(out["mixed"], whole) and torch.equal(out["tf-grouped"], grouped)


def _bad_all_to_all(case):
    x = torch.zeros(4, 4)
    calls = {"count": lambda: cr.all_to_all(x, split_dimension=0, concat_dimension=0, split_count=3),
             "bool-count": lambda: cr.all_to_all(x, 0, 0, split_count=True),
             "both": lambda: cr.all_to_all(x, 0, 1, split_dimension=0),
             "both-concat": lambda: cr.all_to_all(x, 0, 1, concat_dimension=1),
             "missing": lambda: cr.all_to_all(x, concat_dimension=1)}
    try:
        calls[case]()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("case,error,match", [
    ("count", "ValueError", r"split_count=3 must equal the group size 2"),
    ("bool-count", "ValueError", r"split_count=True must equal the group size 2"),
    ("both", "TypeError", r"split_dim=0 and TF's split_dimension=0; they are one argument"),
    ("both-concat", "TypeError", r"concat_dim=1 and TF's concat_dimension=1"),
    ("missing", "TypeError", r"missing the argument split_dim \(TF's split_dimension\)"),
])
def test_all_to_all_tf_keyword_errors(case, error, match):
    s = cr.MirroredStrategy(2)
    for res in s.experimental_local_results(s.run(_bad_all_to_all, args=(case,))):
        assert res is not None and res[0] == error
        assert re.search(match, res[1]), res[1]


# ------------------------------------------------------------------ 4. MEAN of huge finite values

MEAN_DTYPES = [torch.bfloat16, torch.float32, torch.float64]
HALVES = [[0, 1], [2, 3]]


def _huge(dtype, r: int) -> torch.Tensor:
    """Replica r's values: most above max/4, so their sum overflows while their mean does not."""
    big = torch.finfo(dtype).max
    return torch.tensor([0.9 * big, (0.3 + 0.1 * r) * big, -0.8 * big, 1.5 + r], dtype=torch.float64).to(dtype)


def _exact_mean(xs) -> torch.Tensor:
    """The mean of every replica's values, exactly (rational arithmetic), rounded to float64."""
    cols = zip(*[[Fraction(v) for v in x.double().tolist()] for x in xs])
    return torch.tensor([float(sum(c) / len(xs)) for c in cols], dtype=torch.float64)


def _means(x):
    return {"mean": cr.cross_replica_mean(x), "halves": cr.cross_replica_mean(x, HALVES),
            "all_reduce": cr.all_reduce(x, "mean"), "scatter": cr.reduce_scatter(x, "mean"),
            "replica_ctx": cr.get_replica_context().all_reduce("mean", x)}


@pytest.mark.parametrize("dtype", MEAN_DTYPES, ids=str)
def test_mean_of_huge_values_is_finite_in_replica_context(run_replicas, dtype):
    xs = [_huge(dtype, r) for r in range(4)]
    whole = _exact_mean(xs)
    for r, out in enumerate(run_replicas(_means, 4, xs)):
        half = _exact_mean([xs[i] for i in HALVES[r // 2]])
        for key in ("mean", "all_reduce", "replica_ctx"):
            assert out[key].dtype == dtype and bool(torch.isfinite(out[key]).all()), (key, out[key])
            torch.testing.assert_close(out[key].double(), whole, rtol=torch.finfo(dtype).eps * 4, atol=0)
        torch.testing.assert_close(out["halves"].double(), half, rtol=torch.finfo(dtype).eps * 4, atol=0)
        torch.testing.assert_close(out["scatter"].double(), whole.chunk(4)[r], rtol=torch.finfo(dtype).eps * 4,
                                   atol=0)


def _strategy_means(strategy) -> list:
    out = []
    for dtype in MEAN_DTYPES:
        xs = _per_replica(strategy, lambda r, dtype=dtype: _huge(dtype, r))
        reduced = strategy.reduce("mean", xs)
        to = strategy.extended.reduce_to("mean", xs, "cpu").values[0]
        (batched,) = strategy.extended.batch_reduce_to("mean", [(xs, "cpu")])
        rows = _per_replica(strategy, lambda r, dtype=dtype: _huge_rows(dtype, r))
        along = strategy.reduce("mean", rows, axis=0)  # over every row of every replica
        out.append([t.double() for t in (reduced, to, batched.values[0])] + [along.double()])
    return out


def _huge_rows(dtype, r: int) -> torch.Tensor:
    return torch.stack([_huge(dtype, r), _huge(dtype, (r + 1) % 4)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strategy_mean_of_huge_values_is_finite(layout):
    _, workers, per_worker = layout
    n = workers * per_worker
    for res in run_main(_strategy_means, layout):
        for dtype, got in zip(MEAN_DTYPES, res):
            ref = _exact_mean([_huge(dtype, r) for r in range(n)])
            for t in got[:3]:
                torch.testing.assert_close(t, ref, rtol=torch.finfo(dtype).eps * 4, atol=0)
            rows = _exact_mean([row for r in range(n) for row in _huge_rows(dtype, r)])
            torch.testing.assert_close(got[3], rows, rtol=torch.finfo(dtype).eps * 4, atol=0)


def _mean_pair(pair):
    return cr.all_reduce(list(pair), "mean")


def _mean_rule(leaves_per_replica, scale=4.0):
    """The MEAN of every leaf over the replicas by the documented rule: the plain sum in
    replica order / n; when any element of any leaf's result is not finite, every leaf of
    the call redone with its values scaled by 1/scale first and the result by scale after."""
    def mean(xs):
        total = xs[0] + xs[1]
        for x in xs[2:]:
            total = total + x
        return total / len(xs)

    columns = list(zip(*leaves_per_replica))
    plain = [mean(list(c)) for c in columns]
    if all(bool(torch.isfinite(p).all()) for p in plain):
        return plain, False
    return [mean([x * (1.0 / scale) for x in c]) * scale for c in columns], True


@pytest.mark.parametrize("numel", [8, 100_000], ids=["small", "parallel-path"])
@pytest.mark.parametrize("case", ["one-leaf-overflows", "no-overflow", "finite-but-its-sum-overflows"])
def test_a_mean_call_is_redone_scaled_as_a_whole_on_every_engine(run_replicas, case, numel):
    # Leaf b's values turn subnormal when scaled by 1/4, so its bits tell the plain mean from
    # the scaled one: the call's decision, taken once for every leaf and replica, shows. The
    # large leaf takes the threads engine's parallel path (each replica checks a share).
    big = torch.finfo(torch.float32).max
    g = torch.Generator().manual_seed(3)
    pairs = []
    for r in range(4):
        a = torch.randn(numel, generator=g) * (1.0 + r)
        if case == "one-leaf-overflows":
            a[numel // 2] = 0.9 * big  # four of them: the sum overflows
        elif case == "finite-but-its-sum-overflows":
            a[:6] = 0.2 * big  # each mean is finite; their sum over the leaf is not
        b = (torch.rand(5, generator=g, dtype=torch.float64) * 3e-38 + 1e-38).float()
        pairs.append((a, b))
    expected, scaled = _mean_rule(pairs)
    assert scaled is (case == "one-leaf-overflows")
    other, _ = _mean_rule([(b,) for _, b in pairs])  # leaf b alone: never scaled
    assert torch.equal(other[0], expected[1]) is not scaled  # the test tells the two apart
    for out in run_replicas(_mean_pair, 4, pairs):
        assert all(torch.equal(o, e) for o, e in zip(out, expected)), (out, expected)


def _ordinary(x):
    return cr.cross_replica_mean(x), cr.cross_replica_mean(x, HALVES)


@pytest.mark.parametrize("dtype", MEAN_DTYPES, ids=str)
def test_mean_of_ordinary_values_keeps_its_bits(run_replicas, dtype):
    g = torch.Generator().manual_seed(5)
    xs = [(torch.randn(64, generator=g, dtype=torch.float64) * 10 ** r).to(dtype) for r in range(4)]
    wide = torch.float32 if dtype is torch.bfloat16 else dtype

    def plain(members):  # the sum in replica order, then / n: the result before the change
        total = xs[members[0]].to(wide)
        for i in members[1:]:
            total = total + xs[i].to(wide)
        return (total / len(members)).to(dtype)

    s = cr.MirroredStrategy(4)
    assert torch.equal(s.reduce("mean", cr.PerReplica(xs)), plain([0, 1, 2, 3]))
    total = xs[0].to(wide).sum(0)
    for x in xs[1:]:
        total = total + x.to(wide).sum(0)
    assert torch.equal(s.reduce("mean", cr.PerReplica(xs), axis=0), (total / 256).to(dtype))
    for r, (whole, half) in enumerate(run_replicas(_ordinary, 4, xs)):
        assert torch.equal(whole, plain([0, 1, 2, 3])) and torch.equal(half, plain(HALVES[r // 2]))
