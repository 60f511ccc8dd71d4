"""Distributed input: splitting global batches, InputContext, input functions."""

import collections
import warnings

import numpy as np
import pytest
import torch

from harness import run_layout

import crossreplica as cr
from crossreplica.data import split_batch, split_sizes


def strategy(n):
    return cr.MirroredStrategy(n, devices=["cpu"] * n)


@pytest.mark.parametrize("rows,parts,expected", [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]),
                                                 (3, 4, [1, 1, 1, 0]), (0, 2, [0, 0]), (5, 1, [5])])
def test_split_sizes(rows, parts, expected):
    assert split_sizes(rows, parts) == expected


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("rows", [8, 10, 3])
def test_tensor_batches_split_along_dim0(n, rows):
    s = strategy(n)
    x = torch.arange(rows * 2.0).view(rows, 2)
    (batch,) = list(s.distribute_dataset([x]))
    assert isinstance(batch, cr.PerReplica)
    parts = s.experimental_local_results(batch)
    assert [p.shape[0] for p in parts] == split_sizes(rows, n)
    assert torch.equal(torch.cat(parts), x)


def test_nest_batches_keep_structure_and_non_tensor_leaves():
    Batch = collections.namedtuple("Batch", "x y")
    s = strategy(2)
    batch = {"inputs": Batch(torch.randn(5, 3), torch.arange(5)), "name": "digits"}
    (out,) = list(s.distribute_dataset([batch]))
    assert isinstance(out, dict) and isinstance(out["inputs"], Batch)
    assert out["name"] == "digits"
    seen = s.run(lambda b: (b["inputs"].x.shape, b["inputs"].y, b["name"]), args=(out,))
    shapes, ys, names = seen
    assert s.experimental_local_results(shapes) == ((3, 3), (2, 3))
    assert [y.tolist() for y in s.experimental_local_results(ys)] == [[0, 1, 2], [3, 4]]
    assert names == "digits"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_per_row_sequences_split_with_the_tensors(n):
    """Lists, tuples and numpy arrays as long as the batch are per-row data: they are cut
    exactly where the tensors are; shorter or nested ones reach every replica whole."""
    rows = 5
    x = torch.arange(rows * 2).view(rows, 2)
    labels = [f"img{i}.png" for i in range(rows)]
    batch = {"x": x, "labels": labels, "ids": tuple(range(rows)), "np": np.arange(rows) * 10,
             "classes": ["cat", "dog"], "pair": [x, x], "tag": "digits"}
    s = strategy(n) if n > 1 else cr.OneDeviceStrategy()
    (out,) = list(s.distribute_dataset([batch]))

    def body(b):  # what each replica received, in a shape that regroups
        return {"x": b["x"], "labels": "|".join(b["labels"]), "ids_type": type(b["ids"]).__name__,
                "ids": torch.tensor(b["ids"]), "np": torch.from_numpy(b["np"]),
                "classes": "|".join(b["classes"]), "pair": b["pair"], "tag": b["tag"]}

    locals_ = s.experimental_local_results(s.run(body, args=(out,)))
    starts = [0]
    for size in split_sizes(rows, n):
        starts.append(starts[-1] + size)
    for i, got in enumerate(locals_):
        lo, hi = starts[i], starts[i + 1]
        assert torch.equal(got["x"], x[lo:hi])
        assert got["labels"] == "|".join(labels[lo:hi])
        assert got["ids_type"] == "tuple" and got["ids"].tolist() == list(range(lo, hi))
        assert got["np"].tolist() == [10 * r for r in range(lo, hi)]
        assert got["classes"] == "cat|dog"
        assert torch.equal(got["pair"][0], x[lo:hi]) and torch.equal(got["pair"][1], x[lo:hi])
        assert got["tag"] == "digits"


def test_namedtuple_of_plain_values_is_not_per_row_data():
    Meta = collections.namedtuple("Meta", "a b")
    parts = split_batch((torch.zeros(2, 1), Meta("u", "v")), 2)
    assert [p[1] for p in parts] == [Meta("u", "v"), Meta("u", "v")]


def test_one_device_gets_the_whole_batch():
    s = cr.OneDeviceStrategy()
    x = torch.randn(4, 2)
    (out,) = list(s.distribute_dataset([x]))
    assert torch.equal(out, x)


def test_works_with_dataloader_and_is_reiterable():
    ds = torch.utils.data.TensorDataset(torch.arange(10.0).view(10, 1), torch.arange(10))
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    s = strategy(2)
    dist = s.distribute_dataset(loader)
    assert len(dist) == 3
    for _ in range(2):  # a new pass each time
        got = []
        for x, y in dist:
            got.append(s.run(lambda a, b: (torch.tensor(a.shape[0]), b), args=(x, y)))
        rows = [tuple(int(t) for t in s.experimental_local_results(r[0])) for r in got]
        assert rows == [(2, 2), (2, 2), (1, 1)]
        assert torch.equal(torch.cat([torch.cat(s.experimental_local_results(r[1])) for r in got]),
                           torch.arange(10))


def test_each_replica_receives_its_part_inside_run():
    s = strategy(4)
    x = torch.arange(10.0)

    def body(part):
        return torch.tensor(cr.replica_id()), part

    for batch in s.distribute_dataset([x]):
        ids, parts = s.run(body, args=(batch,))
    assert [int(i) for i in s.experimental_local_results(ids)] == [0, 1, 2, 3]
    assert [p.tolist() for p in s.experimental_local_results(parts)] == [
        [0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]


def test_uneven_final_batch_gives_exact_global_mean():
    """The loss-and-weight recipe: per-replica mean loss, weight = rows."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x, y = torch.randn(7, 3), torch.randn(7, 1)
    ref = torch.nn.Linear(3, 1)
    ref.load_state_dict(lin.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    s = strategy(4)
    model = s.mirror(lin)

    def body(m, batch):
        xb, yb = batch
        loss = torch.nn.functional.mse_loss(m(xb), yb, reduction="sum") / max(xb.shape[0], 1)
        loss.backward()
        cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)).synchronize(weight=xb.shape[0])
        return m.weight.grad, m.bias.grad

    for batch in s.distribute_dataset([(x, y)]):
        gw, gb = s.run(body, args=(model, batch))
    for v in s.experimental_local_results(gw):
        torch.testing.assert_close(v, ref.weight.grad, rtol=1e-5, atol=1e-7)
    for v in s.experimental_local_results(gb):
        torch.testing.assert_close(v, ref.bias.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ InputContext

def test_input_context_defaults_and_batch_size():
    ctx = cr.InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    ctx = cr.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    assert "input_pipeline_id=1" in repr(ctx)


def test_per_replica_batch_size_not_divisible():
    ctx = cr.InputContext(num_replicas_in_sync=4)
    with pytest.raises(ValueError, match=r"The `global_batch_size` 10 is not divisible by `num_replicas_in_sync` 4"):
        ctx.get_per_replica_batch_size(10)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_input_pipelines": 0}, "num_input_pipelines must be a positive int"),
    ({"input_pipeline_id": -1}, "input_pipeline_id must be a non-negative int"),
    ({"num_input_pipelines": 2, "input_pipeline_id": 2}, r"input_pipeline_id must be in \[0, num_input_pipelines=2\)"),
    ({"num_replicas_in_sync": 1.5}, "num_replicas_in_sync must be a positive int"),
])
def test_input_context_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cr.InputContext(**kwargs)


def test_bad_global_batch_size():
    with pytest.raises(ValueError, match="global_batch_size must be a non-negative int; got -4"):
        cr.InputContext().get_per_replica_batch_size(-4)


def test_distribute_datasets_from_function():
    s = strategy(2)
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(4)
        return [torch.arange(per_replica * 1.0) + 10 * i for i in range(4)]

    dist = s.distribute_datasets_from_function(dataset_fn)
    (ctx,) = contexts
    assert isinstance(ctx, cr.InputContext)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)
    batches = [s.experimental_local_results(b) for b in dist]
    # the replicas take whole per-replica batches in turn (tests/data/test_tf_input.py has more)
    assert len(batches) == len(dist) == 2
    assert [p.tolist() for p in batches[1]] == [[20.0, 21.0], [30.0, 31.0]]


# ------------------------------------------------------------------ bad input

def test_rows_must_agree():
    s = strategy(2)
    with pytest.raises(ValueError, match="leaf 0 has 4 rows, leaf 1 has 3"):
        list(s.distribute_dataset([(torch.zeros(4), torch.zeros(3))]))


def test_zero_dim_tensor():
    s = strategy(2)
    with pytest.raises(ValueError, match="is a 0-d tensor"):
        list(s.distribute_dataset([(torch.zeros(4), torch.tensor(1.0))]))


def test_batch_without_tensor():
    s = strategy(2)
    with pytest.raises(ValueError, match="must hold at least one tensor"):
        list(s.distribute_dataset([("a", 1)]))


def test_already_distributed_batch():
    s = strategy(2)
    with pytest.raises(ValueError, match="already a PerReplica"):
        list(s.distribute_dataset([cr.PerReplica([torch.zeros(1), torch.zeros(1)])]))


@pytest.mark.parametrize("bad", [3, "abc", None])
def test_not_iterable(bad):
    with pytest.raises(ValueError, match="dataset must be an iterable of global batches"):
        strategy(2).distribute_dataset(bad)


def test_dataset_fn_errors():
    s = strategy(2)
    with pytest.raises(ValueError, match="dataset_fn must be callable"):
        s.distribute_datasets_from_function([1, 2])
    with pytest.raises(ValueError, match="dataset_fn must return an iterable"):
        s.distribute_datasets_from_function(lambda ctx: 3)


# ------------------------------------------------------------------ a JAX pmap-style stacked batch

LAYOUTS = [
    pytest.param(("threads", 1, 4), id="threads-1x4"),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]


def _porting_warnings(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in seen if issubclass(w.category, cr.logs.PortingWarning)]


@pytest.mark.parametrize("n", [2, 4])
def test_a_pmap_stacked_batch_warns_once_per_dataset(n):
    s = strategy(n)
    x, y = torch.randn(n, 5, 3), torch.randn(n, 5)  # (replicas, per_replica_batch, ...)
    dataset = s.distribute_dataset([(x, y)] * 3)
    batches, seen = _porting_warnings(lambda: list(dataset))
    assert len(batches) == 3 and len(seen) == 1
    assert str(seen[0].message) == (
        f"strategy.distribute_dataset got a global batch of {n} rows for {n} replicas in sync, so each replica gets "
        f"a batch of one row (tensor shapes [[{n}, 5, 3], [{n}, 5]]): this looks like a JAX pmap-style stacked batch "
        f"(replicas, per_replica_batch, ...). distribute_dataset splits a global batch along dim 0, its rows: pass "
        f"the rows themselves (x.flatten(0, 1), a global batch of {5 * n} rows), or hand each replica its slice with "
        f"strategy.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group]). If a "
        f"global batch of {n} rows is what you mean, silence this with "
        f"warnings.filterwarnings(\"ignore\", category=cr.logs.PortingWarning)")
    assert seen[0].filename == __file__  # the loop over the dataset
    # both fixes give each replica its 5 rows
    for fixed in (next(iter(s.distribute_dataset([(x.flatten(0, 1), y.flatten(0, 1))]))),
                  s.experimental_distribute_values_from_function(lambda ctx: (x[ctx.replica_id_in_sync_group],
                                                                              y[ctx.replica_id_in_sync_group]))):
        parts = s.experimental_local_results(fixed[0])
        assert [tuple(p.shape) for p in parts] == [(5, 3)] * n
        assert all(torch.equal(p, x[i]) for i, p in enumerate(parts))


@pytest.mark.parametrize("batch", [
    pytest.param((torch.randn(2, 3), torch.randn(2)), id="rows-and-labels"),
    pytest.param((torch.randn(2, 3, 8, 8), torch.arange(2)), id="images-and-labels"),
    pytest.param(torch.randn(2, 1, 8, 8), id="grayscale-images"),
    pytest.param({"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16)}, id="tokens"),
    pytest.param((torch.randn(4, 5, 3), torch.randn(4, 5)), id="more-rows-than-replicas"),
    pytest.param((torch.randn(2, 5, 3), torch.randn(2, 4)), id="per-replica-sizes-differ"),
])
def test_ordinary_batches_of_as_many_rows_as_replicas_do_not_warn(batch):
    s = strategy(2)
    _, seen = _porting_warnings(lambda: list(s.distribute_dataset([batch])))
    assert seen == []


def test_input_functions_and_one_replica_do_not_warn():
    stacked = torch.randn(2, 5, 3)
    _, seen = _porting_warnings(lambda: list(strategy(2).distribute_datasets_from_function(lambda ctx: [stacked] * 2)))
    assert seen == []
    _, seen = _porting_warnings(lambda: list(cr.OneDeviceStrategy().distribute_dataset([stacked[:1]])))
    assert seen == []


class _Sequences(torch.utils.data.Dataset):
    """Items of shape (5, 3): a DataLoader of 4 stacks them like pmap's per-device batches."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((5, 3), float(i))


def _stacked_loader_main(strategy) -> list[str]:
    loader = torch.utils.data.DataLoader(_Sequences(), batch_size=strategy.num_replicas_in_sync)
    dataset = strategy.distribute_dataset(loader)
    _, seen = _porting_warnings(lambda: [list(dataset), list(dataset)])
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stacked_batch_from_a_sharded_loader_warns_on_every_worker(layout):
    for messages in run_layout(_stacked_loader_main, layout):
        assert len(messages) == 1
        assert messages[0].startswith("strategy.distribute_dataset got a global batch of 4 rows for 4 replicas in "
                                      "sync, so each replica gets a batch of one row (tensor shapes [[4, 5, 3]])")
