"""The layout-invariant mode: bitwise identical parameters on every layout, and its cost.

    .venv/bin/python benchmarks/layout_invariance.py            # 200 steps of each model, every layout
    .venv/bin/python benchmarks/layout_invariance.py --steps 40 # quicker

Part 1 trains the demo's MLP (digits, dropout, the CLI's ``--layout-invariant``)
and a transformer encoder (dropout, AdamW) for ``--steps`` steps on one device,
2, 3, 4 and 8 in-process replicas, 2 and 4 processes and 2 processes x 2 replicas
(torchrun), all with ``cr.LayoutInvariant(micro_batches=24)``, and checks that
every final state_dict is bitwise the one-device one.

Part 2 times a training step of the encoder side by side (every mode's step in
turn, in one process), default mode vs the layout-invariant mode on the same
replicas: with one micro-batch per replica (``M = R``: the mode's own cost, the
tree sum and the bookkeeping; the tree sum gathered, sharded, or chosen by
size) and with 24 (smaller micro-batches, the price of supporting 1..24
replicas); and the peak RSS of a fresh process per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import crossreplica as cr
from crossreplica.testing import free_port
from _common import fmt_time, median, print_table

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
M = 24
BATCH = 48


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


def _step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def make_strategy(kind: str, replicas: int, layout: cr.LayoutInvariant | None) -> cr.Strategy:
    if kind == "one_device":
        return cr.OneDeviceStrategy(layout_invariant=layout)
    if kind == "mirrored":
        return cr.MirroredStrategy(num_replicas=replicas, layout_invariant=layout)
    return cr.MultiWorkerMirroredStrategy(replicas_per_worker=replicas, layout_invariant=layout)


def train_encoder(strategy: cr.Strategy, steps: int) -> tuple[dict, list[float]]:
    """The encoder's final state_dict and the seconds of each step."""
    torch.manual_seed(0)
    model = strategy.mirror(Encoder())
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3)), args=(model,))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * BATCH, 12, 8, generator=g)
    y = torch.randint(0, 4, (steps * BATCH,), generator=g)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    torch.manual_seed(5)
    times = []
    for b in strategy.distribute_dataset(batches):
        t0 = time.perf_counter()
        strategy.run(_step, args=(model, opts, b))
        times.append(time.perf_counter() - t0)
    return strategy.experimental_local_results(model)[0].state_dict(), times


def _launch(cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out}")
    return out


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]


LAYOUTS = [  # (name, launcher processes or None, strategy kind, replicas per process)
    ("1 device", None, "one_device", 1),
    ("2 replicas", None, "mirrored", 2), ("3 replicas", None, "mirrored", 3),
    ("4 replicas", None, "mirrored", 4), ("8 replicas", None, "mirrored", 8),
    ("2 processes", 2, "multi_worker", 1), ("4 processes", 4, "multi_worker", 1),
    ("2 processes x 2", 2, "multi_worker", 2),
]


def _demo_params(name: str, nproc: int | None, kind: str, per: int, steps: int, out: str) -> None:
    epochs = max(1, round(steps / 23))  # 1437 training rows in global batches of 64: 23 steps an epoch
    args = ["-m", "crossreplica.cli", "train", "--layout-invariant", "--micro-batches", str(M), "--epochs",
            str(epochs), "--no-progress", "--no-compare", "--dropout", "0.1", "--save-params", out]
    if kind == "one_device":
        args += ["--strategy", "one_device"]
    elif kind == "mirrored":
        args += ["--replicas", str(per)]
    else:
        args += ["--strategy", "multi_worker", "--replicas-per-worker", str(per)]
    _launch((_torchrun(nproc) if nproc else [sys.executable]) + args)


def _encoder_params(name: str, nproc: int | None, kind: str, per: int, steps: int, out: str) -> None:
    args = [os.path.join(HERE, "layout_invariance.py"), "--worker", kind, "--replicas", str(per), "--steps",
            str(steps), "--out", out]
    _launch((_torchrun(nproc) if nproc else [sys.executable]) + args)


def part1(steps: int) -> bool:
    print(f"## Bitwise across layouts ({steps} steps, LayoutInvariant(micro_batches={M}))\n")
    ok = True
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, run in (("demo MLP", _demo_params), ("transformer encoder", _encoder_params)):
            reference = None
            for name, nproc, kind, per in LAYOUTS:
                path = os.path.join(tmp, "params.pt")
                t0 = time.perf_counter()
                run(name, nproc, kind, per, steps, path)
                seconds = time.perf_counter() - t0
                params = torch.load(path)
                if reference is None:
                    reference, same = params, "reference"
                else:
                    diff = [k for k in params if not torch.equal(params[k], reference[k])]
                    same = "bitwise" if not diff else f"DIFFERS in {len(diff)} tensors"
                    ok &= not diff
                rows.append([model, name, same, f"{seconds:.1f} s"])
    print_table(["model", "layout", "final state_dict vs 1 device", "wall (incl. start-up)"], rows)
    return ok


MODES = ("default", "M=R", "M=R gathered", "M=R sharded", f"M={M}")


def _layout_of(mode: str, replicas: int) -> cr.LayoutInvariant | None:
    if mode == "default":
        return None
    return cr.LayoutInvariant(replicas if mode.startswith("M=R") else M)


def _sharded_of(mode: str) -> bool | None:
    return {"M=R gathered": False, "M=R sharded": True}.get(mode)


def part2(reps: int, steps: int) -> None:
    print(f"\n## Step time and memory, encoder, default vs layout-invariant ({steps} steps of every mode in "
          f"turn in one process, median step; peak RSS of a fresh process per mode, median of {reps}; "
          f"OMP_NUM_THREADS=1)\n")
    rows = []
    for replicas in (1, 2, 4):
        kind = "one_device" if replicas == 1 else "mirrored"
        out = _launch([sys.executable, os.path.join(HERE, "layout_invariance.py"), "--side-by-side", kind,
                       "--replicas", str(replicas), "--steps", str(steps)])
        steps_of = json.loads(out.strip().splitlines()[-1])
        for mode in MODES:
            rss = median([json.loads(_launch([sys.executable, os.path.join(HERE, "layout_invariance.py"),
                                               "--measure", mode, "--kind", kind, "--replicas", str(replicas),
                                               "--steps", "10"]).strip().splitlines()[-1])["rss"]
                          for _ in range(reps)])
            rows.append([f"{replicas}", mode, fmt_time(steps_of[mode]), f"{steps_of[mode] / steps_of['default']:.2f}x",
                         f"{rss:.0f} MiB"])
    print_table(["replicas", "mode", "median step", "vs default", "peak RSS"], rows)


def _side_by_side(kind: str, replicas: int, steps: int) -> None:
    """Every mode's step in turn, so drifting load hits them alike."""
    import crossreplica.collectives.tree as tree
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * BATCH, 12, 8, generator=g)
    y = torch.randint(0, 4, (steps * BATCH,), generator=g)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    runs = {}
    for mode in MODES:
        strategy = make_strategy(kind, replicas, _layout_of(mode, replicas))
        torch.manual_seed(0)
        model = strategy.mirror(Encoder())
        opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3)),
                            args=(model,))
        runs[mode] = (strategy, model, opts, iter(strategy.distribute_dataset(batches)))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(steps):
        for mode, (strategy, model, opts, it) in runs.items():
            tree.SHARDED = _sharded_of(mode)
            batch = next(it)
            t0 = time.perf_counter()
            strategy.run(_step, args=(model, opts, batch))
            times[mode].append(time.perf_counter() - t0)
    print(json.dumps({mode: median(ts[3:]) for mode, ts in times.items()}))


def _measure(mode: str, kind: str, replicas: int, steps: int) -> None:
    import crossreplica.collectives.tree as tree
    torch.set_num_threads(1)
    tree.SHARDED = _sharded_of(mode)
    _, times = train_encoder(make_strategy(kind, replicas, _layout_of(mode, replicas)), steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"step": median(times[3:]), "rss": rss}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3, help="fresh processes per timed mode (median)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--side-by-side", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        strategy = make_strategy(args.worker, args.replicas, cr.LayoutInvariant(M))
        params, _ = train_encoder(strategy, args.steps)
        if strategy.extended.input_pipeline_id == 0:
            torch.save(params, args.out)
        return 0
    if args.side_by_side:
        _side_by_side(args.side_by_side, args.replicas, args.steps)
        return 0
    if args.measure:
        _measure(args.measure, args.kind, args.replicas, args.steps)
        return 0
    ok = part1(args.steps)
    part2(args.reps, min(args.steps, 60))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
