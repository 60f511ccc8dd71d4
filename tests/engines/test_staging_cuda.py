"""Gloo on CUDA tensors through host staging (engines/torch_dist/staging.py), on a GPU.

Two worker processes, one replica each, on GPUs with gloo (the layout of workers sharing
a GPU): every all-reduce form (synchronous, in place, asynchronous as the optimizer's
overlapped buckets start them, MEAN, several dtypes, non-contiguous, larger than a chunk)
gives exactly the bytes of the CPU run, through the same-host arena (page-locked) and
through pinned host copies with gloo; results are right when the replica works on a side
stream whose input is written after a long GPU sleep; and training is bitwise the same
staged as unstaged. The pool forces gloo, so these run also where every worker could have
a GPU of its own (NCCL, which does not stage). The CPU-side logic is tests/engines/test_staging.py.

Skipped, with the reason, where no CUDA device is visible.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

import crossreplica as cr
import crossreplica.testing as crt
from crossreplica.engines.base import AllReduceParams, Call, Kind
from crossreplica.engines.torch_dist import all_reduce as all_reduce_module
from crossreplica.engines.torch_dist import shared_memory
from crossreplica.reduce_op import ReduceOp
from crossreplica.testing import WorkerPool
from crossreplica.testing.runner import raise_failed

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
    pytest.mark.multiprocess,
]

WORKERS = 2


@pytest.fixture(scope="module")
def pool():
    """Two workers, one replica each on a GPU, joined by gloo (forced: with a GPU per worker
    the pool would pick NCCL, which needs no staging)."""
    p = WorkerPool(WORKERS, 1, device="cuda")
    p.backend = "gloo"
    with p:
        yield p


def _run(pool: WorkerPool, fn, *per_replica_args, mode: str = "replica", main_args=()) -> list:
    out = pool.run(fn, *per_replica_args, mode=mode, main_args=main_args)
    if not out.ok:
        raise_failed(out, f"{fn.__qualname__} on the gloo pool", pool.timeout_seconds)
    return [out.results[r] for r in range(WORKERS)]


def _on_cpu(fn, *per_replica_args) -> list:
    """The reference: the same replica function on CPU replicas (in-process)."""
    return crt.run_replicas(fn, *per_replica_args, engine="threads", device="cpu")


def _assert_same(reference, got, what: str) -> None:
    ref_leaves, got_leaves = tree_leaves(reference), tree_leaves(got)
    assert len(ref_leaves) == len(got_leaves), what
    for k, (a, b) in enumerate(zip(ref_leaves, got_leaves)):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), (what, k)
        else:
            assert a == b, (what, k)


def _inplace(tensors: list[torch.Tensor], op: ReduceOp, start: bool = False):
    rctx = cr.get_replica_context()
    call = Call.of(Kind.ALL_REDUCE, (tuple(range(rctx.num_replicas_in_sync)),), AllReduceParams(op, inplace=True),
                   tensors)
    if start:
        return rctx.engine.execute_async(rctx.replica_id_in_sync_group, call, tensors)
    return rctx.engine.execute(rctx.replica_id_in_sync_group, call, tensors)


class _Paths:
    """Inside, this worker's engine takes the given path for CUDA tensors: ``"arena"`` (the
    same-host arena, the default), ``"unregistered"`` (the arena without page-locking),
    ``"pinned"`` (pinned host copies and gloo) or ``"unstaged"`` (the plain copies of before)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        engine = cr.get_replica_context().engine
        self.engine = engine if hasattr(engine, "staging") else None  # None: the CPU reference, nothing to choose
        if self.engine is None:
            return self
        self.saved = (engine.shared_memory, all_reduce_module.stageable, shared_memory.register)
        if self.path == "pinned":
            engine.shared_memory = None
        elif self.path == "unregistered":
            shared_memory.register = lambda *args: None
            self._new_arenas()  # the ones of earlier calls are page-locked already
        elif self.path == "unstaged":
            all_reduce_module.stageable = lambda tensors, comm_device: False
        return self

    def __exit__(self, *exc):
        if self.engine is None:
            return
        self.engine.shared_memory, all_reduce_module.stageable, shared_memory.register = self.saved
        if self.path == "unregistered":
            self._new_arenas()

    def _new_arenas(self) -> None:
        """Forgets the same-host arenas (every worker alike), so the next calls make new ones."""
        reducer = self.engine.shared_memory
        if reducer is not None:
            for arena in list(reducer._arenas.values()):
                reducer._drop(arena)
            reducer._arenas.clear()


# ---------------------------------------------------------------------- every form, the CPU's bytes


def _forms(x: torch.Tensor, big: torch.Tensor, path: str) -> dict:
    device = cr.get_replica_context().device
    x, big = x.to(device), big.to(device)  # big: larger than a chunk (staging.CHUNK_BYTES)
    out: dict = {}
    with _Paths(path):
        for op in ("sum", "mean", "max", "min"):
            out[f"f32/{op}"] = cr.all_reduce(x, op)
            out[f"f64/{op}"] = cr.all_reduce(x.double(), op)
            out[f"big/{op}"] = cr.all_reduce(big, op)
        out["f16"] = cr.all_reduce(x.half(), "sum")
        out["bf16"] = cr.all_reduce(x.bfloat16(), "mean")
        out["int64"] = cr.all_reduce((x * 10).long(), "sum")
        out["bool"] = (cr.all_reduce(x > 0, "max"), cr.all_reduce(x > 0, "min"))
        out["strided"] = cr.all_reduce(x.t(), "sum")
        out["empty"] = cr.all_reduce(x[:0], "sum")
        out["nest"] = cr.all_reduce({"a": x, "b": [x.double(), big, (x * 3).long()]}, "sum")
        out["nest mean"] = cr.all_reduce({"a": x, "b": [x.double(), big]}, "mean")
        for op in (ReduceOp.SUM, ReduceOp.MEAN):
            y, z = x.clone(), big.clone()
            same = _inplace([y, z], op)
            assert same[0] is y and same[1] is z
            out[f"inplace/{op}"] = [y, z]
            # The optimizer's form: several started, then waited in order.
            started = [t.clone() for t in (x.view(-1), big, x.double().view(-1))]
            pending = [_inplace([t], op, start=True) for t in started]
            out[f"async/{op}"] = [t for p in pending for t in p.wait()]
            assert all(a is b for a, b in zip(out[f"async/{op}"], started))
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert all(t.device == device for t in leaves), [t.device for t in leaves]
    return {k: [t.cpu() for t in tree_leaves(v)] for k, v in out.items()}


def _inputs():
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(48, 5, generator=g) * 100 for _ in range(WORKERS)]
    bigs = [torch.randn(3 << 20, generator=g) for _ in range(WORKERS)]  # 12 MiB: three 4 MiB chunks
    return xs, bigs


@pytest.mark.parametrize("path", ["arena", "unregistered", "pinned"])
def test_every_all_reduce_form_gives_the_cpu_bytes(pool, path):
    xs, bigs = _inputs()
    reference = _on_cpu(_forms, xs, bigs, [path] * WORKERS)
    got = _run(pool, _forms, xs, bigs, [path] * WORKERS)
    for r in range(WORKERS):
        assert reference[r].keys() == got[r].keys()
        for key in reference[r]:
            _assert_same(reference[r][key], got[r][key], f"replica {r}, {key}, {path}")


# ---------------------------------------------------------------------- stream order


def _on_side_stream(value: float, path: str) -> dict:
    """The inputs are written on a side stream after a long GPU sleep; the collectives must
    wait for them, and the side stream's later kernels for the results."""
    device = cr.get_replica_context().device
    side = torch.cuda.Stream(device)
    n = 1 << 20  # 4 MiB: one chunk
    x, y = torch.zeros(n, device=device), torch.zeros(3 * n, device=device)  # y: three chunks
    side.wait_stream(torch.cuda.current_stream(device))
    with _Paths(path), torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time before the fill
        x.fill_(value)
        total = cr.all_reduce(x, "sum")
        doubled = total * 2  # queued on the side stream, after the collective's result
        torch.cuda._sleep(20_000_000)
        y.fill_(value)
        _inplace([y], ReduceOp.SUM)
        y_doubled = y * 2
        torch.cuda._sleep(20_000_000)
        z = torch.full((n,), value, device=device)
        pending = _inplace([z], ReduceOp.MEAN, start=True)
        torch.cuda._sleep(20_000_000)  # more work on the side stream while the bucket travels
        x.fill_(-1.0)  # the input of the first call, rewritten: its result must not change
        pending.wait()
        z_plus = z + 1
    torch.cuda.current_stream(device).wait_stream(side)
    return {"total": total.cpu(), "doubled": doubled.cpu(), "y": y.cpu(), "y doubled": y_doubled.cpu(),
            "z": z.cpu(), "z plus": z_plus.cpu()}


@pytest.mark.parametrize("path", ["arena", "pinned"])
def test_collectives_follow_the_replica_stream(pool, path):
    values = [1.0, 2.0]
    s = sum(values)
    for out in _run(pool, _on_side_stream, values, [path] * WORKERS):
        n = out["total"].numel()
        assert torch.equal(out["total"], torch.full((n,), s))
        assert torch.equal(out["doubled"], torch.full((n,), 2 * s))
        assert torch.equal(out["y"], torch.full((3 * n,), s))
        assert torch.equal(out["y doubled"], torch.full((3 * n,), 2 * s))
        assert torch.equal(out["z"], torch.full((n,), s / 2))
        assert torch.equal(out["z plus"], torch.full((n,), s / 2 + 1))


# ---------------------------------------------------------------------- training


def _net() -> torch.nn.Module:
    g = torch.Generator().manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2200),
                              torch.nn.ReLU(), torch.nn.Linear(2200, 10))  # a 4.4 MiB weight: two chunks
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return net


def _train(path: str, overlap: bool) -> list[torch.Tensor]:
    device = cr.get_replica_context().device
    rid = cr.replica_id()
    with _Paths(path):
        model = _net().to(device)
        opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), overlap=overlap,
                                     bytes_per_pack=1 << 20)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rid)
            x, y = torch.randn(32, 64, generator=g).to(device), torch.randint(0, 10, (32,), generator=g).to(device)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if overlap:  # the buckets were reduced during backward, not left to step()
                assert len(opt._overlapped.reduced) == len(list(model.parameters()))
            opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlap"])
def test_training_staged_is_bitwise_training_unstaged(pool, overlap):
    reference = _run(pool, _train, ["unstaged"] * WORKERS, [overlap] * WORKERS)
    for r in range(1, WORKERS):  # replicas identical
        _assert_same(reference[0], reference[r], "unstaged replicas")
    for path in ("arena", "pinned"):
        got = _run(pool, _train, [path] * WORKERS, [overlap] * WORKERS)
        for r in range(WORKERS):
            _assert_same(reference[r], got[r], f"replica {r}, {path}")


# ---------------------------------------------------------------------- the memory itself


def _memory_facts(strategy: cr.Strategy) -> dict:
    engine = strategy.extended.engine

    def one_call():
        x = torch.ones(1 << 16, device=cr.get_replica_context().device)
        return cr.all_reduce(x, "sum").cpu()

    out = strategy.experimental_local_results(strategy.run(one_call))[0]
    reducer = engine.shared_memory
    arena = reducer._arenas.get(torch.float32) if reducer is not None else None
    saved, engine.shared_memory = engine.shared_memory, None
    try:
        strategy.run(one_call)  # through pinned host copies
    finally:
        engine.shared_memory = saved
    host = engine.staging._arenas.get(torch.float32)
    return {"sum": float(out[0]), "backend": engine.backend, "comm": str(engine.comm_device),
            "same host": reducer is not None and reducer.enabled,
            "page-locked": arena is not None and arena.pinned is not None,
            "pinned": host is not None and host.buffer is not None and host.buffer.is_pinned(),
            "held": (arena.held if arena else 0) + (host.held if host else 0), "queued": engine.staging.pending}


def test_staging_memory_is_page_locked(pool):
    for facts in _run(pool, _memory_facts, mode="main"):
        assert facts["backend"] == "gloo" and facts["comm"] == "cpu", facts
        assert facts["sum"] == WORKERS, facts
        assert facts["same host"], facts
        assert facts["page-locked"], ("cudaHostRegister refused the same-host arena: its copies go through pageable "
                                      f"memory (the same bytes, slower); see the worker log. {facts}")
        assert facts["pinned"], facts
        assert facts["held"] == 0 and facts["queued"] == 0, facts
