"""In-process runs while the caller computes between them: no oversubscription.

    PYTHONPATH=$PWD python benchmarks/caller_busy.py [--replicas 2] [--runs 40] [--rounds 7]

A training loop of in-process replicas where the caller does one parallelised
torch op per run (building the next batch, an update: here a 1M-element
``mul_``), against the same loop with an idle caller. The caller's OpenMP
workers spin for milliseconds after each of its ops; crossreplica quiets them
before the replica threads compute, where the last run took 1 ms or more
(crossreplica/strategies/openmp_pool.py).
Each row is measured with that quieting on (crossreplica as shipped) and off
(the previous behaviour), interleaved in one process, medians over
``--rounds`` loops of ``--runs`` runs. Issue 41's target: caller-busy /
caller-idle at most 1.15 with the default environment.

The second row is a short run (one 4 KiB all-reduce) after each caller op,
where the quieting stands aside: both columns should agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_time, print_table  # noqa: E402

import crossreplica as cr  # noqa: E402
from crossreplica.strategies import openmp_pool  # noqa: E402


def quieting(on: bool) -> None:
    """Turns the caller's quieting on (as shipped) or off (the behaviour before it)."""
    openmp_pool._looked = True
    openmp_pool._pause = openmp_pool._find_pause() if on else None


def mlp_step(w: torch.Tensor) -> torch.Tensor:
    x = w
    for _ in range(10):
        x = torch.tanh(x @ w)
    return cr.all_reduce(x.sum(), "sum")


def small_step(x: torch.Tensor) -> torch.Tensor:
    return cr.all_reduce(x, "sum")


def loop(strategy: cr.MirroredStrategy, step: Callable, arg: object, runs: int, busy: bool,
         big: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(runs):
        if busy:
            big.mul_(1.0001)
        strategy.run(step, (arg,))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if openmp_pool._find_pause() is None:
        print("this torch's OpenMP runtime has no omp_pause_resource_all: nothing to compare")
    strategy = cr.MirroredStrategy(args.replicas)
    big = torch.randn(1 << 20)
    work = {"mlp step (10 x 256x256 matmul + tanh)": (mlp_step, cr.PerReplica([torch.randn(256, 256)
                                                                              for _ in range(args.replicas)])),
            "one 4 KiB all-reduce": (small_step, torch.ones(1024))}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} cores, "
          f"{args.replicas} replicas, {args.runs} runs per loop, median of {args.rounds} loops")
    rows = []
    for name, (step, arg) in work.items():
        times: dict[tuple[bool, bool], list[float]] = {(q, b): [] for q in (True, False) for b in (False, True)}
        for on in (True, False):  # warm-up
            quieting(on)
            loop(strategy, step, arg, args.runs, True, big)
        for _ in range(args.rounds):
            for on in (True, False):
                quieting(on)
                for busy in (False, True):
                    times[on, busy].append(loop(strategy, step, arg, args.runs, busy, big))
        med = {key: statistics.median(value) / args.runs for key, value in times.items()}
        for on in (True, False):
            rows.append([name, "quieted (shipped)" if on else "not quieted (before)",
                         fmt_time(med[on, False]), fmt_time(med[on, True]),
                         f"{med[on, True] / med[on, False]:.2f}"])
    quieting(True)
    print_table(["replica work", "caller's OpenMP workers", "per run, caller idle", "per run, caller busy",
                 "busy / idle"], rows)


if __name__ == "__main__":
    main()
