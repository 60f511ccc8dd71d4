"""Moving CUDA payloads through host memory, for a transport that works on the CPU.

With gloo (workers sharing a GPU, hosts without NCCL) this engine's transports
work on host memory: its comm device is the CPU. A plain ``tensor.to("cpu")``
copies into pageable memory, so the host waits for the GPU at each copy, the copy
runs at a fraction of the bus's speed, and the results come back the same way.
Here a call's CUDA tensors are copied with ``non_blocking=True`` on a side stream
per device, which first waits for the caller's current stream, into page-locked
host memory kept across calls (:class:`HostArena`; on workers of one host, the
same-host arena itself, registered with ``cudaHostRegister``:
``shared_memory.py``). The host waits once for those copies (an event), the
transport that CPU tensors would take runs on the copies, so the bytes are the
same, and the results go back on the side stream, the caller's stream made to
wait for them (an event). The asynchronous form (the optimizer's overlapped
buckets) queues each call's launch behind its copies (:class:`Deferred`):
launches happen in call order, as soon as the copies are done (:meth:`Staging.poll`,
at the next start) or when a result or another cross-process call needs them
(:meth:`Staging.flush`), so every worker issues its transport calls in one order.

Invariants:

* host memory that an async copy may still read or write is written by the host
  (or handed to a peer, or unregistered) only once that copy's event has
  completed (:class:`InFlight`); the side stream waits for the caller's current
  stream before it reads or writes a tensor of the caller's;
* staging regions are claimed when a call starts and released when it ends, in
  call order on every worker, so a call's region is the same on every worker;
* only CUDA tensors with the CPU as comm device are staged (:func:`stageable`):
  CPU tensors, and machines without CUDA, never reach a CUDA call here (the
  machinery itself also runs on CPU tensors, synchronously: the tests use that).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

import torch

__all__ = ["CHUNK_BYTES", "DONE", "AllOf", "Deferred", "HostArena", "HostCopy", "InFlight", "Piece", "Ready",
           "Registration", "Staging", "plan_chunks", "register", "stageable"]

_log = logging.getLogger(__name__)

#: a staged payload's copies and rounds go chunk by chunk (the copy of chunk i+1 overlaps the
#: transport of chunk i, and the way back of chunk i the transport of chunk i+1); a guess,
#: not measured
CHUNK_BYTES = 4 << 20
_HOST_MIN_BYTES = 1 << 20
#: the most pinned memory per dtype; a call that needs more takes the unstaged path
HOST_MAX_BYTES = 1 << 30
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context


def stageable(tensors: Iterable[torch.Tensor], comm_device: torch.device) -> bool:
    """Whether a call's tensors go through host staging: the transport works on the CPU
    and every tensor is a contiguous CUDA tensor (at least one)."""
    if comm_device.type != "cpu":
        return False
    seen = False
    for t in tensors:
        if not t.is_cuda or not t.is_contiguous():
            return False
        seen = True
    return seen


class Piece(NamedTuple):
    """A run of one tensor's elements inside a flat region (contiguous tensors)."""

    tensor: int  #: the tensor's position among the tensors laid out
    lo: int  #: its first element in the piece
    hi: int  #: one past its last
    at: int  #: where the piece starts in the region


def plan_chunks(numels: Sequence[int], itemsize: int, chunk_bytes: int | None = None) -> list[list[Piece]]:
    """The tensors of one dtype laid end to end (a flat region), cut into chunks of
    ``chunk_bytes`` (``CHUNK_BYTES`` when None; 0: one chunk), the last one shorter:
    each chunk's pieces, in order. The cut depends on the sizes alone, so every
    worker cuts a call alike; empty tensors have no piece, and no chunk is empty."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    total = sum(numels)
    step = max(1, chunk_bytes // itemsize) if chunk_bytes > 0 else max(total, 1)
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    filled = at = 0
    for j, n in enumerate(numels):
        lo = 0
        while lo < n:
            take = min(n - lo, step - filled)
            current.append(Piece(j, lo, lo + take, at))
            lo += take
            at += take
            filled += take
            if filled == step:
                chunks.append(current)
                current, filled = [], 0
    if current:
        chunks.append(current)
    return chunks


# ---------------------------------------------------------------- completion of async copies


class Ready(Protocol):
    """Copies queued on a stream (a ``torch.cuda.Event`` after them is one)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    """Copies that ran synchronously (no CUDA device involved)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


DONE: Ready = _Done()


class AllOf:
    """The copies of several devices: done when each is."""

    __slots__ = ("parts",)

    def __init__(self, parts: Iterable[Ready]):
        self.parts = list(parts)

    def query(self) -> bool:
        return all(part.query() for part in self.parts)

    def synchronize(self) -> None:
        for part in self.parts:
            part.synchronize()


class InFlight:
    """The async copies that may still use a piece of host memory: the last one queued
    on each side stream (later copies of a stream finish after its earlier ones)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[Hashable, Ready] = {}

    def add(self, stream: Hashable | None, ready: Ready) -> None:
        if stream is not None:
            self._last[stream] = ready

    def settle(self, stream: Hashable | None = None) -> None:
        """Before ``stream`` writes into the memory (None: the host, or a peer): waits on
        the host for the copies of every other stream; those of ``stream`` itself come
        before anything queued on it later."""
        for s in [s for s in self._last if stream is None or s != stream]:
            self._last.pop(s).synchronize()

    def __len__(self) -> int:
        return len(self._last)


# ---------------------------------------------------------------- page-locked host memory


class Registration:
    """Host memory page-locked with ``cudaHostRegister`` until :meth:`release` (or, as a
    safety net, until this object is collected); ``keep`` (the mapping) lives as long."""

    __slots__ = ("__weakref__", "_finalize")

    def __init__(self, ptr: int, device: torch.device, keep: object):
        self._finalize = weakref.finalize(self, _unregister, ptr, device, keep)

    def release(self) -> None:
        """Unregisters (once): first waits for the device, so no copy still uses the pages."""
        self._finalize()


def register(ptr: int, nbytes: int, device: torch.device, keep: object) -> Registration | None:
    """Page-locks ``nbytes`` of host memory at ``ptr`` (a mapped file's pages) so copies
    between it and ``device`` are DMA; None where CUDA refuses (those copies then go
    through pageable memory: the same bytes, slower)."""
    try:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            result = cudart.cudaHostRegister(ptr, nbytes, _PORTABLE)
        err = int(result)
    except (RuntimeError, AttributeError, TypeError) as e:
        _log.info("staging: cannot page-lock %d bytes of shared memory (%s); copies go through pageable memory",
                  nbytes, e)
        return None
    if err != 0:
        _forget_error(device)
        try:
            why = cudart.cudaGetErrorString(result)
        except (RuntimeError, TypeError):
            why = "?"
        _log.info("staging: cudaHostRegister of %d bytes of shared memory failed (error %d: %s); copies go "
                  "through pageable memory", nbytes, err, why)
        return None
    return Registration(ptr, device, keep)


def _unregister(ptr: int, device: torch.device, keep: object) -> None:
    with contextlib.suppress(Exception):  # best effort: at exit CUDA may be gone already
        torch.cuda.synchronize(device)
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _forget_error(device)


def _forget_error(device: torch.device) -> None:
    """A failed CUDA runtime call stays this thread's last error, which torch's next kernel
    launch check would report as its own; a kernel launched here reads it first (its
    check raises, which clears it)."""
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device=device).fill_(0)


def _host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat host buffer, pinned where CUDA can pin it (else pageable: slower copies)."""
    if torch.cuda.is_available():
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as e:
            _log.info("staging: no pinned memory for %d x %s (%s); pageable instead", numel, dtype, e)
    return torch.empty(numel, dtype=dtype)


class HostArena:
    """Host memory of one dtype for staged calls: a flat buffer (pinned) whose regions are
    claimed in call order, from the start again once none is held, so it is reused call
    after call. Grown geometrically; a buffer replaced while some of its regions are held
    lives on with them, and the caching host allocator keeps a freed pinned buffer from
    reuse until the copies recorded on it are done."""

    def __init__(self, dtype: torch.dtype, max_bytes: int = HOST_MAX_BYTES):
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.buffer: torch.Tensor | None = None
        self.used = 0  #: elements of ``buffer`` claimed since it was last empty
        self.held = 0  #: regions claimed and not released (in any buffer of this arena)
        self.inflight = InFlight()

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def claim(self, numel: int) -> torch.Tensor | None:
        """A region of ``numel`` elements (a 1-D view), or None past ``max_bytes``."""
        itemsize = self.dtype.itemsize
        if self.buffer is None or self.used + numel > self.capacity:
            if numel * itemsize > self.max_bytes:
                return None
            size = max(numel + (self.used if self.held else 0), 2 * self.capacity, _HOST_MIN_BYTES // itemsize)
            size = min(size, max(self.max_bytes // itemsize, numel))
            self.buffer, self.used = _host_buffer(size, self.dtype), 0
        region = self.buffer[self.used:self.used + numel]
        self.used += numel
        self.held += 1
        return region

    def release(self) -> None:
        self.held -= 1
        if self.held == 0:
            self.used = 0


class HostCopy(NamedTuple):
    """A call's tensors copied into host regions (:meth:`Staging.to_host`)."""

    rows: list[list[torch.Tensor]]  #: the host copies, shaped like the tensors
    arenas: list[HostArena]  #: the arena of each region held (one entry per region)
    ready: Ready  #: the copies to the host
    starts: dict[torch.device, torch.cuda.Stream | None]  #: the callers' streams the copies followed, by device


# ---------------------------------------------------------------- deferred launches


class Deferred:
    """One staged call's launches (its transport's start, chunk by chunk), each to run
    once its copies are done."""

    __slots__ = ("done", "dropped", "steps")

    def __init__(self, steps: Iterable[tuple[Ready, Callable[[], None]]]):
        self.steps = deque(steps)
        self.done = not self.steps
        #: some launch never ran: an earlier one failed, or the engine closed
        self.dropped = False


class Staging:
    """One engine's staging: its side streams, pinned arenas and queue of deferred launches.
    ``idle`` is called while the host waits for copies (the same-host path's progress)."""

    def __init__(self, idle: Callable[[], None] | None = None):
        self.idle = idle
        self._sides: dict[torch.device, torch.cuda.Stream] = {}
        self._arenas: dict[torch.dtype, HostArena] = {}
        self._queue: deque[Deferred] = deque()

    # ------------------------------------------------------------ streams

    def side(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of ``device`` (None for a CPU device)."""
        if device.type != "cuda":
            return None
        stream = self._sides.get(device)
        if stream is None:
            stream = self._sides[device] = torch.cuda.Stream(device)
        return stream

    @contextlib.contextmanager
    def copying(self, device: torch.device) -> Iterator[None]:
        """Copies to or from ``device`` made inside are queued on its side stream."""
        side = self.side(device)
        if side is None:
            yield
            return
        with torch.cuda.stream(side):
            yield

    def follow(self, device: torch.device) -> torch.cuda.Stream | None:
        """The caller's current stream on ``device``, which the side stream now waits for
        (None for a CPU device)."""
        side = self.side(device)
        if side is None:
            return None
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        return current

    def mark(self, device: torch.device) -> Ready:
        """What the side stream of ``device`` has queued so far."""
        side = self.side(device)
        if side is None:
            return DONE
        event = torch.cuda.Event()
        event.record(side)
        return event

    def hand_back(self, device: torch.device, outs: Iterable[torch.Tensor],
                  also: Iterable[torch.cuda.Stream | None] = ()) -> Ready:
        """After copies into ``outs`` on the side stream of ``device``: the caller's current
        stream (and the streams in ``also``) wait for them, and ``outs`` are marked as used
        on the side stream (their memory is not handed out again before it is done)."""
        side = self.side(device)
        if side is None:
            return DONE
        event = torch.cuda.Event()
        event.record(side)
        for stream in {torch.cuda.current_stream(device)} | {s for s in also if s is not None}:
            stream.wait_event(event)
        for t in outs:
            if t.is_cuda:
                t.record_stream(side)
        return event

    # ------------------------------------------------------------ pinned copies

    def arena(self, dtype: torch.dtype) -> HostArena:
        arena = self._arenas.get(dtype)
        if arena is None:
            arena = self._arenas[dtype] = HostArena(dtype)
        return arena

    def to_host(self, rows: Sequence[Sequence[torch.Tensor]]) -> HostCopy | None:
        """Starts copying each tensor of ``rows`` into a region of its dtype's host arena,
        on each device's side stream after the caller's current stream; None when the
        memory is not there (the caller takes the unstaged path)."""
        arenas: list[HostArena] = []
        host_rows: list[list[torch.Tensor]] = []
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for row in rows:
            out = []
            for t in row:
                arena = self.arena(t.dtype)
                region = arena.claim(t.numel())
                if region is None:
                    for held in arenas:
                        held.release()
                    return None
                arenas.append(arena)
                out.append(region.view(t.shape))
                by_device.setdefault(t.device, []).append((out[-1], t))
            host_rows.append(out)
        starts, marks = {}, []
        for device in by_device:
            for arena in set(arenas):
                arena.inflight.settle(self.side(device))
        for device, pairs in by_device.items():
            starts[device] = self.follow(device)
            with self.copying(device):
                for host, t in pairs:
                    host.copy_(t, non_blocking=True)
            ready = self.mark(device)
            for arena in set(arenas):
                arena.inflight.add(self.side(device), ready)
            marks.append(ready)
        return HostCopy(host_rows, arenas, AllOf(marks), starts)

    def from_host(self, copy: HostCopy, dests: Sequence[Sequence[torch.Tensor]]) -> None:
        """Copies each host row of ``copy`` into ``dests`` (tensors shaped alike) on the side
        streams; the callers' streams wait for them; then the regions are released."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for host_row, row in zip(copy.rows, dests):
            for host, t in zip(host_row, row):
                by_device.setdefault(t.device, []).append((t, host))
        try:
            for device, pairs in by_device.items():
                self.follow(device)  # the side stream writes the caller's tensors after its work so far
                with self.copying(device):
                    for t, host in pairs:
                        t.copy_(host, non_blocking=True)
                ready = self.hand_back(device, [t for t, _ in pairs], also=(copy.starts.get(device),))
                for arena in set(copy.arenas):
                    arena.inflight.add(self.side(device), ready)
        finally:
            self.release(copy)

    @staticmethod
    def release(copy: HostCopy) -> None:
        for arena in copy.arenas:
            arena.release()

    # ------------------------------------------------------------ the queue

    def defer(self, steps: Iterable[tuple[Ready, Callable[[], None]]]) -> Deferred:
        """Queues a call's launches behind every call queued before it."""
        deferred = Deferred(steps)
        if not deferred.done:
            self._queue.append(deferred)
        return deferred

    @property
    def pending(self) -> int:
        """Calls with launches still queued."""
        return len(self._queue)

    def poll(self) -> None:
        """Launches, in order, the queued steps whose copies are done; stops at the first
        that is not (never waits)."""
        while self._queue:
            head = self._queue[0]
            while head.steps:
                ready, launch = head.steps[0]
                if not ready.query():
                    return
                head.steps.popleft()
                self._launch(launch)
            head.done = True
            self._queue.popleft()

    def flush(self, through: Deferred | None = None) -> None:
        """Launches, in order, every queued step (waiting for its copies) up to and including
        ``through``'s (None: all of them). Raises if ``through`` was dropped: its transport
        never started, so it has no result."""
        if through is not None and through.done:
            if through.dropped:
                raise RuntimeError("a staged collective never started: a collective started before it failed, "
                                   "or the engine was closed")
            return
        while self._queue:
            head = self._queue[0]
            while head.steps:
                ready, launch = head.steps.popleft()
                self.wait_for(ready)
                self._launch(launch)
            head.done = True
            self._queue.popleft()
            if head is through:
                return

    def wait_for(self, ready: Ready) -> None:
        """Waits on the host for copies (doing ``idle`` work meanwhile)."""
        if self.idle is None:
            ready.synchronize()
            return
        while not ready.query():  # the copies finish in bounded time; meanwhile, other work
            self.idle()
            os.sched_yield()

    def _launch(self, launch: Callable[[], None]) -> None:
        try:
            launch()
        except BaseException:
            self._drop_queue()  # the engine is broken now: nothing queued is launched any more
            raise

    def _drop_queue(self) -> None:
        for deferred in self._queue:
            deferred.dropped = bool(deferred.steps)
            deferred.steps.clear()
            deferred.done = True
        self._queue.clear()

    def close(self) -> None:
        """Forgets the queue and waits for the side streams, so no copy outlives the engine's
        host memory."""
        self._drop_queue()
        for stream in self._sides.values():
            with contextlib.suppress(RuntimeError):
                stream.synchronize()
