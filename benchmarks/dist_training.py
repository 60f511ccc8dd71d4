"""Data-parallel training step across processes: crossreplica vs torch DistributedDataParallel.

    PYTHONPATH=$PWD python benchmarks/dist_training.py [--workers 2] [--steps 40] [--width N]

Both sides train the same model on the same per-replica batches over gloo in
the same run, one intra-op thread per process. The default model is the demo's
(crossreplica.demo.make_model: MLP 64-128-128-10); ``--width N`` trains an MLP
256-N-N-10 instead. crossreplica: ``strategy.run(step)`` with
``cr.CrossShardOptimizer(SGD)`` (gradients packed and all-reduced in place).
DDP: ``DistributedDataParallel(model)`` with its default 25 MiB buckets, which
overlap the reduction with the backward pass. Prints median step times on
rank 0 and checks that both end with the same parameters. The driver draws
docs/img/dist_training.png (docs/img/dist_training_w<N>.png with --width N;
--plot PATH, --no-plot). ``--quick``: 8 steps, a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

DROPPED = 3  # first steps left out of the medians (warm-up)


def worker(steps: int, width: int, out_path: str | None) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import crossreplica as cr

    strategy = cr.MultiWorkerMirroredStrategy(timeout_seconds=600)
    rank = strategy.extended.worker_rank

    from crossreplica.demo import make_model

    torch.set_num_threads(1)
    inputs = 64 if width == 0 else 256

    def make() -> torch.nn.Module:
        if width == 0:
            return make_model(128, seed=0)
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                   torch.nn.ReLU(), torch.nn.Linear(width, 10))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return torch.randn(64, inputs, generator=g), torch.randint(0, 10, (64,), generator=g)

    ours = make()
    opt = cr.CrossShardOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01))
    params = list(ours.parameters())

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ours(x), y).backward()
        opt.step()

    ddp = DistributedDataParallel(make())
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        dopt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        dopt.step()

    t_ours, t_ddp = [], []
    for s in range(steps):
        x, y = batch(s)
        dist.barrier()
        t0 = time.perf_counter()
        strategy.run(step_fn, (x, y))
        t_ours.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        ddp_step(x, y)
        t_ddp.append(time.perf_counter() - t0)
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours.parameters(), ddp.module.parameters()))
    if rank == 0:
        n = sum(p.numel() for p in params)
        a, b = statistics.median(t_ours[DROPPED:]), statistics.median(t_ddp[DROPPED:])
        print(f"params {n} ({n * 4 / 2**20:.1f} MiB of gradients), {dist.get_world_size()} workers, "
              f"batch 64 per replica, {steps} steps (first {DROPPED} dropped)")
        print("| path | median step | vs DDP |\n|---|---|---|")
        print(f"| torch DDP | {b * 1e3:.2f} ms | 1.00 |")
        print(f"| crossreplica (CrossShardOptimizer) | {a * 1e3:.2f} ms | {a / b:.2f} |")
        print(f"final parameters equal: {same}")
        if out_path:
            with open(out_path, "w") as f:
                json.dump({"ours": t_ours[DROPPED:], "ddp": t_ddp[DROPPED:], "params": n,
                           "workers": dist.get_world_size(), "same": same}, f)
    strategy.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=0, help="MLP width (default 0: the demo model)")
    p.add_argument("--quick", action="store_true", help="8 steps (a smoke run)")
    p.add_argument("--plot", metavar="PATH", help="the PNG to write (default docs/img/dist_training[_w<N>].png)")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.steps = 8
    if a.worker:
        worker(a.steps, a.width, a.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        rc = launch(a, out)
        if rc == 0 and not a.no_plot:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from _plot import SMOKE_NOTE, default_path, plot_dist_training
            with open(out) as f:
                res = json.load(f)
            model = "demo MLP 64-128-128-10" if a.width == 0 else f"MLP 256-{a.width}-{a.width}-10"
            plot_dist_training(res["ddp"], res["ours"],
                               a.plot or default_path("dist_training" + (f"_w{a.width}" if a.width else "")),
                               f"{model} ({res['params'] * 4 / 2**20:.1f} MiB of gradients), "
                               f"{res['workers']} processes, 64 rows each", SMOKE_NOTE if a.quick else None)
    raise SystemExit(rc)


def launch(a: argparse.Namespace, out: str) -> int:
    """Runs the workers under torchrun; returns its exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.workers}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", os.path.abspath(__file__), "--worker",
           "--steps", str(a.steps), "--width", str(a.width), "--out", out]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
