"""Shared fixtures: the engine matrix every engine-agnostic test runs over."""

from __future__ import annotations

import functools
import os

# Before crossreplica is imported (here, or in a worker's forkserver): the
# threads engine's parallel path starts at 256 KiB per replica, so the suite's
# "large" tensors (test_collectives.LARGE) take it without being slow.
os.environ.setdefault("CROSSREPLICA_PARALLEL_BYTES", str(256 * 1024))
# Its small all-reduces write every member's output into rows of one buffer from
# 3 members on (8 by default), so tests with 2 replicas take the other form.
os.environ.setdefault("CROSSREPLICA_SHARED_ROWS_MEMBERS", "3")

import sys

# Helpers and subprocess scripts live in tests/support/ (import harness, nests, guides, ...).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import pytest  # noqa: E402
from harness import RUNNERS, STARTUP_SECONDS  # noqa: E402

import crossreplica.testing as crt

# Every engine crossreplica.testing runs; engines other than "threads" spawn
# processes and are marked ``multiprocess``.
ENGINES = list(crt.ENGINES)


def _param(name: str):
    marks = () if name == "threads" else (pytest.mark.multiprocess,)
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(params=[_param(e) for e in ENGINES])
def engine(request) -> str:
    return request.param


@pytest.fixture
def run_replicas(engine, request):
    """``run_replicas(fn, num_replicas, *per_replica_args, **opts) -> list``.

    ``fn`` must be a module-level function; replica ``i`` gets ``arg[i]`` of
    every per-replica argument and runs inside a replica context. Results are
    returned in replica-id order.

    Tests marked ``detects_mismatch`` expect replicas whose calls disagree to get
    CollectiveMismatchError. The in-process engine always compares calls; across
    processes that is the strategy's documented opt-in ``check_collectives=True``
    (without it the calls meet in the backend and fail only at the timeout), so
    those tests run on workers built with it.
    """
    runner = RUNNERS[engine]
    if engine == "processes" and request.node.get_closest_marker("detects_mismatch"):
        return functools.partial(runner, check_collectives=True)
    return runner


@pytest.fixture
def time_bound(engine):
    """``time_bound(seconds)``: a wall-clock bound for one run_replicas call on this engine."""
    return lambda seconds: seconds + STARTUP_SECONDS.get(engine, 30.0)


@pytest.fixture(scope="session", autouse=True)
def _stop_process_pools():
    """Kills the worker pools of the "processes" engine at the end of the session."""
    yield
    crt.shutdown()


@pytest.fixture(scope="session")
def simulated_hosts():
    """Two simulated hosts (crossreplica.testing.hosts) for the session, for tests marked
    ``hosts``; skips with the reason where they cannot be made. Pools placed on them are
    closed before the hosts are removed."""
    from crossreplica.testing.hosts import SimulatedHosts, available
    from crossreplica.testing.runner import shutdown_pools

    reason = available()
    if reason is not None:
        pytest.skip(reason)
    with SimulatedHosts(2) as hosts:
        try:
            yield hosts
        finally:
            shutdown_pools(hosts)


@pytest.fixture(params=[pytest.param(False, id="one-host"),
                        pytest.param(True, id="2-hosts", marks=pytest.mark.hosts)])
def hosts(request):
    """None (every worker on this host), then the session's two simulated hosts: a test
    taking it runs both ways (``hosts=`` of crossreplica.testing's runners)."""
    return request.getfixturevalue("simulated_hosts") if request.param else None


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.engine_xfail(engine, reason=...)``: a known limitation of one engine,
    xfail(strict=True) on that engine only (an unexpected pass fails the run)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        engine = callspec.params.get("engine") if callspec is not None else None
        for mark in item.iter_markers("engine_xfail"):
            if engine in mark.args:
                item.add_marker(pytest.mark.xfail(reason=mark.kwargs["reason"], strict=True))
