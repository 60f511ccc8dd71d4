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
  per (workers, replicas_per_worker, timeout, check_collectives), started on
  first use. A job that fails anywhere closes its pool (torch.distributed
  refuses work after a failure) and the next call starts a fresh one.
  :func:`shutdown` closes them all; it also runs at interpreter exit.

:func:`launch` and :func:`run_workers` run one job on fresh workers instead.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import crossreplica as cr
from crossreplica.testing.hosts import SimulatedHosts
from crossreplica.testing.pool import (
    DEFAULT_TEST_TIMEOUT,
    Outcome,
    WorkerPool,
    check_per_replica_args,
    describe,
    job_limit,
    resolve_layout,
)
from crossreplica.testing.remote import WorkerPoolError, primary_exception
from crossreplica.testing.worker import Boxed, check_device_type, function_spec, replica_devices

ENGINES: tuple[str, ...] = ("threads", "processes")

_strategies: dict[tuple[int, float, str], cr.MirroredStrategy] = {}
_log = logging.getLogger(__name__)


def _run_threads(fn: Callable[..., Any], num_replicas: int, per_replica_args: Sequence[Sequence[Any]],
                 timeout_seconds: float, device: str) -> list[Any]:
    check_per_replica_args(num_replicas, per_replica_args)
    key = (num_replicas, float(timeout_seconds), device)
    strategy = _strategies.get(key)
    if strategy is None:
        strategy = _strategies[key] = cr.MirroredStrategy(devices=replica_devices(device, 0, num_replicas),
                                                          timeout_seconds=timeout_seconds)
    # Always PerReplica (also for one replica), so a None argument is not trimmed by run.
    args = tuple(cr.PerReplica(list(a)) for a in per_replica_args)
    result = strategy.run(Boxed(fn), args=args)
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
                 timeout_seconds: float = DEFAULT_TEST_TIMEOUT, check_collectives: bool = False,
                 device: str = "cpu", hosts: SimulatedHosts | None = None) -> list[Any]:
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
        device: ``"cpu"`` (default, also where GPUs are visible, so results are the same
            everywhere) or ``"cuda"``: replica ``i`` on ``cuda:i % gpus``; worker processes
            then use NCCL if each has a GPU of its own, else gloo.
        hosts: processes only: the workers spread over these simulated hosts
            (:class:`~crossreplica.testing.WorkerPool`'s ``hosts``).

    Raises:
        the replica's exception (see the module docstring); WorkerPoolError when a
        worker could not start, died without reporting or ran past its bound.
    """
    n = _num_replicas(num_replicas, per_replica_args)
    check_device_type(device)
    if engine == "threads":
        if hosts is not None:
            raise ValueError(f"hosts needs engine='processes' (threads run in this process); got engine={engine!r}")
        return _run_threads(fn, n, per_replica_args, timeout_seconds, device)
    if engine == "processes":
        return run_pooled(fn, n, per_replica_args, replicas_per_worker, timeout_seconds, check_collectives, device,
                          hosts)
    raise ValueError(f"engine must be one of {list(ENGINES)}; got {engine!r}")


def launch(fn: Callable[..., Any], *per_replica_args: Sequence[Any], num_replicas: int | None = None,
           replicas_per_worker: int | None = None, mode: str = "replica",
           timeout_seconds: float = DEFAULT_TEST_TIMEOUT, check_collectives: bool = False,
           device: str = "cpu", hosts: SimulatedHosts | None = None) -> Outcome:
    """Runs one job on fresh worker processes and reports every worker's outcome; never
    raises for a worker's failure. For tests of failure behaviour: nothing kills the
    other workers when one fails, so each reports what it saw.

    ``mode="main"`` runs ``fn(strategy)`` once per worker (``num_replicas`` then counts
    all replicas: workers x replicas_per_worker)."""
    n = _num_replicas(num_replicas, per_replica_args)
    workers, rpw = resolve_layout(n, replicas_per_worker)
    with WorkerPool(workers, rpw, timeout_seconds=timeout_seconds, check_collectives=check_collectives,
                    device=device, hosts=hosts) as pool:
        return pool.run(fn, *per_replica_args, mode=mode)


def run_workers(main: Callable[..., Any], num_workers: int, replicas_per_worker: int = 1, *,
                args: Sequence[Any] = (), timeout_seconds: float = DEFAULT_TEST_TIMEOUT,
                check_collectives: bool = False, device: str = "cpu",
                hosts: SimulatedHosts | None = None) -> list[Any]:
    """Per-worker results of ``main(strategy, *args)``, run once per worker in cross-replica
    context on fresh worker processes (it may leave its worker in any state); ``args``
    (picklable) are the same on every worker; ``hosts``: the workers spread over them."""
    with WorkerPool(num_workers, replicas_per_worker, timeout_seconds=timeout_seconds,
                    check_collectives=check_collectives, device=device, hosts=hosts) as pool:
        out = pool.run(main, mode="main", main_args=args)
    if not out.ok:
        raise_failed(out, f"run_workers({main.__qualname__})", timeout_seconds)
    return [out.results[r] for r in range(num_workers)]


# ---------------------------------------------------------------------- persistent pools

_pools: dict[tuple[int, int, float, bool, str, tuple[str, ...]], WorkerPool] = {}


def pooled(num_workers: int, replicas_per_worker: int, timeout_seconds: float = DEFAULT_TEST_TIMEOUT,
           check_collectives: bool = False, device: str = "cpu", hosts: SimulatedHosts | None = None) -> WorkerPool:
    """The running pool of this layout and options, started on first use or after a failure."""
    key = (num_workers, replicas_per_worker, float(timeout_seconds), bool(check_collectives), device,
           tuple(hosts.namespaces) if hosts else ())
    pool = _pools.get(key)
    if pool is not None and not pool.alive:
        _log.warning("a worker of %s exited between jobs; starting a new pool", repr(pool))
        pool.close()
        pool = None
    if pool is None:
        pool = WorkerPool(num_workers, replicas_per_worker, timeout_seconds=timeout_seconds,
                          check_collectives=check_collectives, device=device, hosts=hosts).start()
        _pools[key] = pool
    return pool


def run_pooled(fn: Callable[..., Any], num_replicas: int, per_replica_args: Sequence[Sequence[Any]],
               replicas_per_worker: int | None = None, timeout_seconds: float = DEFAULT_TEST_TIMEOUT,
               check_collectives: bool = False, device: str = "cpu",
               hosts: SimulatedHosts | None = None) -> list[Any]:
    """Per-replica results of ``fn`` on a persistent pool; a failed job's exception is raised here."""
    workers, rpw = resolve_layout(num_replicas, replicas_per_worker)
    check_per_replica_args(num_replicas, per_replica_args)
    function_spec(fn)  # a function workers cannot import fails here, before any pool starts
    pool = pooled(workers, rpw, timeout_seconds, check_collectives, device, hosts)
    try:
        out = pool.run(fn, *per_replica_args)
    except BaseException:
        _discard(pool)
        raise
    if out.ok:
        return [out.results[r] for r in range(num_replicas)]
    _log.warning("%s failed on %s; the pool is closed and the next job starts a fresh one (the process "
                 "group refuses work after a failure)", fn.__qualname__, repr(pool))
    _discard(pool)  # the engine refuses work after a failure: the next call gets a fresh pool
    raise_failed(out, f"{fn.__qualname__} on {pool!r}", timeout_seconds)


def raise_failed(out: Outcome, what: str, timeout_seconds: float) -> NoReturn:
    """Raises for a job that did not succeed: the culprit's exception, rebuilt, when a worker
    reported one; else WorkerPoolError naming the workers that exited or did not answer."""
    if out.failures:
        raise primary_exception(out.failures)
    raise WorkerPoolError(f"{what}: {describe({}, out.exitcodes, out.unanswered, job_limit(timeout_seconds))}"
                          f"\n{out.log}")


def _discard(pool: WorkerPool) -> None:
    pool.close()
    for key in [k for k, p in _pools.items() if p is pool]:
        del _pools[key]


def shutdown_pools(hosts: SimulatedHosts | None = None) -> None:
    """Closes every persistent pool (a test session's end; also run at interpreter exit), or
    only those on ``hosts`` (before they are removed)."""
    for key in [k for k, p in _pools.items() if hosts is None or p.hosts is hosts]:
        _pools.pop(key).close()


atexit.register(shutdown_pools)


def shutdown() -> None:
    """Closes every persistent pool and forgets the in-process strategies (a test session's end)."""
    _strategies.clear()
    shutdown_pools()

