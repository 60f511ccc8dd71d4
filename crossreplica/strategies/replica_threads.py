"""Persistent replica threads: created once per strategy, reused by every run.

A run hands each thread the same body; each thread waits on a lock of its own
for work, and the last thread to finish wakes the caller. A replica that
raises calls ``on_error`` at once, so the engine can release the others
instead of letting them wait for a peer that will never arrive.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, Callable, Sequence

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, ReplicaAborted, replica_error

__all__ = ["ReplicaThreads", "raise_first_failure"]

_STOP = object()
_live: "weakref.WeakSet[ReplicaThreads]" = weakref.WeakSet()


def _locked() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


class ReplicaThreads:
    """``n`` daemon threads that run one body per replica, in parallel."""

    def __init__(self, n: int, name: str = "replica"):
        self.n = n
        self._name = name
        self._go = [_locked() for _ in range(n)]
        self._done = _locked()
        self._lock = threading.Lock()
        self._body: Any = None
        self._on_error: Any = None
        self._results: list[Any] = [None] * n
        self._errors: list[tuple[int, BaseException]] = []
        self._remaining = 0
        self._threads: list[threading.Thread] = []
        self._generation = 0
        self.busy = False

    def _start(self) -> None:
        _live.add(self)
        for i in range(self.n):
            t = threading.Thread(target=self._loop, args=(i,), name=f"{self._name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, i: int) -> None:
        go, generation = self._go[i], self._generation
        while True:
            go.acquire()
            body = self._body
            if body is _STOP or generation != self._generation:
                return
            try:
                result = body(i)
            except BaseException as e:  # noqa: BLE001 - reported to the caller of run
                with self._lock:
                    if generation != self._generation:
                        return  # abandoned: a later run must not see this failure
                    self._errors.append((i, e))
                    on_error = self._on_error
                try:
                    on_error(i, e)
                except BaseException:  # noqa: BLE001
                    pass
                del e
            else:
                with self._lock:
                    if generation != self._generation:
                        return  # abandoned: a later run must not see this result
                    self._results[i] = result
            # Drop the body and result (and the strategy they refer to) before idling,
            # so an unused strategy can be collected and its finalizer stop these threads.
            body = result = None
            with self._lock:
                if generation != self._generation:
                    return  # abandoned while stuck; a new set of threads took over
                self._remaining -= 1
                last = self._remaining == 0
            if last:
                self._done.release()

    def run(self, body: Callable[[int], Any], on_error: Callable[[int, BaseException], None],
            failure_grace: float, names: Sequence[int] | None = None) -> list[Any]:
        """Runs ``body(i)`` on every thread; returns the results or raises the first failure.

        Once a replica has failed, the others get ``failure_grace`` seconds to
        notice and return; a replica stuck outside any collective after that is
        abandoned (its thread is replaced) rather than hanging the caller.
        """
        if self.busy:
            raise RuntimeError(
                "strategy.run was called while a run of the same strategy is in progress (from a "
                "replica function or merge_fn); call it from the main program only")
        if not self._threads:
            self._start()
        self.busy = True
        self._body, self._on_error = body, on_error
        self._results = [None] * self.n
        self._errors = []
        self._remaining = self.n
        try:
            for g in self._go:
                g.release()
            while not self._done.acquire(timeout=1.0):
                if self._errors and not self._done.acquire(timeout=failure_grace):
                    self._abandon()
                    break
                elif self._errors:
                    break
            errors = list(self._errors)
            results = self._results
        finally:
            self._body = self._on_error = None
            self.busy = False
        if errors:
            raise_first_failure(errors, names)
        return results

    def _abandon(self) -> None:
        """Leaves the current threads to finish on their own; the next run starts new ones."""
        with self._lock:
            self._generation += 1
        self._go = [_locked() for _ in range(self.n)]
        self._done = _locked()
        self._threads = []

    def close(self, join_timeout: float | None = None) -> None:
        """Stops the threads (idle ones at once; a busy run is left to finish).

        Called from the strategy's finalizer, which may run on one of these very
        threads, so joining is optional (interpreter exit joins briefly).
        """
        if self._threads and not self.busy:
            self._body = _STOP
            for g in self._go:
                g.release()
            if join_timeout is not None:
                me = threading.current_thread()
                for t in self._threads:
                    if t is not me:
                        t.join(join_timeout)
            self._threads = []


@atexit.register
def _close_all() -> None:
    # Stop idle replica threads before the interpreter (and torch's thread
    # pools) shut down underneath them.
    for threads in list(_live):
        threads.close(join_timeout=0.2)


def raise_first_failure(errors: list[tuple[int, BaseException]], names: Sequence[int] | None = None) -> None:
    """Raises what the user should see for a failed run.

    A replica's own exception wins over the ReplicaAborted of the replicas it
    released; collective-level failures (mismatch, timeout) that every replica
    saw are raised as they are, anything else as a ReplicaError that is also an
    instance of the original exception's type.
    """
    primary = [(i, e) for i, e in errors if not isinstance(e, ReplicaAborted)] or errors
    i, exc = primary[0]
    collective = [(j, e) for j, e in primary if isinstance(e, (CollectiveMismatchError, CollectiveTimeoutError))]
    if collective and len(collective) == len(primary):
        raise collective[0][1]
    raise replica_error(names[i] if names is not None else i, exc) from exc
