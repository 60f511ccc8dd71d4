"""Shared fixtures: the engine matrix every engine-agnostic test runs over."""

from __future__ import annotations

import pytest

from harness import RUNNERS, STARTUP_SECONDS

# Adding an engine to the whole suite: add its name here and its runner to
# harness.RUNNERS. Engines other than "threads" spawn processes and are
# marked ``multiprocess``.
ENGINES = ["threads"]


def _param(name: str):
    marks = () if name == "threads" else (pytest.mark.multiprocess,)
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(params=[_param(e) for e in ENGINES])
def engine(request) -> str:
    return request.param


@pytest.fixture
def run_replicas(engine):
    """``run_replicas(fn, num_replicas, *per_replica_args, **opts) -> list``.

    ``fn`` must be a module-level function; replica ``i`` gets ``arg[i]`` of
    every per-replica argument and runs inside a replica context. Results are
    returned in replica-id order.
    """
    return RUNNERS[engine]


@pytest.fixture
def time_bound(engine):
    """``time_bound(seconds)``: a wall-clock bound for one run_replicas call on this engine."""
    return lambda seconds: seconds + STARTUP_SECONDS.get(engine, 30.0)
