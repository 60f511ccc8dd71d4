"""Staging CUDA payloads through host memory for a CPU transport (engines/torch_dist/staging.py),
what runs without a GPU: the chunk plan, the decision of what is staged, the host arenas, the
queue of deferred launches, and the whole staged machinery run on CPU tensors (its copies are
then synchronous) in worker processes, which must give the unstaged path's bytes, in every
form: synchronous and asynchronous, in place or not, through the same-host arena (several
regions under way at once, chunk by chunk) and through host copies with gloo. The GPU side
(side streams, events, pinned and registered memory) is tests/engines/test_staging_cuda.py."""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import crossreplica as cr
from crossreplica.engines.base import AllReduceParams, Call, Kind
from crossreplica.engines.torch_dist import all_reduce as all_reduce_module
from crossreplica.engines.torch_dist import shared_memory, staging
from crossreplica.engines.torch_dist.staging import (
    DONE,
    AllOf,
    HostArena,
    InFlight,
    Piece,
    Staging,
    plan_chunks,
    stageable,
)
from crossreplica.errors import CollectiveMismatchError
from crossreplica.reduce_op import ReduceOp
from crossreplica.testing import run_workers

# ---------------------------------------------------------------------- the chunk plan


def _covered(chunks: list[list[Piece]], numels: list[int]) -> None:
    """Every element of every tensor once, in order, at consecutive places of the region."""
    pieces = [p for chunk in chunks for p in chunk]
    at = 0
    seen = {j: 0 for j in range(len(numels))}
    for p in pieces:
        assert p.at == at and p.lo == seen[p.tensor] and p.hi > p.lo
        at += p.hi - p.lo
        seen[p.tensor] = p.hi
    assert at == sum(numels)
    assert all(seen[j] == n for j, n in enumerate(numels))


def test_chunks_cut_the_region_at_fixed_sizes_across_tensors():
    numels = [5, 0, 9, 3]
    chunks = plan_chunks(numels, 4, chunk_bytes=16)  # 4 elements a chunk
    _covered(chunks, numels)
    sizes = [sum(p.hi - p.lo for p in chunk) for chunk in chunks]
    assert sizes == [4, 4, 4, 4, 1]
    assert chunks[1] == [Piece(0, 4, 5, 4), Piece(2, 0, 3, 5)]  # a chunk spans tensors; the empty one has none


def test_one_chunk_when_chunking_is_off_or_the_payload_is_small():
    assert plan_chunks([3, 4], 4, chunk_bytes=0) == [[Piece(0, 0, 3, 0), Piece(1, 0, 4, 3)]]
    assert len(plan_chunks([1000], 4)) == 1  # under CHUNK_BYTES
    assert len(plan_chunks([staging.CHUNK_BYTES // 4 * 2 + 1], 4)) == 3
    assert plan_chunks([0, 0], 4) == [] and plan_chunks([], 8) == []


def test_the_plan_depends_on_the_sizes_alone():
    numels = [1000, 17, 4096, 1]
    a = plan_chunks(numels, 2, chunk_bytes=1024)
    _covered(a, numels)
    assert a == plan_chunks(list(numels), 2, chunk_bytes=1024)
    assert all(sum(p.hi - p.lo for p in chunk) == 512 for chunk in a[:-1])


# ---------------------------------------------------------------------- what is staged


class _FakeCuda:
    """Stands for a CUDA tensor where there is none (only what ``stageable`` reads)."""

    is_cuda = True

    def __init__(self, contiguous: bool = True):
        self._contiguous = contiguous

    def is_contiguous(self) -> bool:
        return self._contiguous


def test_cpu_tensors_are_never_staged():
    cpu = torch.device("cpu")
    assert not stageable([torch.ones(3), torch.ones(2)], cpu)
    assert not stageable([], cpu)
    assert not stageable([_FakeCuda(), torch.ones(2)], cpu)  # a mix takes the unstaged path


def test_cuda_tensors_are_staged_only_for_a_cpu_transport():
    assert stageable([_FakeCuda(), _FakeCuda()], torch.device("cpu"))
    assert not stageable([_FakeCuda()], torch.device("cuda", 0))  # NCCL: the tensors stay where they are
    assert not stageable([_FakeCuda(contiguous=False)], torch.device("cpu"))


# ---------------------------------------------------------------------- copies in flight


class _Copies:
    """A stand-in for an event after copies: done once ``finished``."""

    def __init__(self, name: str, log: list[str], finished: bool = False):
        self.name, self.log, self.finished = name, log, finished

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.log.append(f"waited {self.name}")
        self.finished = True


def test_a_writer_waits_for_the_copies_of_other_streams_only():
    log: list[str] = []
    inflight = InFlight()
    inflight.add("s1", _Copies("a", log))
    inflight.add("s1", _Copies("b", log))  # later on the same stream: the one to wait for
    inflight.add("s2", _Copies("c", log))
    inflight.add(None, _Copies("cpu", log))  # synchronous copies: nothing to wait for
    inflight.settle("s1")  # the copies of s1 come before anything queued on s1 later
    assert log == ["waited c"] and len(inflight) == 1
    inflight.settle()  # the host writes: every stream's
    assert log == ["waited c", "waited b"] and len(inflight) == 0


def test_all_of_is_done_when_each_part_is():
    log: list[str] = []
    parts = [_Copies("a", log, finished=True), _Copies("b", log)]
    both = AllOf(parts)
    assert not both.query()
    both.synchronize()
    assert both.query() and log == ["waited a", "waited b"]
    assert DONE.query() and AllOf([]).query()


# ---------------------------------------------------------------------- deferred launches


def test_launches_run_in_call_order_as_their_copies_finish():
    log: list[str] = []
    q = Staging()
    first = [_Copies("1a", log), _Copies("1b", log)]
    second = [_Copies("2a", log, finished=True)]
    d1 = q.defer([(c, lambda c=c: log.append(f"launch {c.name}")) for c in first])
    d2 = q.defer([(c, lambda c=c: log.append(f"launch {c.name}")) for c in second])
    q.poll()
    assert log == [] and q.pending == 2  # the second call's copies are done, but it comes after the first
    first[0].finished = True
    q.poll()
    assert log == ["launch 1a"] and not d1.done
    first[1].finished = True
    q.poll()
    assert log == ["launch 1a", "launch 1b", "launch 2a"] and d1.done and d2.done and q.pending == 0


def test_flush_waits_for_the_copies_up_to_a_call():
    log: list[str] = []
    q = Staging()
    calls = [q.defer([(_Copies(str(k), log), lambda k=k: log.append(f"launch {k}"))]) for k in range(3)]
    q.flush(calls[1])
    assert log == ["waited 0", "launch 0", "waited 1", "launch 1"] and q.pending == 1
    q.flush(calls[0])  # already launched: nothing to do
    assert q.pending == 1
    q.flush()
    assert log[-2:] == ["waited 2", "launch 2"] and calls[2].done
    assert q.defer([]).done and q.pending == 0


def test_flush_does_idle_work_while_copies_run():
    log: list[str] = []
    copies = _Copies("x", log)
    polls = []

    def idle():
        polls.append(1)
        if len(polls) == 3:
            copies.finished = True

    q = Staging(idle=idle)
    q.defer([(copies, lambda: log.append("launch"))])
    q.flush()
    assert len(polls) == 3 and log == ["launch"]  # never a blocking wait


def test_a_failed_launch_drops_the_queue():
    log: list[str] = []
    q = Staging()

    def fail():
        raise RuntimeError("the transport failed")

    broken = q.defer([(DONE, fail), (DONE, lambda: log.append("after"))])
    later = q.defer([(DONE, lambda: log.append("later"))])
    with pytest.raises(RuntimeError, match="transport failed"):
        q.flush()
    assert q.pending == 0 and broken.done and later.done and log == []
    with pytest.raises(RuntimeError, match="never started"):  # no result rather than the inputs unreduced
        q.flush(later)
    assert log == []


def test_closing_drops_what_is_queued():
    q = Staging()
    queued = q.defer([(_Copies("x", []), lambda: None)])
    q.close()
    assert q.pending == 0
    with pytest.raises(RuntimeError, match="never started"):
        q.flush(queued)


# ---------------------------------------------------------------------- host arenas


def test_host_regions_are_reused_call_after_call():
    arena = HostArena(torch.float32)
    a = arena.claim(100)
    b = arena.claim(50)
    assert a is not None and b is not None
    assert b.data_ptr() == a.data_ptr() + 400  # regions of one buffer, in call order
    arena.release()
    assert arena.used == 150  # one still held: nothing is reused yet
    arena.release()
    assert arena.used == 0 and arena.held == 0
    c = arena.claim(120)
    assert c is not None and c.data_ptr() == a.data_ptr()  # the same memory again
    assert arena.capacity == (1 << 20) // 4  # the first buffer: 1 MiB


def test_host_arena_grows_geometrically_and_keeps_held_regions():
    arena = HostArena(torch.float64)
    small = arena.claim(10)
    assert small is not None
    small.copy_(torch.arange(10.0))
    first = arena.capacity
    big = arena.claim(first)  # does not fit behind the held region: a new buffer
    assert big is not None and arena.capacity >= first + 10 and arena.capacity >= 2 * first
    assert torch.equal(small, torch.arange(10.0, dtype=torch.float64))  # the held region is untouched
    arena.release()
    arena.release()
    assert arena.used == 0
    again = arena.claim(first)
    assert again is not None and again.data_ptr() == big.data_ptr()


def test_an_empty_region_is_a_region_too():
    arena = HostArena(torch.float32)
    region = arena.claim(0)
    assert region is not None and region.numel() == 0 and arena.held == 1
    arena.release()
    assert arena.held == 0 and arena.used == 0


def test_host_arena_refuses_past_its_limit():
    arena = HostArena(torch.float32, max_bytes=4096)
    assert arena.claim(1025) is None and arena.held == 0
    region = arena.claim(1024)
    assert region is not None and arena.capacity == 1024  # capped at the limit


def test_copies_to_the_host_and_back_on_cpu_tensors():
    q = Staging()
    xs = [torch.arange(6.0).view(2, 3), torch.arange(4, dtype=torch.float64)]
    copy = q.to_host([xs])
    assert copy is not None and copy.ready.query()
    assert [h.shape for h in copy.rows[0]] == [x.shape for x in xs]
    for h, x in zip(copy.rows[0], xs):
        assert torch.equal(h, x) and h.data_ptr() != x.data_ptr()
        h.mul_(2)
    outs = [torch.empty_like(x) for x in xs]
    q.from_host(copy, [outs])
    assert all(torch.equal(o, 2 * x) for o, x in zip(outs, xs))
    assert all(a.held == 0 and a.used == 0 for a in q._arenas.values())


def test_a_call_too_large_for_the_host_arena_holds_nothing():
    q = Staging()
    q.arena(torch.float32).max_bytes = 64
    copy = q.to_host([[torch.ones(4), torch.ones(100)]])
    assert copy is None and q.arena(torch.float32).held == 0


# ---------------------------------------------------------------------- the engine, on CPU tensors


def _cpu_rule(tensors, comm_device) -> bool:
    """``stageable`` for the tests: CPU tensors too (the machinery's copies are then synchronous)."""
    tensors = list(tensors)
    return comm_device.type == "cpu" and bool(tensors) and all(t.is_contiguous() for t in tensors)


def _net() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return net


def _train(overlap: bool) -> list[torch.Tensor]:
    """Three steps of momentum SGD, small buckets (several under way at once with overlap)."""
    rid = cr.replica_id()
    model = _net()
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), bytes_per_pack=2400,
                                 overlap=overlap)
    grads = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rid)
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        grads.extend(p.grad.clone() for p in model.parameters())
        opt.step()
    return grads + [p.detach().clone() for p in model.parameters()]


def _inplace(x: list[torch.Tensor], op: ReduceOp, start: bool = False):
    rctx = cr.get_replica_context()
    everyone = (tuple(range(rctx.num_replicas_in_sync)),)
    call = Call.of(Kind.ALL_REDUCE, everyone, AllReduceParams(op, inplace=True), x)
    if start:
        return rctx.engine.execute_async(rctx.replica_id_in_sync_group, call, x)
    return rctx.engine.execute(rctx.replica_id_in_sync_group, call, x)


def _work() -> dict:
    """Every all-reduce form the engine stages, and training with and without overlap."""
    rid, n = cr.replica_id(), cr.num_replicas()
    g = torch.Generator().manual_seed(rid)
    xs = {"small": torch.randn(3, 5, generator=g), "chunked": torch.randn(3000, generator=g),
          "grows": torch.randn(300_000, generator=g), "f64": torch.randn(7, generator=g, dtype=torch.float64),
          "half": torch.randn(33, generator=g).half(), "ints": torch.arange(6) * (rid + 1)}
    out: dict = {}
    # Async calls under way together, the second larger than the arena behind the first:
    # the arena grows while a region is held.
    a, b = xs["chunked"].clone(), torch.randn(700_000, generator=g)
    first, second = _inplace([a], ReduceOp.SUM, start=True), _inplace([b], ReduceOp.MEAN, start=True)
    out["async grown"] = [*first.wait(), *second.wait()]
    for k, v in xs.items():
        for op in ("sum", "mean", "max", "min"):
            if not (k == "ints" and op == "mean"):
                out[f"{k}/{op}"] = cr.all_reduce(v, op)
    out["nest"] = cr.all_reduce({"a": xs["small"], "b": [xs["chunked"] * 2, xs["f64"]], "c": xs["grows"]})
    out["strided"] = cr.all_reduce(xs["chunked"].view(30, 100).t(), "sum")
    out["alone"] = cr.all_reduce(xs["small"], "sum", group_assignment=[[r] for r in range(n)])  # no transport
    for op in (ReduceOp.SUM, ReduceOp.MEAN):
        y, z = xs["chunked"].clone(), xs["grows"].clone()
        out[f"inplace/{op}"] = _inplace([y, z], op)
        pending = [_inplace([t], op, start=True) for t in (xs["chunked"].clone(), xs["small"].clone(),
                                                           xs["f64"].clone())]
        out[f"async/{op}"] = [t for p in pending for t in p.wait()]
    out["untouched"] = torch.equal(xs["small"], torch.randn(3, 5, generator=torch.Generator().manual_seed(rid)))
    out["train"] = _train(overlap=False)
    out["train overlapped"] = _train(overlap=True)
    return out


def _counted(obj: object, name: str, counts: collections.Counter) -> None:
    method = getattr(obj, name)

    def counting(*args, **kwargs):
        counts[name] += 1
        return method(*args, **kwargs)
    setattr(obj, name, counting)


def _staged_and_not(strategy: cr.Strategy, same_host: bool) -> dict:
    """The replica work staged (CPU tensors through the staging machinery) and not."""
    engine = strategy.extended.engine
    reducer = engine.shared_memory
    if not same_host:
        engine.shared_memory = None
    counts: collections.Counter = collections.Counter()
    _counted(engine.staging, "to_host", counts)
    if reducer is not None:
        _counted(reducer, "stage", counts)
    saved_rule, saved_chunk = all_reduce_module.stageable, staging.CHUNK_BYTES

    def run() -> dict:
        return strategy.experimental_local_results(strategy.run(_work))[0]

    try:
        reference = run()
        unstaged_counts = dict(counts)
        all_reduce_module.stageable, staging.CHUNK_BYTES = _cpu_rule, 4096  # 1024 floats a chunk
        staged = run()
    finally:
        all_reduce_module.stageable, staging.CHUNK_BYTES = saved_rule, saved_chunk
        engine.shared_memory = reducer
    arenas = [] if reducer is None else [*reducer._arenas.values(), *reducer._retired]
    return {"reference": reference, "staged": staged, "unstaged counts": unstaged_counts, "counts": dict(counts),
            "regions held": sum(a.held + a.used for a in arenas) + sum(a.held for a in engine.staging._arenas.values()),
            "retired": 0 if reducer is None else len(reducer._retired), "queued": engine.staging.pending,
            "same host": reducer is not None and reducer.enabled}


_SHM = pytest.mark.skipif(not (os.path.isdir(shared_memory.SHM_DIR) and os.access(shared_memory.SHM_DIR, os.W_OK)),
                          reason="no writable /dev/shm: the workers use the backend")


@pytest.mark.multiprocess
@pytest.mark.parametrize("same_host", [pytest.param(True, marks=_SHM, id="same-host"),
                                       pytest.param(False, id="pinned-and-gloo")])
@pytest.mark.parametrize("workers", [2, 3])
def test_staged_calls_give_the_unstaged_bytes(workers, same_host):
    results = run_workers(_staged_and_not, workers, args=(same_host,))
    for out in results:
        assert out["unstaged counts"] == {}  # CPU tensors are never staged
        assert out["counts"]["to_host"] > 0  # host copies: gloo, subgroups, ints
        if same_host:
            assert out["same host"] and out["counts"]["stage"] > 0  # straight into the arena
        assert out["regions held"] == 0 and out["retired"] == 0 and out["queued"] == 0
        ref, got = out["reference"], out["staged"]
        assert got["untouched"] and ref["untouched"]
        assert ref.keys() == got.keys()
        for key in ref:
            if key == "untouched":
                continue
            for a, b in zip(torch.utils._pytree.tree_leaves(ref[key]), torch.utils._pytree.tree_leaves(got[key])):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
    first = results[0]["staged"]
    for out in results[1:]:  # every worker holds the same results
        for key in ("nest", "async grown", "train overlapped"):
            for a, b in zip(torch.utils._pytree.tree_leaves(first[key]),
                            torch.utils._pytree.tree_leaves(out["staged"][key])):
                assert torch.equal(a, b), key


def _mismatched_regions(strategy: cr.Strategy) -> str:
    """Worker rank 1 holds a region the other never claimed, so their next call's regions
    differ: each must notice rather than sum different data."""
    engine = strategy.extended.engine
    reducer = engine.shared_memory
    if engine.rank == 1:
        reducer._claim({torch.float32: 10})
    try:
        pending = reducer.stage([torch.ones(100)], ReduceOp.SUM, engine.staging, None)
        assert pending is not None
        pending.wait()
    except CollectiveMismatchError as e:
        return "mismatch" if "different calls" in str(e) else str(e)
    return "summed"


@pytest.mark.multiprocess
@_SHM
def test_workers_whose_regions_differ_fail_instead_of_mixing_data():
    assert run_workers(_mismatched_regions, 2) == ["mismatch", "mismatch"]
