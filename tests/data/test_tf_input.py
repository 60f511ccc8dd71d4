"""Input as TF does it: per-replica datasets from a function, values from a function, and
index sharding of map-style DataLoaders across workers.

Each check runs in one process (MirroredStrategy, 4 replicas) and across worker
processes (MultiWorkerMirroredStrategy via crossreplica.testing.run_workers, 2x1 and
2x2), and is compared with what the replicas should see, computed here from the data.
"""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import crossreplica as cr
from crossreplica.data import split_sizes
from crossreplica.input_shards import ShardedLoader, shardable
from crossreplica.testing import run_workers

# (engine, workers, replicas per worker)
LAYOUTS = [
    pytest.param(("threads", 1, 4), id="threads-1x4"),
    pytest.param(("processes", 2, 1), id="processes-2x1", marks=pytest.mark.multiprocess),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]


def run_main(main, layout) -> list:
    """``main(strategy)`` once per worker of ``layout``; the per-worker results."""
    engine, workers, per_worker = layout
    if engine == "threads":
        return [main(cr.MirroredStrategy(per_worker, devices=["cpu"] * per_worker))]
    return run_workers(main, workers, per_worker)


# ------------------------------------------------------------------ datasets from a function

SAMPLES, GLOBAL_BATCH = 44, 8


def _pipeline_rows(pipeline: int, pipelines: int) -> list[int]:
    return list(range(SAMPLES))[pipeline::pipelines]


def _from_function_main(strategy) -> dict:
    """The TF idiom: each pipeline reads its share of the samples, batched per replica."""
    contexts = []

    def dataset_fn(ctx: cr.InputContext):
        contexts.append(repr(ctx))
        per = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        rows = _pipeline_rows(ctx.input_pipeline_id, ctx.num_input_pipelines)
        return [(torch.tensor(rows[i:i + per], dtype=torch.float32), [f"s{r}" for r in rows[i:i + per]])
                for i in range(0, len(rows), per)]

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    seen = []
    for batch in dist:
        out = strategy.run(lambda b: (cr.replica_id(), b[0] * 1, "|".join(b[1])), args=(batch,))
        ids, xs, labels = (strategy.experimental_local_results(v) for v in out)
        seen.append([(i, x.tolist(), s) for i, x, s in zip(ids, xs, labels)])
    return {"contexts": contexts, "len": len(dist), "seen": seen}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_replicas_take_whole_per_replica_batches_in_turn(layout):
    """Global batch 8 on 4 replicas: each replica gets 2 rows per step (not 8 / 4 / 4), and an
    epoch takes SAMPLES / 8 steps; the last step's replicas without an element get empty ones."""
    _, workers, per_worker = layout
    n = workers * per_worker
    per = GLOBAL_BATCH // n
    results = run_main(_from_function_main, layout)
    for w, res in enumerate(results):
        assert res["contexts"] == [f"InputContext(num_input_pipelines={workers}, input_pipeline_id={w}, "
                                   f"num_replicas_in_sync={n})"]
        rows = _pipeline_rows(w, workers)
        elements = [rows[i:i + per] for i in range(0, len(rows), per)]
        steps = -(-len(elements) // per_worker)
        assert res["len"] == steps == len(res["seen"])
        for s, step in enumerate(res["seen"]):
            for i, (rid, x, labels) in enumerate(step):
                want = elements[s * per_worker + i] if s * per_worker + i < len(elements) else []
                assert rid == w * per_worker + i
                assert x == [float(r) for r in want]
                assert labels == "|".join(f"s{r}" for r in want)
    full = [x for res in results for step in res["seen"][:-1] for _, x, _ in step]
    assert all(len(x) == per for x in full)


def test_one_replica_gets_each_element_whole_and_in_place():
    s = cr.OneDeviceStrategy()
    dist = s.distribute_datasets_from_function(lambda ctx: [torch.ones(3), torch.zeros(3)])
    got = list(dist)
    assert len(dist) == 2 and all(isinstance(g, torch.Tensor) for g in got)
    assert [g.tolist() for g in got] == [[1.0] * 3, [0.0] * 3]


def test_elements_of_different_structure_are_refused():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    dist = s.distribute_datasets_from_function(lambda ctx: [(torch.ones(2),), {"x": torch.ones(2)}])
    with pytest.raises(ValueError, match="share one structure"):
        list(dist)


def test_short_last_step_needs_a_batch_dimension():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    dist = s.distribute_datasets_from_function(lambda ctx: [torch.tensor(1.0)])
    with pytest.raises(ValueError, match="fewer elements than local replicas"):
        list(dist)


# ------------------------------------------------------------------ values from a function

def _values_main(strategy) -> dict:
    def value_fn(ctx: cr.ValueContext):
        return {"x": torch.full((2,), float(ctx.replica_id_in_sync_group)), "n": ctx.num_replicas_in_sync}

    values = strategy.experimental_distribute_values_from_function(value_fn)
    out = strategy.run(lambda v: v["x"] * 2 + v["n"], args=(values,))
    return {"types": [type(values["x"]).__name__, type(values["n"]).__name__],
            "local": [t.tolist() for t in strategy.experimental_local_results(out)],
            "total": strategy.reduce("sum", out).tolist()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distribute_values_from_function(layout):
    _, workers, per_worker = layout
    n = workers * per_worker
    for w, res in enumerate(run_main(_values_main, layout)):
        assert res["types"] == ["PerReplica", "PerReplica"]
        assert res["local"] == [[2.0 * r + n] * 2 for r in range(w * per_worker, (w + 1) * per_worker)]
        assert res["total"] == [float(sum(2 * r + n for r in range(n)))] * 2


def test_value_context_and_bad_value_fn():
    ctx = cr.ValueContext(2, 4)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (2, 4)
    assert repr(ctx) == "ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)"
    with pytest.raises(ValueError, match="replica_id_in_sync_group must be in"):
        cr.ValueContext(4, 4)
    with pytest.raises(ValueError, match="num_replicas_in_sync"):
        cr.ValueContext(0, 0)
    s = cr.OneDeviceStrategy()
    one = s.experimental_distribute_values_from_function(lambda c: torch.tensor(c.replica_id_in_sync_group))
    assert isinstance(one, cr.PerReplica) and one.values[0].item() == 0  # always wrapped, as TF
    with pytest.raises(ValueError, match="value_fn must be callable"):
        s.experimental_distribute_values_from_function(3)
    with pytest.raises(cr.ReplicaContextError):
        s.run(lambda: s.experimental_distribute_values_from_function(lambda c: 1))


# ------------------------------------------------------------------ sharding by index

ROWS, BATCH = 17, 8  # batches of 8, 8 and 1 row: the last leaves some replicas, and workers, no rows


class RecordingDataset(Dataset):
    """A map-style dataset that records the indices it reads."""

    def __init__(self, n: int):
        self.n, self.read = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.read.append(int(i))
        return torch.tensor([float(i), float(i * i)]), f"row{i}"


def _loader(dataset: Dataset, **kw) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7), **kw)


def _sharded_main(strategy) -> dict:
    dataset = RecordingDataset(ROWS)
    dist = strategy.distribute_dataset(_loader(dataset))
    seen = []
    for _ in range(2):  # re-iterable: the second pass reads its own share again
        for batch in dist:
            out = strategy.run(lambda b: (b[0] * 1, "|".join(b[1])), args=(batch,))
            seen.append([(x.tolist(), s) for x, s in zip(*(strategy.experimental_local_results(v) for v in out))])
    return {"sharded": dist.sharded, "len": len(dist), "read": sorted(dataset.read), "seen": seen}


def _expected_parts(n: int) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Per pass over the loader: for each global batch the rows of each replica, and the indices."""
    loader = _loader(RecordingDataset(ROWS))  # iterated as a loader: its pass draws from the generator too
    steps, index_lists = [], []
    for _ in range(2):
        for x, _labels in loader:
            indices = x[:, 0].long().tolist()
            sizes = split_sizes(len(indices), n)
            starts = [sum(sizes[:r]) for r in range(n)]
            steps.append([indices[starts[r]:starts[r] + sizes[r]] for r in range(n)])
            index_lists.append(indices)
    return steps, index_lists


@pytest.mark.parametrize("layout", LAYOUTS)
def test_map_style_loader_is_sharded_across_workers(layout):
    """Every replica sees what the unsharded split gives it, while each worker reads only
    its replicas' rows (one more row for a batch in which it has none: a loader cannot
    collate nothing). In one process there is one pipeline: nothing to shard."""
    engine, workers, per_worker = layout
    n = workers * per_worker
    steps, index_lists = _expected_parts(n)
    for w, res in enumerate(run_main(_sharded_main, layout)):
        assert res["sharded"] == (workers > 1)
        assert res["len"] == -(-ROWS // BATCH)
        local = range(w * per_worker, (w + 1) * per_worker)
        assert len(res["seen"]) == len(steps)
        for got, parts in zip(res["seen"], steps):
            assert got == [([[float(i), float(i * i)] for i in parts[r]], "|".join(f"row{i}" for i in parts[r]))
                           for r in local]
        mine = [i for parts, indices in zip(steps, index_lists)
                for i in ([i for r in local for i in parts[r]] or indices[:1])]
        assert res["read"] == (sorted(mine) if workers > 1 else sorted(i for ix in index_lists for i in ix))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sharded_loader_reads_one_workers_share(num_workers):
    """ShardedLoader in one process, as worker 1 of 2 (replicas 2 and 3 of 4) sees it, with the
    loader's own worker processes too: the shares arrive in order with their global rows."""
    steps, _ = _expected_parts(4)
    sharded = ShardedLoader(_loader(RecordingDataset(ROWS), num_workers=num_workers), 4, [2, 3])
    assert len(sharded) == 3
    for p in range(2):  # a DataLoader restarts its pass on every iter()
        got = [(batch[0][:, 0].long().tolist(), list(batch[1]), rows) for batch, rows in sharded]
        want = [(parts[2] + parts[3], [f"row{i}" for i in parts[2] + parts[3]], sum(map(len, parts)))
                for parts in steps[3 * p:3 * p + 3]]
        # the last batch has one row, replica 0's: this worker fetches it, and cuts it away
        assert got[:2] == want[:2]
        assert got[2][2] == 1 and want[2][0] == []


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(6.0).view(3, 2))


def test_what_cannot_be_sharded_by_index():
    dataset = RecordingDataset(4)
    assert shardable(DataLoader(dataset, batch_size=2))
    assert not shardable(DataLoader(dataset, batch_size=None))  # each item is a whole global batch
    assert not shardable(DataLoader(_Stream(), batch_size=2))
    assert not shardable([torch.ones(2)])
    with pytest.raises(ValueError, match="map-style dataset"):
        ShardedLoader(DataLoader(_Stream(), batch_size=2), 2, [0])


def _stream_main(strategy) -> dict:
    dist = strategy.distribute_dataset(DataLoader(_Stream(), batch_size=2))
    out = [strategy.experimental_local_results(strategy.run(lambda b: b * 1, args=(b,))) for b in dist]
    return {"sharded": dist.sharded, "parts": [[t.tolist() for t in step] for step in out]}


@pytest.mark.multiprocess
def test_iterable_dataset_is_read_whole_by_every_worker():
    """An IterableDataset cannot be sharded by index: each worker reads it all and keeps its rows."""
    x = torch.arange(6.0).view(3, 2)
    for w, res in enumerate(run_workers(_stream_main, 2, 1)):
        assert res["sharded"] is False
        assert res["parts"] == [[x[0:2][w:w + 1].tolist()], [x[2:3][0:1].tolist() if w == 0 else []]]
