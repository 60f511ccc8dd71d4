"""Where in-process replicas meet; one barrier with a leader and a sticky error.

Every collective, merge_call and phase barrier of the local replicas is one
round of :meth:`Rendezvous.exchange`. Each participant deposits its call and
payload; the last to arrive becomes the leader, runs ``leader_fn`` on every
deposit, and wakes the others, who read the leader's result. A participant
waits on a lock of its own (the cheapest wake-up CPython offers), always with
a timeout. The wake-up is a chain: the leader wakes one participant and each
woken one the next, so the threads do not all contend for the GIL at once
(BENCHMARKS.md, "Latency at 64 replicas").

Failures are sticky until the next run: a timeout, a mismatch between
replicas, a replica that returned while others wait, or an abort after a
replica raised wakes every waiter with the error, and any later arrival
raises it at once. No round can hang.

A waiter first waits ``slow`` seconds (:func:`~crossreplica.logs.slow_seconds`),
then logs one WARNING per round naming the replicas not yet arrived, then waits
for the rest of the timeout: the fast path is the same single timed wait. A
timeout or a mismatch is logged once, at ERROR, by the replica that found it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, ReplicaAborted
from ..logs import report, slow_seconds
from .base import Kind
from .deadline import Deadline

__all__ = ["Rendezvous"]

_log = logging.getLogger(__name__)


def _locked() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


class _Failure:
    __slots__ = ("make",)

    def __init__(self, make: Callable[[], BaseException]):
        self.make = make

    @staticmethod
    def of(exc: BaseException) -> _Failure:
        """A failure that raises ``exc`` itself."""
        return _Failure(lambda: exc)


class Rendezvous:
    """A reusable meeting point for ``n`` participants (local replica indices)."""

    def __init__(self, n: int, timeout: float, names: Sequence[int] | None = None,
                 slow: float | None = None):
        self.n = n
        self.timeout = timeout
        self.names = tuple(names) if names is not None else tuple(range(n))
        #: seconds a participant waits before a WARNING names the ones not yet arrived
        self.slow = slow_seconds(timeout) if slow is None else slow
        self._lock = threading.Lock()
        #: called (lock held) when the sticky error is set or a participant returns, so
        #: that waits outside the rounds (``async_rounds.py``) notice
        self.listeners: list[Callable[[], None]] = []
        self._fresh()

    def _fresh(self) -> None:
        n = self.n
        self._wake = [_locked() for _ in range(n)]
        self._calls: list[Any] = [None] * n
        self._payloads: list[Any] = [None] * n
        self._outcome: list[Any] = [None] * n
        self._next = [-1] * n  # whom a woken participant wakes in turn (-1: nobody)
        self._arrived = 0
        self._round = 0
        self._finished = [False] * n
        self._num_finished = 0
        self._error: _Failure | None = None
        self._slow_round = -1  # the last round a slow warning was logged for

    def begin_run(self) -> None:
        """Re-arms for a new run (every participant has left the previous one)."""
        with self._lock:
            self._fresh()

    # ------------------------------------------------------------------ rounds

    def exchange(self, i: int, call: Any, payload: Any,
                 leader_fn: Callable[[list, list], Any] | None,
                 timeout: float | None = None) -> Any:
        """Deposits ``(call, payload)`` as participant ``i``; returns the leader's result."""
        with self._lock:
            if self._error is not None:
                raise self._error.make()
            if self._num_finished:
                self._calls[i] = call
                raise self._fail_finished([j for j in range(self.n) if self._finished[j]]).make()
            self._calls[i] = call
            self._payloads[i] = payload
            self._arrived += 1
            leader = self._arrived == self.n
            if leader:
                calls, payloads = self._calls, self._payloads
                self._calls, self._payloads = [None] * self.n, [None] * self.n
                self._arrived = 0
                self._round += 1
        if leader:
            try:
                result = leader_fn(calls, payloads) if leader_fn is not None else None
            except CollectiveMismatchError as e:
                message = str(e)
                report(_log, logging.ERROR, e)
                with self._lock:
                    self._error = _Failure(lambda: CollectiveMismatchError(message))
                result = _Failure(lambda: CollectiveMismatchError(message))
            except BaseException as e:  # noqa: BLE001 - handed to every participant
                result = _Failure.of(e)
            # A chain: the leader wakes one participant, each woken one the next, so
            # that the woken threads do not all contend for the GIL at once.
            waiters = [j for j in range(self.n) if j != i]
            for j, k in zip(waiters, waiters[1:]):
                self._outcome[j] = result
                self._next[j] = k
            if waiters:
                self._outcome[waiters[-1]] = result
                self._wake[waiters[0]].release()
            if isinstance(result, _Failure):
                raise result.make()
            return result
        return self._wait(i, call, self.timeout if timeout is None else timeout)

    def _wait(self, i: int, call: Any, timeout: float) -> Any:
        wait = Deadline(timeout, self.slow)
        reported = False
        while not self._wake[i].acquire(timeout=wait.next_block()):
            if wait.expired():
                self._timed_out(i, call, timeout)  # raises, unless the round completed just now
                break
            if wait.turned_slow():
                reported = self._warn_slow(i, call, wait.waited, timeout)
        if reported:
            self._pass_on(i)
            if _log.isEnabledFor(logging.INFO):
                _log.info("collective %s on replica %s completed after %.3gs", _describe(call),
                          self.names[i], wait.waited)
        return self._outcome_of(i)

    def _warn_slow(self, i: int, call: Any, waited: float, timeout: float) -> bool:
        """Logs (once per round) which participants a round still waits for; whether it did."""
        with self._lock:
            if self._calls[i] is not call or self._slow_round == self._round:
                return False  # the round was taken by its leader, or another waiter reported it
            self._slow_round = self._round
            missing = [self.names[j] for j in range(self.n) if self._calls[j] is None and not self._finished[j]]
            arrived = [self.names[j] for j in range(self.n) if self._calls[j] is not None]
        _log.warning("collective %s has waited %.3gs: replicas %s have not arrived yet (replicas %s are "
                     "waiting); it fails after %gs", _describe(call), waited, missing, arrived, timeout)
        return True

    def _timed_out(self, i: int, call: Any, timeout: float) -> None:
        """Raises the timeout, unless the round completed as the wait ended (then the
        wake-up is due, and taken here)."""
        with self._lock:
            if self._calls[i] is call:  # still waiting: this round cannot complete
                missing = [self.names[j] for j in range(self.n)
                           if self._calls[j] is None and not self._finished[j]]
                message = (f"collective {_describe(call)} timed out after {timeout:g}s: replicas "
                           f"{missing} never arrived (replicas "
                           f"{[self.names[j] for j in range(self.n) if self._calls[j] is not None]} "
                           f"were waiting)")
                failure = self._set_error(_Failure(
                    lambda: CollectiveTimeoutError(message, tuple(missing))), skip=i, log=message)
                self._calls[i] = None
                raise failure.make()
        self._wake[i].acquire()  # the round completed as we timed out: the wake-up is due

    def _pass_on(self, i: int) -> None:
        """Woken participant ``i`` wakes the next one of its round's chain."""
        nxt = self._next[i]
        if nxt >= 0:
            self._next[i] = -1
            self._wake[nxt].release()

    def _outcome_of(self, i: int) -> Any:
        self._pass_on(i)
        outcome = self._outcome[i]
        self._outcome[i] = None
        if isinstance(outcome, _Failure):
            raise outcome.make()
        return outcome

    # ---------------------------------------------------------------- failures

    def failure(self) -> BaseException | None:
        """The sticky error of this run, as the exception to raise; None while there is none."""
        error = self._error
        return None if error is None else error.make()

    def has_finished(self, i: int) -> bool:
        """Whether participant ``i`` returned from its replica function in this run."""
        return self._finished[i]

    def fail(self, exc: BaseException) -> None:
        """Makes ``exc`` the sticky error (unless there is one) and releases every waiter."""
        with self._lock:
            self._set_error(_Failure.of(exc))

    def _set_error(self, failure: _Failure, skip: int = -1, log: str | None = None) -> _Failure:
        """Makes ``failure`` sticky (unless an earlier one is) and wakes every waiting
        participant (lock held); returns the sticky failure. ``log``: logged at ERROR
        when this failure is the first."""
        if self._error is None:
            self._error = failure
            if log is not None:
                _log.error("%s", log)
        for j in range(self.n):
            if j != skip and self._calls[j] is not None:
                self._calls[j] = None
                self._outcome[j] = self._error
                self._wake[j].release()
        self._arrived = 0
        self._payloads = [None] * self.n  # the failed round's tensors are not kept until the next run
        for listener in self.listeners:
            listener()
        return self._error

    def _fail_finished(self, done: list[int]) -> _Failure:
        waiting = [j for j in range(self.n) if self._calls[j] is not None]
        lines = [f"  replica {self.names[j]}: "
                 + (self._calls[j].describe() if hasattr(self._calls[j], "describe") else str(self._calls[j]))
                 for j in waiting]
        lines += [f"  replica {self.names[j]}: <returned from the replica function>" for j in done]
        merge = any(getattr(self._calls[j], "kind", None) is Kind.MERGE_CALL for j in waiting)
        head = ("replicas made a different number of merge_call() calls" if merge else
                "replicas made different collective calls")
        message = (f"{head} (call #{self._round + 1} of this run): some replicas returned from the "
                   f"replica function while others wait:\n" + "\n".join(lines))
        return self._set_error(_Failure(lambda: CollectiveMismatchError(message)), log=message)

    def finish(self, i: int) -> None:
        """Participant ``i`` returned from its replica function."""
        with self._lock:
            if not self._finished[i]:
                self._finished[i] = True
                self._num_finished += 1
            if self._error is None and self._arrived:
                self._fail_finished([j for j in range(self.n) if self._finished[j]])
            for listener in self.listeners:
                listener()

    def abort(self, i: int, exc: BaseException) -> None:
        """Participant ``i`` failed with ``exc``: release everyone, now and later."""
        message = (f"replica {self.names[i]} failed with {type(exc).__name__}: {exc}; "
                   f"the other replicas were released")
        with self._lock:
            self._calls[i] = None
            self._set_error(_Failure(lambda: ReplicaAborted(message)))


def _describe(call: Any) -> str:
    return call.describe() if hasattr(call, "describe") else str(call)
