"""The bounds every collective wait shares: a deadline, and one slow warning on the way.

The in-process rendezvous (a lock per waiter), the asynchronous rounds (a
condition shared with the work they help with) and the cross-process watchdog
(sliced backend waits and store polls) block in different ways; what they wait
*for* is the same: until the deadline, warning once when the wait is slow
(:func:`~crossreplica.logs.slow_seconds`). Each asks its :class:`Deadline`
how long it may block next, whether the slow mark has just passed and whether
time is up, so the three cannot drift apart again.

The package's other waits (a store poll, a shared-memory round, a join of
threads, a test pool's replies) keep theirs here too: a polling loop pauses
with :meth:`Deadline.sleep` (a fixed pause) or :meth:`Deadline.back_off` (a
pause that doubles up to a cap), never past the deadline, so no loop computes
a deadline or doubles a pause on its own.
"""

from __future__ import annotations

import math
import os
import time

from ..logs import slow_seconds

__all__ = ["Deadline"]


class Deadline:
    """A wait that ends ``timeout`` seconds from now, and turns slow ``slow`` seconds in
    (default :func:`~crossreplica.logs.slow_seconds`; never when that is past the end)."""

    __slots__ = ("timeout", "started", "end", "warned", "_slow_at", "_pause")

    def __init__(self, timeout: float, slow: float | None = None):
        self.timeout = timeout
        self.started = time.monotonic()
        self.end = self.started + timeout
        slow = slow_seconds(timeout) if slow is None else slow
        self._slow_at = self.started + slow if slow < timeout else math.inf
        #: whether :meth:`turned_slow` has said so (the wait then reports its completion)
        self.warned = False
        self._pause = 0.0  # the next pause of back_off (0: its first)

    @property
    def waited(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.started

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.end

    def turned_slow(self) -> bool:
        """True once: the first time it is asked after the slow mark (warn then)."""
        if time.monotonic() < self._slow_at:
            return False
        self._slow_at = math.inf
        self.warned = True
        return True

    def next_block(self, cap: float = math.inf) -> float:
        """How long to block before something is due: the slow mark, the deadline, or
        ``cap`` seconds, whichever comes first; at least a millisecond."""
        now = time.monotonic()
        return max(min(self.end - now, self._slow_at - now, cap), 1e-3)

    @property
    def left(self) -> float:
        """Seconds until the deadline; 0 once it has passed."""
        return max(self.end - time.monotonic(), 0.0)

    def sleep(self, seconds: float) -> None:
        """Sleeps ``seconds`` (a polling wait's fixed pause), never past the deadline."""
        time.sleep(max(min(seconds, self.end - time.monotonic()), 0.0))

    def back_off(self, first: float, most: float, spin: float = 0.0) -> None:
        """One pause of a polling wait that backs off: ``first`` seconds the first time, then
        twice the last pause, up to ``most``; never past the deadline. Within the first
        ``spin`` seconds of the wait it yields the core instead (``os.sched_yield``: a peer
        due any moment is seen at once, and a runnable one gets the core). The pauses are
        the wait's: waits that share this Deadline go on from where the last one left off."""
        now = time.monotonic()
        if now - self.started < spin:
            os.sched_yield()
            return
        pause = self._pause or first
        self._pause = min(2 * pause, most)
        time.sleep(max(min(pause, self.end - now), 0.0))
