"""TF's other spellings (issue 40, the seed audit): each works as TF's does, against values
computed here with plain torch or TF's documented ones.

1. ``name=`` on the TPU ops (``cross_replica_sum(x, group_assignment=None, name=None)``,
   ``cross_replica_mean``, ``collective_permute``, ``all_to_all``), and a name put where
   the group goes named as that mistake;
2. ``experimental_distribute_datasets_from_function``; ``experimental_hints=`` (TF 2.2/2.3's
   ``options``) on ``ReplicaContext.all_reduce``, ``reduce_to``, ``batch_reduce_to`` and the
   cross-device ops;
3. ``reduce_non_distributed_value`` (0 for 0, the value for MEAN, SUM of another value
   refused) and TF 1.x's ``cr.VariableAggregation`` where a reduce op goes;
4. TPU-estimator-era loops: ``steps_per_run``, ``make_input_fn_iterator``,
   ``experimental_run``, ``experimental_make_numpy_dataset``;
5. variables under ``experimental_logical_device`` (cross-replica and replica context) and
   ``ReplicaContext.experimental_logical_device``;
6. TF's positional ``all_to_all(x, concat_dimension, split_dimension, split_count, ...)``.

Behaviour the engines share runs on threads and on worker processes.
"""

from __future__ import annotations

import functools
import re
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from harness import run_layout as run_main
from plain_torch import mse, one_device_training

import crossreplica as cr

# (engine, workers, replicas per worker)
LAYOUTS = [
    pytest.param(("threads", 1, 4), id="threads-1x4"),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]


def _x(r: int) -> torch.Tensor:
    return torch.tensor([1.0 + r, -2.0 * r, 0.25 * r + 0.5])


def _seq_sum(values) -> torch.Tensor:
    """The sum in ascending replica order, as every reduction adds."""
    out = values[0].clone()
    for v in values[1:]:
        out = out + v
    return out


# ------------------------------------------------------------------ 1. name= on the TPU ops


def _named_ops(x):
    return {"sum-kw": cr.cross_replica_sum(x, name="grad_sum"),
            "sum-pos": cr.cross_replica_sum(x, None, "grad_sum"),
            "sum-grouped": cr.cross_replica_sum(x, [[0, 1], [2, 3]], "pair_sum"),
            "mean-kw": cr.cross_replica_mean(x, name="grad_mean"),
            "mean-grouped": cr.cross_replica_mean(x, [[0, 2], [1, 3]], "pair_mean"),
            "ring": cr.collective_permute(x, [[0, 1], [1, 2], [2, 3], [3, 0]], "ring"),
            "swap": cr.collective_permute(x, [[0, 1], [1, 0]], name="swap"),
            "a2a": cr.all_to_all(x.reshape(1, 3).expand(4, 3).contiguous(), 0, 0, name="a2a")}


def test_tpu_ops_take_tfs_name(run_replicas):
    xs = [_x(r) for r in range(4)]
    total = _seq_sum(xs)
    for r, out in enumerate(run_replicas(_named_ops, 4, xs)):
        pair = [0, 1] if r < 2 else [2, 3]
        strided = [0, 2] if r % 2 == 0 else [1, 3]
        assert torch.equal(out["sum-kw"], total) and torch.equal(out["sum-pos"], total)
        assert torch.equal(out["sum-grouped"], xs[pair[0]] + xs[pair[1]])
        assert torch.equal(out["mean-kw"], total / 4)
        assert torch.equal(out["mean-grouped"], (xs[strided[0]] + xs[strided[1]]) / 2)
        assert torch.equal(out["ring"], xs[(r - 1) % 4])
        assert torch.equal(out["swap"], xs[1 - r] if r < 2 else torch.zeros(3))
        assert torch.equal(out["a2a"], torch.stack(xs))  # row r of every member, in group order


def _named_sum_alone():
    return cr.cross_replica_sum(torch.ones(2), name="my_grad_sum")


def test_name_labels_the_call_in_a_profiler_trace():
    s = cr.MirroredStrategy(1)  # the replica runs in this thread, which the profiler records
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = s.run(_named_sum_alone)
    assert torch.equal(out, torch.ones(2))
    assert "my_grad_sum" in {e.name for e in prof.events()}


def _bad_name(case):
    x = torch.ones(2)
    calls = {"str-group": lambda: cr.cross_replica_sum(x, "grad_sum"),
             "str-group-mean": lambda: cr.cross_replica_mean(x, "grad_mean"),
             "int-name": lambda: cr.cross_replica_sum(x, None, 3),
             "permute-name": lambda: cr.collective_permute(x, [[0, 1]], ["ring"]),
             "a2a-name": lambda: cr.all_to_all(torch.ones(2, 2), 0, 1, name=1)}
    try:
        calls[case]()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("case,error,match", [
    ("str-group", "ValueError", r"cr\.cross_replica_sum: group_assignment='grad_sum' is a str, which looks like "
                                r"TF's op name; TF's order is \(x, group_assignment=None, name=None\), as here: "
                                r"pass it as name='grad_sum'"),
    ("str-group-mean", "ValueError", r"cr\.cross_replica_mean: group_assignment='grad_mean' is a str"),
    ("int-name", "TypeError", r"cr\.cross_replica_sum: name must be a str \(TF's op name\) or None; got 3"),
    ("permute-name", "TypeError", r"cr\.collective_permute: name must be a str .* got \['ring'\]"),
    ("a2a-name", "TypeError", r"cr\.all_to_all: name must be a str"),
])
def test_name_errors(case, error, match):
    s = cr.MirroredStrategy(2)
    for got in s.experimental_local_results(s.run(_bad_name, args=(case,))):
        assert got is not None and got[0] == error
        assert re.search(match, got[1]), got[1]


# ------------------------------------------------------------------ 2. TF's older names for inputs and options


def _pipeline(ctx):
    """Per-replica batches for this input pipeline: two steps, one element per local replica."""
    per_pipeline = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    first = ctx.input_pipeline_id * per_pipeline
    return [torch.full((2,), 10.0 * step + first + i) for step in range(2) for i in range(per_pipeline)]


def _datasets_main(strategy) -> dict:
    new = [[v.tolist() for v in strategy.experimental_local_results(e)]
           for e in strategy.distribute_datasets_from_function(_pipeline)]
    old = [[v.tolist() for v in strategy.experimental_local_results(e)]
           for e in strategy.experimental_distribute_datasets_from_function(_pipeline)]
    try:
        strategy.experimental_distribute_datasets_from_function(_pipeline, options=object())
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"new": new, "old": old, "refused": refused, "ids": list(strategy.extended.local_replica_ids)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experimental_distribute_datasets_from_function(layout):
    for res in run_main(_datasets_main, layout):
        assert res["old"] == res["new"]
        assert res["new"] == [[[10.0 * step + r] * 2 for r in res["ids"]] for step in range(2)]
        assert "options has no crossreplica counterpart (TF's tf.distribute.InputOptions); pass None" in res["refused"]


def _hinted(x, timeout):
    rctx = cr.get_replica_context()
    hints = cr.CommunicationOptions(timeout_seconds=timeout)
    return {"hints": rctx.all_reduce("sum", x, experimental_hints=hints),
            "options": rctx.all_reduce("sum", x, options=hints),
            "positional": rctx.all_reduce(cr.ReduceOp.MEAN, x, hints)}


@pytest.mark.parametrize("timeout", [None, 30.0])  # 30 s: the merge_call path, None: the engine's
def test_experimental_hints_on_replica_all_reduce(run_replicas, engine, timeout):
    xs = [_x(r) for r in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = run_replicas(_hinted, 4, xs, [timeout] * 4)
    for out in outs:
        assert torch.equal(out["hints"], _seq_sum(xs)) and torch.equal(out["options"], _seq_sum(xs))
        assert torch.equal(out["positional"], _seq_sum(xs) / 4)
    if engine == "threads":  # (a worker process's warnings stay in its stderr)
        assert any(issubclass(w.category, DeprecationWarning) and "experimental_hints=...) is TF 2.2/2.3's name "
                   "for options=" in str(w.message) for w in caught)


def test_experimental_hints_with_options_is_one_argument_twice():
    s = cr.MirroredStrategy(2)
    opts = cr.CommunicationOptions()

    def both():
        try:
            cr.get_replica_context().all_reduce("sum", torch.ones(1), options=opts, experimental_hints=opts)
        except TypeError as e:
            return str(e)

    for msg in s.experimental_local_results(s.run(both)):
        assert "experimental_hints is TF's old name for options: pass options only" in msg
    with pytest.raises(TypeError, match="extended.reduce_to got options=.* and experimental_hints="):
        s.extended.reduce_to("sum", cr.PerReplica([torch.ones(1)] * 2), "cpu", opts, experimental_hints=opts)
    with pytest.warns(DeprecationWarning, match=r"ReplicaContext.all_reduce\(experimental_hints=\.\.\.\)"):
        assert cr.get_replica_context().all_reduce("sum", 3.0, experimental_hints=opts) == 3.0  # the default context


# ------------------------------------------------------------------ 3. non-distributed values and TF 1.x's aggregations


def _grads(strategy):
    return strategy.experimental_distribute_values_from_function(lambda ctx: _x(ctx.replica_id_in_sync_group))


def _reduce_main(strategy) -> dict:
    """Every result as a list (or the error's message)."""
    va = cr.VariableAggregation
    g = _grads(strategy)
    out: dict = {}

    def keep(key, fn):
        try:
            v = fn()
        except (TypeError, ValueError) as e:
            out[key] = (type(e).__name__, str(e))
            return
        if isinstance(v, cr.DistributedValues):
            v = [t.tolist() for t in v.values]
        elif isinstance(v, list):
            v = [[t.tolist() for t in m.values] for m in v]
        elif isinstance(v, torch.Tensor):
            v = ("tensor", v.tolist(), str(v.dtype))
        out[key] = v

    ops = strategy.extended.cross_device_ops
    keep("sum-0", lambda: strategy.reduce("sum", 0))
    keep("prod-0", lambda: strategy.reduce("prod", 0.0))
    keep("mean-3", lambda: strategy.reduce("mean", 3))
    keep("max-3", lambda: strategy.reduce("max", 3.5))
    keep("sum-zeros", lambda: strategy.reduce("sum", torch.zeros(2, 2)))
    keep("sum-3", lambda: strategy.reduce("sum", 3.0))
    keep("sum-nest", lambda: strategy.reduce("sum", {"zero": 0, "g": g}))
    keep("destinations-as-axis", lambda: strategy.reduce(va.SUM, g, "cpu"))
    with strategy.scope():
        keep("ops-sum-zeros", lambda: ops.reduce("sum", torch.zeros(3), "cpu"))
        keep("ops-mean-value", lambda: ops.reduce("mean", torch.ones(3), "cpu"))
        keep("ops-sum-value", lambda: ops.reduce("sum", torch.ones(3), "cpu"))
        keep("ops-batch-zeros", lambda: ops.batch_reduce("sum", [(torch.zeros(1), "cpu"), (g, "cpu")]))
        keep("ops-va-sum", lambda: ops.reduce(va.SUM, g, "cpu"))
        keep("ops-hints", lambda: ops.reduce("mean", g, "cpu", experimental_hints=cr.CommunicationOptions()))
    keep("va-sum", lambda: strategy.reduce(va.SUM, g))
    keep("va-mean", lambda: strategy.reduce(va.MEAN, g))
    keep("va-first", lambda: strategy.reduce(va.ONLY_FIRST_REPLICA, g))
    keep("va-first-plain", lambda: strategy.reduce(va.ONLY_FIRST_REPLICA, 2.5))
    keep("va-first-axis", lambda: strategy.reduce(va.ONLY_FIRST_REPLICA, g, axis=0))
    keep("va-none", lambda: strategy.reduce(va.NONE, g))
    keep("va-reduce-to", lambda: strategy.extended.reduce_to(va.MEAN, g, "cpu"))
    keep("va-reduce-to-first", lambda: strategy.extended.reduce_to(va.ONLY_FIRST_REPLICA, g, g))
    keep("va-batch", lambda: strategy.extended.batch_reduce_to(va.SUM, [(g, "cpu"), (g, g)]))
    keep("va-batch-first", lambda: strategy.extended.batch_reduce_to(va.ONLY_FIRST_REPLICA, [(g, "cpu")]))
    keep("hints-reduce-to", lambda: strategy.extended.reduce_to(
        "sum", g, "cpu", experimental_hints=cr.CommunicationOptions(timeout_seconds=30)))
    keep("hints-batch", lambda: strategy.extended.batch_reduce_to(
        "sum", [(g, "cpu")], experimental_hints=cr.CommunicationOptions(bytes_per_pack=8)))
    keep("va-in-replica", lambda: strategy.run(lambda x: cr.all_reduce(x, va.MEAN), args=(g,)))
    out["local"] = len(strategy.extended.worker_devices)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_distributed_values_and_variable_aggregations(layout):
    _, workers, per_worker = layout
    n = workers * per_worker
    xs = [_x(r) for r in range(n)]
    total, first = _seq_sum(xs).tolist(), xs[0].tolist()
    mean = (_seq_sum(xs) / n).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        results = run_main(_reduce_main, layout)
    for res in results:
        local = res["local"]
        # TF's reduce_non_distributed_value: 0 for 0 (any op), the value for MEAN (MAX, MIN)
        assert res["sum-0"] == ("tensor", 0, "torch.int64") and res["prod-0"] == ("tensor", 0.0, "torch.float32")
        assert res["mean-3"] == ("tensor", 3, "torch.int64")  # an int: no arithmetic, no dtype rule
        assert res["max-3"][1] == 3.5 and res["sum-zeros"][1] == [[0.0, 0.0], [0.0, 0.0]]
        assert res["sum-3"][0] == "ValueError" and (f"a non-distributed value tensor(3.) cannot be reduced with "
                                                    f"op=sum over {n} replicas") in res["sum-3"][1]
        assert res["sum-nest"]["zero"] == 0 and res["sum-nest"]["g"].tolist() == total
        assert res["destinations-as-axis"][0] == "TypeError"
        assert "TF 1.x's reduce(aggregation, value, destinations) is strategy.extended.reduce_to(op, value, " \
               "destinations)" in res["destinations-as-axis"][1]
        assert res["ops-sum-zeros"] == [[0.0] * 3] and res["ops-mean-value"] == [[1.0] * 3]
        assert res["ops-sum-value"][0] == "ValueError"
        assert "TF's CrossDeviceOps.reduce reads a plain tensor as one replica's value" in res["ops-sum-value"][1]
        assert res["ops-batch-zeros"] == [[[0.0]], [total]]
        assert res["ops-va-sum"] == [total] and res["ops-hints"] == [mean]
        # TF 1.x's VariableAggregation where a reduce op goes: SUM, MEAN; ONLY_FIRST_REPLICA is replica 0's
        assert res["va-sum"][1] == total and res["va-mean"][1] == mean
        assert res["va-first"][1] == first and res["va-first-plain"][1] == 2.5
        assert res["va-first-axis"][0] == "ValueError" and "takes replica 0's value as it is" in res["va-first-axis"][1]
        assert res["va-none"][0] == "ValueError"
        assert "reduce_op=cr.VariableAggregation.NONE has no cr.ReduceOp" in res["va-none"][1]
        assert res["va-reduce-to"] == [mean] and res["va-reduce-to-first"] == [first] * local
        assert res["va-batch"] == [[total], [total] * local] and res["va-batch-first"] == [[first]]
        assert res["hints-reduce-to"] == [total] and res["hints-batch"] == [[total]]
        assert res["va-in-replica"] == [mean] * local


def test_non_distributed_sum_over_one_replica_is_the_value():
    s = cr.MirroredStrategy(1)
    assert s.reduce("sum", 3.0) == 3.0 and s.reduce(cr.VariableAggregation.SUM, 3.0) == 3.0
    with s.scope():
        assert torch.equal(cr.AllReduceCrossDeviceOps().reduce("sum", torch.ones(2), "cpu").values[0], torch.ones(2))


# ------------------------------------------------------------------ 4. TPU-estimator-era loops

GLOBAL, STEPS, LR = 8, 4, 0.1


def _data() -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(0)
    return g.standard_normal((GLOBAL * STEPS, 3)).astype(np.float32), g.standard_normal((GLOBAL * STEPS, 1)).astype(
        np.float32)


def _fresh_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Linear(3, 1)


def _plain_torch() -> list[torch.Tensor]:
    """One device, each global batch whole, the mean loss, plain SGD."""
    x, y = map(torch.from_numpy, _data())
    return one_device_training(_fresh_model(), functools.partial(torch.optim.SGD, lr=LR),
                               zip(x.split(GLOBAL), y.split(GLOBAL)), mse).params


def _tpu_step(model, batch):
    """The TPU way: the replica's mean loss, gradients averaged with cross_replica_mean."""
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    params = list(model.parameters())
    grads = cr.cross_replica_mean(list(torch.autograd.grad(loss, params)), name="grads")
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(LR * g)
    return loss.detach()


def _input_fn(ctx):
    """Per-replica batches for this pipeline: per step, its replicas' rows of the global batch."""
    x, y = map(torch.from_numpy, _data())
    per = ctx.get_per_replica_batch_size(GLOBAL)
    local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    ids = range(ctx.input_pipeline_id * local, (ctx.input_pipeline_id + 1) * local)
    return [(x[s * GLOBAL + r * per:s * GLOBAL + (r + 1) * per], y[s * GLOBAL + r * per:s * GLOBAL + (r + 1) * per])
            for s in range(STEPS) for r in ids]


def _estimator_main(strategy, source: str, steps_per_run: int) -> dict:
    strategy.extended.steps_per_run = steps_per_run
    with strategy.scope():
        model = strategy.mirror(_fresh_model())
    if source == "input_fn":
        iterator = strategy.make_input_fn_iterator(_input_fn, cr.InputReplicationMode.PER_WORKER)
        assert iterator.initialize() == []
    else:
        dataset = strategy.experimental_make_numpy_dataset(_data())
        iterator = iter(strategy.distribute_dataset(DataLoader(dataset, batch_size=GLOBAL)))
    dispatches = 0
    while True:
        try:
            strategy.experimental_run_steps(lambda batch: _tpu_step(model, batch), iterator)  # steps_per_run steps
        except StopIteration:
            break
        dispatches += 1
    out = {"dispatches": dispatches, "steps_per_run": strategy.steps_per_run,
           "params": [[p.detach().clone() for p in m.parameters()] for m in strategy.experimental_local_results(model)]}
    if source == "input_fn":
        iterator.initialize()  # a new pass: TF 1.x's initializer
        first = strategy.experimental_run(lambda batch: batch[0].sum(), iterator)
        out["first"] = [v.item() for v in strategy.experimental_local_results(first)]
        out["ids"] = list(strategy.extended.local_replica_ids)
    return out


@pytest.mark.parametrize("source", ["input_fn", "numpy"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tpu_estimator_loop_trains_like_plain_torch(layout, source):
    expected = _plain_torch()
    x, _ = _data()
    per = GLOBAL // (layout[1] * layout[2])
    for res in run_main(_estimator_main, layout, source, 2):
        assert res["dispatches"] == STEPS // 2 and res["steps_per_run"] == 2
        for params in res["params"]:
            for got, want in zip(params, expected):
                torch.testing.assert_close(got, want)
        if source == "input_fn":  # the first step again, replica r's rows of the first global batch
            assert res["first"] == pytest.approx([float(x[r * per:(r + 1) * per].sum()) for r in res["ids"]])
    assert any(not torch.equal(e, p) for e, p in zip(expected, _fresh_model().parameters()))  # it trained


def _count_steps(ctx, inputs):
    ctx.set_non_tensor_output("seen", ctx.non_tensor_outputs.get("seen", 0) + 1)


def test_steps_per_run_is_tpustrategys_argument_and_attribute():
    s = cr.MirroredStrategy(2, steps_per_run=3)
    assert s.steps_per_run == s.extended.steps_per_run == 3
    assert cr.MirroredStrategy(2).steps_per_run == 1 and cr.OneDeviceStrategy().extended.steps_per_run == 1
    batches = [torch.arange(4.0) + 10 * i for i in range(7)]
    it = iter(s.distribute_dataset(batches))
    last = s.experimental_run_steps(lambda x: x.sum(), it)  # three steps: batches 0, 1, 2
    assert [v.item() for v in s.experimental_local_results(last)] == [batches[2][:2].sum().item(),
                                                                       batches[2][2:].sum().item()]
    ctx = s.extended.experimental_run_steps_on_iterator(_count_steps, it)  # three more
    assert ctx.non_tensor_outputs["seen"] == 3
    assert torch.equal(next(it).values[0], batches[6][:2])
    s.extended.steps_per_run = None  # TF's default
    assert s.steps_per_run == 1
    with pytest.raises(ValueError, match=r"steps_per_run must be a positive int \(or None: 1\); got 0"):
        cr.MirroredStrategy(2, steps_per_run=0)
    with pytest.raises(ValueError, match=r"steps_per_run must be a positive int \(or None: 1\); got 2\.5"):
        s.extended.steps_per_run = 2.5
    with pytest.raises(AttributeError):
        s.steps_per_run = 4  # TF's: read it from (and set it on) strategy.extended


def test_make_input_fn_iterator_modes_and_errors():
    s = cr.MirroredStrategy(2)
    fn = lambda ctx: [torch.ones(1) * i for i in range(4)]  # noqa: E731
    it = s.make_input_fn_iterator(fn, "per_worker")
    assert [v.item() for v in it.get_next().values] == [0.0, 1.0]
    assert [v.item() for v in next(it).values] == [2.0, 3.0]
    with pytest.raises(StopIteration):
        it.get_next()
    assert it.initialize() == [] and [v.item() for v in next(iter(it)).values] == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"supports replication_mode=cr\.InputReplicationMode\.PER_WORKER only \(as "
                                         r"TF\); got cr\.InputReplicationMode\.PER_REPLICA"):
        s.make_input_fn_iterator(fn, cr.InputReplicationMode.PER_REPLICA)
    with pytest.raises(ValueError, match=r"replication_mode must be a cr\.InputReplicationMode \(PER_WORKER, "
                                         r"PER_REPLICA\) or its name; got 'per_host'"):
        s.make_input_fn_iterator(fn, "per_host")
    with pytest.raises(ValueError, match=r"input_iterator must be an iterator over a distributed dataset \(pass "
                                         r"iter\(dataset\)\)"):
        s.experimental_run(lambda x: x, [torch.ones(2)])
    assert s.experimental_local_results(s.experimental_run(cr.replica_id)) == (0, 1)


def test_experimental_make_numpy_dataset():
    s = cr.MirroredStrategy(2)
    a, b = np.arange(12.0).reshape(6, 2), np.arange(6)
    expected = torch.tensor(a.tolist(), dtype=torch.float64).sum(0)  # plain torch, before a changes
    ds = s.experimental_make_numpy_dataset({"a": a, "b": b})
    assert len(ds) == 6
    row = ds[4]
    assert torch.equal(row["a"], torch.tensor([8.0, 9.0], dtype=torch.float64)) and row["b"].item() == 4
    a[4, 0] = -1.0  # a copy, as TF's
    assert ds[4]["a"][0].item() == 8.0
    stacked = s.experimental_make_numpy_dataset([np.zeros(3), np.ones(3)])  # a list is stacked (tf.data's rule)
    assert len(stacked) == 2 and torch.equal(stacked[1], torch.ones(3, dtype=torch.float64))
    batch = next(iter(s.distribute_dataset(DataLoader(ds, batch_size=6))))
    assert torch.equal(s.reduce("sum", s.run(lambda x: x["a"].sum(0), args=(batch,))), expected)
    with pytest.raises(ValueError, match=r"every array of numpy_input must have the same number of rows .* got "
                                         r"\[6, 5\] rows"):
        s.experimental_make_numpy_dataset((a, np.zeros(5)))
    with pytest.raises(ValueError, match=r"numpy_input leaf 0 is a scalar"):
        s.experimental_make_numpy_dataset(np.float32(3.0))
    with pytest.raises(ValueError, match=r"session has no crossreplica counterpart"):
        s.experimental_make_numpy_dataset(a, session=object())


# ------------------------------------------------------------------ 5. variables under a logical device

CPU, META = torch.device("cpu"), torch.device("meta")


def _two_logical(n):
    s = cr.MirroredStrategy(n)
    s.extended.set_logical_devices([(CPU, META)] * n)  # on a CPU machine: a second device to tell apart
    return s


@pytest.mark.parametrize("n", [1, 2])
def test_variables_created_under_a_logical_device_in_cross_replica_context(n):
    s = _two_logical(n)
    ext = s.extended
    with s.scope():
        with ext.experimental_logical_device(1) as devices:
            assert devices == (META,) * n and ext.worker_devices == (META,) * n
            v = cr.Variable(torch.ones(2), name="v")
            w = cr.Variable(1.0)
            m = s.mirror(torch.nn.Linear(2, 2))
            inner = s.run(lambda: (ext.worker_devices, torch.empty(0).device))  # a replica starts on device 0
        u = cr.Variable(torch.ones(2))
    assert [c.device for c in v.values] == [c.device for c in w.values] == [META] * n
    assert [next(x.parameters()).device for x in m.values] == [META] * n
    assert [c.device for c in u.values] == [CPU] * n and ext.worker_devices == (CPU,) * n
    assert all(got == ((CPU,) * n, CPU) for got in s.experimental_local_results(inner))
    with pytest.raises(ValueError, match=r"logical_device_id must be an int in \[0, 2\)"):
        with ext.experimental_logical_device(2):
            pass


def _replica_variable():
    with cr.get_replica_context().experimental_logical_device(1) as device:
        v = cr.Variable(torch.ones(2))
        made = torch.empty(0).device
    return device, made, tuple(c.device for c in v.values)


def test_replica_context_experimental_logical_device_places_variables():
    s = _two_logical(2)
    for device, made, copies in s.experimental_local_results(s.run(_replica_variable)):
        assert device == made == META and copies == (META, META)
    with cr.get_replica_context().experimental_logical_device(0) as devices:  # the default replica context
        assert devices == cr.get_strategy().extended.worker_devices


def _accumulate(v, g):
    with cr.get_replica_context().experimental_logical_device(1):
        v.assign_add(g)  # SUM aggregation: every replica's g, once
        return v.value().clone()


def test_a_variable_made_under_a_logical_device_trains_like_plain_torch():
    s = cr.MirroredStrategy(devices=["cpu"] * 4, logical_devices_per_replica=2)
    with s.scope(), s.extended.experimental_logical_device(1):
        v = cr.Variable(torch.zeros(3), aggregation=cr.VariableAggregation.SUM)
    gs = [_x(r) for r in range(2)]
    out = s.run(_accumulate, args=(v, cr.PerReplica(gs)))
    for got in s.experimental_local_results(out):
        assert torch.equal(got, gs[0] + gs[1])
    assert all(torch.equal(c, gs[0] + gs[1]) for c in v.values)


# ------------------------------------------------------------------ 6. TF's positional all_to_all


def _tf_positional(x):
    return {"tf": cr.all_to_all(x, 1, 0, 4),
            "tf-grouped": cr.all_to_all(x, 0, 1, 2, [[0, 2], [1, 3]], "grouped_a2a"),
            "tf-group-kw": cr.all_to_all(x, 0, 1, 2, group_assignment=[[0, 2], [1, 3]], name="kw"),
            "ours": cr.all_to_all(x, 0, 1, [[0, 1, 2, 3]]),
            "ours-kw": cr.all_to_all(x, 0, 1, group_assignment=[[0, 1, 2, 3]])}


def test_all_to_all_takes_tfs_positional_order(run_replicas):
    xs = [torch.arange(24.0).reshape(4, 6) + 100 * r for r in range(4)]
    groups = [[0, 2], [1, 3]]
    for r, out in enumerate(run_replicas(_tf_positional, 4, xs)):
        whole = torch.cat([x.chunk(4, 0)[r] for x in xs], 1)  # split along 0, concatenated along 1
        group = next(g for g in groups if r in g)
        grouped = torch.cat([xs[m].chunk(2, 1)[group.index(r)] for m in group], 0)  # split 1, concatenated 0
        assert torch.equal(out["tf"], whole) and torch.equal(out["ours"], whole) and torch.equal(out["ours-kw"], whole)
        assert torch.equal(out["tf-grouped"], grouped) and torch.equal(out["tf-group-kw"], grouped)


def _bad_positional(case):
    x = torch.zeros(4, 4)
    calls = {"count": lambda: cr.all_to_all(x, 1, 0, 3),
             "twice": lambda: cr.all_to_all(x, 1, 0, 2, split_count=2),
             "group-twice": lambda: cr.all_to_all(x, 1, 0, 2, [[0, 1]], group_assignment=[[0, 1]]),
             "too-many-tf": lambda: cr.all_to_all(x, 1, 0, 2, None, "n", 7),
             "too-many-ours": lambda: cr.all_to_all(x, 0, 1, None, None),
             "ours-twice": lambda: cr.all_to_all(x, 0, 1, [[0, 1]], group_assignment=[[0, 1]])}
    try:
        calls[case]()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("case,error,match", [
    ("count", "ValueError", r"split_count=3 must equal the group size 2"),
    ("twice", "TypeError", r"cr\.all_to_all\(x, 1, 0, 2, \.\.\.\) is TF's positional order \(concat_dimension, "
                           r"split_dimension, split_count\), which already gives split_count"),
    ("group-twice", "TypeError", r"cr\.all_to_all got group_assignment twice"),
    ("too-many-tf", "TypeError", r"in TF's positional order takes at most x, concat_dimension, split_dimension, "
                                 r"split_count, group_assignment and name; got 7"),
    ("too-many-ours", "TypeError", r"takes x, split_dim, concat_dim and group_assignment positionally"),
    ("ours-twice", "TypeError", r"cr\.all_to_all got group_assignment twice"),
])
def test_all_to_all_positional_errors(case, error, match):
    s = cr.MirroredStrategy(2)
    for got in s.experimental_local_results(s.run(_bad_positional, args=(case,))):
        assert got is not None and got[0] == error and re.search(match, got[1]), got
