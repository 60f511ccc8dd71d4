"""The caller's spinning OpenMP workers are quieted before replica threads compute
(crossreplica/strategies/openmp_pool.py)."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import pytest
import torch

import crossreplica as cr
from crossreplica.strategies import openmp_pool
from crossreplica.strategies.replica_threads import QUIET_AFTER


def _libgomp_pause():
    """The process's libgomp ``omp_pause_resource_all``, or a skip saying why not."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads the caller's threads from /proc (Linux)")
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's parallel backend is not OpenMP")
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp (libomp puts idle threads to sleep instead)")
    return gomp.omp_pause_resource_all


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _workers_alive_during_a_run(previous_run_seconds: float) -> tuple[set[int], set[int], list, torch.Tensor]:
    """The caller's new OpenMP workers (from one parallelised op) and the threads alive while
    the next run's replica 0 computes, after a run that took ``previous_run_seconds``."""
    pause = _libgomp_pause()
    strategy = cr.MirroredStrategy(2)
    strategy.run(lambda: time.sleep(previous_run_seconds))
    took = strategy.extended._threads._last_seconds
    if (took >= QUIET_AFTER) != (previous_run_seconds >= QUIET_AFTER):
        pytest.skip(f"the run meant to take {previous_run_seconds}s took {took:.4f}s (a loaded machine)")
    pause(1)  # the caller starts without a pool: the op below creates its workers
    before = _tids()
    big = torch.randn(1 << 22)
    big.mul_(1.0001)  # far above the grain size: parallelised over 2 threads
    workers = _tids() - before
    if not workers:
        pytest.skip("the op did not start an OpenMP worker thread here")
    x = torch.randn(64, 64)
    seen: list[set[int]] = []

    def fn(x):
        if cr.get_replica_context().replica_id_in_sync_group == 0:
            seen.append(_tids())
        return cr.cross_replica_sum(x @ x)

    out = strategy.experimental_local_results(strategy.run(fn, (x,)))
    return workers, seen[0], list(out), x


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_the_callers_openmp_workers_are_not_left_spinning_during_a_long_run(two_threads):
    """A parallelised op in the caller leaves libgomp's workers spinning for milliseconds;
    after a run of more than QUIET_AFTER, the next run ends them before the replicas
    compute (libgomp ends a paused pool's workers), so they take no core from the
    replicas. The replicas' numbers are those of a plain-torch reference."""
    workers, alive, out, x = _workers_alive_during_a_run(2 * QUIET_AFTER)
    assert not (workers & alive), f"the caller's OpenMP workers {workers} were alive while the replicas ran"
    reference = (x @ x) + (x @ x)
    for value in out:
        torch.testing.assert_close(value, reference, rtol=0, atol=0)


def test_after_short_runs_the_callers_workers_are_left_alone(two_threads):
    """Ending and starting them again costs tens of microseconds (and on some machines a
    scheduler stall of milliseconds): not worth it where a run is short."""
    workers, alive, _, _ = _workers_alive_during_a_run(0.0)
    assert workers <= alive


def test_the_pause_is_found_in_the_runtime_torch_loaded():
    """A lookup that silently found nothing would leave the spinning in place: where torch
    computes with libgomp, the pause is the runtime's own."""
    pause = _libgomp_pause()
    found = openmp_pool._find_pause()
    assert found is not None
    assert ctypes.cast(found, ctypes.c_void_p).value == ctypes.cast(pause, ctypes.c_void_p).value
    assert found(1) == 0  # outside a parallel region: the pool (if any) ended
