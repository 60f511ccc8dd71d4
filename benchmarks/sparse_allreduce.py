"""Sparse all-reduce of an embedding-sized gradient: sparse COO vs its dense view.

Each replica holds a 1e6 x 4 float32 value with ``--rows`` stored rows (an
embedding gradient). Measured side by side, each mode in a fresh process (peak
RSS only grows within a process):
  sparse  cr.all_reduce of the sparse COO value (one gather, coalesced result)
  dense   cr.all_reduce of x.to_dense() (the baseline: what densifying costs)
Columns: the median time per call over --trials, the peak RSS growth of the
process over the calls, and the ratios dense / sparse.

    .venv/bin/python benchmarks/sparse_allreduce.py [--replicas 4] [--rows 512] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_time, median, print_table  # noqa: E402

import crossreplica as cr  # noqa: E402

SHAPE = (10 ** 6, 4)


def _value(r: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(r)
    idx = torch.randperm(SHAPE[0], generator=g)[:rows]
    return torch.sparse_coo_tensor(idx.unsqueeze(0), torch.randn(rows, SHAPE[1], generator=g), SHAPE,
                                   check_invariants=False)


def _step(x: torch.Tensor, dense: bool) -> torch.Tensor:
    return cr.all_reduce(x.to_dense() if dense else x, "sum")


def measure(mode: str, n: int, rows: int, trials: int) -> dict:
    """One mode in this process: median seconds per call and peak RSS growth in bytes."""
    warnings.simplefilter("ignore")
    s = cr.MirroredStrategy(n, devices=["cpu"] * n)
    xs = cr.PerReplica([_value(r, rows) for r in range(n)])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = s.run(_step, args=(xs, mode == "dense"))
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": median(times), "rss": (peak - base) * 1024, "layout": str(out.values[0].layout)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--measure", choices=["sparse", "dense"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure, a.replicas, a.rows, a.trials)))
        return
    res = {}
    for mode in ("sparse", "dense"):
        cmd = [sys.executable, __file__, "--measure", mode, "--replicas", str(a.replicas), "--rows",
               str(a.rows), "--trials", str(a.trials)]
        res[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(f"{a.replicas} replicas, {SHAPE[0]} x {SHAPE[1]} float32, {a.rows} stored rows per replica; "
          f"median of {a.trials} calls")
    rows = [[mode, res[mode]["layout"], fmt_time(res[mode]["seconds"]), f"{res[mode]['rss'] / 2 ** 20:.1f} MiB"]
            for mode in ("sparse", "dense")]
    print_table(["mode", "result", "time / call", "peak RSS growth"], rows)
    print(f"dense / sparse: time x{res['dense']['seconds'] / res['sparse']['seconds']:.1f}, "
          f"peak memory x{max(res['dense']['rss'], 1) / max(res['sparse']['rss'], 1):.1f}")


if __name__ == "__main__":
    main()
