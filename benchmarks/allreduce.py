"""In-process all-reduce: our threads engine vs a naive one-thread reduction.

For each replica count and size, interleaved trials measure side by side:
  ours    cr.all_reduce(x, op) inside strategy.run, per call (replica 0's clock)
  naive   torch.stack(xs).sum(0) (or .mean(0), ...) in one thread (one output, not N)
  bound   the memory-traffic bound: every input read once and every output
          written once is 2 x N x size bytes; at the bandwidth of a
          preallocated dst.copy_(src) (which reads and writes size bytes)
          that takes N x t_copy(size). The best of 1 and 2 intra-op threads
          is used, so the bound is not flattered.
Ratios: speed-up over naive (naive / ours) and fraction of the bound
(bound / ours; 100% would be running at copy bandwidth). On a GPU every loop waits
for the device once, after its last call, as a training loop does; "host per call"
is the time the replica's thread spent per call before that wait.

    .venv/bin/python benchmarks/allreduce.py            # full table
    .venv/bin/python benchmarks/allreduce.py --quick    # fewer sizes and trials
    .venv/bin/python benchmarks/allreduce.py --op mean  # another reduction (default sum)
    python benchmarks/allreduce.py --device cuda          # replicas on the GPUs (several share one
                                                          # where there are fewer GPUs than replicas)

It also draws docs/img/allreduce.png (--plot PATH, --no-plot): time vs size
per replica count against the naive baseline and the traffic bound, and the
latency at the smallest size vs replicas.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_size, fmt_time, median, print_table, timeit  # noqa: E402
from _plot import SMOKE_NOTE, add_plot_arguments, plot_allreduce

import crossreplica as cr  # noqa: E402

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def reps_for(nbytes: int, n: int) -> int:
    return max(3, min(3000, int(3e7 / (nbytes * n))))


def timed(fn, reps: int, device: torch.device, host: list[float] | None = None) -> float:
    """Seconds per call of ``fn`` over ``reps`` back-to-back calls, on a GPU up to the end
    of the work they queued (one wait after the last call, as a training loop waits).
    ``host``: on a GPU, gets the seconds per call the host spent queueing them."""
    if device.type != "cuda":
        return timeit(fn, reps)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize(device)
    if host is not None:
        host.append((t1 - t0) / reps)
    return (time.perf_counter() - t0) / reps


def _loop(x: torch.Tensor, reps: int, op: str) -> tuple[float, float]:
    cr.all_reduce(x, op)  # warm-up: first-touch of the output pages
    host: list[float] = []
    return timed(lambda: cr.all_reduce(x, op), reps, x.device, host), (host or [0.0])[0]


_NAIVE = {"sum": lambda t: t.sum(0), "mean": lambda t: t.mean(0), "max": lambda t: t.amax(0),
          "min": lambda t: t.amin(0), "prod": lambda t: t.prod(0)}


def copy_time(nbytes: int, reps: int, device: torch.device) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        dst.copy_(src)
        best = min(best, timed(lambda: dst.copy_(src), reps, device))
    torch.set_num_threads(1)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="bytes per replica")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--op", choices=sorted(_NAIVE), default="sum", help="the reduction (default sum)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the replicas and the baselines run (default cpu)")
    add_plot_arguments(parser, "allreduce")
    args = parser.parse_args()
    sizes = args.sizes or (SIZES[::2] if args.quick else SIZES)
    trials = 3 if args.quick else args.trials
    torch.set_num_threads(1)  # the replicas are the parallelism; the naive baseline is one thread
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and not gpus:
        parser.error("--device cuda: no CUDA device is visible")
    where = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else f"{os.cpu_count()} cores"
    print(f"torch {torch.__version__}, {where}, all_reduce {args.op}, {trials} interleaved trials, medians\n")
    naive_op = _NAIVE[args.op]
    rows = []
    points = []
    for n in args.replicas:
        devices = [torch.device("cuda", i % gpus) if gpus else torch.device("cpu") for i in range(n)]
        strategy = cr.MirroredStrategy(devices=devices) if gpus else cr.MirroredStrategy(n)
        for nbytes in sizes:
            reps = reps_for(nbytes, n)
            xs = [torch.randn(nbytes // 4).to(d) for d in devices]
            ours, host, naive, copy = [], [], [], []
            for _ in range(trials):
                t, h = (strategy.experimental_local_results(v)[0]
                        for v in strategy.run(_loop, (cr.PerReplica(xs), reps, args.op)))
                ours.append(t)
                host.append(h)
                naive.append(timed(lambda xs=xs, d=devices[0]: naive_op(torch.stack([x.to(d) for x in xs])), reps,
                                   devices[0]))
                copy.append(copy_time(nbytes, reps, devices[0]))
            t_ours, t_naive = median(ours), median(naive)
            t_bound = n * median(copy)
            points.append({"replicas": n, "bytes": nbytes, "ours": t_ours, "naive": t_naive, "bound": t_bound})
            rows.append([str(n), fmt_size(nbytes), fmt_time(t_ours), fmt_time(t_naive), fmt_time(t_bound),
                         f"{t_naive / t_ours:.2f}x", f"{100 * t_bound / t_ours:.0f}%"]
                        + ([fmt_time(median(host))] if gpus else []))
            print(" | ".join(rows[-1]), flush=True)
    print()
    print_table(["replicas", "size", "ours", f"naive stack+{args.op}", "traffic bound", "speed-up", "of bound"]
                + (["host per call"] if gpus else []), rows)
    if not args.no_plot:
        plot_allreduce(points, args.plot, SMOKE_NOTE if args.quick else None)


if __name__ == "__main__":
    main()
