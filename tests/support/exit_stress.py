"""Runs a short training-like workload in many forked children that then exit normally.

Usage: python exit_stress.py CHILDREN PARALLEL

torch and crossreplica are imported once, before any thread starts; each child
(os.fork) runs one scenario and leaves through normal interpreter finalization,
which is where replica threads that were not joined used to abort the process
(exit code 134). Prints one line per child, "scenario exit-status", and exits
with 0 only if every child exited with status 0.
"""

from __future__ import annotations

import gc
import os
import sys

import torch

import crossreplica as cr


def _collectives(strategy: cr.Strategy, steps: int) -> object:
    def fn() -> object:
        x = torch.ones(16)
        for _ in range(steps):
            x = cr.all_reduce(x, "mean")
        return x
    return strategy.run(fn)


def kept_until_exit() -> None:
    """The strategy and its last results stay alive until the interpreter exits."""
    global strategy, result
    strategy = cr.MirroredStrategy(2)
    for _ in range(10):
        result = _collectives(strategy, 20)


def dropped_before_exit() -> None:
    """Several strategies are dropped (their threads told to stop) just before exit."""
    strategies = [cr.MirroredStrategy(4) for _ in range(6)]
    for _ in range(3):
        outs = [s.run(lambda: [cr.all_reduce(torch.ones(10), "sum") for _ in range(10)]) for s in strategies]
    del outs, strategies
    gc.collect()


def failed_and_abandoned() -> None:
    """A run whose replica failed while another was busy outside any collective."""
    strategy = cr.MirroredStrategy(2, timeout_seconds=0.2)

    def fn() -> object:
        if cr.replica_id() == 0:
            raise ValueError("boom")
        import time
        time.sleep(0.5)
        return torch.ones(3)

    try:
        strategy.run(fn)
    except ValueError:
        pass
    _collectives(strategy, 10)


def multi_worker_local() -> None:
    """MultiWorkerMirroredStrategy with two local replicas (one worker, no launcher)."""
    global mw, mw_result
    mw = cr.MultiWorkerMirroredStrategy(replicas_per_worker=2)
    for _ in range(10):
        mw_result = _collectives(mw, 20)


# Dropping strategies just before exit is the workload that aborted most often
# (a few percent of children on a 2-core machine before the fix): run it more.
SCENARIOS = [dropped_before_exit, kept_until_exit, dropped_before_exit, failed_and_abandoned,
             dropped_before_exit, multi_worker_local]


def main() -> int:
    children, parallel = int(sys.argv[1]), int(sys.argv[2])
    running: dict[int, str] = {}
    failed = 0
    started = 0
    while started < children or running:
        while started < children and len(running) < parallel:
            scenario = SCENARIOS[started % len(SCENARIOS)]
            started += 1
            pid = os.fork()
            if pid == 0:
                scenario()
                return 0  # falls out through normal interpreter finalization
            running[pid] = scenario.__name__
        pid, status = os.wait()
        name = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        print(name, code, flush=True)
        failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
