"""The cost of one ``strategy.run`` on in-process replicas, and where its time goes.

    PYTHONPATH=$PWD python benchmarks/run_overhead.py [--replicas 1 2 4 64] [--runs 300] [--rounds 7]

Per run (the figure a user sees, issue 23's target 3: one 4 KiB all-reduce in at
most 60 us at 2 replicas, at most 15 us per extra replica at 64): an empty
replica function and one ``cr.all_reduce`` of 4 KiB, medians over ``--rounds``
loops of ``--runs`` runs each, beside the replica threads' bare hand-off
(``ReplicaThreads.run`` of a body that does nothing) measured in the same run.
Then, at 2 replicas, a timeline of the empty run (medians of timestamps taken
inside it): the caller's work before it wakes the replica threads, the wake,
the replica bodies, the wake back, and the caller's work after.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median_time  # noqa: E402

import crossreplica as cr  # noqa: E402
from crossreplica.strategies.replica_threads import ReplicaThreads  # noqa: E402

X = torch.ones(1024)  # 4 KiB of float32


def empty() -> None:
    return None


def all_reduce() -> torch.Tensor:
    return cr.all_reduce(X, "sum")


def timeline(runs: int) -> dict[str, float]:
    """Medians of the moments (us from the call) inside an empty run on 2 replicas."""
    strategy = cr.MirroredStrategy(2)
    strategy.run(empty)
    threads = strategy.extended._threads
    if threads is None:
        raise SystemExit("benchmarks/run_overhead.py: 2 replicas ran without replica threads")
    marks: dict[str, float] = {}
    real = threads.run

    def run(body: Callable[[int], Any], *rest: Any) -> list[Any]:
        marks["wakes the replica threads"] = time.perf_counter()

        def timed(i: int) -> Any:
            marks.setdefault("first body starts", time.perf_counter())
            try:
                return body(i)
            finally:
                marks["last body ends"] = time.perf_counter()
        out = real(timed, *rest)
        marks["the caller is back"] = time.perf_counter()
        return out
    threads.run = run  # type: ignore[method-assign]
    rows = []
    for _ in range(runs):
        marks.clear()
        t0 = time.perf_counter()
        strategy.run(empty)
        rows.append({k: (v - t0) * 1e6 for k, v in marks.items()} | {"run returns": (time.perf_counter() - t0) * 1e6})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 64])
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; us per strategy.run, "
          f"medians of {a.rounds} x {a.runs} runs\n")
    print("| replicas | empty run | one 4 KiB all-reduce | threads' bare hand-off | all-reduce run per extra replica |")
    print("|---|---|---|---|---|")
    base = None
    for n in a.replicas:
        strategy = cr.MirroredStrategy(n)
        runs = max(a.runs // max(n // 4, 1), 20)
        t_empty = median_time(functools.partial(strategy.run, empty), runs, a.rounds)
        t_reduce = median_time(functools.partial(strategy.run, all_reduce), runs, a.rounds)
        if n > 1:
            bare = ReplicaThreads(n)
            t_bare = median_time(functools.partial(bare.run, lambda i: None, lambda i, e: None, 1.0), runs, a.rounds)
            bare.close()
        extra = "" if base is None or n == base[0] else f"{(t_reduce - base[1]) / (n - base[0]) * 1e6:.1f} us"
        if n == 2:
            base = (n, t_reduce)
        print(f"| {n} | {t_empty * 1e6:.0f} us | {t_reduce * 1e6:.0f} us | "
              f"{'-' if n == 1 else f'{t_bare * 1e6:.0f} us'} | {extra or '-'} |", flush=True)
    print("\nAn empty run on 2 replicas, moment by moment (us from the call, medians):\n")
    print("| moment | us | since the one before |\n|---|---|---|")
    before = 0.0
    for name, t in sorted(timeline(a.runs * 3).items(), key=lambda kv: kv[1]):
        print(f"| {name} | {t:.1f} | {t - before:.1f} |")
        before = t


if __name__ == "__main__":
    main()
