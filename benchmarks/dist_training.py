"""Data-parallel training step across processes: crossreplica vs torch DistributedDataParallel.

    PYTHONPATH=$PWD python benchmarks/dist_training.py [--model demo|mlp|cnn|transformer] [--steps 40]

Sides per step, interleaved: DDP, CrossShardOptimizer reducing after
backward, CrossShardOptimizer(overlap=True) reducing buckets during backward
(through gloo, and through shared memory where the workers share a host; the
plot shows DDP against overlap=True), and the floor: the same step with no
gradient reduction at all (each worker's own SGD, the workers drift apart),
the least any data-parallel step can take on these cores.

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

``--device cuda`` trains on the GPUs, worker ``i`` on GPU ``i % count``, and times
each step to the end of its GPU work. The backend is NCCL where every worker has
a GPU of its own, else gloo on the CUDA tensors, for both sides (``--backend``
chooses).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

DROPPED = 3  # first steps left out of the medians (warm-up)


MODELS = ("demo", "mlp", "cnn", "transformer")


def build(model: str, width: int) -> tuple[Any, Callable[[int, int], tuple[Any, Any]]]:
    """(a model factory, batch(step, rank) -> (x, y)) for ``model``."""
    import torch
    from torch import nn

    from crossreplica.demo import make_model

    def seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def made() -> nn.Module:
            torch.manual_seed(0)
            return make()
        return made

    def rows(shape: tuple[int, ...], classes: int, per_row: bool = False) -> Callable[[int, int], tuple[Any, Any]]:
        def batch(step: int, rank: int) -> tuple[Any, Any]:
            g = torch.Generator().manual_seed(step * 1000 + rank)
            return torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)
        return batch

    if model == "demo" and width == 0:
        return (lambda: make_model(128, seed=0)), rows((64, 64), 10)
    if model in ("demo", "mlp"):
        w = width or 2200
        return seeded(lambda: nn.Sequential(nn.Linear(256, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                                            nn.Linear(w, 10))), rows((64, 256), 10)
    if model == "cnn":
        return seeded(lambda: nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))), rows((16, 3, 32, 32), 10)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
            self.body = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
            self.head = nn.Linear(256, 10)

        def forward(self, x: Any) -> Any:
            return self.head(self.body(x).mean(1))
    return seeded(Encoder), rows((16, 32, 256), 10)


def worker(steps: int, model: str, width: int, out_path: str | None, bucket_mb: float,
           device_type: str = "cpu", backend: str | None = None) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import crossreplica as cr

    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        strategy = cr.MultiWorkerMirroredStrategy(timeout_seconds=600, backend=backend, devices=[device])
    else:
        device = torch.device("cpu")
        strategy = cr.MultiWorkerMirroredStrategy(timeout_seconds=600)
    rank = strategy.extended.worker_rank
    torch.set_num_threads(1)
    make, on_host = build(model, width)

    def batch(step: int, rank: int) -> tuple[Any, Any]:
        x, y = on_host(step, rank)
        return x.to(device), y.to(device)

    def placed() -> torch.nn.Module:
        return make().to(device)
    loss_fn = torch.nn.functional.cross_entropy

    def ours(overlap: bool) -> tuple[torch.nn.Module, Callable[[Any, Any], None]]:
        net = placed()
        pack = int(bucket_mb * 2**20) if overlap else cr.optim.DEFAULT_BYTES_PER_PACK
        opt = cr.CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), overlap=overlap,
                                     bytes_per_pack=pack)

        def step_fn(x: Any, y: Any) -> None:
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
        return net, lambda x, y: strategy.run(step_fn, (x, y))

    plain, run_plain = ours(False)
    overlapped, run_overlap = ours(True)
    through_backend, run_backend = ours(True)
    engine = strategy.extended.engine
    reducer = engine.shared_memory

    def run_on_backend(x: Any, y: Any) -> None:
        engine.shared_memory = None  # its buckets are ordinary tensors, all-reduced by gloo
        try:
            run_backend(x, y)
        finally:
            engine.shared_memory = reducer
    ddp = DistributedDataParallel(placed(), device_ids=[device] if device.type == "cuda" else None)
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step(x: Any, y: Any) -> None:
        dopt.zero_grad()
        loss_fn(ddp(x), y).backward()
        dopt.step()

    alone = placed()
    aopt = torch.optim.SGD(alone.parameters(), lr=0.01)

    def floor_step(x: Any, y: Any) -> None:
        aopt.zero_grad()
        loss_fn(alone(x), y).backward()
        aopt.step()

    variants = {"torch DDP": ddp_step, "crossreplica, reduce after backward": run_plain,
                f"crossreplica, overlap=True, buckets through {dist.get_backend()}": run_on_backend,
                "crossreplica, overlap=True": run_overlap,
                "floor: no gradient reduction (each worker's own SGD)": floor_step}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for s in range(steps):
        x, y = batch(s, rank)
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    diffs = {name: max(float((a - b).detach().abs().max()) for a, b in zip(net.parameters(), ddp.module.parameters()))
             for name, net in (("plain", plain), ("overlap", overlapped), ("through the backend", through_backend))}
    if rank == 0:
        n = sum(p.numel() for p in plain.parameters())
        base = statistics.median(times["torch DDP"][DROPPED:])
        where = (f"{torch.cuda.get_device_name(device)}, {dist.get_backend()}" if device.type == "cuda"
                 else f"CPU, {dist.get_backend()}")
        print(f"model {model}: {n} params ({n * 4 / 2**20:.1f} MiB of gradients), {dist.get_world_size()} "
              f"workers on {where}, {steps} steps (first {DROPPED} dropped), variants interleaved per step")
        print("| path | median step | vs DDP |\n|---|---|---|")
        for name, ts in times.items():
            med = statistics.median(ts[DROPPED:])
            print(f"| {name} | {med * 1e3:.2f} ms | {med / base:.3f} |")
        print(f"max abs diff of the final parameters vs DDP: reduce after backward {diffs['plain']:.3g}, "
              f"overlap {diffs['overlap']:.3g}, overlap through the backend {diffs['through the backend']:.3g}; "
              f"same-host shared memory: {'on' if reducer is not None and reducer.enabled else 'off'}")
        if out_path:
            with open(out_path, "w") as f:
                json.dump({"ours": times["crossreplica, overlap=True"][DROPPED:],
                           "ddp": times["torch DDP"][DROPPED:], "params": n,
                           "workers": dist.get_world_size(), "diffs": diffs}, f)
    strategy.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", choices=MODELS, default="demo",
                   help="demo (MLP 64-128-128-10), mlp (256-2200-2200-10, ~20 MiB of gradients), cnn, transformer")
    p.add_argument("--width", type=int, default=0, help="MLP width (demo/mlp; 0: the model's default)")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="overlap=True bucket size in MiB (default 4)")
    p.add_argument("--quick", action="store_true", help="8 steps (a smoke run)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the workers train (default cpu)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="with --device cuda: default nccl where each worker has a GPU of its own, else gloo")
    p.add_argument("--plot", metavar="PATH", help="the PNG to write (default docs/img/dist_training[_w<N>].png)")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.steps = 8
    if a.worker:
        worker(a.steps, a.model, a.width, a.out, a.bucket_mb, a.device, a.backend)
        return
    if a.device == "cuda" and a.backend is None:
        import torch
        a.backend = "nccl" if 0 < a.workers <= torch.cuda.device_count() else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        rc = launch(a, out)
        if rc == 0 and not a.no_plot:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from _plot import SMOKE_NOTE, default_path, plot_dist_training
            with open(out) as f:
                res = json.load(f)
            model = {"demo": "demo MLP 64-128-128-10", "mlp": "MLP 256-2200-2200-10", "cnn": "small CNN",
                     "transformer": "3-layer transformer encoder"}[a.model]
            if a.width and a.model in ("demo", "mlp"):
                model = f"MLP 256-{a.width}-{a.width}-10"
            name = "dist_training" + ("" if a.model == "demo" else f"_{a.model}") + (f"_w{a.width}" if a.width else "")
            plot_dist_training(res["ddp"], res["ours"], a.plot or default_path(name),
                               f"{model} ({res['params'] * 4 / 2**20:.1f} MiB of gradients), "
                               f"{res['workers']} processes, 64 rows each", SMOKE_NOTE if a.quick else None)
    raise SystemExit(rc)


def launch(a: argparse.Namespace, out: str) -> int:
    """Runs the workers under torchrun; returns its exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.workers}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id={secrets.token_hex(8)}",  # the job secret: store keys no one else can guess
           os.path.abspath(__file__), "--worker",
           "--steps", str(a.steps), "--model", a.model, "--width", str(a.width), "--bucket-mb", str(a.bucket_mb),
           "--out", out, "--device", a.device] + (["--backend", a.backend] if a.backend else [])
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
