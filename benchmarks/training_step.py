"""Training step: in-process replicas vs one process using every core.

Part 1 (the target): an MLP 784-1024-1024-10, global batch 256, SGD (lr 0.01,
momentum 0.9, foreach):

* baseline: one process, no strategy, torch.set_num_threads(2): forward,
  backward and step on the whole batch of 256;
* crossreplica: MirroredStrategy with 2 in-process replicas,
  torch.set_num_threads(1) (one intra-op thread per replica), 128 rows each,
  CrossShardOptimizer (the 7.4 MB of gradients reduced in one engine call), and
  its overlap=True / shard_optimizer_state=True variants (both: each replica
  steps its slices of its own parameters and copies the other's);
* the floor: the same 2 replicas with no gradient reduction at all (each
  steps its own gradients), the least a data-parallel step can take here.

Part 2: the demo's model (digits MLP 64-128-128-10, global batch 64) on 1, 2
and 4 replicas (intra-op threads = cores // replicas) against plain torch on
one device with every core.

Part 3: the cost of keeping BatchNorm's running statistics identical
(``strategy.mirror(model, sync_buffers=...)``): the demo model with a
BatchNorm1d after each hidden layer, global batch 64, one step per
``strategy.run`` (the sync runs once per run), on 2 and 4 replicas, with
``sync_buffers="broadcast"`` (the default) and ``"mean"`` against ``None`` (no
sync, the copies drift apart).

Part 4: the demo step on 2 replicas, one step per ``strategy.run``, with
per-replica random streams (the default) and without
(``strategy.extended.random_streams = False``), and the per-run cost of
carrying the caller's torch state (grad mode, autocast, default device, ...)
into the replicas: with part 3, the cost of what makes replicas see the same
numbers as one device (docs/fidelity.md).

Variants are measured side by side, interleaved round by round, in the same
process; the tables give the median ms per step and the ratio to the baseline.
On a shared machine the baseline's two OpenMP threads suffer most from other
load (one descheduled thread stalls every parallel region), so the ratio of
the minima is printed too: it is the better estimate for a quiet machine.

    PYTHONPATH=. python benchmarks/training_step.py [--rounds 15] [--steps 5]
    PYTHONPATH=. python benchmarks/training_step.py --quick   # a smoke run: 2 rounds x 1 step
    PYTHONPATH=. python benchmarks/training_step.py --buffers-only   # part 3 alone

It also draws docs/img/training_step.png (--plot PATH, --no-plot): step time
relative to one process, and the demo model's step time vs replicas.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _plot import SMOKE_NOTE, add_plot_arguments, plot_training_step

import crossreplica as cr
from crossreplica import torch_state
from crossreplica import demo


def mlp(sizes: list[int], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def plain_runner(model: nn.Module, x: torch.Tensor, y: torch.Tensor, threads: int, steps: int) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)

    def run() -> None:
        torch.set_num_threads(threads)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return run


def replica_step(model: nn.Module, opt: cr.CrossShardOptimizer, x: torch.Tensor, y: torch.Tensor,
                 steps: int, weighted: bool = True) -> None:
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step(weight=x.shape[0] if weighted else None)


def replica_step_alone(model: nn.Module, opt: cr.CrossShardOptimizer, x: torch.Tensor, y: torch.Tensor,
                       steps: int, weighted: bool = True) -> None:
    """The floor: the same step with no gradient reduction (the wrapped optimizer steps)."""
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.optimizer.step()


def strategy_runner(model: nn.Module, x: torch.Tensor, y: torch.Tensor, replicas: int, threads: int,
                    steps: int, reduce: bool = True, **options: bool) -> tuple[Callable[[], None], cr.Strategy, Any]:
    """``options``: CrossShardOptimizer's overlap / shard_optimizer_state (equal rows: no weight);
    ``reduce=False``: the floor, each replica stepping its own gradients."""
    s = cr.MirroredStrategy(replicas, devices=["cpu"] * replicas) if replicas > 1 else cr.OneDeviceStrategy()
    models = s.mirror(model)
    opts = s.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9,
                                                                  foreach=True), **options), args=(models,))
    (batch,) = list(s.distribute_dataset([(x, y)]))

    def run() -> None:
        torch.set_num_threads(threads)
        s.run(replica_step if reduce else replica_step_alone, args=(models, opts, batch[0], batch[1], steps,
                                                                    not options))
    return run, s, opts


def bn_model(hidden: int = 128, seed: int = 0) -> nn.Module:
    """The demo model with a BatchNorm1d after each hidden layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))


def buffer_sync_runner(x: torch.Tensor, y: torch.Tensor, replicas: int, threads: int, steps: int,
                       sync_buffers: str | None) -> Callable[[], None]:
    """``steps`` training steps of :func:`bn_model`, one ``strategy.run`` each."""
    s = cr.MirroredStrategy(replicas, devices=["cpu"] * replicas)
    models = s.mirror(bn_model(), sync_buffers=sync_buffers)
    opts = s.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9,
                                                                  foreach=True)), args=(models,))
    (batch,) = list(s.distribute_dataset([(x, y)]))

    def run() -> None:
        torch.set_num_threads(threads)
        for _ in range(steps):
            s.run(replica_step, args=(models, opts, batch[0], batch[1], 1, False))
    return run


def state_table(opts: dict[str, Any]) -> None:
    """Bytes of optimizer state tensors per replica, per variant."""
    from crossreplica.optim.sharded import state_bytes
    print("| variant | optimizer state per replica (bytes) | vs unsharded |\n|---|---:|---:|")
    base = None
    for name, per in opts.items():
        sizes = [state_bytes(o._sharded.inner if o._sharded is not None else o.optimizer)
                 for o in per.values]
        base = base or max(sizes)
        print(f"| {name} | {' / '.join(str(b) for b in sizes)} | {max(sizes) / base:.3f} |")
    print()


def measure(variants: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def table(title: str, times: dict[str, list[float]], baseline: str) -> None:
    base = statistics.median(times[baseline])
    base_min = min(times[baseline])
    print(title)
    print(f"| {'variant':<56} | {'median ms/step':>14} | {'min ms':>8} | {'median / baseline':>17} "
          f"| {'min / baseline min':>18} |")
    print(f"|{'-' * 58}|{'-' * 15}:|{'-' * 9}:|{'-' * 18}:|{'-' * 19}:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name:<56} | {med * 1e3:>14.2f} | {min(ts) * 1e3:>8.2f} | {med / base:>16.2f}x "
              f"| {min(ts) / base_min:>17.2f}x |")
    print()


def buffer_sync_part(xb: torch.Tensor, yb: torch.Tensor, cores: int, rounds: int, steps: int) -> None:
    """Part 3: BatchNorm buffers kept identical, against no sync. Besides wall time, the
    process's CPU time per step (every thread's): steadier than wall time on a loaded machine."""
    warnings.filterwarnings("ignore", message="the mirrored copies of")  # sync_buffers=None says so once
    for n in (2, 4):
        threads = max(1, cores // n)
        base_name = f"{n} replicas, sync_buffers=None (baseline: no sync)"
        variants = {base_name: buffer_sync_runner(xb, yb, n, threads, steps, None)}
        for policy in ("broadcast", "mean"):
            variants[f"{n} replicas, sync_buffers={policy!r}"] = buffer_sync_runner(xb, yb, n, threads, steps, policy)
        cpu: dict[str, list[float]] = {k: [] for k in variants}

        def timed(fn: Callable[[], None], out: list[float]) -> Callable[[], None]:
            def run() -> None:
                t0 = time.process_time()
                fn()
                out.append((time.process_time() - t0) / steps)
            return run

        title = (f"demo model + BatchNorm1d x 2, global batch 64, SGD, one step per run, {n} replicas x "
                 f"{threads} intra-op thread(s); {rounds} rounds x {steps} steps, interleaved")
        table(title + ": wall time",
              measure({k: timed(fn, cpu[k]) for k, fn in variants.items()}, rounds, steps), base_name)
        # the first entry is measure()'s warm-up
        table(title + ": CPU time of the process (every thread)", {k: ts[1:] for k, ts in cpu.items()}, base_name)


def random_stream_table(x: torch.Tensor, y: torch.Tensor, cores: int, rounds: int, steps: int) -> None:
    """Part 4: the demo step on 2 replicas, one step per ``strategy.run`` (so per-run costs are
    not amortised), with per-replica random streams (the default) and without
    (``extended.random_streams = False``); then what carrying the caller's torch state into
    the replicas costs per run (``torch_state.capture`` + ``applied``, timed alone)."""
    threads = max(1, cores // 2)
    variants = {}
    for on in (False, True):
        run, s, _ = strategy_runner(demo.make_model(), x, y, 2, threads, 1)
        s.extended.random_streams = on
        variants[f"MirroredStrategy, 2 replicas, random_streams={on}"] = (
            lambda run=run: [run() for _ in range(steps)] and None)
    base_name = "MirroredStrategy, 2 replicas, random_streams=False"
    times = measure(variants, rounds, steps)
    table(f"per-replica random streams on the demo step (2 replicas x {threads} intra-op thread(s), one step "
          f"per run); {rounds} rounds x {steps} steps, interleaved", times, base_name)
    reps = 2000
    t0 = time.perf_counter()
    for _ in range(reps):
        with torch_state.applied(torch_state.capture()):
            pass
    per_run = (time.perf_counter() - t0) / reps
    step = statistics.median(times[base_name])
    print(f"caller's torch state carried into the replicas (capture once, apply per replica): "
          f"{per_run * 1e6:.1f} us per capture+apply, {2 * per_run / step * 100:.2f}% of the step "
          f"for 2 replicas\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5, help="steps per round and variant (part 1)")
    ap.add_argument("--demo-steps", type=int, default=20, help="steps per round and variant (part 2)")
    ap.add_argument("--buffers-only", action="store_true", help="part 3 only (BatchNorm buffer sync), no plot")
    ap.add_argument("--quick", action="store_true", help="2 rounds x 1 step (checks the script, measures little)")
    add_plot_arguments(ap, "training_step")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.demo_steps = 2, 1, 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    saved = torch.get_num_threads()
    print(f"torch {torch.__version__}, {cores} cores available, load average {os.getloadavg()[0]:.2f}\n")
    if args.buffers_only:
        x_train, y_train, _, _ = demo.load_digits(0)
        buffer_sync_part(x_train[:64], y_train[:64], cores, args.rounds, args.demo_steps)
        torch.set_num_threads(saved)
        return

    # ---- part 1: the MLP 784-1024-1024-10
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 784, generator=g)
    y = torch.randint(0, 10, (256,), generator=g)
    base_name = "one process, no strategy, 2 intra-op threads (baseline)"
    strat_run, _, plain_opts = strategy_runner(mlp([784, 1024, 1024, 10]), x, y, 2, 1, args.steps)
    overlap_run, _, _ = strategy_runner(mlp([784, 1024, 1024, 10]), x, y, 2, 1, args.steps, overlap=True)
    shard_run, _, shard_opts = strategy_runner(mlp([784, 1024, 1024, 10]), x, y, 2, 1, args.steps,
                                               shard_optimizer_state=True)
    both_run, _, both_opts = strategy_runner(mlp([784, 1024, 1024, 10]), x, y, 2, 1, args.steps,
                                             overlap=True, shard_optimizer_state=True)
    floor_run, _, _ = strategy_runner(mlp([784, 1024, 1024, 10]), x, y, 2, 1, args.steps, reduce=False)
    variants = {
        base_name: plain_runner(mlp([784, 1024, 1024, 10]), x, y, 2, args.steps),
        "MirroredStrategy, 2 replicas x 1 intra-op thread": strat_run,
        "  same, overlap=True": overlap_run,
        "  same, shard_optimizer_state=True": shard_run,
        "  same, overlap=True and shard_optimizer_state=True": both_run,
        "  floor: same, no gradient reduction": floor_run,
    }
    mlp_times = measure(variants, args.rounds, args.steps)
    state_table({"SGD momentum, unsharded": plain_opts, "SGD momentum, shard_optimizer_state=True": shard_opts,
                 "SGD momentum, overlap=True and shard_optimizer_state=True": both_opts})
    mlp_base = base_name
    table(f"MLP 784-1024-1024-10, global batch 256, SGD; {args.rounds} rounds x {args.steps} steps, interleaved",
          mlp_times, base_name)

    # ---- part 2: the demo model
    x_train, y_train, _, _ = demo.load_digits(0)
    xb, yb = x_train[:64], y_train[:64]
    net = demo.make_model()
    base_name = f"plain torch, one device, {cores} intra-op threads (baseline)"
    variants = {base_name: plain_runner(demo.make_model(), xb, yb, cores, args.demo_steps)}
    replicas_of = {}
    for n in (1, 2, 4):
        threads = max(1, cores // n)
        run, _, _ = strategy_runner(demo.make_model(), xb, yb, n, threads, args.demo_steps)
        kind = "OneDeviceStrategy" if n == 1 else "MirroredStrategy"
        variants[f"{kind}, {n} replica(s) x {threads} intra-op thread(s)"] = run
        replicas_of[f"{kind}, {n} replica(s) x {threads} intra-op thread(s)"] = n
    del net
    demo_times = measure(variants, args.rounds, args.demo_steps)
    table(f"demo model (digits MLP 64-128-128-10), global batch 64, SGD; {args.rounds} rounds x "
          f"{args.demo_steps} steps, interleaved", demo_times, base_name)

    buffer_sync_part(xb, yb, cores, args.rounds, args.demo_steps)
    random_stream_table(xb, yb, cores, args.rounds, args.demo_steps)
    torch.set_num_threads(saved)
    if not args.no_plot:
        plot_training_step(mlp_times, mlp_base, demo_times, base_name, replicas_of, args.plot,
                           SMOKE_NOTE if args.quick else None)


if __name__ == "__main__":
    main()
