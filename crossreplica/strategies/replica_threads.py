"""Persistent replica threads: created once per strategy, reused by every run.

A run hands each thread the same body; each thread waits on a lock of its own
for work, and the last thread to finish wakes the caller. A replica that
raises calls ``on_error`` at once, so the engine can release the others
instead of letting them wait for a peer that will never arrive.

Lifetime (what keeps exit clean and failures leak-free):

* nothing outlives a run: the results and errors are handed to the caller and
  dropped here, and a failed replica's traceback frames are cleared in its own
  thread, so neither its tensors nor the strategy stay reachable from threads
  that live on;
* every thread told to stop is joined, with a bounded wait, by whoever stopped
  it (a closed strategy, an abandoned run's replacement) and at the latest by
  an ``atexit`` hook. A daemon thread that still runs when the interpreter
  finalizes is killed where it stands; inside libtorch that is
  ``std::terminate`` (exit code 134), so no replica thread may be left awake.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from typing import Any, NoReturn
from collections.abc import Callable, Sequence

from .openmp_pool import quiet_caller_threads
from ..errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ReplicaAborted,
    replica_error,
)
from ..engines.deadline import Deadline

__all__ = ["ReplicaThreads", "raise_first_failure"]

_log = logging.getLogger(__name__)
_STOP = object()
_live: "weakref.WeakSet[ReplicaThreads]" = weakref.WeakSet()
# Threads told to stop (closed, or left behind by an abandoned run) that were not
# seen to end yet; interpreter exit joins them (bounded) before finalizing.
_stopping: set[threading.Thread] = set()
_stopping_lock = threading.Lock()

#: A run at least this long (the last one's time) starts by quieting the caller's OpenMP
#: workers (openmp_pool.py): their spinning would take a core for its whole length.
QUIET_AFTER = 1e-3
#: How long closing a strategy waits for its idle threads to end (they end at once
#: unless the machine is overloaded).
JOIN_TIMEOUT = 5.0
#: How long interpreter exit waits, in all, for replica threads that are still busy
#: (replicas of an abandoned run stuck in user code).
EXIT_JOIN_TIMEOUT = 5.0


def _join(threads: Sequence[threading.Thread], timeout: float) -> None:
    """Joins ``threads`` (except the calling one) within ``timeout`` seconds in all."""
    wait = Deadline(timeout, math.inf)
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join(wait.left)
    with _stopping_lock:
        _stopping.difference_update([t for t in threads if not t.is_alive()])


def _stop(threads: Sequence[threading.Thread]) -> None:
    with _stopping_lock:
        _stopping.update(threads)


def _clear_frames(exc: BaseException) -> None:
    """Drops the locals of the finished frames ``exc`` passed through (and of its cause
    and context), so a stored failure does not keep the replica's tensors, its
    arguments or the strategy alive. File names and line numbers stay."""
    seen: set[int] = set()
    e: BaseException | None = exc
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or len(seen) > 100:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            try:
                tb.tb_frame.clear()
            except RuntimeError:  # still executing (this thread's loop): keep it
                pass
            tb = tb.tb_next
        todo.append(e.__cause__)  # type: ignore[arg-type]
        todo.append(e.__context__)  # type: ignore[arg-type]


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
        self._results: list[Any] | None = None
        self._errors: list[tuple[int, BaseException]] = []
        self._remaining = 0
        self._threads: list[threading.Thread] = []
        self._generation = 0
        self._last_seconds = 0.0  # how long the last run took
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
                    on_error = self._on_error
                try:
                    on_error(i, e)  # release the other replicas first
                except BaseException:  # noqa: BLE001
                    pass
                on_error = None
                # The failure is kept until run raises it (and by the user after):
                # without its frames' locals, so it holds no tensors and no strategy.
                _clear_frames(e)
                with self._lock:
                    if generation != self._generation:
                        return
                    self._errors.append((i, e))
            else:
                with self._lock:
                    if generation != self._generation:
                        return  # abandoned: a later run must not see this result
                    self._results[i] = result  # type: ignore[index]
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
        results: list[Any] = [None] * self.n
        errors: list[tuple[int, BaseException]] = []  # (replica, exception), in the order they failed
        self._results, self._errors = results, errors
        self._remaining = self.n
        try:
            if self._last_seconds >= QUIET_AFTER:  # see openmp_pool.py: worth it for long runs only
                quiet_caller_threads()
            started = time.perf_counter()
            for g in self._go:
                g.release()
            while not self._done.acquire(timeout=1.0):
                if self._errors and not self._done.acquire(timeout=failure_grace):
                    _log.warning("%d of %d replica threads were still busy outside any collective %gs after "
                                 "replica %s failed; they are abandoned and new threads serve the next run",
                                 self._remaining, self.n, failure_grace,
                                 (names or range(self.n))[self._errors[0][0]])
                    self._abandon()
                    break
                elif self._errors:
                    break
            errors = list(errors)
            self._last_seconds = time.perf_counter() - started
        finally:
            # Nothing of the run stays here: results and errors belong to the caller.
            self._body = self._on_error = self._results = None
            self._errors = []
            self.busy = False
        if errors:
            del results  # the failed run's results are not kept alive by this frame
            raise_first_failure(errors, names)
        return results

    def _abandon(self) -> None:
        """Leaves the current threads to finish on their own; the next run starts new ones.

        The idle ones are woken and end at once (they see the new generation); a
        replica still stuck in user code ends when it returns. Both are joined at
        the latest at interpreter exit.
        """
        with self._lock:
            self._generation += 1
        old_go, old_threads = self._go, self._threads
        self._go = [_locked() for _ in range(self.n)]
        self._done = _locked()
        self._threads = []
        _stop(old_threads)
        for g in old_go:
            try:
                g.release()
            except RuntimeError:  # not taken yet: its thread will see the new generation
                pass

    def close(self, join_timeout: float = JOIN_TIMEOUT) -> None:
        """Stops the idle threads and waits up to ``join_timeout`` seconds for them to end.

        A busy run is left to finish. Called from the strategy's finalizer, which
        may run on one of these very threads: then nobody is joined here (the
        others end at once; interpreter exit joins them if need be).
        """
        if not self._threads or self.busy:
            return
        threads, self._threads = self._threads, []
        self._body = _STOP
        _stop(threads)
        old_go, self._go = self._go, [_locked() for _ in range(self.n)]
        for g in old_go:
            try:
                g.release()
            except RuntimeError:  # not taken yet: its thread will find _STOP
                pass
        if threading.current_thread() not in threads:
            _join(threads, join_timeout)


@atexit.register
def _close_all() -> None:
    # Every replica thread must have ended before the interpreter (and torch's
    # thread pools) finalize: one that wakes up during finalization dies where
    # it stands, which inside libtorch is std::terminate (exit code 134).
    for threads in list(_live):
        threads.close(join_timeout=0.0)  # tell every one to stop, then join them together
    with _stopping_lock:
        pending = list(_stopping)
    _join(pending, EXIT_JOIN_TIMEOUT)


def raise_first_failure(errors: list[tuple[int, BaseException]], names: Sequence[int] | None = None) -> NoReturn:
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
