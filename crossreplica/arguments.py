"""Checks for numeric arguments, shared by every public entry point.

Each check validates once, at the boundary, and raises a ValueError that names
the argument, shows the value and says what was expected, as the rest of the
library's messages do.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any

from .errors import summarize

__all__ = ["NamedEnum", "check_address", "check_call", "check_int", "check_number"]


def _int_rule(low: int | None, high: int | None) -> str:
    if high is not None:
        return f"an int in [{0 if low is None else low}, {high})"
    if low == 1:
        return "a positive int"
    if low == 0:
        return "a non-negative int"
    return "an int" if low is None else f"an int >= {low}"


def check_int(value: Any, name: str, *, low: int | None = None, high: int | None = None,
              hint: str = "") -> int:
    """``value`` if it is an int (not a bool) with ``low <= value < high``.

    ``hint`` follows the rule in the message, e.g. ``" (0: automatic)"``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or (low is not None and int(value) < low) or (high is not None and int(value) >= high):
        raise ValueError(f"{name} must be {_int_rule(low, high)}{hint}; got {summarize(value)}")
    return int(value)


def check_number(value: Any, name: str, *, positive: bool = False, hint: str = "") -> float:
    """``value`` as a float if it is a finite real number (not a bool), and > 0 with
    ``positive`` (>= 0 otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or (value <= 0 if positive else value < 0):
        rule = "a positive number (finite)" if positive else "a finite number >= 0"
        raise ValueError(f"{name} must be {rule}{hint}; got {summarize(value)}")
    return float(value)


def check_address(text: str, name: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as a host and a port.

    Raises:
        ValueError: naming ``name``, the text and the expected form.
    """
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be HOST:PORT with a port in 1..65535, e.g. 'node0:29400'; got "
                         f"{summarize(text)}")
    return host, int(port)


def check_call(fn: Any, args: Any, kwargs: Any, call: str | None = None) -> None:
    """Checks a function and the arguments it will be called with: ``fn`` callable, ``args``
    a tuple or list, ``kwargs`` a dict or None; ``call`` shows how ``fn`` is called."""
    if not callable(fn):
        raise TypeError(f"fn must be callable{f' as {call}' if call else ''}; got {summarize(fn)}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments; got {summarize(args)}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None; got {summarize(kwargs)}")


class NamedEnum(enum.Enum):
    """An enum of crossreplica's public API whose arguments take a member or its name."""

    @classmethod
    def from_any(cls, value: Any, argname: str) -> Any:
        """The member for a member or its (case-insensitive) name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"{argname} must be a cr.{cls.__name__} ({', '.join(cls.__members__)}) or its name; "
                         f"got {summarize(value)}")
