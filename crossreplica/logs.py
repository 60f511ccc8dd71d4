"""Logging and warnings: the library's logger, the slow-collective threshold, warning categories.

Every module logs to ``logging.getLogger(__name__)``, a child of the
``"crossreplica"`` logger. That logger carries a ``logging.NullHandler``, so
nothing is printed unless the application configures logging
(``logging.basicConfig(level=logging.INFO)``, or a handler on
``logging.getLogger("crossreplica")``). What is logged at which level is listed
in docs/reliability.md ("Logging"). Invariant: the hot path formats nothing;
messages are built lazily (``%``-style arguments) or behind ``isEnabledFor``,
and the slow-collective warning costs a waiter nothing until it has waited
:func:`slow_seconds`.

Misuse that still works is reported with ``warnings.warn`` and one of the
categories shown here (all subclasses of :class:`CrossReplicaWarning`, a
``UserWarning``; defined in ``errors.py`` beside the exceptions, so that
``settings.py`` can warn too; :class:`PortingWarning`, which only the layers
above warn with, is defined here), so ``warnings.filterwarnings`` can silence or
escalate them.
"""

from __future__ import annotations

import logging

from . import settings
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, ConfigurationWarning, CrossReplicaWarning,
                     ReplicaAborted, ReplicasDivergeWarning, SharedModuleWarning, UnsyncedBuffersWarning)

__all__ = ["LOGGER_NAME", "SLOW_SECONDS_ENV", "ConfigurationWarning", "CrossReplicaWarning", "PortingWarning",
           "ReplicasDivergeWarning", "SharedModuleWarning", "UnsyncedBuffersWarning", "replica_failed", "report",
           "slow_seconds"]

#: The root of the library's loggers.
LOGGER_NAME = "crossreplica"
#: Seconds a collective may wait before a WARNING names the replicas it waits for.
SLOW_SECONDS_ENV = settings.SLOW_SECONDS
#: Without SLOW_SECONDS_ENV: a tenth of the collective timeout, at most this many seconds.
MAX_DEFAULT_SLOW_SECONDS = 10.0


class PortingWarning(CrossReplicaWarning):
    """Code written for another system's layout that crossreplica translated or suspects: a
    ``torch.nn.SyncBatchNorm`` that ``strategy.mirror`` made a ``cr.nn.SyncBatchNorm``, a global
    batch that looks like JAX ``pmap``'s stacked ``(replicas, per_replica_batch, ...)`` one."""


_root = logging.getLogger(LOGGER_NAME)
if not any(isinstance(h, logging.NullHandler) for h in _root.handlers):
    _root.addHandler(logging.NullHandler())


def slow_seconds(timeout: float) -> float:
    """The slow-collective threshold for a collective timeout of ``timeout`` seconds:
    env ``CROSSREPLICA_SLOW_SECONDS`` (a positive number of seconds, as a timeout), else
    ``min(timeout / 10, 10)``. A threshold at or above the timeout turns the warning off.

    Raises:
        ValueError: the variable is set to something other than a positive number.
    """
    configured = settings.slow_seconds()
    return min(timeout / 10.0, MAX_DEFAULT_SLOW_SECONDS) if configured is None else configured


def report(logger: logging.Logger, level: int, exc: BaseException, what: str = "") -> None:
    """Logs ``exc`` at ``level`` once: the same exception object passing through several
    layers (an engine, then the strategy) is logged by the first only."""
    if getattr(exc, "_crossreplica_logged", False) or not logger.isEnabledFor(level):
        return
    try:
        exc._crossreplica_logged = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__: may be logged twice
        pass
    # The message, not the exception: a kept record must not keep the failed run's frames alive.
    logger.log(level, "%s%s: %s", what, type(exc).__name__, str(exc))


def replica_failed(logger: logging.Logger, replica_id: int, exc: BaseException, where: str = "") -> None:
    """Logs that ``replica_id`` failed with ``exc`` and the others are released: WARNING for
    the replica's own exception (the run re-raises it as a ReplicaError); DEBUG for the
    consequences of another failure (released, a timeout or mismatch logged where found)."""
    if isinstance(exc, (ReplicaAborted, CollectiveTimeoutError, CollectiveMismatchError)):
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%sreplica %s stopped: %s: %s", where, replica_id, type(exc).__name__, str(exc))
        return
    if logger.isEnabledFor(logging.WARNING):  # str(exc), as in report
        logger.warning("%sreplica %s raised %s: %s; the other replicas are released", where, replica_id,
                       type(exc).__name__, str(exc))
