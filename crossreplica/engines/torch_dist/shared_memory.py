"""The same-host all-reduce, through shared memory.

gloo carries an all-reduce between processes of one host over loopback TCP
(every byte copied through the kernel, summed on gloo's threads); processes of
one host can instead map each other's buffers: each worker reduces its 1/W
slice of every worker's buffer and writes the result into all of them
(figures: BENCHMARKS.md, "Across processes").

Scope: one replica per worker, tensors of the floating dtypes that reduce in
their own dtype (float16 and bfloat16 arrive as float32), a group of every
worker. Three forms: buffers handed out by :meth:`SharedMemoryReducer.buffer`,
all-reduced in place and asynchronously (SUM, MEAN: the optimizer keeps its
overlapped gradient buckets there, so nothing is copied); any synchronous
all-reduce (SUM, MEAN, MAX, MIN) of CPU tensors, copied into a region of an
*arena* (a buffer of the same kind per dtype, grown with the calls, at most 256
MiB) and the results copied out; and the staged CUDA tensors of gloo workers
(``staging.py``: :meth:`SharedMemoryReducer.stage`), copied by DMA straight into
their region (this worker's copy of the arena is page-locked with
``cudaHostRegister``) chunk by chunk, each chunk a round of its own, started once
its copy is done, synchronously or asynchronously (the optimizer's buckets on
GPUs). Regions are claimed in call order and given back when the call ends, on
every worker alike; several may be under way at once. Every other call takes
the backend. Whether the
workers share a host is decided once, by all of them together (a probe file in
``/dev/shm``), so the same calls take the same path on every worker;
``CROSSREPLICA_SHARED_MEMORY=0`` turns the path off.

Invariants (the round protocol, the files' lifetime and the waits in detail:
docs/architecture.md, "engines/torch_dist/shared_memory.py"):

* the results are the bytes of ``reduction.py`` (ascending worker rank, block
  by block), those of the in-process engine and of the ordered backend path;
* a worker writes only its own header, and nobody touches a worker's region
  from the end of a round until that worker deposits the next one there; each
  round's region is in its depositor's header, and a round whose region differs
  between workers raises CollectiveMismatchError instead of mixing data;
* the files have names only while a buffer is set up: a worker killed later
  leaves nothing in /dev/shm; a full /dev/shm fails at creation (never SIGBUS
  later) and that buffer takes the backend on every worker;
* every wait is bounded: a dead peer is a WorkerFailedError naming it at once,
  an abort releases the wait, and the timeout is a CollectiveTimeoutError
  naming the ranks that never deposited or published.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ... import store_keys
from ...errors import CollectiveMismatchError, CollectiveTimeoutError
from ...reduce_op import WIRE_DTYPES, ReduceOp
from ..base import Pending
from ..deadline import Deadline
from ..reduction import reduce_into
from .agreement import mismatch, shared_code
from .shm_files import HEADER, SHM_DIR, alive, create, open_existing, reads, unlink
from .staging import InFlight, Piece, Ready, Registration, Staging, plan_chunks, register
from .watchdog import WorkerFailedError

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["SHM_DIR", "SharedMemoryReducer", "usable"]

_DEPOSITED, _PUBLISHED = 0, 1
# The region of the last round deposited: the round it describes (written first), then
# its offset and length, and the stamp of the call it belongs to (its number and digest,
# agreement.py) (see _deposit and _check_region).
_DESCRIBED, _OFFSET, _NUMEL, _CALL, _DIGEST = 2, 3, 4, 5, 6
_Code = tuple[int, int]  # a call's number and code (agreement.shared_code)
_BLOCK_BYTES = 1 << 20  # per block of a slice: its running result is re-read from cache
# A wait (Deadline.back_off) yields the core for its first millisecond, then sleeps
# 50 us, doubling to 200 us: a peer's last bucket is noticed within 0.2 ms (measured
# on the transformer model: 1 ms pauses left 2-5 ms per step in the final wait, these
# 1-3 ms). Yielding pays even with more workers than cores (4 on 2: 0.15 ms per 4 KiB
# call, 0.40 ms with sleeps alone), since a yield hands the core to a runnable peer.
_SPIN = 1e-3
_FIRST_PAUSE = 5e-5
_MAX_PAUSE = 2e-4
_POOLED_BYTES = 1 << 20
_ARENA_MIN_BYTES = 1 << 20
_ARENA_MAX_BYTES = 256 << 20  # larger synchronous calls take the backend
_ABORT_CHECK = 0.25  # seconds between checks of the store's abort key while waiting
_fence = threading.Lock()

_log = logging.getLogger(__name__)


def usable(eng: TorchDistEngine) -> bool:
    """Whether the engine's layout allows the path at all (before the probe)."""
    return (eng.replicas_per_worker == 1 and eng.world_size > 1 and eng.comm_device.type == "cpu"
            and eng.watchdog.store is not None and os.path.isdir(SHM_DIR))


class _Segment:
    """One worker's copy of a buffer and, once mapped, every worker's."""

    __slots__ = ("index", "numel", "dtype", "tensor", "header", "path", "copies", "headers", "seq")

    def __init__(self, index: int, path: str, numel: int, dtype: torch.dtype):
        self.index, self.path, self.numel, self.dtype = index, path, numel, dtype
        self.tensor, self.header = create(path, numel, dtype)
        self.copies: list[torch.Tensor] = []  # every worker's data, in rank order
        self.headers: list[memoryview] = []
        self.seq = 0  # rounds started on this buffer


class _Round:
    """One all-reduce of ``numel`` elements at ``offset`` of a segment, on every worker."""

    __slots__ = ("segment", "seq", "op", "offset", "numel", "reduced", "stamp")

    def __init__(self, segment: _Segment, seq: int, op: ReduceOp, numel: int, offset: int, stamp: _Code):
        self.segment, self.seq, self.op, self.numel, self.offset = segment, seq, op, numel, offset
        self.stamp = stamp
        self.reduced = False


class _Arena:
    """The buffer of one dtype whose regions the synchronous and staged calls use: claimed
    in call order (``used``), from the start again once no call holds one (``held``)."""

    __slots__ = ("held", "inflight", "pin_tried", "pinned", "segment", "used")

    def __init__(self, segment: _Segment):
        self.segment = segment
        self.used = 0
        self.held = 0
        #: copies between this worker's copy and a GPU that may still be running
        self.inflight = InFlight()
        self.pinned: Registration | None = None  # this worker's copy, page-locked for the staged copies
        self.pin_tried = False


#: an arena's regions held by one call: dtype -> (arena, offset of the region)
_Held = dict[torch.dtype, tuple[_Arena, int]]


class SharedMemoryReducer:
    """The same-host all-reduce of one engine; see the module docstring."""

    def __init__(self, eng: TorchDistEngine):
        self._eng = eng
        self._enabled: bool | None = None  # decided by the probe, at the first buffer
        self._tokens: list[str] = []
        self._pids: list[int] = []  # every worker's process id (the same host)
        self._arenas: dict[torch.dtype, _Arena] = {}  # buffers of the synchronous and staged calls
        self._retired: list[_Arena] = []  # arenas grown out of while a call still held a region
        self._refused: dict[torch.dtype, int] = {}  # arena sizes the workers could not create
        self._segments: dict[int, _Segment] = {}  # data_ptr -> segment
        self._count = 0
        self._open: list[_Round] = []  # rounds started whose slice this worker has not reduced
        self._paths: list[str] = []  # files this worker has created and not yet unlinked
        self._finalizer = weakref.finalize(self, unlink, self._paths)

    @property
    def enabled(self) -> bool:
        return bool(self._enabled)

    # ------------------------------------------------------------ buffers

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A CPU tensor of ``numel`` elements that the path can all-reduce, or None
        (not on one host, or a dtype it leaves to the backend). Every worker must ask
        for the same buffers in the same order."""
        if numel <= 0 or not dtype.is_floating_point or dtype in WIRE_DTYPES:
            return None
        if self._enabled is None:
            self._enabled = self._probe()
        if not self._enabled:
            return None
        self._count += 1
        path = self._path(self._eng.rank, self._count)
        self._paths.append(path)
        segment: _Segment | None = None
        try:
            segment = _Segment(self._count, path, numel, dtype)
        except OSError as e:  # /dev/shm is full (a container's 64 MB default), or not writable
            _log.warning("worker rank %d could not create a shared-memory buffer of %d elements of %s in %s (%s); "
                         "the calls on this buffer go through the backend on every worker",
                         self._eng.rank, numel, dtype, SHM_DIR, e)
        try:
            created = self._meet(f"created/{self._count}", "1" if segment is not None else "0")
            if segment is None or any(ok != b"1" for ok in created):
                return None  # every worker gives this buffer up together
            self._map_everyone(segment)
        finally:
            unlink([path])  # mapped everywhere (or given up): the name is not needed
            self._paths.remove(path)
        self._segments[segment.tensor.data_ptr()] = segment
        return segment.tensor

    def _map_everyone(self, segment: _Segment) -> None:
        """Maps every worker's copy of ``segment`` (every worker has created its own);
        once all have mapped, the files can lose their names."""
        eng = self._eng
        for rank in range(eng.world_size):
            if rank == eng.rank:
                tensor, header = segment.tensor, segment.header
            else:
                tensor, header = open_existing(self._path(rank, segment.index), segment.numel, segment.dtype)
            segment.copies.append(tensor)
            segment.headers.append(header)
        self._meet(f"mapped/{segment.index}")

    def _meet(self, what: str, value: str = "1") -> list[bytes]:
        """Posts this worker's ``value`` at ``what`` in the store, waits for every worker's
        (``watchdog.until``: bounded by the timeout, abort-aware) and returns them in rank order."""
        watchdog, rank = self._eng.watchdog, self._eng.rank
        store = watchdog.store
        store.set(store_keys.shared_memory(watchdog.prefix, what, rank), value)
        keys = [store_keys.shared_memory(watchdog.prefix, what, r) for r in range(self._eng.world_size)]

        def late() -> list[int]:
            return [r for r, key in enumerate(keys) if not store.check([key])]

        watchdog.until(lambda: bool(store.check(keys)), range(self._eng.world_size), late, pace=0.02,
                       timed_out=lambda missing: CollectiveTimeoutError(
                           f"collective {watchdog.where} timed out after {watchdog.timeout:g}s on worker rank {rank} "
                           f"setting up its shared-memory buffer: worker ranks {missing} (replicas {missing}) never "
                           f"arrived", tuple(missing)))
        return [store.get(key) for key in keys]

    def _probe(self) -> bool:
        """Whether every worker can read every other's files: the same host (collective)."""
        eng = self._eng
        rank = eng.rank
        token = secrets.token_hex(8)
        path = os.path.join(SHM_DIR, f"crossreplica-{token}-probe")
        try:  # as private as the buffers: workers of other users cannot read it, so the path stays off
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(token)
        except OSError:
            token = ""
        try:
            posted = [v.decode().partition(":") for v in self._meet("probe", f"{os.getpid()}:{token}")]
            tokens = [t for _, _, t in posted]
            self._pids = [int(pid) for pid, _, _ in posted]
            # Same host: every probe file readable, every peer process visible (its death is then
            # noticed while waiting; in another pid namespace the path stays off).
            ok = all(tokens) and all(reads(os.path.join(SHM_DIR, f"crossreplica-{t}-probe"), t) for t in tokens) \
                and all(alive(pid) for pid in self._pids)
            agreed = all(v == b"1" for v in self._meet("verdicts", "1" if ok else "0"))
        finally:
            if token:
                unlink([path])
        self._tokens = tokens
        _log.info("torch_dist engine: worker rank %d: same-host shared-memory all-reduce %s", rank,
                  "on" if agreed else f"off (the workers do not share a host, or {SHM_DIR} is not usable)")
        return agreed

    # ------------------------------------------------------------ rounds

    def start(self, tensors: Sequence[torch.Tensor], op: ReduceOp) -> Pending | None:
        """Starts an in-place all-reduce of ``tensors`` over every worker; None when one
        of them is not a whole buffer of ours (the caller takes the backend)."""
        segments = []
        for t in tensors:
            segment = self._segments.get(t.data_ptr())
            if segment is None or t.numel() != segment.numel or t.dtype != segment.dtype:
                return None
            segments.append(segment)
        stamp = self._code()
        rounds = [self._deposit(segment, segment.numel, op, 0, stamp) for segment in segments]
        self.progress()
        return Pending(lambda: self._finish(rounds, list(tensors)))

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, inplace: bool) -> list[torch.Tensor] | None:
        """A synchronous all-reduce over every worker through this worker's arena: the
        tensors are copied in, reduced, and copied out (into themselves when ``inplace``,
        else into new tensors); None when the path does not take them (the caller takes
        the backend): a dtype it leaves to the backend, or more than ``_ARENA_MAX_BYTES``
        of one dtype. Each dtype has an arena of its own."""
        totals = _totals(tensors)
        held = None if totals is None else self._claim(totals)
        if totals is None or held is None:
            return None
        try:
            places = []  # each tensor's slice of its dtype's region
            offsets = {dtype: offset for dtype, (_, offset) in held.items()}
            for arena, _ in held.values():
                arena.inflight.settle()  # the host writes: no copy to a GPU may still read it
            for t in tensors:
                n, offset = t.numel(), offsets[t.dtype]
                place = held[t.dtype][0].segment.tensor[offset:offset + n].view(t.shape)
                place.copy_(t)
                places.append(place)
                offsets[t.dtype] = offset + n
            stamp = self._code()
            self._finish([self._deposit(arena.segment, totals[d], op, offset, stamp)
                          for d, (arena, offset) in held.items()], [])
            if inplace:
                return [t.copy_(place) for t, place in zip(tensors, places)]
            # Large results in the engine's reused buffers: fresh pages cost more than the reduction.
            return [self._eng.pool.empty(tuple(t.shape), t.dtype, t.device).copy_(place)
                    if place.numel() * place.element_size() >= _POOLED_BYTES else place.clone() for t, place in
                    zip(tensors, places)]
        finally:
            self._release(held)

    def stage(self, tensors: Sequence[torch.Tensor], op: ReduceOp, staging: Staging,
              out_device: torch.device | None, stamp: _Code | None = None) -> Pending | None:
        """Starts an all-reduce over every worker of ``tensors`` (contiguous, on one device:
        a staged call's CUDA tensors, ``staging.py``) through the arenas: each dtype's
        tensors are copied on the device's side stream straight into a region of its arena
        (this worker's copy page-locked: DMA), chunk by chunk (``staging.plan_chunks``);
        each chunk is a round, deposited once its copy is done, in call order
        (``staging.defer``: at a later start or at the latest at the wait). The wait copies
        each chunk's result back as soon as its round is over: into ``tensors`` when
        ``out_device`` is None, else into new tensors there (the tensors' own device).
        None when the path does not take the call (as :meth:`all_reduce`); no copy has
        started then. Every worker makes the same calls in the same order, so the regions
        and rounds agree. ``stamp``: the call's (default: the engine's current call)."""
        device = tensors[0].device if tensors else None
        if (device is None or (out_device is not None and out_device != device)
                or any(t.device != device or not t.is_contiguous() for t in tensors)):
            return None
        totals = _totals(tensors)
        held = None if totals is None else self._claim(totals)
        if totals is None or held is None:
            return None
        side = staging.side(device)
        start = staging.follow(device)
        chunks: list[tuple[torch.Tensor, list[int], list[Piece]]] = []  # region, its tensors, the chunk's pieces
        steps: list[tuple[Ready, Callable[[], None]]] = []
        rounds: list[_Round] = []
        for dtype, (arena, offset) in held.items():
            self._pin(arena, device)
            arena.inflight.settle(side)
            mine = [j for j, t in enumerate(tensors) if t.dtype == dtype]
            region = arena.segment.tensor[offset:offset + totals[dtype]]
            for pieces in plan_chunks([tensors[j].numel() for j in mine], region.element_size()):
                with staging.copying(device):
                    for p in pieces:
                        region[p.at:p.at + p.hi - p.lo].copy_(tensors[mine[p.tensor]].view(-1)[p.lo:p.hi],
                                                              non_blocking=True)
                ready = staging.mark(device)
                arena.inflight.add(side, ready)
                lo, last = pieces[0].at, pieces[-1]
                hi = last.at + last.hi - last.lo
                steps.append((ready, _Deposit(self, rounds, arena.segment, offset + lo, hi - lo, op,
                                              self._code() if stamp is None else stamp)))
                chunks.append((region, mine, pieces))
        deferred = staging.defer(steps)

        def finish() -> list[torch.Tensor]:
            try:
                staging.flush(deferred)
                outs = list(tensors) if out_device is None else [torch.empty_like(t) for t in tensors]
                staging.follow(device)  # the side stream writes the caller's tensors after its work so far
                for r, (region, mine, pieces) in zip(rounds, chunks):
                    self._finish([r], [])
                    with staging.copying(device):
                        for p in pieces:
                            outs[mine[p.tensor]].view(-1)[p.lo:p.hi].copy_(region[p.at:p.at + p.hi - p.lo],
                                                                           non_blocking=True)
                done = staging.hand_back(device, outs, also=(start,))
                for arena, _ in held.values():
                    arena.inflight.add(side, done)
                return outs
            finally:
                self._release(held)
        return Pending(finish)

    def _pin(self, arena: _Arena, device: torch.device) -> None:
        """Page-locks this worker's copy of ``arena`` (once) for copies with ``device``."""
        if arena.pin_tried or device.type != "cuda":
            return
        arena.pin_tried = True
        segment = arena.segment
        tensor = segment.tensor  # the data starts HEADER bytes into the (page-aligned) mapping
        arena.pinned = register(tensor.data_ptr() - HEADER, HEADER + segment.numel * tensor.element_size(), device,
                                tensor)

    def _claim(self, totals: dict[torch.dtype, int]) -> _Held | None:
        """A region of ``totals[dtype]`` elements in each dtype's arena (grown, together with
        every worker, where it does not fit), all or none."""
        held: _Held = {}
        for dtype, numel in totals.items():  # the same dtypes in the same order on every worker
            arena = self._arena(numel, dtype) if numel else None
            if arena is None:
                self._release(held)
                return None
            held[dtype] = (arena, arena.used)
            arena.used += numel
            arena.held += 1
        return held

    def _release(self, held: _Held) -> None:
        """Gives the regions back; an arena none is held in starts from its beginning again."""
        for arena, _ in held.values():
            arena.held -= 1
            if arena.held == 0:
                arena.used = 0
                if arena in self._retired:
                    self._retired.remove(arena)
                    self._drop(arena)

    def _arena(self, numel: int, dtype: torch.dtype) -> _Arena | None:
        """This worker's arena for ``dtype`` with room for ``numel`` more elements, grown
        (together with every worker: they make the same calls) where it has not: to the
        regions held plus ``numel``, at least twice its size."""
        arena = self._arenas.get(dtype)
        if arena is not None and arena.used + numel <= arena.segment.numel:
            return arena
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > _ARENA_MAX_BYTES or numel >= self._refused.get(dtype, numel + 1):
            return None
        size = max(numel + (arena.used if arena is not None else 0),
                   2 * arena.segment.numel if arena is not None else 0, _ARENA_MIN_BYTES // itemsize)
        size = min(size, _ARENA_MAX_BYTES // itemsize)
        tensor = self.buffer(size, dtype)
        if tensor is None:  # given up by the workers together: remembered the same everywhere
            self._refused[dtype] = min(numel, self._refused.get(dtype, numel))
            return None
        if arena is not None:
            if arena.held:
                self._retired.append(arena)  # its regions live on until their calls end
            else:
                self._drop(arena)
        self._arenas[dtype] = arena = _Arena(self._segments[tensor.data_ptr()])
        return arena

    def _drop(self, arena: _Arena) -> None:
        """Forgets an arena no call holds: its copies done, its pages unlocked, its mappings
        gone with the last reference."""
        arena.inflight.settle()
        if arena.pinned is not None:
            arena.pinned.release()
            arena.pinned = None
        self._segments.pop(arena.segment.tensor.data_ptr(), None)

    def _code(self) -> _Code:
        """The stamp of the engine's current call, as the headers carry it."""
        watchdog = self._eng.watchdog
        return shared_code(watchdog.count, watchdog.current)

    def _deposit(self, segment: _Segment, numel: int, op: ReduceOp, offset: int, stamp: _Code) -> _Round:
        """Publishes that this worker's ``numel`` elements at ``offset`` of ``segment`` are in
        place, for the call of ``stamp``."""
        segment.seq += 1
        header = segment.header
        header[_DESCRIBED] = segment.seq
        _memory_fence()
        header[_OFFSET], header[_NUMEL], header[_CALL], header[_DIGEST] = offset, numel, stamp[0], stamp[1]
        _memory_fence()
        header[_DEPOSITED] = segment.seq
        r = _Round(segment, segment.seq, op, numel, offset, stamp)
        self._open.append(r)
        return r

    def progress(self) -> None:
        """Reduces this worker's slice of every started round that all workers have deposited,
        each segment's rounds in order: a round is published only after the earlier ones of
        its segment (peers read "published s" as "every round up to s"), so once one is not
        ready, the later ones of its segment wait for the next pass even if a peer has
        deposited them meanwhile."""
        waiting: list[_Segment] = []  # segments with a round not ready in this pass
        for r in self._open:
            if r.reduced or (waiting and any(r.segment is s for s in waiting)):
                continue
            if _all_at_least(r.segment.headers, _DEPOSITED, r.seq):
                _memory_fence()
                self._check_region(r)
                self._reduce_slice(r)
            else:
                waiting.append(r.segment)
        self._open = [r for r in self._open if not r.reduced]

    def _reduce_slice(self, r: _Round) -> None:
        segment, eng = r.segment, self._eng
        copies, n, w = segment.copies, r.numel, eng.world_size
        lo, hi = r.offset + n * eng.rank // w, r.offset + n * (eng.rank + 1) // w
        step = max(1, _BLOCK_BYTES // segment.tensor.element_size())
        for s in range(lo, hi, step):
            blocks = [c[s:min(hi, s + step)] for c in copies]
            reduce_into(r.op, blocks[0], blocks)  # rank 0's block is the accumulator
            for b in blocks[1:]:
                b.copy_(blocks[0])
        _memory_fence()
        segment.header[_PUBLISHED] = r.seq
        r.reduced = True

    def _check_region(self, r: _Round) -> None:
        """Raises if a worker deposited round ``r`` for another call or in another region than
        this worker (their calls disagree): never a sum of different data. Checked against
        every header still describing ``r`` (its words are read between two reads of the
        round they describe)."""
        for rank, header in enumerate(r.segment.headers):
            if header[_DEPOSITED] != r.seq:
                continue  # already past r: its words describe a later round
            _memory_fence()
            offset, numel, call, digest = header[_OFFSET], header[_NUMEL], header[_CALL], header[_DIGEST]
            _memory_fence()
            if header[_DESCRIBED] != r.seq:
                continue
            if (call, digest) != r.stamp:
                raise mismatch(self._eng.rank, "same-host shared memory", r.stamp[0], self._eng.watchdog.current,
                               rank, call)
            if (offset, numel) != (r.offset, r.numel):
                raise CollectiveMismatchError(
                    f"collective {self._eng.watchdog.where} on worker rank {self._eng.rank} (same-host shared memory): "
                    f"worker rank {rank} deposited round {r.seq} of this buffer as {numel} elements at {offset}, this "
                    f"worker as {r.numel} at {r.offset}: the workers made different calls")

    def _path(self, rank: int, index: int) -> str:
        return os.path.join(SHM_DIR, f"crossreplica-{self._tokens[rank]}-{index}")

    def _finish(self, rounds: list[_Round], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Waits (``watchdog.until``: bounded, abort-aware) until every worker has published
        each round. Each attempt spins, then sleeps briefly, for up to ``_ABORT_CHECK``
        seconds, so the watchdog's store reads stay off a fast round's path."""
        eng = self._eng
        watchdog = eng.watchdog
        wait = Deadline(watchdog.timeout, watchdog.slow)  # the watchdog's bounds; the pauses go on across attempts

        def attempt() -> bool:
            check = Deadline(_ABORT_CHECK, math.inf)
            while True:
                self.progress()
                if all(r.reduced and _all_at_least(r.segment.headers, _PUBLISHED, r.seq) for r in rounds):
                    return True
                if check.expired():
                    break
                wait.back_off(_FIRST_PAUSE, _MAX_PAUSE, spin=_SPIN)
            dead = [rank for rank, pid in enumerate(self._pids) if rank != eng.rank and not alive(pid)]
            if dead:
                raise WorkerFailedError(
                    f"collective {watchdog.where} failed on worker rank {eng.rank} (same-host shared "
                    f"memory): worker ranks {dead} (replicas {dead}) died", tuple(dead))
            return False

        everyone = range(eng.world_size)
        watchdog.until(attempt, everyone, lambda: self._late(rounds), timed_out=lambda late: CollectiveTimeoutError(
            f"collective {watchdog.where} timed out after {watchdog.timeout:g}s on worker rank {eng.rank} "
            f"(same-host shared memory): worker ranks {late} (replicas {late}) never arrived (ranks taking "
            f"part: {list(everyone)})", tuple(late)), wait=wait)
        _memory_fence()
        return tensors

    def _late(self, rounds: list[_Round]) -> list[int]:
        """Worker ranks that have not deposited or published one of ``rounds``."""
        late: set[int] = set()
        for r in rounds:
            for rank, header in enumerate(r.segment.headers):
                if header[_DEPOSITED] < r.seq or header[_PUBLISHED] < r.seq:
                    late.add(rank)
        late.discard(self._eng.rank)
        return sorted(late)

    def close(self) -> None:
        """Unlinks every file this worker still names (the mappings live on with their tensors)
        and unlocks the arenas' pages once no copy uses them."""
        for arena in [*self._arenas.values(), *self._retired]:
            self._drop(arena)
        self._arenas.clear()
        self._retired.clear()
        self._finalizer()


class _Deposit:
    """A staged chunk's launch: deposits its round (``rounds`` gets it) and reduces what is ready."""

    __slots__ = ("numel", "offset", "op", "reducer", "rounds", "segment", "stamp")

    def __init__(self, reducer: SharedMemoryReducer, rounds: list[_Round], segment: _Segment, offset: int,
                 numel: int, op: ReduceOp, stamp: _Code):
        self.reducer, self.rounds, self.segment, self.offset, self.numel, self.op = (
            reducer, rounds, segment, offset, numel, op)
        self.stamp = stamp

    def __call__(self) -> None:
        self.rounds.append(self.reducer._deposit(self.segment, self.numel, self.op, self.offset, self.stamp))
        self.reducer.progress()


def _totals(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, int] | None:
    """Elements per dtype, in first-seen order; None when a dtype is one the path leaves to the backend."""
    totals: dict[torch.dtype, int] = {}
    for t in tensors:
        if not t.dtype.is_floating_point or t.dtype in WIRE_DTYPES:
            return None
        totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
    return totals


def _memory_fence() -> None:
    """Orders this thread's memory accesses around a published header word: a lock's
    acquire and release are full barriers on every architecture (see the module docstring)."""
    with _fence:
        pass


def _all_at_least(headers: list[memoryview], word: int, seq: int) -> bool:
    for header in headers:  # noqa: SIM110 - a plain loop on the polling path
        if header[word] < seq:
            return False
    return True
