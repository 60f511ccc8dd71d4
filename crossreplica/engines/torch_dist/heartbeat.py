"""Each worker's heartbeat in the store, and the peers whose heartbeat stopped.

A collective notices a lost worker when a connection to it breaks. With three
workers or more, the ones still waiting may hold no connection to the lost one
(it sits elsewhere in the ring, or the exchange is coordinated through the
store), and a frozen (SIGSTOP) or cut-off worker breaks no connection at all:
the survivors then wait for the whole timeout, and name only the ranks that
had not posted their progress. So every worker bumps a counter in the store a
few times a second, from a daemon thread on a store connection of its own
(a cut link blocks that thread only), and a wait that outlasts a slice reads
every peer's counter: peers whose counter stopped moving for
``CROSSREPLICA_HEARTBEAT_SECONDS`` are lost, and the wait fails naming all of
them.

A counter that never moved (0: the peer's engine does not exist yet) proves
nothing and is never judged; the clock of a counter starts when this worker
first reads it, so a reader that was itself descheduled never judges a peer
on time it did not watch.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ... import store_keys

__all__ = ["Heartbeat", "Pulses"]

_log = logging.getLogger(__name__)


class _Beater:
    """The one daemon thread of a process that bumps every live heartbeat's counter."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A fresh state (also in a forked child: the parent's thread and lock stay behind)."""
        self._lock = threading.Lock()
        self._beats: list[weakref.ref[Heartbeat]] = []
        self._thread: threading.Thread | None = None
        self._exiting = threading.Event()

    def add(self, beat: Heartbeat) -> None:
        with self._lock:
            self._beats.append(weakref.ref(beat))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="crossreplica-heartbeat", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                beats = [b for b in (ref() for ref in self._beats) if b is not None and not b.stopped]
                self._beats = [weakref.ref(b) for b in beats]
                if not beats or self._exiting.is_set():
                    self._thread = None
                    return
                period = min(b.period for b in beats)
            for beat in beats:
                beat.beat()
            self._exiting.wait(period)

    def stop_at_exit(self) -> None:
        """Ends the thread before the interpreter finalizes, so it is never inside a store
        call while the store's objects are torn down (bounded: a call stuck on a cut link
        is left behind)."""
        self._exiting.set()
        thread = self._thread
        if thread is not None:
            thread.join(_EXIT_JOIN)


_BEATER = _Beater()
atexit.register(_BEATER.stop_at_exit)
os.register_at_fork(after_in_child=_BEATER.reset)

#: seconds the interpreter's exit waits for the heartbeat thread
_EXIT_JOIN = 1.0


class Heartbeat:
    """This worker's counter under ``prefix``, bumped every ``period`` seconds on a clone
    of ``store`` (a connection of its own) until :meth:`stop`, or until the store fails."""

    def __init__(self, store: Any, prefix: str, rank: int, period: float):
        self.period = period
        self.stopped = False
        #: why the store failed a beat (its host is gone), once it has
        self.failure: str | None = None
        self._calling_since: float | None = None  # when the beat under way began
        self._key = store_keys.heartbeat(prefix, rank)
        self._store = store.clone()
        self._store.add(self._key, 1)  # at once: a peer that reads it now sees this worker alive
        _BEATER.add(self)

    def beat(self) -> None:
        self._calling_since = time.monotonic()
        try:
            self._store.add(self._key, 1)
        except Exception as e:  # noqa: BLE001 - the store host is gone: the peers' waits say so
            _log.debug("heartbeat %s stopped: %s", self._key, e)
            self.failure = f"{type(e).__name__}: {e}"
            self.stopped = True
        self._calling_since = None

    def store_lost(self, after: float) -> str | None:
        """Why this worker's store is gone: a beat failed (its host died, refused), or one has
        waited ``after`` seconds for an answer (frozen, cut off); None while it answers."""
        if self.failure is not None:
            return f"it failed a heartbeat ({self.failure})"
        since = self._calling_since
        if since is not None and time.monotonic() - since >= after:
            return f"it has not answered a heartbeat for {time.monotonic() - since:.1f}s"
        return None

    def stop(self) -> None:
        self.stopped = True


class Pulses:
    """What one worker knows of its peers' heartbeats (for :meth:`lost`)."""

    def __init__(self, prefix: str, rank: int, world_size: int, stopped_after: float):
        self.stopped_after = stopped_after
        self._keys = {peer: store_keys.heartbeat(prefix, peer) for peer in range(world_size) if peer != rank}
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (counter, when first read at it)

    def lost(self, read: Callable[[Callable[[Any], Any]], Any], after: float | None = None) -> list[int]:
        """The peers whose counter has not moved for ``after`` seconds (default
        ``stopped_after``) of this worker's watching. ``read(call)`` runs ``call(store)``
        bounded (the watchdog's probe), answering None when the store does not."""
        after = self.stopped_after if after is None else after
        keys = self._keys
        if not keys:
            return []
        names = list(keys.values())
        values = read(lambda s: s.multi_get(names) if s.check(names) else [s.add(k, 0) for k in names])
        if values is None:
            return []
        now = time.monotonic()
        lost = []
        for peer, value in zip(keys, values):
            counter = int(value)
            before, since = self._seen.get(peer, (-1, now))
            if counter != before:
                self._seen[peer] = (counter, now)
            elif counter > 0 and now - since >= after:
                lost.append(peer)
        return lost


def period(stopped: float) -> float:
    """How often a worker beats: often enough that ``stopped`` seconds are many missed beats."""
    return min(0.25, stopped / 8)


def describe(lost: Sequence[int], stopped: float) -> str:
    return (f"worker ranks {list(lost)} stopped answering (no heartbeat for {stopped:g}s: the process died, "
            f"was frozen, or lost its network)")
