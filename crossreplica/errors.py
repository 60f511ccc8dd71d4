"""Exceptions raised by crossreplica.

Every error a user can trigger derives from :class:`CrossReplicaError`, so
``except cr.errors.CrossReplicaError`` catches all of them; each also derives
from the builtin its meaning matches (RuntimeError, TimeoutError) so generic
handlers keep working.

The warning categories live here too (``cr.logs`` shows them, and documents
them): misuse that still works is a ``warnings.warn`` with one of them.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "summarize",
    "CheckpointError",
    "CrossReplicaError",
    "ReplicaContextError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "WorkerFailedError",
    "FencedOutError",
    "ReplicaError",
    "CrossReplicaWarning",
    "SharedModuleWarning",
    "ReplicasDivergeWarning",
    "UnsyncedBuffersWarning",
    "ConfigurationWarning",
]


_SUMMARY = reprlib.Repr()
_SUMMARY.maxlevel = 3
_SUMMARY.maxlist = _SUMMARY.maxtuple = _SUMMARY.maxset = _SUMMARY.maxfrozenset = 8
_SUMMARY.maxdeque = _SUMMARY.maxarray = 8
_SUMMARY.maxdict = 6
_SUMMARY.maxstring = _SUMMARY.maxother = 80
_SUMMARY.maxlong = 40


def summarize(value: Any, limit: int = 200) -> str:
    """A repr of ``value`` for an error message: at most ``limit`` characters.

    Long sequences show their first items and their length, so a message about
    a million-entry argument stays short and quick to build.
    """
    try:
        text = _SUMMARY.repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} object>"
    try:
        n = len(value) if not isinstance(value, (str, bytes)) else None
    except Exception:  # noqa: BLE001 - no length
        n = None
    if n is not None and n > _SUMMARY.maxlist:
        text = f"{text} ({n} items)"
    if len(text) > limit:
        text = text[:max(limit - 3, 0)] + "..."
    return text


class CrossReplicaError(RuntimeError):
    """Base class of crossreplica's runtime errors."""


class CheckpointError(CrossReplicaError, ValueError):
    """A checkpoint file cannot be read: missing pieces, truncated, corrupted, or not
    written by ``cr.save``. The message names the path and what is wrong."""


class ReplicaContextError(CrossReplicaError):
    """A replica-only API was called outside a replica function (or the reverse)."""


class CollectiveMismatchError(CrossReplicaError):
    """Replicas disagree on a collective: op, shape, dtype, group or call order.

    The message lists each replica's call so the diverging one is visible.
    """


class CollectiveTimeoutError(CrossReplicaError, TimeoutError):
    """Some replicas never arrived at a collective within the timeout.

    Attributes:
        missing: the replica ids (or ranks) that did not arrive, when known.
    """

    def __init__(self, message: str, missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.missing = tuple(missing)


class FencedOutError(CrossReplicaError):
    """This worker was left out of a fault-tolerant job's new membership (it was judged lost)."""


class WorkerFailedError(CollectiveTimeoutError):
    """Another worker of a multi-worker job is gone (it died, froze or was cut off: its
    heartbeat stopped, or the connection to it broke during a collective), so its replicas
    will never arrive (``missing`` holds their ids, when known); or this worker cannot reach
    the job's store, or a member of a fault-tolerant job failed in a way no regrouping
    mends. ``cr.FaultTolerance`` goes on without a lost worker."""


class ReplicaError(CrossReplicaError):
    """A replica function raised; the other replicas were released.

    Attributes:
        replica_id: the replica whose function raised first.
        original: the exception it raised (also ``__cause__``).
    """

    def __init__(self, replica_id: int, original: BaseException):
        super().__init__(
            f"replica {replica_id} raised {type(original).__name__}: {original}")
        self.replica_id = replica_id
        self.original = original
        self.__cause__ = original


_wrapped_types: dict[type, type] = {}


def replica_error(replica_id: int, original: BaseException) -> ReplicaError:
    """A ReplicaError that is also an instance of ``type(original)``.

    So ``except ValueError`` still catches a replica's ValueError raised through
    ``strategy.run``, while ``except cr.errors.ReplicaError`` sees which replica.
    """
    cls = type(original)
    if isinstance(original, ReplicaError) or not isinstance(original, Exception):
        return ReplicaError(replica_id, original)
    wrapped = _wrapped_types.get(cls)
    if wrapped is None:
        try:
            wrapped = type(f"ReplicaError[{cls.__name__}]", (ReplicaError, cls),
                           {"__init__": ReplicaError.__init__, "__str__": Exception.__str__,
                            "__module__": __name__})
        except TypeError:  # layout conflict (e.g. OSError): plain ReplicaError
            wrapped = ReplicaError
        _wrapped_types[cls] = wrapped
    try:
        return wrapped(replica_id, original)
    except Exception:
        return ReplicaError(replica_id, original)


class ReplicaAborted(CrossReplicaError):
    """Raised in the replicas released because another replica failed (internal)."""


class CrossReplicaWarning(UserWarning):
    """Base of the warnings crossreplica issues for code that runs but is probably wrong."""


class SharedModuleWarning(CrossReplicaWarning):
    """Several replicas of one process were handed the same module with trainable
    parameters (they would race on its gradients); ``strategy.mirror`` it instead."""


class ReplicasDivergeWarning(CrossReplicaWarning):
    """The replicas take different steps where they should take the same one: a plain
    torch optimizer stepping without a cross-replica reduction, gradients edited before
    CrossShardOptimizer reduces them, or mirrored copies that differ at ``cr.save``
    (``optim/guards.py``)."""


class UnsyncedBuffersWarning(CrossReplicaWarning, RuntimeWarning):
    """The mirrored copies of a module mirrored with ``sync_buffers=None`` hold different
    buffers after a run (``strategies/buffers.py``)."""


class ConfigurationWarning(CrossReplicaWarning):
    """A setting that is not what it looks like: an unknown ``CROSSREPLICA_*`` variable
    (a typo), an argument that an existing set-up overrides, or a set-up that works but
    is unsafe."""
