"""Bounded, abort-aware waits, and what a failure says.

Invariant: no wait of this engine outlasts the timeout, and a worker whose
replica raised releases the others within a fraction of a second. On CPU
(gloo) waits are sliced: between slices the worker checks a store key that a
failing worker sets (:meth:`Watchdog.announce`); on timeout the store's
progress keys tell which ranks never arrived. NCCL waits are left to NCCL's
own watchdog, which enforces the process-group timeout.

A gloo wait that outlasts the slow threshold (:func:`~crossreplica.logs.slow_seconds`,
at least two slices, so every worker that arrived has posted its progress) logs
one WARNING naming the call and the worker ranks that have not reached it; the
check runs between slices only, so a fast collective pays nothing for it.

A failing worker's cause reaches every peer: the peer that reads the abort key
says so (``read/<rank>``), and a worker that announced a failure, or leaves the
interpreter on an uncaught exception (announced then), waits before it leaves,
at most ``LINGER_SECONDS``, until every peer has read it or stopped
(:meth:`Watchdog.linger`): a store it serves, and the process a peer's
shared-memory wait watches, would otherwise go with it, and the peer could say
only that it died. A wait whose attempt finds a peer gone reads the abort key
first, so it names the cause whenever the store outlives the failing worker.

Store keys, under one prefix per engine: ``abort`` (the failing worker's
message), ``read/<rank>`` (a worker knows the failure: it read or set ``abort``),
``progress/<rank>`` (the last cross-process call a worker reached),
``p2p/<a>-><b>`` (point-to-point exchanges worker ``a`` reached with ``b``),
``meet/<count>.<k>/<rank>`` (a worker reached a host-side collective such as
``cr.save``, :meth:`Watchdog.meet`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import logging
import math
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from ... import settings, store_keys
from ... import torch_private as tp
from ...errors import (CollectiveMismatchError, CollectiveTimeoutError, CrossReplicaError, ReplicaAborted,
                       ReplicaError, WorkerFailedError)
from ...logs import slow_seconds
from ..base import Call
from ..deadline import Deadline
from .agreement import stamp_of
from .heartbeat import Heartbeat, Pulses, describe, period
from .store_probe import StoreProbe

__all__ = ["LINGER_SECONDS", "Watchdog", "WorkerFailedError", "is_peer_loss"]

_SLICE = 0.25  # seconds between abort-key checks while a collective waits
_BATCH = 0.02  # seconds a point-to-point wait polls the store on the probe's thread between such checks

_log = logging.getLogger(__name__)

# The errors torch raises, typed, when a peer or the store host is gone (NCCL, the TCP store).
_TYPED_LOSS = (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)
# gloo's Work.wait rethrows its transport's gloo::IoException ("Connection closed by peer",
# "Timed out waiting ... for recv") as a plain RuntimeError: for that untyped error only,
# the message is what tells a lost peer from a bug in the call.
_GLOO_LOSS_WORDS = ("connection", "closed", "reset by peer", "broken pipe", "read error", "write error",
                    "timed out", "timeout", "socket", "unreachable", "gloo", "nccl")
# gloo's Work.wait(timeout) ends a slice with this untyped RuntimeError; the work goes on.
_GLOO_SLICE_TIMEOUT = "Operation timed out"
#: at most how long a worker that failed waits, before it leaves, until its peers have read why
LINGER_SECONDS = 10.0
# The failures that are another worker's (or a lost peer's) consequence: never announced at exit.
_CONSEQUENCES = (ReplicaAborted, CollectiveTimeoutError, CollectiveMismatchError)
_GONE = object()  # a store call that failed or did not answer (linger)


def is_peer_loss(e: BaseException) -> bool:
    """Whether a backend error means a peer is gone (rather than a bug in the call)."""
    if isinstance(e, _TYPED_LOSS):
        return True
    if type(e) is RuntimeError:  # untyped: gloo (see _GLOO_LOSS_WORDS)
        text = str(e).lower()
        return any(word in text for word in _GLOO_LOSS_WORDS)
    return False


def _default_store() -> Any:
    return tp.default_store()


class Watchdog:
    """Waits and failure reports of one engine; counts its cross-process calls."""

    def __init__(self, rank: int, world_size: int, replicas_per_worker: int, timeout: float,
                 backend: str):
        self.rank = rank
        self.world_size = world_size
        self.replicas_per_worker = replicas_per_worker
        self.timeout = timeout
        self.backend = backend
        #: seconds a wait lasts before a WARNING names the ranks not arrived (at least two slices)
        self.slow = max(slow_seconds(timeout), 2 * _SLICE)
        self.store = _default_store()
        #: the waits' store calls, each bounded (a cut link would block one for minutes)
        self.probe = StoreProbe(self.store)
        # Every worker creates its engines in the same order (SPMD), so its own count
        # of engines names the same engine everywhere.
        serial = 0
        if self.store is not None:
            serial = self.store.add(store_keys.engine_serial(rank), 1)
        self._prefix = store_keys.engine(serial)
        #: this worker's heartbeat, and its peers' (a lost peer is named within seconds)
        self.heartbeat: Heartbeat | None = None
        self.pulses: Pulses | None = None
        #: how long the store may leave a heartbeat unanswered before it counts as lost
        self._store_silence = max(settings.heartbeat_seconds(), self.probe.seconds)
        if self.store is not None and world_size > 1:
            stopped = settings.heartbeat_seconds()
            try:
                self.heartbeat = Heartbeat(self.store, self._prefix, rank, period(stopped))
            except Exception as e:  # noqa: BLE001 - a store without clone(): lost peers show at the timeout
                _log.info("no heartbeat on this store (%s): a lost worker is noticed at the timeout", e)
            else:
                self.pulses = Pulses(self._prefix, rank, world_size, stopped)
        #: cross-process calls so far (the same on every worker: SPMD)
        self.count = 0
        self._next_read: dict[str, float] = {}  # when each once-a-slice store read is due next (_due)
        #: the call under way, described only if something goes wrong
        self.current: Call | str = "no collective yet"
        self._exchanges: dict[int, int] = {}  # peer worker -> point-to-point exchanges with it so far
        self._meetings = 0  # host-side collectives met so far (meet)
        self._transfer_thread: ThreadPoolExecutor | None = None  # waits point-to-point works (Transfers)
        #: the failure this worker announced (the first), which its peers must read before it leaves
        self.announced: str | None = None
        self._lingered = False
        _LIVE.add(self)

    @property
    def prefix(self) -> str:
        """The store prefix of this engine's keys (the same engine on every worker)."""
        return self._prefix

    @property
    def where(self) -> str:
        what = self.current.describe() if isinstance(self.current, Call) else self.current
        return f"{what} (cross-process call #{self.count})"

    # ------------------------------------------------------------ waiting

    def until(self, attempt: Callable[[], bool], ranks: Sequence[int], late: Callable[[], Sequence[int]],
              pace: float = 0.0, timed_out: Callable[[list[int]], BaseException] | None = None,
              wait: Deadline | None = None) -> Deadline:
        """The one wait of this engine: calls ``attempt()`` until it returns True, bounded by
        the timeout, and returns its bounds. Between attempts it posts this worker's
        progress (once), raises when another worker announced a failure, a peer's heartbeat
        stopped or the deadline passed (``timed_out(late())``, or the collective's
        CollectiveTimeoutError naming ``late()``), and warns once when the wait is slow.
        ``attempt`` paces itself (a sliced backend wait, a batch of store polls); with
        ``pace`` the loop also pauses between attempts (:meth:`Deadline.back_off`, up to
        ``pace`` seconds).
        ``wait``: the bounds to keep, when ``attempt`` needs them too (default: from now)."""
        if wait is None:
            wait = Deadline(self.timeout, self.slow)
        posted = False
        while not self._attempt(attempt):
            if not posted:
                self.post_progress()
                posted = True
            aborted = self.abort_message()
            if aborted is not None:
                raise self.released(aborted)
            if wait.waited >= _SLICE:  # never on a fast exchange's path
                self.raise_if_peers_lost()
                self.raise_if_calls_differ(ranks)
            if wait.expired():
                missing = list(late())
                if timed_out is not None:
                    raise timed_out(missing)
                replicas = self._replicas_of(missing)
                raise CollectiveTimeoutError(
                    f"collective {self.where} timed out after {self.timeout:g}s on worker rank "
                    f"{self.rank}: worker ranks {missing} (replicas {list(replicas)}) never "
                    f"arrived (ranks taking part: {list(ranks)}){self._cut_off()}", replicas)
            if wait.turned_slow():
                self.warn_slow(wait, ranks, late())
            if pace:
                wait.back_off(min(1e-4, pace), pace)
        if wait.warned:
            self.completed(wait)
        return wait

    def _attempt(self, attempt: Callable[[], bool]) -> bool:
        """``attempt()``; when it finds a peer gone, another worker's announced failure (which
        may be why that peer left) is raised instead, so this worker names the cause."""
        try:
            return attempt()
        except CollectiveTimeoutError as e:
            aborted = self.abort_message()
            if aborted is None:
                raise
            raise self.released(aborted) from e

    def wait(self, work: Any, ranks: Sequence[int]) -> None:
        """Waits for ``work`` in slices (:meth:`until`)."""
        if self.backend == "nccl":
            work.wait()  # the NCCL watchdog enforces the process-group timeout
            return

        bounds = Deadline(self.timeout, self.slow)  # the last slice ends at the deadline, not past it

        def attempt() -> bool:
            try:
                work.wait(datetime.timedelta(seconds=max(min(_SLICE, bounds.left), 0.001)))
            except RuntimeError as e:
                # Anything but the end of a slice (or a finished work) is the backend
                # reporting a real failure.
                if _GLOO_SLICE_TIMEOUT not in str(e) or work.is_completed():
                    raise
                return False
            return True

        self.until(attempt, ranks, lambda: self._missing(ranks), wait=bounds)

    def await_peers(self, peers: Sequence[int], ranks: Sequence[int]) -> Deadline:
        """Posts this worker's arrival at its next exchange with each of ``peers`` and waits
        (:meth:`until`) until each has posted its arrival at the same exchange; returns the
        wait's bounds. Both sides of a pair walk their exchanges in the same order, so a per-pair
        count names the same exchange on both. Needs the store."""
        want = {}
        for peer in peers:
            want[peer] = self._exchanges.get(peer, 0) + 1
            self._exchanges[peer] = want[peer]
        mine = [store_keys.p2p(self._prefix, self.rank, peer) for peer in peers]
        theirs = {peer: store_keys.p2p(self._prefix, peer, self.rank) for peer in peers}
        posts = [mine]  # emptied once posted: a batch the store did not answer is not posted again
        waiting = list(peers)

        def poll(store: Any) -> list[int]:
            # On the probe's thread, so a cut link cannot block this worker: posts once, then
            # polls for up to one batch (most exchanges end in the first poll, in one hop).
            for key in posts.pop() if posts else ():
                store.add(key, 1)
            batch = Deadline(_BATCH, math.inf)
            while True:
                left = [peer for peer, key in theirs.items() if store.add(key, 0) < want[peer]]
                if not left or batch.expired():
                    return left
                batch.back_off(0.0005, 0.01)

        def attempt() -> bool:
            waiting[:] = self.probe(list(peers), poll, raises=True)  # a dead store host: a lost peer
            return not waiting

        return self.until(attempt, ranks, lambda: waiting)

    def meet(self, what: str) -> None:
        """Waits (:meth:`until`) until every worker has reached the host-side collective
        ``what`` (``cr.save``), before any of its cross-process calls.

        A worker that went on to a later cross-process call instead (its progress key,
        posted while it waits there, is past this worker's count) never comes: ``what``
        was called on some workers only (the DDP habit ``if rank == 0: save``), which
        fails here at once rather than as a mismatched collective after the timeout.

        Raises:
            CollectiveMismatchError: a worker went past ``what`` without calling it.
            CollectiveTimeoutError: a worker did not reach it within the timeout.
        """
        if self.store is None or self.world_size == 1:
            return
        self._meetings += 1
        number = f"{self.count}.{self._meetings}"
        self.probe(None, lambda s: s.set(store_keys.meeting(self._prefix, number, self.rank), what))
        keys = {rank: store_keys.meeting(self._prefix, number, rank) for rank in range(self.world_size)
                if rank != self.rank}
        absent = list(keys)

        def attempt() -> bool:
            if self.probe(False, lambda s: s.check(list(keys.values()))):
                return True
            absent[:] = [rank for rank, key in keys.items() if not self._posted(key)]
            gone = [rank for rank in absent if self._progress(rank) > self.count]
            if gone:
                raise CollectiveMismatchError(
                    f"{what} was called on worker rank {self.rank}, but worker ranks {gone} (replicas "
                    f"{list(self._replicas_of(gone))}) went on to their next collective without calling it. "
                    f"{what} is a collective: every worker must call it (the chief alone writes the file); "
                    f"drop the `if rank == 0:` (DDP's `if master_process:`) around it")
            return False

        def timed_out(missing: list[int]) -> BaseException:
            return CollectiveTimeoutError(
                f"{what} timed out after {self.timeout:g}s on worker rank {self.rank}: worker ranks {missing} "
                f"(replicas {list(self._replicas_of(missing))}) never called it; {what} is a collective that "
                f"every worker must call{self._cut_off()}", self._replicas_of(missing))

        current, self.current = self.current, what
        try:
            self.until(attempt, range(self.world_size), lambda: absent, pace=0.02, timed_out=timed_out)
        finally:
            self.current = current

    def transfers(self, peers: Sequence[int]) -> Transfers:
        """The waits for this exchange's point-to-point works with ``peers`` (other workers): on
        gloo, once the peers have arrived (:meth:`await_peers`), on this engine's transfer
        thread (:class:`Transfers`); on NCCL, or without the store, in slices (:meth:`wait`)."""
        ranks = tuple(sorted({*peers, self.rank}))
        if self.backend == "nccl" or self.store is None:
            return Transfers(self, ranks)
        if self._transfer_thread is None:
            self._transfer_thread = ThreadPoolExecutor(1, thread_name_prefix="crossreplica-transfers")
        return Transfers(self, ranks, (self._transfer_thread, self.await_peers(list(peers), ranks)))

    def close(self) -> None:
        """Stops this worker's heartbeat (the engine is closed); a transfer still waited on
        ends at its deadline."""
        _LIVE.discard(self)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self._transfer_thread is not None:
            self._transfer_thread.shutdown(wait=False, cancel_futures=True)

    def store_lost(self) -> str | None:
        """Why the job's store stopped answering this worker (a wait's call went unanswered,
        or the heartbeat's failed or has waited as long as a peer's silence takes to count
        as lost), or None."""
        if self.probe.unreachable:
            return f"it did not answer within {self.probe.seconds:g}s"
        if self.heartbeat is None:
            return None
        return self.heartbeat.store_lost(self._store_silence)

    def stopped_peers(self, broken: bool = False) -> list[int]:
        """The peers whose heartbeat has stopped, as this worker has watched it so far
        (none without heartbeats); for waits outside a collective (a regrouping). ``broken``:
        the group already failed, so half the window names a peer (as :meth:`lost` does)."""
        if self.pulses is None:
            return []
        after = self.pulses.stopped_after / 2 if broken else None
        return self.pulses.lost(lambda call: self.probe(None, call), after)

    def _due(self, read: str) -> bool:
        """Whether the store read ``read`` is due: at most once a slice each, so that a
        waiting worker's polls stay cheap for the store."""
        now = time.monotonic()
        if now < self._next_read.get(read, 0.0):
            return False
        self._next_read[read] = now + _SLICE
        return True

    def raise_if_peers_lost(self) -> None:
        """Raises WorkerFailedError naming every peer whose heartbeat stopped (read at most
        once a slice), after telling the other workers through the abort key."""
        if self.pulses is None or not self._due("pulses"):
            return
        lost = self.pulses.lost(lambda call: self.probe(None, call))
        if lost:
            message = (f"collective {self.where} failed on worker rank {self.rank}: "
                       f"{describe(lost, self.pulses.stopped_after)}")
            self.announce(message)
            raise WorkerFailedError(message, self._replicas_of(lost))

    def raise_if_calls_differ(self, ranks: Sequence[int]) -> None:
        """Raises CollectiveMismatchError when a peer among ``ranks`` posted that it waits at
        a call of the same number as this worker's latest but another stamp (read at most
        once a slice): the workers made different calls, and would otherwise wait for each
        other until the timeout."""
        if self.store is None or not self._due("calls"):
            return
        mine = self.stamp
        for rank in ranks:
            if rank == self.rank:
                continue
            count, stamp = self._posted_call(rank)
            if count == self.count and stamp != mine:
                message = (f"replicas made different collective calls: worker rank {rank} waits at its "
                           f"cross-process call #{count} with another kind, op, dtype, shape or group assignment "
                           f"than this worker's (rank {self.rank}) call #{self.count}, {self.where}; every "
                           f"replica must make the same collective calls in the same order (a call made on one "
                           f"worker only, such as strategy.reduce under `if rank == 0`, pairs with another "
                           f"call); CROSSREPLICA_CHECK_COLLECTIVES=1 lists every replica's call")
                self.announce(message)
                raise CollectiveMismatchError(message)

    def _cut_off(self) -> str:
        """What a timeout message adds when the store stopped answering this worker."""
        if not self.probe.unreachable:
            return ""
        return ("; the store (at MASTER_ADDR, served by rank 0 or torchrun's agent) stopped answering this "
                "worker too, so this worker is probably the one cut off from the others (a network partition), "
                "and the ranks named are only those it could not hear from")

    def warn_slow(self, wait: Deadline, ranks: Sequence[int], late: Sequence[int]) -> None:
        """The WARNING of a wait past the slow threshold (once per wait; any transport)."""
        _log.warning("collective %s has waited %.3gs on worker rank %s: worker ranks %s (replicas %s) have "
                     "not reached it yet (ranks taking part: %s); it fails after %gs", self.where, wait.waited,
                     self.rank, list(late), list(self._replicas_of(late)), list(ranks), self.timeout)

    def completed(self, wait: Deadline) -> None:
        """The INFO record of a wait that completed after its slow warning."""
        if _log.isEnabledFor(logging.INFO):
            _log.info("collective %s on worker rank %s completed after %.3gs", self.where, self.rank, wait.waited)

    def _replicas_of(self, workers: Sequence[int]) -> tuple[int, ...]:
        per_worker = self.replicas_per_worker
        return tuple(rid for worker in workers for rid in range(worker * per_worker, (worker + 1) * per_worker))

    # ------------------------------------------------------------ the store keys

    # Each call goes through the probe: bounded, and a failed call (a dead store host, which
    # shows up as a lost peer instead) answers its default. The timeout still bounds every wait.

    def announce(self, message: str) -> None:
        """Sets the abort key, so the other workers stop waiting (best effort); before this
        worker leaves, it waits for them to read it (:meth:`linger`)."""
        if self.announced is None:
            self.announced = message
        abort, read = store_keys.abort(self._prefix), store_keys.read(self._prefix, self.rank)
        self.probe(None, lambda s: (s.set(abort, message), s.set(read, "1")))

    def released(self, aborted: str) -> ReplicaAborted:
        """The error of this worker, released from its wait by another worker's failure
        (``aborted``: the abort key's message); posts that it has read the cause, so the
        failing worker need not wait for it before leaving (:meth:`linger`)."""
        self._has_read()
        return ReplicaAborted(f"{aborted}; this worker was released from {self.where}")

    def _has_read(self) -> None:
        """Posts that this worker knows of the failure announced (:meth:`linger` waits for it)."""
        read = store_keys.read(self._prefix, self.rank)
        self.probe(None, lambda s: s.set(read, "1"))

    def announce_at_exit(self, failure: BaseException) -> None:
        """Announces ``failure``, the exception this process leaves on, unless this worker
        announced one already, another worker's failure came first (this one then posts
        that it knows it), or ``failure`` is a lost peer, a timeout, a mismatch or a release."""
        if self.announced is not None or self.store is None or self.world_size == 1:
            return
        if self.abort_message() is not None:  # another worker failed first: this one knows why
            self._has_read()
            return
        original = failure.original if isinstance(failure, ReplicaError) else failure
        if isinstance(failure, _CONSEQUENCES) or isinstance(original, _CONSEQUENCES):
            return  # a lost peer, a timeout or a mismatch, each reported by the peers themselves
        self.announce(f"worker rank {self.rank} failed: {type(original).__name__}: {original}")

    def linger(self, seconds: float = LINGER_SECONDS) -> None:
        """Once, before this worker leaves after announcing a failure: waits until every peer
        has read it (or announced one of its own), its heartbeat has stopped, or the store
        stops answering, at most ``seconds`` (and the timeout). A peer that reads the cause
        after this worker's exit could not name it: the store may be this worker's, and a
        peer's shared-memory wait takes a vanished process for a dead one."""
        if self.announced is None or self._lingered or self.store is None or self.world_size == 1:
            return
        self._lingered = True
        keys = {peer: store_keys.read(self._prefix, peer) for peer in range(self.world_size) if peer != self.rank}
        bound = min(seconds, self.timeout)
        wait = Deadline(bound, bound)  # no slow warning: the warning below says what is left
        while True:
            unread = self.probe(_GONE, lambda s: [peer for peer, key in keys.items() if not s.check([key])])
            if unread is _GONE or not unread:
                return
            stopped = set(self.stopped_peers())
            unread = [peer for peer in unread if peer not in stopped]
            if not unread:
                return
            if wait.expired():
                _log.warning("worker rank %d leaves before worker ranks %s read why it failed (waited %gs): "
                             "they may report it only as lost", self.rank, unread, bound)
                return
            wait.sleep(_LINGER_POLL)

    @property
    def stamp(self) -> int:
        """The digest of the latest call's stamp (agreement.py; 0 for a host-side meeting)."""
        return stamp_of(self.count, [self.current]).digest if isinstance(self.current, Call) else 0

    def post_progress(self) -> None:
        posted = f"{self.count} {self.stamp}"  # the call this worker waits at, and its stamp
        self.probe(None, lambda s: s.set(store_keys.progress(self._prefix, self.rank), posted))

    def abort_message(self) -> str | None:
        key = store_keys.abort(self._prefix)
        return self.probe(None, lambda s: s.get(key).decode(errors="replace") if s.check([key]) else None)

    def _posted(self, key: str) -> bool:
        return bool(self.probe(False, lambda s: s.check([key])))

    def _progress(self, rank: int) -> int:
        """The last cross-process call ``rank`` posted that it waits at (-1: none, or unknown)."""
        return self._posted_call(rank)[0]

    def _posted_call(self, rank: int) -> tuple[int, int]:
        """The number and stamp of the last call ``rank`` posted that it waits at ((-1, 0): none,
        or unknown)."""
        key = store_keys.progress(self._prefix, rank)

        def read(s: Any) -> tuple[int, int]:
            if not s.check([key]):
                return -1, 0
            count, _, stamp = s.get(key).decode().partition(" ")
            return int(count), int(stamp or 0)
        return self.probe((-1, 0), read)

    def _missing(self, ranks: Sequence[int], grace: float = 0.0) -> list[int]:
        """Ranks among ``ranks`` that have not posted progress at this call (store based)."""
        if self.store is None:
            return [rank for rank in ranks if rank != self.rank]
        wait = Deadline(grace, math.inf)
        while True:
            missing = []
            for rank in ranks:
                if rank == self.rank:
                    continue
                if self._progress(rank) < self.count:
                    missing.append(rank)
            if not missing or wait.expired():
                return missing
            wait.sleep(0.1)

    def _stopped_heartbeats(self) -> list[int]:
        """The peers whose heartbeat stops within the heartbeat window (the dead ones, when a
        connection broke), or [] when none does or there are no heartbeats. A peer whose
        connection broke only because it failed too keeps beating and is not named. A broken
        connection is evidence already, so a counter still for half the window (several
        missed beats) names its peer: a killed worker is named in about half the window."""
        if self.pulses is None:
            return []
        after = self.pulses.stopped_after / 2
        wait = Deadline(self.pulses.stopped_after + 2 * _SLICE, math.inf)
        while not wait.expired() and self.abort_message() is None:
            stopped = self.pulses.lost(lambda call: self.probe(None, call), after)
            if stopped:
                return stopped
            wait.sleep(_SLICE)
        return []

    def lost(self, e: BaseException) -> CrossReplicaError:
        """Turns a backend error (a peer closed its connection) into our error type."""
        aborted = self.abort_message()
        if aborted is not None:
            return self.released(aborted)
        self.post_progress()
        missing = self._stopped_heartbeats() or self._missing(range(self.world_size), grace=1.0)
        aborted = self.abort_message()
        if aborted is not None:
            return self.released(aborted)
        replicas = self._replicas_of(missing)
        who = (f"worker ranks {missing} (replicas {list(replicas)}) did not reach it and are presumed "
               f"dead" if missing else "the failing worker is unknown")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(". ")[0]  # the backend's advice that follows is not ours to give
        # A worker cut off from the store is the likelier cause than a peer's crash in gloo.
        why = self._cut_off() or (_ABORTED_BY_GLOO if self.backend == "gloo" else "")
        return WorkerFailedError(
            f"collective {self.where} failed on worker rank {self.rank}: the connection to another "
            f"worker broke ({first}); {who}{why}", replicas)


# gloo aborts a process whose peer sends another size in a collective: a worker that crashed
# there may have made another call than this one (engines/torch_dist/agreement.py).
_ABORTED_BY_GLOO = (" (if it crashed in gloo, it may have made another collective call than this worker with "
                    "a payload of another size, which gloo aborts on; CROSSREPLICA_CHECK_COLLECTIVES=1 names "
                    "such a mismatch before the data moves)")


class Transfers:
    """Waits for one exchange's gloo send/recv works, which cannot be waited on in slices (a
    timed-out wait completes the work with an error: the recv is lost). The engine's
    transfer thread waits on them, each bounded by the exchange's deadline, in the order
    :meth:`expect` gives them (the order the caller waits in, so that thread runs ahead),
    while the caller's waits go through :meth:`Watchdog.until`: a peer frozen in the middle
    of a transfer is named by its heartbeat within seconds instead of at the timeout."""

    def __init__(self, watchdog: Watchdog, ranks: Sequence[int],
                 on_thread: tuple[ThreadPoolExecutor, Deadline] | None = None):
        """``on_thread``: the transfer thread and the exchange's bounds; None waits in slices
        on the caller's thread (:meth:`Watchdog.wait`: NCCL, or no store)."""
        self._watchdog, self._ranks, self._on_thread = watchdog, tuple(ranks), on_thread
        self._pending: dict[int, tuple[Any, Future]] = {}  # id(work) -> (work, its wait)

    def expect(self, works: Sequence[Any]) -> None:
        """Starts waiting, in this order, for ``works`` the caller will wait for in this order."""
        if self._on_thread is None:
            return
        pool, bounds = self._on_thread
        for work in works:
            if id(work) not in self._pending:
                self._pending[id(work)] = (work, pool.submit(_wait_by, work, bounds))

    def __call__(self, work: Any) -> None:
        """Waits for ``work`` (raising what its wait raised)."""
        watchdog = self._watchdog
        if self._on_thread is None:
            watchdog.wait(work, self._ranks)
            return
        bounds = self._on_thread[1]
        self.expect([work])
        _, future = self._pending.pop(id(work))

        def settled() -> bool:
            concurrent.futures.wait([future], timeout=_SLICE)
            return future.done()
        try:
            if not future.done():
                watchdog.until(settled, self._ranks, lambda: [r for r in self._ranks if r != watchdog.rank],
                               wait=bounds)
            future.result()
        except BaseException:
            for _, later in self._pending.values():  # not started: nobody will wait for them
                later.cancel()
            raise


#: the watchdogs of the engines not closed yet (:func:`_at_exit`)
_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()
_LINGER_POLL = 0.05  # seconds between a lingering worker's looks at its peers


def _at_exit() -> None:
    """As the interpreter exits: each open engine publishes the uncaught exception the
    process leaves on (if any) and waits for its peers to read its failure (:meth:`Watchdog.linger`).
    Registered after the heartbeat's and the probe's exit hooks, so it runs before them."""
    failure = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # set for an uncaught one
    for watchdog in list(_LIVE):
        try:
            if isinstance(failure, BaseException):
                watchdog.announce_at_exit(failure)
            watchdog.linger()
        except Exception as e:  # noqa: BLE001 - the exit goes on; the peers then say the worker was lost
            _log.debug("worker rank %d could not publish its failure at exit: %s", watchdog.rank, e)


atexit.register(_at_exit)


def _wait_by(work: Any, bounds: Deadline) -> None:
    """On the transfer thread: ``work.wait`` bounded by ``bounds`` (the time left when it starts)."""
    work.wait(datetime.timedelta(seconds=max(bounds.left, 0.001)))
