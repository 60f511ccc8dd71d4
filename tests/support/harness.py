"""How the engine-agnostic tests run a replica function on N replicas: crossreplica.testing.

Each engine provides ``run(fn, num_replicas, *per_replica_args, **opts)``, the
signature of the ``run_replicas`` fixture (conftest.py): ``fn`` is a
module-level (picklable) function, called once per replica inside a replica
context with that replica's entry of every ``per_replica_args`` sequence; the
results come back as a list in replica-id order.

Options: ``timeout_seconds`` (collective timeout, default 30 s so a hang bug
fails fast instead of waiting the library's 300 s), ``check_collectives``
(processes: the strategy's opt-in comparison of calls across workers).

The engine list (conftest.ENGINES) is crossreplica.testing.ENGINES.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import crossreplica.testing as crt

#: the helpers' folder (subprocess scripts among them) and the repository
SUPPORT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SUPPORT))
DEFAULT_TIMEOUT = crt.DEFAULT_TEST_TIMEOUT


def _runner(engine: str) -> Callable[..., list[Any]]:
    def run(fn: Callable[..., Any], num_replicas: int, *per_replica_args: Any, **opts: Any) -> list[Any]:
        return crt.run_replicas(fn, *per_replica_args, num_replicas=num_replicas, engine=engine, **opts)
    return run


RUNNERS: dict[str, Callable[..., list[Any]]] = {engine: _runner(engine) for engine in crt.ENGINES}

# Seconds an engine needs to start its replicas; time bounds in failure tests are added to it.
# A pool of processes starts lazily (on its layout's first job, and again after a failed job):
# a fork from a forkserver that has imported torch, then process-group set-up.
STARTUP_SECONDS: dict[str, float] = {"threads": 0.0, "processes": 10.0}


def subprocess_env() -> dict[str, str]:
    """This process's environment for a launched command (torchrun, the CLI), with the repository
    on PYTHONPATH and one OpenMP thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CROSSREPLICA_CHECK_COLLECTIVES", None)
    return env


def run_layout(main: Callable[..., Any], layout: tuple[str, int, int], *args: Any) -> list[Any]:
    """``main(strategy, *args)`` once per worker of ``layout`` (engine, workers, replicas per
    worker): in this process on MirroredStrategy, or on worker processes; the per-worker results."""
    engine, workers, per_worker = layout
    if engine == "threads":
        import crossreplica as cr

        return [main(cr.MirroredStrategy(per_worker), *args)]
    return crt.run_workers(main, workers, per_worker, args=args)
