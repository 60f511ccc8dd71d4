"""The library's environment settings: every ``CROSSREPLICA_*`` variable, declared once.

Each variable has one entry in :data:`SETTINGS` (its rule, default and meaning;
docs/settings.md lists them). A value is read when it is used, not at import,
so ``import crossreplica`` never fails on a bad value; a bad one raises a
ValueError naming the variable, the value and the rule, checked by the same
functions as the constructor arguments (``timeouts.py``, ``arguments.py``).
Parsed values are cached by their raw text, so a changed environment takes
effect at the next use. An empty value is the same as an unset one. A
``CROSSREPLICA_*`` variable that no entry declares (a typo) gets one
ConfigurationWarning naming the closest known name.
"""

from __future__ import annotations

import difflib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from .arguments import check_address, check_int
from .errors import ConfigurationWarning
from .timeouts import MAX_TIMEOUT, canonical_timeout

__all__ = ["PREFIX", "SETTINGS", "Setting", "check_collectives", "describe", "get", "job_secret",
           "launch_id", "heartbeat_seconds", "parallel_bytes", "shared_memory", "shared_rows_members", "slow_seconds",
           "timeout"]

PREFIX = "CROSSREPLICA_"

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: how its text is read and what it means.

    ``kind`` is "seconds" (a timeout's rule: ``(0, one week]``), "int" (at least
    ``low``), "flag" (1/true/yes/on or 0/false/no/off, any case), "secret" (a
    string), "text" (a name: printable, without spaces), "address" (``HOST:PORT``) or
    "script" (read by scripts/setup.sh, not by the library).
    ``public`` is False for tuning knobs the test suite sets.
    """

    name: str
    kind: str
    default: Any
    meaning: str
    public: bool = True
    low: int | None = None

    @property
    def rule(self) -> str:
        """What a value must be, in words (as the error messages say it)."""
        if self.kind == "seconds":
            return f"a positive number of seconds, at most {MAX_TIMEOUT:g} (one week)"
        if self.kind == "int":
            return "a positive int" if self.low == 1 else f"an int >= {self.low}"
        if self.kind == "flag":
            return f"one of {list(_TRUE + _FALSE)} (any case)"
        if self.kind == "secret":
            return "a string of printable characters, without spaces at its ends, other than 'none'"
        if self.kind == "address":
            return "HOST:PORT with a port in 1..65535, e.g. 'node0:29400'"
        if self.kind == "text":
            return "printable characters without spaces"
        return "read by scripts/setup.sh"

    def parse(self, raw: str) -> Any:
        """The value ``raw`` (the variable's text, not empty) stands for.

        Raises:
            ValueError: ``raw`` breaks the rule; the message names the variable.
        """
        label = f"environment variable {self.name}"
        text = raw.strip()
        if self.kind == "seconds":
            try:
                seconds = float(text)
            except ValueError:  # not a number: the same message as for any other bad value
                raise ValueError(f"{label} must be {self.rule}; got {raw!r}") from None
            return canonical_timeout(seconds, label)
        if self.kind == "int":
            try:
                number: Any = int(text)
            except ValueError:
                number = raw
            return check_int(number, label, low=self.low)
        if self.kind == "flag" and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        if self.kind == "secret" and raw == text and raw.isprintable() and raw.lower() != "none":
            return raw
        if self.kind == "script":
            return raw
        if self.kind == "address":
            return check_address(raw, label)
        if self.kind == "text" and raw.isprintable() and not any(c.isspace() for c in raw):
            return raw
        secret = self.kind == "secret" and text.lower() != "none"
        shown = f"a value of {len(raw)} characters (not shown: a secret)" if secret else repr(raw)
        raise ValueError(f"{label} must be {self.rule}; got {shown}")


TIMEOUT = "CROSSREPLICA_TIMEOUT"
SLOW_SECONDS = "CROSSREPLICA_SLOW_SECONDS"
CHECK_COLLECTIVES = "CROSSREPLICA_CHECK_COLLECTIVES"
SHARED_MEMORY = "CROSSREPLICA_SHARED_MEMORY"
JOB_SECRET = "CROSSREPLICA_JOB_SECRET"
PARALLEL_BYTES = "CROSSREPLICA_PARALLEL_BYTES"
SHARED_ROWS_MEMBERS = "CROSSREPLICA_SHARED_ROWS_MEMBERS"
HEARTBEAT_SECONDS = "CROSSREPLICA_HEARTBEAT_SECONDS"
JOIN = "CROSSREPLICA_JOIN"
COORDINATOR = "CROSSREPLICA_COORDINATOR"
LAUNCH_ID = "CROSSREPLICA_LAUNCH_ID"

#: Every CROSSREPLICA_* variable, in the order docs/settings.md lists them.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting(TIMEOUT, "seconds", 300.0,
            "how long a collective waits for the other replicas (and workers) when a strategy "
            "is built without timeout_seconds"),
    Setting(SLOW_SECONDS, "seconds", None,
            "how long a collective waits before a WARNING names the replicas not arrived; "
            "unset: a tenth of the timeout, at most 10 s"),
    Setting(HEARTBEAT_SECONDS, "seconds", 2.0,
            "how long a worker's heartbeat may stop (it died, froze or lost its network) before the "
            "workers waiting for it in a collective fail naming it"),
    Setting(CHECK_COLLECTIVES, "flag", False,
            "MultiWorkerMirroredStrategy's check_collectives when the argument is not given"),
    Setting(SHARED_MEMORY, "flag", True,
            "same-host workers (one replica each) all-reduce floating point through /dev/shm"),
    Setting(JOB_SECRET, "secret", None,
            "a value shared by every worker of a job, from which the store's keys are derived; "
            "unset: torchrun's run id"),
    Setting(COORDINATOR, "address", None,
            "the job's coordinator (`crossreplica coordinator`), which serves the job's store to the workers "
            "that know CROSSREPLICA_JOB_SECRET; `crossreplica launch` sets it; unset: the store of MASTER_ADDR:"
            "MASTER_PORT (rank 0's or torchrun's agent's, without authentication)"),
    Setting(JOIN, "flag", False,
            "this worker joins a running fault-tolerant job (cr.FaultTolerance) at a step boundary "
            "instead of starting one; `crossreplica launch --max-restarts` sets it on a restarted worker"),
    Setting(LAUNCH_ID, "text", None,
            "which worker process of its launcher this is (`crossreplica launch` sets it on a worker it starts "
            "again): a joining worker records its identity under it, so the launcher can tell whether the job "
            "went on without that worker", public=False),
    Setting(PARALLEL_BYTES, "int", 2 * 1024 * 1024,
            "bytes per replica from which the threads engine shares a collective's work out to "
            "every replica thread", public=False, low=1),
    Setting(SHARED_ROWS_MEMBERS, "int", 8,
            "group size from which the threads engine writes a small all-reduce's outputs into "
            "rows of one buffer", public=False, low=2),
    Setting("CROSSREPLICA_TORCH", "script", None,
            "the torch requirement scripts/setup.sh installs (default torch==2.13.0)"),
    Setting("CROSSREPLICA_TORCH_INDEX", "script", None,
            "the package index scripts/setup.sh installs torch from"),
)}

_cache: dict[str, tuple[str, Any]] = {}  # name -> (raw text, parsed value)
_warned: set[str] = set()
_lock = threading.Lock()


def _warn_unknown() -> None:
    """One ConfigurationWarning per CROSSREPLICA_* variable that no entry declares."""
    unknown = [k for k in os.environ if k.startswith(PREFIX) and k not in SETTINGS and k not in _warned]
    if not unknown:
        return
    with _lock:
        unknown = [k for k in unknown if k not in _warned]
        _warned.update(unknown)
    for name in sorted(unknown):
        # Compared without the prefix every name shares, so only a near miss is suggested.
        close = difflib.get_close_matches(name[len(PREFIX):], [k[len(PREFIX):] for k in SETTINGS], n=1)
        hint = f"did you mean {PREFIX}{close[0]}?" if close else f"the known ones are {list(SETTINGS)}"
        warnings.warn(f"environment variable {name} is not a crossreplica setting and is ignored; {hint}",
                      ConfigurationWarning, stacklevel=4)


def get(name: str) -> Any:
    """The value of setting ``name`` now: the environment's, validated, or the default.

    Raises:
        ValueError: the variable is set to a value its rule refuses.
    """
    setting = SETTINGS[name]
    _warn_unknown()
    raw = os.environ.get(name, "")
    if not raw.strip():
        return setting.default
    cached = _cache.get(name)
    if cached is not None and cached[0] == raw:
        return cached[1]
    value = setting.parse(raw)
    _cache[name] = (raw, value)
    return value


def timeout() -> float:
    """The default collective timeout in seconds (``CROSSREPLICA_TIMEOUT``, 300)."""
    return float(get(TIMEOUT))


def slow_seconds() -> float | None:
    """The slow-collective threshold set by ``CROSSREPLICA_SLOW_SECONDS``; None when unset."""
    value = get(SLOW_SECONDS)
    return None if value is None else float(value)


def heartbeat_seconds() -> float:
    """How long a worker's heartbeat may stop before the workers waiting for it fail."""
    return float(get(HEARTBEAT_SECONDS))


def check_collectives() -> bool:
    """Whether collectives are compared across workers by default (``CROSSREPLICA_CHECK_COLLECTIVES``)."""
    return bool(get(CHECK_COLLECTIVES))


def shared_memory() -> bool:
    """Whether same-host workers may all-reduce through shared memory (``CROSSREPLICA_SHARED_MEMORY``)."""
    return bool(get(SHARED_MEMORY))


def join() -> bool:
    """Whether this worker joins a running fault-tolerant job (``CROSSREPLICA_JOIN``)."""
    return bool(get(JOIN))


def launch_id() -> str | None:
    """Which worker process of its launcher this is (``CROSSREPLICA_LAUNCH_ID``); None when unset."""
    value = get(LAUNCH_ID)
    return None if value is None else str(value)


def job_secret() -> str | None:
    """The job secret (``CROSSREPLICA_JOB_SECRET``); None when unset."""
    value = get(JOB_SECRET)
    return None if value is None else str(value)


def parallel_bytes() -> int:
    """Bytes per replica from which the threads engine runs a collective on every thread."""
    return int(get(PARALLEL_BYTES))


def shared_rows_members() -> int:
    """Group size from which the threads engine's small all-reduce outputs share one buffer."""
    return int(get(SHARED_ROWS_MEMBERS))


def describe() -> str:
    """Every setting the library reads, one line each: its value now and where it comes from
    (for a bug report). A bad value is shown with its error instead of raising."""
    lines = []
    for s in SETTINGS.values():
        if s.kind == "script":
            continue
        raw = os.environ.get(s.name, "")
        if not raw.strip():
            lines.append(f"{s.name} = {s.default!r} (default)")
            continue
        try:
            value = get(s.name)
        except ValueError as e:
            lines.append(f"{s.name}: invalid: {e}")
            continue
        shown = "<set>" if s.kind == "secret" else repr(value)
        lines.append(f"{s.name} = {shown} (environment)")
    return "\n".join(lines)
