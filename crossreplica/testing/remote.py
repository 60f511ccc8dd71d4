"""Failures that cross a process boundary: captured in a worker, rebuilt in the parent.

A worker turns the exception its job raised into a :class:`WorkerFailure` (a
picklable record: the type's name and MRO, message, traceback, seconds since the
job started, and the exception itself pickled when it can be). The parent picks
the failure to raise with :func:`primary_exception`: a worker's own failure wins
over the workers it released (``ReplicaAborted``), then the lowest rank; it is
rebuilt with its original type (a ``ReplicaError`` that is also an instance of
the user's exception type, as ``strategy.run`` raises in-process), or becomes a
:class:`RemoteReplicaError` carrying the text when it cannot be unpickled here.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback

from crossreplica.errors import ReplicaError, replica_error


class WorkerPoolError(RuntimeError):
    """Worker processes could not start, one died without reporting, or a job ran past its bound."""


class RemoteReplicaError(RuntimeError):
    """A worker's exception that could not be rebuilt here: its type, message and traceback as text."""


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """What one worker reported when its job raised.

    Attributes:
        rank: the worker's rank.
        type_name: the exception's class name.
        type_names: the class names of its type's MRO, most derived first.
        message: ``str(exception)``.
        traceback: the formatted traceback, as text.
        elapsed: seconds from the start of the job to the failure.
        pickled: the exception, pickled (``None`` when it cannot be).
    """

    rank: int
    type_name: str
    type_names: tuple[str, ...]
    message: str
    traceback: str
    elapsed: float
    pickled: bytes | None = dataclasses.field(default=None, repr=False)

    def is_instance(self, name: str) -> bool:
        """Whether the exception's type is, or derives from, a class called ``name``."""
        return name in self.type_names

    def exception(self) -> BaseException:
        """The exception rebuilt with its original type, or a RemoteReplicaError with its text."""
        exc: BaseException | None = None
        if self.pickled is not None:
            try:
                kind, *rest = pickle.loads(self.pickled)
                exc = replica_error(rest[0], rest[1]) if kind == "replica" else rest[0]
            except Exception:  # noqa: BLE001 - its class or arguments do not exist here: the text instead
                exc = None
        if exc is None:
            exc = RemoteReplicaError(f"worker rank {self.rank} raised {self.type_name}: {self.message}\n"
                                     f"{self.traceback}")
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised in worker rank {self.rank}; its traceback:)\n{self.traceback}")
        return exc


def capture(exc: BaseException, rank: int, elapsed: float) -> WorkerFailure:
    """The record of ``exc``, raised in worker ``rank``; call inside its ``except`` block."""
    return WorkerFailure(rank=rank, type_name=type(exc).__name__,
                         type_names=tuple(c.__name__ for c in type(exc).__mro__), message=str(exc),
                         traceback=traceback.format_exc(), elapsed=elapsed, pickled=_pickled(exc))


def _pickled(exc: BaseException) -> bytes | None:
    # ReplicaError subclasses are made on the fly (replica_error), so they travel as their parts.
    try:
        if isinstance(exc, ReplicaError):
            return pickle.dumps(("replica", exc.replica_id, exc.original))
        return pickle.dumps(("plain", exc))
    except Exception:  # noqa: BLE001 - not picklable: the parent gets the text
        return None


def primary_exception(failures: dict[int, WorkerFailure]) -> BaseException:
    """The exception to raise for a failed job: the culprit over the workers it released."""
    if not failures:
        raise ValueError("failures must name at least one worker; got none")
    culprit = min(failures.values(), key=lambda f: (f.is_instance("ReplicaAborted"), f.rank))
    return culprit.exception()
