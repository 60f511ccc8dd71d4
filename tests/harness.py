"""How the engine-agnostic tests run a replica function on N replicas.

Each engine provides ``run(fn, num_replicas, *per_replica_args, **opts)``:
``fn`` is a module-level (picklable) function, called once per replica inside
a replica context with that replica's entry of every ``per_replica_args``
sequence; the results come back as a list in replica-id order. Results must
be picklable so an engine built on processes can return them.

Options: ``timeout_seconds`` (collective timeout, default 30 s so a hang bug
fails fast instead of waiting the library's 300 s).

To run the suite against another engine, add its runner to RUNNERS and its
name to ``conftest.ENGINES``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import crossreplica as cr

DEFAULT_TIMEOUT = 30.0

_strategies: dict[tuple[int, float], cr.MirroredStrategy] = {}


def _strategy(num_replicas: int, timeout: float) -> cr.MirroredStrategy:
    # Strategies keep persistent replica threads; reusing them keeps the suite fast.
    key = (num_replicas, timeout)
    if key not in _strategies:
        _strategies[key] = cr.MirroredStrategy(num_replicas=num_replicas, timeout_seconds=timeout)
    return _strategies[key]


def _check_args(num_replicas: int, per_replica_args: Sequence[Sequence[Any]]) -> None:
    for k, a in enumerate(per_replica_args):
        if len(a) != num_replicas:
            raise ValueError(f"per_replica_args[{k}] has {len(a)} entries for {num_replicas} replicas")


class _Tagged:
    """A per-replica result box: never the same object on two replicas, so
    regroup always wraps it and select_replica gives each replica's own."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _tagged(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> _Tagged:
        return _Tagged(fn(*args))
    return call


def run_threads(fn: Callable[..., Any], num_replicas: int, *per_replica_args: Sequence[Any],
                timeout_seconds: float = DEFAULT_TIMEOUT) -> list[Any]:
    _check_args(num_replicas, per_replica_args)
    strategy = _strategy(num_replicas, timeout_seconds)
    # Always PerReplica (also for one replica) so a None argument is not trimmed by run.
    args = tuple(cr.PerReplica(list(a)) for a in per_replica_args)
    result = strategy.run(_tagged(fn), args=args)
    if num_replicas == 1:
        return [result.value]
    return [box.value for box in result.values]


def run_processes(fn: Callable[..., Any], num_replicas: int, *per_replica_args: Sequence[Any],
                  timeout_seconds: float = DEFAULT_TIMEOUT, check_collectives: bool = False) -> list[Any]:
    """The same contract on real processes: persistent worker pools (tests/process_pool.py).

    ``check_collectives``: build the workers' strategy with it (conftest turns it on for
    tests marked ``detects_mismatch``; the in-process engine always checks)."""
    from process_pool import run_pooled

    return run_pooled(fn, num_replicas, *per_replica_args, timeout_seconds=timeout_seconds,
                      check_collectives=check_collectives)


RUNNERS: dict[str, Callable[..., list[Any]]] = {"threads": run_threads, "processes": run_processes}

# Seconds an engine needs to start its replicas (processes: the launcher and
# process-group set-up); time bounds in failure tests are added to it.
# A pool of processes starts lazily (on its layout's first job, and again after a failed
# job): a fork from a forkserver that has imported torch, then process-group set-up.
STARTUP_SECONDS: dict[str, float] = {"threads": 0.0, "processes": 10.0}
