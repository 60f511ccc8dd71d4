"""The hierarchical engine; several replica threads per process, processes joined by torch.distributed.

A collective is two levels. First the worker's local replicas meet in-process
on the same :class:`Rendezvous` the threads engine uses: the last to arrive is
the leader, checks that the local calls agree (``check_agreement``, as the
threads engine does), and then performs the cross-process part once for the
whole worker (:meth:`TorchDistEngine.process`: local members reduce first, then
one cross-process collective per worker set and dtype). The other local
replicas wake with their share of the leader's result.

An in-place SUM/MEAN all-reduce started with ``execute_async`` (the optimizer's
gradient buckets during backward) meets locally the same way, but the leader
only starts the cross-process part, one async all-gather of the worker's
tensors (``start_gathered_all_reduce``), and backward goes on while it travels;
the first local replica to wait reduces the rows in ascending replica id (the
ordered path's bytes) for all of them.

merge_call is a round of the local rendezvous only (tf semantics: merge_fn
runs once per worker, on the worker's replicas). Failures inherit both
mechanisms: the rendezvous releases local replicas at once, the store key of
the torch.distributed engine releases the other workers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CollectiveMismatchError
from ..logs import slow_seconds
from .base import FINISHED, Call, Pending, check_agreement
from .kinds import SPECS
from .rendezvous import Rendezvous
from .streams import FencedRounds
from .torch_dist import TorchDistEngine
from .torch_dist.all_reduce import start_gathered_all_reduce

__all__ = ["HierarchicalEngine"]

_log = logging.getLogger(__name__)

class _SharedPending:
    """One worker's asynchronous call, waited for by each of its local replicas: the
    first waiter finishes it; ``wait()`` gives every local replica's outputs (or
    raises what the first waiter met)."""

    def __init__(self, pending: Pending, leaves_per_replica: list[int]):
        self._pending, self._sizes = pending, leaves_per_replica
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def wait(self) -> list[list[torch.Tensor]]:
        with self._lock:
            if self._error is not None:
                raise self._error
            try:
                flat = self._pending.wait()
            except BaseException as e:
                self._error = e
                raise
        rows, start = [], 0
        for k in self._sizes:
            rows.append(flat[start:start + k])
            start += k
        return rows


class HierarchicalEngine(TorchDistEngine):
    """``len(devices)`` local replicas per worker; see the module docstring."""

    def __init__(self, devices: Sequence[torch.device], timeout: float,
                 check_collectives: bool = False, comm_device: torch.device | None = None,
                 ordered_reductions: bool = True):
        super().__init__(devices, timeout, check_collectives, comm_device, ordered_reductions)
        # Local waiters wait for their slowest sibling and then for the leader's
        # cross-process wait, which is itself bounded by ``timeout``.
        self.rendezvous = Rendezvous(self.replicas_per_worker, 2 * self.timeout + 5.0,
                                     self.local_replica_ids, slow=slow_seconds(self.timeout))
        # CUDA replicas: the leader's streams wait for each replica's inputs and theirs for its outputs.
        self._fenced = (FencedRounds(self.rendezvous) if any(d.type == "cuda" for d in self.devices)
                        else None)
        _log.info("hierarchical layout: %d workers x %d local replicas (threads); worker rank %d holds "
                  "replicas %s", self.world_size, self.replicas_per_worker, self.rank, list(self.local_replica_ids))

    def begin_run(self) -> None:
        super().begin_run()
        self.rendezvous.begin_run()

    def execute(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        i = self.local_index[replica_id]
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        if self._fenced is not None:
            return self._fenced.exchange(i, call, tensors, self._lead)[i]
        return self.rendezvous.exchange(i, call, tensors, self._lead)[i]

    def _lead(self, calls: list[Call], payloads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        self._check_local(calls)
        return self.process(calls, payloads)

    def execute_async(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> Pending:
        """The optimizer's buckets: the local replicas meet, and their leader starts one
        async all-gather for the whole worker (``start_gathered_all_reduce``); every local
        replica's Pending waits for it (the first to wait reduces for all). Other calls,
        and layouts it does not take, run now."""
        if self._fenced is not None:  # on CUDA the backend's own streams overlap the transfer
            return Pending.done(self.execute(replica_id, call, tensors))
        i = self.local_index[replica_id]
        outcome = self.rendezvous.exchange(i, call, tensors, self._lead_async)
        if isinstance(outcome, _SharedPending):
            return Pending(lambda: outcome.wait()[i])
        return Pending.done(outcome[i])

    def _lead_async(self, calls: list[Call], payloads: list[list[torch.Tensor]]) -> Any:
        self._check_local(calls)
        if self.broken is None:
            with self._failures():
                pending = start_gathered_all_reduce(self, calls[0], payloads)
            if pending is not None:
                return _SharedPending(pending, [len(row) for row in payloads])
        return self.process(calls, payloads)

    def _check_local(self, calls: list[Call]) -> None:
        """The threads engine's agreement check, on the local members of each group."""
        mine = set(self.local_replica_ids)

        def local_view(call: Call) -> Call:
            if not SPECS[call.kind].compared_locally:
                return call
            groups = tuple(group for group in (tuple(rid for rid in group if rid in mine)
                                               for group in call.groups) if group)
            return call._replace(groups=groups)

        if len({call.groups for call in calls}) > 1 or any(call.kind is not calls[0].kind for call in calls):
            views = calls  # different kinds or groups: reported as they are
        else:
            views = [local_view(c) for c in calls]
        check_agreement(views, self.local_replica_ids, shown=calls)

    def exchange_objects(self, replica_id: int, call: Call, obj: Any, leader_fn: Any,
                         timeout: float | None = None) -> Any:
        return self.rendezvous.exchange(self.local_index[replica_id], call, obj, leader_fn, timeout)

    def finish(self, replica_id: int) -> None:
        i = self.local_index[replica_id]
        if self.check_collectives and self.broken is None:
            # one last checked round, so a worker that makes fewer calls is reported
            self.rendezvous.exchange(i, FINISHED, None, self._lead_finished)
        self.rendezvous.finish(i)

    def _lead_finished(self, calls: list[Call], payloads: list) -> None:
        self._check_local(calls)
        self.process(calls, [[] for _ in calls])

    def abort(self, replica_id: int, exc: BaseException) -> None:
        self.rendezvous.abort(self.local_index[replica_id], exc)
        if isinstance(exc, CollectiveMismatchError) and self.broken is None:
            # Found among this worker's own replicas (the local check, or a replica that
            # returned while a sibling waits), before any cross-process call: the other
            # workers cannot know, so tell them as for a raising replica, or they would
            # wait out the whole timeout.
            self.announce_failure(f"worker rank {self.rank} (replicas {list(self.local_replica_ids)}): "
                           f"its replicas disagree: {exc}")
            return
        super().abort(replica_id, exc)
