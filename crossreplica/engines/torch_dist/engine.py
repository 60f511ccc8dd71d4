"""The torch.distributed engine itself; one call for all local replicas of a worker.

Each process (a *worker*) drives ``replicas_per_worker`` local replicas; the
global replica id is ``worker_rank * replicas_per_worker + local_index``.
:meth:`TorchDistEngine.process` runs the cross-process half of a collective
for every local replica of the worker at once: with one replica per worker
that is the whole engine, with several the hierarchical engine
(``engines/hierarchical.py``) first meets the local replicas in-process.

This module owns the call's life: the per-call record (``plan.Step``), the
dispatch by kind to one module per collective, and the sticky failure state.
Invariant: once a cross-process call failed, the process group is out of step,
so every later call raises at once (a dead peer, a timeout, a mismatch or a
raising replica elsewhere) rather than meeting the wrong call on another worker.
The failure that breaks the engine is logged once, at ERROR (WARNING when this
worker was only released because another one failed); with DEBUG enabled,
every cross-process call is logged as it starts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError, CollectiveTimeoutError, ReplicaAborted
from ...logs import replica_failed, report
from ..base import BARRIER, FINISHED, Call, Kind, Pending, WorkerEngine, check_inplace, is_inplace
from ..buffer_pool import BufferPool
from .all_reduce import all_reduce, reduce_scatter, start_all_reduce
from .broadcast import broadcast
from .chain import drain
from .gather import all_gather
from .p2p import all_to_all, permute
from .plan import Planner, Step
from .shared_memory import SharedMemoryReducer, usable
from .signatures import check_signatures, precheck
from .staging import Staging
from .watchdog import Watchdog, is_peer_loss

__all__ = ["TorchDistEngine"]

_log = logging.getLogger(__name__)


def _broke(e: BaseException) -> None:
    """Logs the failure that breaks the engine (once per exception object)."""
    report(_log, logging.WARNING if isinstance(e, ReplicaAborted) else logging.ERROR, e)


# Each collective kind's implementation (one module per concern; see the package docstring).
_COLLECTIVES = {Kind.ALL_REDUCE: all_reduce, Kind.REDUCE_SCATTER: reduce_scatter, Kind.ALL_GATHER: all_gather,
                Kind.BROADCAST: broadcast, Kind.ALL_TO_ALL: all_to_all, Kind.PERMUTE: permute}


class TorchDistEngine(WorkerEngine):
    """Collectives between processes through torch.distributed, one replica per worker
    (or, as the base of the hierarchical engine, all local replicas of a worker at once)."""

    def __init__(self, devices: Sequence[torch.device], timeout: float,
                 check_collectives: bool = False, comm_device: torch.device | None = None,
                 ordered_reductions: bool = True, shared_memory: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistEngine needs an initialised torch.distributed process group; use "
                "cr.MultiWorkerMirroredStrategy, which initialises it from the torchrun environment")
        self.devices = tuple(devices)
        self.replicas_per_worker = len(self.devices)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.num_replicas = self.world_size * self.replicas_per_worker
        self.local_replica_ids = tuple(self.rank * self.replicas_per_worker + i
                                       for i in range(self.replicas_per_worker))
        #: replica id -> its position among the local replicas
        self.local_index = {rid: i for i, rid in enumerate(self.local_replica_ids)}
        self.backend = str(dist.get_backend())
        if comm_device is None:
            comm_device = (torch.device("cuda", torch.cuda.current_device())
                           if self.backend == "nccl" else torch.device("cpu"))
        self.comm_device = comm_device
        self._timeout = float(timeout)
        self.check_collectives = bool(check_collectives)
        #: reduce floating point in ascending replica id (exactly the in-process results) rather
        #: than with the backend's ring; matters only for groups of three replicas or more
        self.ordered_reductions = ordered_reductions
        #: ordered reductions over every replica across hosts go along a chain of hosts
        #: (``chain.py``); the worker ranks of each host, learnt at the first such call
        self.chain_reductions = True
        self.hosts: list[tuple[int, ...]] | None = None
        #: the chains under way on the chain thread (overlapped buckets; ``chain.start_chain``)
        self.chains: list[Future] = []
        self.chain_pool: ThreadPoolExecutor | None = None
        self.watchdog = Watchdog(self.rank, self.world_size, self.replicas_per_worker, self._timeout,
                                 self.backend)
        self.planner = Planner(self.rank, self.world_size, self.replicas_per_worker, self._timeout)
        # The one-local-replica all-reduce works in place on its own copy of the
        # input: reused buffers spare the page faults of a fresh one each call.
        self.pool = BufferPool(max_buffers=8)
        self._broken: BaseException | None = None
        #: the same-host all-reduce (the buffers from :meth:`shared_buffer`, and synchronous
        #: floating-point calls), where the layout allows it (the workers' probe decides at
        #: the first such call)
        self.shared_memory = SharedMemoryReducer(self) if shared_memory and usable(self) else None
        #: CUDA tensors over a CPU transport (gloo): their copies through host memory and the
        #: launches of the asynchronous ones (``staging.py``)
        self.staging = Staging(idle=self._progress_shared)
        #: where hand_out puts results: each local replica's device (the host inside results_on_host)
        self._out_devices: tuple[torch.device, ...] = self.devices
        _log.info("torch_dist engine: worker rank %d of %d (backend %s), local replicas %s of %d on %s, "
                  "timeout %gs, slow-collective warning after %gs", self.rank, self.world_size, self.backend,
                  list(self.local_replica_ids), self.num_replicas, [str(d) for d in self.devices], self._timeout,
                  self.watchdog.slow)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("torch_dist engine: comm device %s, check_collectives=%s, ordered_reductions=%s",
                       self.comm_device, self.check_collectives, self.ordered_reductions)

    @property
    def timeout(self) -> float:
        return self._timeout

    @contextlib.contextmanager
    def timeout_override(self, seconds: float | None) -> Iterator[None]:
        """Bounds the cross-process waits inside by ``seconds`` instead of the timeout (a
        reduction's ``CommunicationOptions.timeout_seconds``). For the one thread that
        makes this worker's cross-process calls; NCCL keeps the process group's timeout."""
        if seconds is None:
            yield
            return
        saved, self.watchdog.timeout = self.watchdog.timeout, float(seconds)
        try:
            yield
        finally:
            self.watchdog.timeout = saved

    @property
    def broken(self) -> BaseException | None:
        """The failure that put the process group out of step, or None."""
        return self._broken

    def stopped_peers(self) -> list[int]:
        # A broken group is evidence already (as when a collective names the lost: watchdog.lost).
        return self.watchdog.stopped_peers(broken=self._broken is not None)

    def store_lost(self) -> str | None:
        return self.watchdog.store_lost()

    # ------------------------------------------------------------ Engine API

    def execute(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.process([call], [tensors])[0]

    def execute_async(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> Pending:
        """An in-place floating-point SUM/MEAN all-reduce of one replica per worker runs
        as async work of the backend (the optimizer's buckets during backward; CUDA
        tensors over gloo start their copies to the host, ``staging.py``); any other
        call runs now."""
        if self.replicas_per_worker == 1 and self._broken is None and not self.check_collectives:
            with self._failures():
                pending = start_all_reduce(self, call, tensors)
            if pending is not None:
                return pending
        return Pending.done(self.execute(replica_id, call, tensors))

    def shared_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A buffer whose in-place SUM/MEAN all-reduce over every worker goes through
        shared memory when the workers share a host (``shared_memory.py``), else None.
        Collective: every worker asks for the same buffers in the same order."""
        if self.shared_memory is None or device.type != "cpu" or self._broken is not None:
            return None
        buf = self.shared_memory.buffer(numel, dtype)
        if buf is not None and _log.isEnabledFor(logging.DEBUG):
            _log.debug("torch_dist engine: shared-memory buffer of %d x %s", numel, dtype)
        return buf

    def _progress_shared(self) -> None:
        """The same-host path's ready work, while the host waits for staged copies."""
        if self.shared_memory is not None:
            self.shared_memory.progress()

    def _flush(self) -> None:
        """Launches the staged calls still queued and waits for the chains under way, before
        any other cross-process call: one order of calls and messages on every worker."""
        if self.staging.pending:
            self.settle(self.staging.flush)
        drain(self)

    @contextlib.contextmanager
    def results_on_host(self) -> Iterator[None]:
        """Inside, :meth:`hand_out` leaves results on the comm device (a staged call copies
        them to the replicas' devices itself: ``staging.py``)."""
        saved, self._out_devices = self._out_devices, (self.comm_device,) * self.replicas_per_worker
        try:
            yield
        finally:
            self._out_devices = saved

    def settle(self, fn: Any) -> Any:
        """Runs ``fn()`` (a wait on backend work); a failure breaks the engine as in :meth:`process`."""
        with self._failures():
            return fn()

    @contextlib.contextmanager
    def _failures(self, announce: bool = False) -> Iterator[None]:
        """The one place a failure of a cross-process call becomes this engine's state: ours
        (mismatch, timeout, abort) and a backend error that means a lost peer (as
        ``WorkerFailedError``) break the engine, since the process group is out of step;
        any other error is the caller's (a bad call) and leaves it usable. ``announce``:
        also release the other workers through the store (a wait of ours that failed,
        where they may not be waiting on this worker)."""
        try:
            yield
        except (CollectiveMismatchError, CollectiveTimeoutError, ReplicaAborted) as e:
            if announce and not isinstance(e, ReplicaAborted):
                self.announce_failure(f"worker rank {self.rank}: {e}")
            self._broken = e
            _broke(e)
            raise
        except RuntimeError as e:
            if not is_peer_loss(e):
                raise
            err = self.watchdog.lost(e)
            self._broken = err
            if not isinstance(err, ReplicaAborted):  # the first to know: release the workers waiting elsewhere
                self.watchdog.announce(str(err))
            _broke(err)
            raise err from e

    def finish(self, replica_id: int) -> None:
        if self.check_collectives and self._broken is None:
            self.process([FINISHED], [[]])

    def abort(self, replica_id: int, exc: BaseException) -> None:
        """Tells every other worker (through the store) that this one failed."""
        replica_failed(_log, replica_id, exc, f"worker rank {self.rank}: ")
        if isinstance(exc, (ReplicaAborted, CollectiveTimeoutError, CollectiveMismatchError)):
            return  # a consequence of another failure, already known everywhere
        self.announce_failure(f"worker rank {self.rank} (replicas {list(self.local_replica_ids)}): replica "
                              f"{replica_id} raised {type(exc).__name__}: {exc}")

    def announce_failure(self, message: str) -> None:
        """Sets the store's abort key (the other workers stop waiting) and breaks this engine."""
        self.watchdog.announce(message)
        self._broken = ReplicaAborted(f"this worker failed earlier: {message}")

    def close(self) -> None:
        self.staging.close()
        if self.chain_pool is not None:
            self.chain_pool.shutdown(wait=False, cancel_futures=True)
        self.planner.close(abandon=self._broken is not None)
        self.watchdog.close()
        if self.shared_memory is not None:
            self.shared_memory.close()

    # ------------------------------------------------------------ the worker-level call

    def process(self, calls: Sequence[Call], payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Runs one collective for every local replica (``calls``/``payloads`` in local order)."""
        if self._broken is not None:
            raise self._broken_error(self._broken)
        self._flush()  # the staged calls and overlapped chains first: one order of messages on every worker
        call = calls[0]
        self.begin(calls)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("cross-process call #%d: %s", self.watchdog.count, call.describe())
        with self._failures():
            if self.check_collectives:
                check_signatures(self, calls)
            kind = call.kind
            if kind is Kind.FINISHED:
                return [[]]
            inplace = is_inplace(call)
            if inplace:
                check_inplace(payloads)
            else:
                payloads = [[tensor if tensor.is_contiguous() else tensor.contiguous() for tensor in row]
                            for row in payloads]
            # Parameters agree within a group but may differ between groups (an uneven
            # all_gather's sizes, a group-dependent broadcast source): looked up per group.
            step = Step(call, {rid: own.params for rid, own in zip(self.local_replica_ids, calls)}, payloads,
                        inplace)
            run = _COLLECTIVES.get(kind)
            if run is None:
                raise ValueError(f"unknown collective kind {str(kind)!r}")
            if kind is not Kind.ALL_REDUCE:  # all_reduce prechecks where it leaves shared memory
                precheck(self, calls)
            return run(self, step)

    def begin(self, calls: Sequence[Call]) -> None:
        """Counts a cross-process call of this worker (``calls``: its local replicas') as
        started: its number and what the watchdog describes (and the transports stamp,
        ``agreement.py``)."""
        watchdog = self.watchdog
        watchdog.count += 1
        watchdog.current = calls[0]  # described only if something goes wrong

    def meet(self, what: str) -> None:
        """Waits until every worker reaches the host-side collective ``what`` (``cr.save``);
        see :meth:`Watchdog.meet`. A failure breaks the engine and releases the others."""
        if self._broken is not None:
            raise self._broken_error(self._broken)
        self._flush()
        with self._failures(announce=True):
            self.watchdog.meet(what)

    def barrier(self, what: str = "barrier") -> None:
        """Waits (bounded) until every worker reaches the same barrier."""
        if self._broken is not None:
            raise self._broken_error(self._broken)
        self._flush()
        self.begin([BARRIER])
        self.watchdog.current = what
        with self._failures():
            self.watchdog.wait(dist.all_reduce(torch.zeros(1, device=self.comm_device), async_op=True),
                               range(self.world_size))

    def hand_out(self, outs: list[list[Any]], leaf: int, local: list[int], value: torch.Tensor,
                 fresh: bool = True) -> None:
        """Gives each local member of a group its own copy of ``value`` on its device
        (the first may keep ``value`` itself when it is a ``fresh`` buffer of ours)."""
        for k, rid in enumerate(local):
            i = self.local_index[rid]
            outs[i][leaf] = value.to(self._out_devices[i], copy=not (fresh and k == 0))

    @staticmethod
    def _broken_error(broken: BaseException) -> BaseException:
        """What a call after ``broken`` raises."""
        if isinstance(broken, ReplicaAborted):
            return broken
        return type(broken)(f"a previous collective failed, so the process group is out of step; "
                            f"restart the workers (torchrun --max-restarts) and resume from a "
                            f"checkpoint. The failure was: {broken}")
