"""DDP habits that used to give wrong numbers in silence, on threads and on worker processes.

* A DDP loader (``DistributedSampler``) handed to ``distribute_dataset`` is refused with both
  fixes; the per-worker loader through ``distribute_datasets_from_function`` and the global
  loader through ``distribute_dataset`` each read every row once.
* ``torch.distributed`` calls in a replica function: right (and allowed) with one replica per
  process, a ReplicaContextError naming the ``cr.`` call with several (threads, 2x2).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from harness import run_layout

import crossreplica as cr
import crossreplica.testing as crt
from crossreplica.strategies import dist_guard

# (engine, workers, replicas per worker)
LAYOUTS = [
    pytest.param(("threads", 1, 2), id="threads-1x2"),
    pytest.param(("processes", 2, 1), id="processes-2x1", marks=pytest.mark.multiprocess),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]
ROWS = 8


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(ROWS, dtype=torch.float32))


# ------------------------------------------------------------------ a DDP loader


def _ddp_sampler(strategy, dataset) -> DistributedSampler:
    """DDP's sampler: under torchrun its defaults (the world size and rank); in one process the
    two ranks a DDP script would have."""
    ext = strategy.extended
    if ext.num_workers > 1:
        return DistributedSampler(dataset, shuffle=False)
    return DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)


def _rows_seen(strategy, dataset) -> list[float]:
    """This worker's replicas' rows over one pass of ``dataset``."""
    seen: list[float] = []
    for batch in dataset:
        out = strategy.run(lambda b: b[0] * 1, args=(batch,))
        seen += [v for t in strategy.experimental_local_results(out) for v in t.tolist()]
    return seen


def _ddp_loader_main(strategy) -> dict:
    ds = _dataset()
    ddp = DataLoader(ds, batch_size=2, sampler=_ddp_sampler(strategy, ds))
    wrapped = DataLoader(ds, batch_sampler=BatchSampler(_ddp_sampler(strategy, ds), 2, drop_last=False))
    errors = []
    for loader in (ddp, wrapped):
        try:
            strategy.distribute_dataset(loader)
        except ValueError as e:
            errors.append(str(e))
    if strategy.extended.num_workers > 1:  # the fix: the per-worker loader as an input pipeline
        pipeline = strategy.distribute_datasets_from_function(lambda ctx: ddp)
    else:
        pipeline = strategy.distribute_datasets_from_function(lambda ctx: DataLoader(ds, batch_size=2))
    whole = strategy.distribute_dataset(DataLoader(ds, batch_size=4))  # the other fix: global batches
    return {"errors": errors, "pipeline": _rows_seen(strategy, pipeline), "whole": _rows_seen(strategy, whole)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_ddp_loader_is_refused_and_both_fixes_read_every_row(layout):
    _, workers, per_worker = layout
    results = run_layout(_ddp_loader_main, layout)
    for w, res in enumerate(results):
        rank = w if workers > 1 else 0
        assert len(res["errors"]) == 2
        for message in res["errors"]:
            assert message.startswith("strategy.distribute_dataset takes a loader of global batches, but this "
                                      f"DataLoader draws its indices from a torch.utils.data.DistributedSampler "
                                      f"(num_replicas=2, rank={rank}): each of its batches is already one of 2 "
                                      f"shares (DDP's per-rank loader), and splitting it again over the "
                                      f"{workers * per_worker} replicas in sync would train on 1/2 of the data.")
            assert "strategy.distribute_datasets_from_function(lambda ctx: loader)" in message
        assert all("DataLoader(dataset, batch_size=4, shuffle=...)" in m for m in res["errors"])
        if workers > 1:
            assert f"{workers} and {w} here, DistributedSampler's defaults under torchrun" in res["errors"][0]
        else:
            assert "one input pipeline here: drop the sampler" in res["errors"][0]
    for fix in ("pipeline", "whole"):
        rows = sorted(v for res in results for v in res[fix])
        assert rows == [float(r) for r in range(ROWS)], fix  # every row once, over all replicas


def test_a_distributed_sampler_of_one_rank_or_one_replica_is_accepted():
    ds = _dataset()
    single = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=False))
    s = cr.MirroredStrategy(2)
    assert _rows_seen(s, s.distribute_dataset(single)) == [float(r) for r in range(ROWS)]
    ddp = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False))
    one = cr.OneDeviceStrategy()
    assert [b[0].tolist() for b in one.distribute_dataset(ddp)] == [[1.0, 3.0, 5.0, 7.0]]  # nothing split


def test_an_input_pipeline_needs_its_own_share_of_the_sampler():
    ds = _dataset()
    s = cr.MirroredStrategy(2)
    foreign = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    with pytest.raises(ValueError, match=r"dataset_fn returned a DataLoader whose torch.utils.data.DistributedSampler "
                                         r"has num_replicas=2, rank=0, but it feeds input pipeline 0 of 1 .* "
                                         r"DistributedSampler\(dataset, num_replicas=ctx.num_input_pipelines, "
                                         r"rank=ctx.input_pipeline_id\)"):
        s.distribute_datasets_from_function(lambda ctx: foreign)
    own = s.distribute_datasets_from_function(lambda ctx: DataLoader(ds, batch_size=2, sampler=DistributedSampler(
        ds, num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id, shuffle=False)))
    assert sorted(_rows_seen(s, own)) == [float(r) for r in range(ROWS)]


# ------------------------------------------------------------------ torch.distributed in a replica function

VALUES = [1.0, 10.0, 100.0, 1000.0]


def _ddp_mean(value: float) -> float:
    """DDP's logging habit: all-reduce the loss, divide by the world size."""
    t = torch.tensor([value])
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def _cr_mean(value: float) -> float:
    return cr.all_reduce(torch.tensor([value]), "mean").item()


def _world(_: int) -> tuple[int, int, int, int]:
    return dist.get_world_size(), dist.get_rank(), cr.num_replicas(), cr.replica_id()


def _through_torch(value: float) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates it for its functional collectives
        return torch.distributed.nn.functional.all_reduce(torch.tensor([value])).item()


def _torch_and_merge_fn(_: int) -> tuple[int, int]:
    """torch's own rank queries (a DistributedSampler's defaults) and merge_fn's calls pass."""
    sampler = DistributedSampler(range(8))
    world = cr.get_replica_context().merge_call(lambda strategy: dist.get_world_size())
    return sampler.num_replicas, world


def _run(fn, args, layout):
    engine, workers, per_worker = layout
    return crt.run_replicas(fn, args, engine=engine,
                            replicas_per_worker=per_worker if engine == "processes" else None)


@pytest.mark.parametrize("layout", [
    pytest.param(("threads", 1, 4), id="threads-1x4"),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
])
def test_torch_distributed_calls_with_several_replicas_per_process_name_the_cr_call(layout):
    _, workers, per_worker = layout
    local = 2 if workers == 2 else 4
    where = (rf"torch.distributed's ranks are processes and this process runs {local} of the 4 replicas in sync, "
             rf"over {workers} process\(es\)")
    with pytest.raises(cr.ReplicaContextError, match=r"torch.distributed.all_reduce was called in a replica "
                                                     rf"function, but {where}: the replica threads of a process "
                                                     r"call it on the same process group, .* Use t = "
                                                     r"cr.all_reduce\(t, \"sum\"\)"):
        _run(_ddp_mean, VALUES, layout)
    with pytest.raises(cr.ReplicaContextError, match=r"torch.distributed.(get_world_size|get_rank) was called .* "
                                                     r"Use cr.(num_replicas|replica_id)\(\)"):
        _run(_world, range(4), layout)
    with pytest.raises(cr.ReplicaContextError, match=r"torch.distributed.all_reduce was called in a replica function "
                                                     r"\(reached through torch.distributed.nn.functional\)"):
        _run(_through_torch, VALUES, layout)
    assert _run(_cr_mean, VALUES, layout) == [277.75] * 4  # the fix
    if workers == 2:
        assert _run(_torch_and_merge_fn, range(4), layout) == [(2, 2)] * 4


@pytest.mark.multiprocess
def test_torch_distributed_calls_with_one_replica_per_process_are_right():
    layout = ("processes", 2, 1)
    assert _run(_ddp_mean, VALUES[:2], layout) == [5.5, 5.5] == _run(_cr_mean, VALUES[:2], layout)
    assert _run(_world, range(2), layout) == [(2, 0, 2, 0), (2, 1, 2, 1)]


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # no process group in this process: torch's own error
        return type(e), str(e)


def test_the_guard_keeps_torchs_functions_and_cross_replica_calls():
    cr.MirroredStrategy(2).run(lambda: None)  # the first run with several replicas installs it
    assert dist_guard.installed()
    assert dist.all_reduce.__wrapped__ is torch.distributed.distributed_c10d.all_reduce
    assert dist.get_world_size.__name__ == "get_world_size"
    assert _outcome(dist.get_world_size) == _outcome(torch.distributed.distributed_c10d.get_world_size)  # outside
    dist_guard.install()  # again: nothing wrapped twice
    assert dist.get_rank.__wrapped__ is torch.distributed.distributed_c10d.get_rank
