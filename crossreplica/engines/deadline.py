"""The bounds every collective wait shares: a deadline, and one slow warning on the way.

The in-process rendezvous (a lock per waiter), the asynchronous rounds (a
condition shared with the work they help with) and the cross-process watchdog
(sliced backend waits and store polls) block in different ways; what they wait
*for* is the same: until the deadline, warning once when the wait is slow
(:func:`~crossreplica.logs.slow_seconds`). Each asks its :class:`Deadline`
how long it may block next, whether the slow mark has just passed and whether
time is up, so the three cannot drift apart again.
"""

from __future__ import annotations

import math
import time

from ..logs import slow_seconds

__all__ = ["Deadline"]


class Deadline:
    """A wait that ends ``timeout`` seconds from now, and turns slow ``slow`` seconds in
    (default :func:`~crossreplica.logs.slow_seconds`; never when that is past the end)."""

    __slots__ = ("timeout", "started", "end", "warned", "_slow_at")

    def __init__(self, timeout: float, slow: float | None = None):
        self.timeout = timeout
        self.started = time.monotonic()
        self.end = self.started + timeout
        slow = slow_seconds(timeout) if slow is None else slow
        self._slow_at = self.started + slow if slow < timeout else math.inf
        #: whether :meth:`turned_slow` has said so (the wait then reports its completion)
        self.warned = False

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
