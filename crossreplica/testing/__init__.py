"""Run your replica functions on threads and on processes, the way crossreplica's own suite does.

Write the replica function once and check it on every engine::

    import torch
    import crossreplica as cr
    import crossreplica.testing as crt

    def step(x):                       # module-level: worker processes import it
        return cr.all_reduce(x, "sum")

    if __name__ == "__main__":         # workers import this file: run nothing there
        xs = [torch.full((2,), float(r)) for r in range(4)]
        for engine in crt.ENGINES:     # "threads", "processes"
            out = crt.run_replicas(step, xs, engine=engine)  # 4 replicas: 2 workers x 2
            assert all(torch.equal(o, sum(xs)) for o in out)
        crt.shutdown()                 # or leave it to interpreter exit

With pytest, parametrise a fixture over ``crt.ENGINES`` and call
``crt.shutdown()`` from a session-scoped fixture's teardown.

* :func:`run_replicas`: per-replica results, in replica-id order; a replica's
  exception is raised here with its original type. On ``"processes"`` each layout
  (4 replicas -> 2 workers x 2 replicas, 2 -> 2x1, 6 -> 2x3, odd n -> n x 1, or
  ``replicas_per_worker=``) is served by a persistent :class:`WorkerPool`,
  started on first use and again after a failed call.
* :func:`run_workers`: ``main(strategy)`` once per worker, in cross-replica context.
* :func:`launch`: one job on fresh workers, every worker's :class:`Outcome`
  (results, :class:`WorkerFailure` records, exit codes) instead of an exception:
  for testing what workers see when one of them fails.
* :class:`WorkerPool`: start / run / close workers yourself.
* ``hosts=`` (processes; each of the above): the workers spread over simulated
  hosts (:class:`crossreplica.testing.hosts.SimulatedHosts`: network namespaces,
  root only), consecutive ranks on each host, as torchrun places them.

Workers are started by torch's elastic launcher with torchrun's environment
(see :mod:`crossreplica.testing.pool`). This package sits above the strategies:
nothing in crossreplica imports it, and ``import crossreplica`` does not load it
(it registers an exit hook and loads torch's launcher, which programs that never
test should not pay for).
"""

import warnings

from crossreplica.testing.pool import (
    DEFAULT_TEST_TIMEOUT,
    Outcome,
    WorkerPool,
    free_port,
    layout,
)
from crossreplica.testing.remote import (
    RemoteReplicaError,
    WorkerFailure,
    WorkerPoolError,
)
from crossreplica.testing.runner import (
    ENGINES,
    launch,
    run_replicas,
    run_workers,
    shutdown,
)

__all__ = [
    "DEFAULT_TEST_TIMEOUT",
    "ENGINES",
    "Outcome",
    "RemoteReplicaError",
    "WorkerFailure",
    "WorkerPool",
    "WorkerPoolError",
    "free_port",
    "launch",
    "layout",
    "run_replicas",
    "run_workers",
    "shutdown",
]


def __getattr__(name: str) -> object:
    """``DEFAULT_TIMEOUT``, the old name of :data:`DEFAULT_TEST_TIMEOUT`, with a DeprecationWarning
    (renamed: the library's default collective timeout is another value, 300 s)."""
    if name == "DEFAULT_TIMEOUT":
        warnings.warn("crossreplica.testing.DEFAULT_TIMEOUT is deprecated: use DEFAULT_TEST_TIMEOUT",
                      DeprecationWarning, stacklevel=2)
        return DEFAULT_TEST_TIMEOUT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
