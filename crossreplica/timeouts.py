"""Timeout arguments: every wait in crossreplica has one, finite and bounded.

A timeout is a real number of seconds in ``(0, MAX_TIMEOUT]``. Infinity, NaN,
zero, negative values and values beyond a week are refused with a ValueError at
the API boundary (they used to be accepted and then fail every wait with an
OverflowError deep inside a lock or a datetime); a non-number is a TypeError.
There is deliberately no "wait forever": a replica that never arrives must
become an error, so pass a generous bound instead.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import summarize

__all__ = ["MAX_TIMEOUT", "canonical_timeout"]

#: The largest accepted timeout: one week, in seconds.
MAX_TIMEOUT = 7 * 24 * 3600.0


def canonical_timeout(value: Any, argname: str = "timeout_seconds") -> float:
    """``value`` as a float number of seconds in ``(0, MAX_TIMEOUT]``.

    Raises:
        TypeError: ``value`` is not a real number (a string, a bool, None).
        ValueError: ``value`` is not finite, not positive, or above MAX_TIMEOUT.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{argname} must be a positive number of seconds, at most {MAX_TIMEOUT:g} (one week); got "
            f"{type(value).__name__} {summarize(value)}")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT):
        raise ValueError(
            f"{argname} must be a positive number of seconds, at most {MAX_TIMEOUT:g} (one week); got "
            f"{summarize(value)}. Every wait has a timeout: for a very long one pass e.g. 86400")
    return seconds
