"""One call, any engine: run a replica function and get each replica's result.

``run_replicas(fn, *per_replica_args, engine=...)`` is the contract every engine
keeps: ``fn`` runs once per replica inside a replica context, replica ``i``
getting entry ``i`` of every per-replica argument, and the results come back as
a list in replica-id order. If a replica raised, its exception is raised here
(``strategy.run``'s ReplicaError, also an instance of the original type), so
``pytest.raises(ValueError)`` works the same on every engine.

* ``"threads"``: a ``cr.MirroredStrategy`` in this process, kept per
  (num_replicas, timeout) so its replica threads serve many calls.
* ``"processes"``: a persistent :class:`~crossreplica.testing.pool.WorkerPool`
  per layout and options (see that module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import crossreplica as cr
from crossreplica.testing.pool import (
    DEFAULT_TIMEOUT,
    Outcome,
    WorkerPool,
    check_per_replica_args,
    resolve_layout,
    run_pooled,
    shutdown_pools,
)
from crossreplica.testing.remote import WorkerPoolError, primary_exception

ENGINES: tuple[str, ...] = ("threads", "processes")

_strategies: dict[tuple[int, float], cr.MirroredStrategy] = {}


class _Box:
    """A per-replica result in a fresh object, so regroup always wraps it."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _run_threads(fn: Callable[..., Any], num_replicas: int, per_replica_args: Sequence[Sequence[Any]],
                 timeout_seconds: float) -> list[Any]:
    check_per_replica_args(num_replicas, per_replica_args)
    key = (num_replicas, float(timeout_seconds))
    strategy = _strategies.get(key)
    if strategy is None:
        strategy = _strategies[key] = cr.MirroredStrategy(num_replicas=num_replicas,
                                                          timeout_seconds=timeout_seconds)
    # Always PerReplica (also for one replica), so a None argument is not trimmed by run.
    args = tuple(cr.PerReplica(list(a)) for a in per_replica_args)
    result = strategy.run(lambda *a: _Box(fn(*a)), args=args)
    if num_replicas == 1:
        return [result.value]
    return [box.value for box in result.values]


def _num_replicas(num_replicas: int | None, per_replica_args: Sequence[Sequence[Any]]) -> int:
    if num_replicas is None:
        if not per_replica_args:
            raise ValueError("num_replicas is required when no per-replica argument gives it")
        num_replicas = len(per_replica_args[0])
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int; got {num_replicas!r}")
    return num_replicas


def run_replicas(fn: Callable[..., Any], *per_replica_args: Sequence[Any], num_replicas: int | None = None,
                 engine: str = "threads", replicas_per_worker: int | None = None,
                 timeout_seconds: float = DEFAULT_TIMEOUT, check_collectives: bool = False) -> list[Any]:
    """Per-replica results of ``fn`` on ``num_replicas`` replicas of ``engine``.

    Args:
        fn: the replica function; for ``"processes"``, a module-level function
            (workers import it by module and name) with picklable arguments and results.
        per_replica_args: sequences with one value per replica.
        num_replicas: defaults to the length of the first per-replica argument.
        engine: ``"threads"`` (in this process) or ``"processes"`` (worker processes).
        replicas_per_worker: processes only; default :func:`layout` (4 replicas -> 2x2).
        timeout_seconds: the collective timeout, so a hang fails fast.
        check_collectives: processes only: compare every call across workers
            (the threads engine always does).

    Raises:
        the replica's exception (see the module docstring); WorkerPoolError when a
        worker could not start, died without reporting or ran past its bound.
    """
    n = _num_replicas(num_replicas, per_replica_args)
    if engine == "threads":
        return _run_threads(fn, n, per_replica_args, timeout_seconds)
    if engine == "processes":
        return run_pooled(fn, n, per_replica_args, replicas_per_worker, timeout_seconds, check_collectives)
    raise ValueError(f"engine must be one of {list(ENGINES)}; got {engine!r}")


def launch(fn: Callable[..., Any], *per_replica_args: Sequence[Any], num_replicas: int | None = None,
           replicas_per_worker: int | None = None, mode: str = "replica",
           timeout_seconds: float = DEFAULT_TIMEOUT, check_collectives: bool = False) -> Outcome:
    """Runs one job on fresh worker processes and reports every worker's outcome; never
    raises for a worker's failure. For tests of failure behaviour: nothing kills the
    other workers when one fails, so each reports what it saw.

    ``mode="main"`` runs ``fn(strategy)`` once per worker (``num_replicas`` then counts
    all replicas: workers x replicas_per_worker)."""
    n = _num_replicas(num_replicas, per_replica_args)
    workers, rpw = resolve_layout(n, replicas_per_worker)
    with WorkerPool(workers, rpw, timeout_seconds=timeout_seconds, check_collectives=check_collectives) as pool:
        return pool.run(fn, *per_replica_args, mode=mode)


def run_workers(main: Callable[[Any], Any], num_workers: int, replicas_per_worker: int = 1, *,
                timeout_seconds: float = DEFAULT_TIMEOUT, check_collectives: bool = False) -> list[Any]:
    """Per-worker results of ``main(strategy)``, run once per worker in cross-replica context
    on fresh worker processes (it may leave its worker in any state)."""
    with WorkerPool(num_workers, replicas_per_worker, timeout_seconds=timeout_seconds,
                    check_collectives=check_collectives) as pool:
        out = pool.run(main, mode="main")
    if out.failures:
        raise primary_exception(out.failures)
    if not out.ok:
        raise WorkerPoolError(f"run_workers({main.__qualname__}): exit codes {out.exitcodes}, "
                              f"no answer from ranks {list(out.unanswered)}\n{out.log}")
    return [out.results[r] for r in range(num_workers)]


def shutdown() -> None:
    """Closes every persistent pool and forgets the in-process strategies (a test session's end)."""
    _strategies.clear()
    shutdown_pools()

