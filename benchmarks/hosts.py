"""Data-parallel training step across simulated hosts with a limited link: crossreplica vs DDP.

    sudo PYTHONPATH=$PWD python benchmarks/hosts.py [--rates 1gbit 200mbit] [--per-host 1 2] [--steps 12]
    sudo PYTHONPATH=$PWD python benchmarks/hosts.py --rates 1gbit --per-host 2 --parts

Two simulated hosts (``crossreplica.testing.hosts``: network namespaces on a
bridge, each host's link limited by a ``tc`` token bucket, both ways), 1 or 2
worker processes per host (RANK, MASTER_ADDR, ...), one intra-op thread each. Every step
trains the same model on the same per-replica batches with each variant in
turn: torch DDP (its default 25 MiB buckets, overlapped with backward), and
CrossShardOptimizer reducing after backward or with ``overlap=True``. With 3
replicas or more the reduction is the ordered (deterministic) one, along the
chain of hosts (``engines/torch_dist/chain.py``); for comparison, the same
without pipelining (the chain's slices in one piece), the ordered all-reduce
it replaces (``ordered.py``), and the backend's ring (``ordered_reductions=False``,
not deterministic across layouts). Compressed reductions: ours with
``compression=torch.bfloat16`` (after backward and overlapped) against DDP with its
``bf16_compress_hook`` registered (``fp16_compress_hook`` where the backend has no
bfloat16; the row's name says which ran). Medians over the steps after warm-up, and
the bytes each step sent across hosts (the hosts' ``eth0`` transmit counters,
``/proc/net/dev``, summed over both hosts; the store's and barrier's small
messages included). ``--parts`` times what the step is made of instead (also in
bfloat16: the link, the chain, the ring and the casts).
Needs root (``crossreplica.testing.hosts.available``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DROPPED = 3  # first steps left out of the medians (warm-up)
COMPRESSED = "crossreplica bf16 compression, after backward"
COMPRESSED_OVERLAP = "crossreplica bf16 compression, overlap=True"


def tx_bytes() -> int:
    """Bytes this host (network namespace) has sent on eth0, its link to the other hosts."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0


def exit_now() -> None:
    """Ends a worker without freeing its objects: freeing DDP's reducer after the strategy
    closed frees the gloo process group while holding the GIL, and the group's destructor
    joins threads that may need the GIL to free a finished work's tensors
    (pytorch/pytorch#56297); workers here hung that way once their results were in."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def mlp(width: int) -> Any:
    """The benchmark's model, the same initial weights on every worker and variant."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def worker(steps: int, width: int, rows: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import crossreplica as cr
    from crossreplica.engines.torch_dist import chain

    strategy = cr.MultiWorkerMirroredStrategy(timeout_seconds=600)
    rank, world = strategy.extended.worker_rank, dist.get_world_size()
    first_on_host = int(os.environ.get("LOCAL_RANK", "0")) == 0
    torch.set_num_threads(1)
    engine = strategy.extended.engine
    loss_fn = torch.nn.functional.cross_entropy

    def ours(overlap: bool, compression: Any = None,
             **engine_settings: Any) -> tuple[nn.Module, Callable[[Any, Any], None]]:
        net = mlp(width)
        opt = cr.CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), overlap=overlap,
                                     compression=compression)

        def step_fn(x: Any, y: Any) -> None:
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()

        def run(x: Any, y: Any) -> None:
            saved = {k: getattr(engine, k) for k in ("chain_reductions", "ordered_reductions")}
            saved_piece = chain.PIECE_BYTES
            for k, v in engine_settings.items():
                if k == "piece_bytes":
                    chain.PIECE_BYTES = v
                else:
                    setattr(engine, k, v)
            try:
                strategy.run(step_fn, (x, y))
            finally:
                for k, v in saved.items():
                    setattr(engine, k, v)
                chain.PIECE_BYTES = saved_piece
        return net, run

    ddp = DistributedDataParallel(mlp(width))
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step(x: Any, y: Any) -> None:
        dopt.zero_grad()
        loss_fn(ddp(x), y).backward()
        dopt.step()

    # DDP's bfloat16 hook where the backend reduces bfloat16 (gloo does on torch 2.13), else its float16 one.
    # DDP refuses a hook named bf16_compress_hook without CUDA and NCCL (a check of the name alone), so
    # torch's hook is registered under another name: the same function runs, on gloo.
    try:
        dist.all_reduce(torch.zeros(1, dtype=torch.bfloat16))
        hook_name, torch_hook = "bf16_compress_hook", default_hooks.bf16_compress_hook
    except (RuntimeError, ValueError, TypeError):
        hook_name, torch_hook = "fp16_compress_hook", default_hooks.fp16_compress_hook

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks the annotations
        return torch_hook(state, bucket)

    ddp_hooked = DistributedDataParallel(mlp(width))
    ddp_hooked.register_comm_hook(None, hook)
    hopt = torch.optim.SGD(ddp_hooked.parameters(), lr=0.01)

    def hooked_step(x: Any, y: Any) -> None:
        hopt.zero_grad()
        loss_fn(ddp_hooked(x), y).backward()
        hopt.step()

    hooked = f"torch DDP + {hook_name}"
    nets: dict[str, nn.Module] = {"torch DDP": ddp.module, hooked: ddp_hooked.module}
    variants: dict[str, Callable[[Any, Any], None]] = {"torch DDP": ddp_step, hooked: hooked_step}
    bf16 = torch.bfloat16
    sides: list[tuple[str, bool, Any, dict[str, Any]]] = [
        ("crossreplica, reduce after backward", False, None, {}), ("crossreplica, overlap=True", True, None, {}),
        (COMPRESSED, False, bf16, {}), (COMPRESSED_OVERLAP, True, bf16, {})]
    if world > 2:  # the ordered path (3 replicas or more)
        sides += [("  chain in one piece (no pipelining), after backward", False, None, {"piece_bytes": 0}),
                  ("  before: ordered.py, after backward", False, None, {"chain_reductions": False}),
                  ("  before: ordered.py, overlap=True", True, None, {"chain_reductions": False}),
                  ("  backend ring (ordered_reductions=False), after backward", False, None,
                   {"ordered_reductions": False})]
    for name, overlap, compression, settings in sides:
        nets[name], variants[name] = ours(overlap, compression, **settings)
    times: dict[str, list[float]] = {k: [] for k in variants}
    sent: dict[str, list[int]] = {k: [] for k in variants}
    for s in range(steps):
        g = torch.Generator().manual_seed(s * 1000 + rank)
        x, y = torch.randn(rows, 256, generator=g), torch.randint(0, 10, (rows,), generator=g)
        for name, fn in variants.items():
            dist.barrier()
            before = tx_bytes()
            t0 = time.perf_counter()
            fn(x, y)
            times[name].append(time.perf_counter() - t0)
            dist.barrier()
            sent[name].append(tx_bytes() - before if first_on_host else 0)
    per_worker: list[Any] = [None] * world
    dist.all_gather_object(per_worker, sent)
    if rank == 0:
        n = sum(p.numel() for p in ddp.module.parameters())
        base = statistics.median(times["torch DDP"][DROPPED:])
        cross = {name: statistics.median([sum(w[name][i] for w in per_worker) for i in range(DROPPED, steps)])
                 for name in variants}
        print(f"MLP 256-{width}-{width}-10: {n} params ({n * 4 / 2**20:.1f} MiB of gradients), {world} workers, "
              f"{rows} rows each, {steps} steps (first {DROPPED} dropped), variants interleaved per step")
        print("| path | median step | vs DDP | sent across hosts per step | vs DDP |\n|---|---|---|---|---|")
        for name, ts in times.items():
            med = statistics.median(ts[DROPPED:])
            print(f"| {name.strip()} | {med * 1e3:.1f} ms | {med / base:.2f} | {cross[name] / 2**20:.1f} MiB | "
                  f"{cross[name] / cross['torch DDP']:.2f} |")
        ref = nets["crossreplica, reduce after backward"]
        same = {name: all(torch.equal(a, b) for a, b in zip(ref.parameters(), net.parameters()))
                for name, net in nets.items() if not name.startswith("torch DDP") and "ring" not in name
                and name not in (COMPRESSED, COMPRESSED_OVERLAP)}
        print("final parameters bitwise those of reduce after backward: "
              + ", ".join(f"{name.strip()}: {'yes' if ok else 'NO'}" for name, ok in same.items()), flush=True)
        compressed_same = all(torch.equal(a, b) for a, b in zip(nets[COMPRESSED].parameters(),
                                                                nets[COMPRESSED_OVERLAP].parameters()))
        best = min(statistics.median(times[name][DROPPED:]) for name in (COMPRESSED, COMPRESSED_OVERLAP))
        print(f"bf16 compression, the faster of its two rows: {best / base:.2f}x torch DDP, "
              f"{best / statistics.median(times[hooked][DROPPED:]):.2f}x {hooked}; its overlapped parameters bitwise "
              f"those after backward: {'yes' if compressed_same else 'NO'}", flush=True)
    strategy.close()
    exit_now()


def parts(width: int, rows: int, reps: int = 7) -> None:
    """``--parts``: what a 2 x 2 step is made of, each part timed on every worker at once:
    forward and backward, the link's floor (each host's owners exchanging their slices with
    the other host's), the chain alone and DDP's ring alone, on the step's gradient size."""
    import torch
    import torch.distributed as dist

    import crossreplica as cr
    from crossreplica.engines.torch_dist import chain

    strategy = cr.MultiWorkerMirroredStrategy(timeout_seconds=600)
    torch.set_num_threads(1)
    rank, world, engine = dist.get_rank(), dist.get_world_size(), strategy.extended.engine
    net = mlp(width)
    x, y = torch.randn(rows, 256), torch.randint(0, 10, (rows,))
    vector = torch.randn(sum(p.numel() for p in net.parameters()))
    hosts = chain.host_layout(engine)
    per_host = len(hosts[0])
    half = vector[: vector.numel() // per_host]
    peer = (rank + per_host) % world  # the same owner on the other host
    inbox = torch.empty_like(half)

    def backward() -> None:
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()

    def link() -> None:
        sends = [dist.isend(half, peer), dist.irecv(inbox, peer)]
        for work in sends:
            work.wait()

    narrow = vector.to(torch.bfloat16)
    from crossreplica.reduce_op import compress, decompress

    def link_narrow() -> None:
        half16 = narrow[: narrow.numel() // per_host]
        sends = [dist.isend(half16, peer), dist.irecv(torch.empty_like(half16), peer)]
        for work in sends:
            work.wait()

    def casts() -> None:  # what compression adds on each worker: the cast down, and back up
        decompress(compress(vector, torch.bfloat16, 4.0), torch.float32, 4.0, 4, out=vector)

    timed = {"forward + backward": backward,
             f"the link's floor: {half.numel() * 4 / 2**20:.2f} MiB each way between owners, all at once": link,
             f"the chain alone ({vector.numel() * 4 / 2**20:.1f} MiB)":
                 lambda: chain.reduce_vectors(engine, hosts, cr.ReduceOp.SUM, [vector]),
             "DDP's ring alone (gloo all_reduce)": lambda: dist.all_reduce(vector.clone()),
             f"bf16: the link's floor ({half.numel() * 2 / 2**20:.2f} MiB each way)": link_narrow,
             f"bf16: the chain alone ({narrow.numel() * 2 / 2**20:.1f} MiB)":
                 lambda: chain.reduce_vectors(engine, hosts, cr.ReduceOp.SUM, [narrow]),
             "bf16: DDP's ring alone (gloo all_reduce)": lambda: dist.all_reduce(narrow.clone()),
             "bf16: the casts down and back up of the whole gradient": casts}
    medians = {}
    for name, fn in timed.items():
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        medians[name] = statistics.median(times)
    if rank == 0:
        print(f"{world} workers on {len(hosts)} hosts, medians of {reps} on rank 0\n| part | time |\n|---|---|")
        for name, t in medians.items():
            print(f"| {name} | {t * 1e3:.1f} ms |", flush=True)
    strategy.close()
    exit_now()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"], help="link rates (tc), e.g. 1gbit")
    p.add_argument("--per-host", nargs="+", type=int, default=[1, 2], help="worker processes per host")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=2200, help="MLP width (2200: ~20 MiB of gradients)")
    p.add_argument("--rows", type=int, default=16, help="rows per replica and step")
    p.add_argument("--parts", action="store_true",
                   help="time the parts of the step instead (forward and backward, the link, the chain, the ring)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        if a.parts:
            parts(a.width, a.rows)
        else:
            worker(a.steps, a.width, a.rows)
        return
    from crossreplica.testing.hosts import SimulatedHosts, available

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the hosts are removed on the way out
    reason = available()
    if reason is not None:
        raise SystemExit(f"benchmarks/hosts.py: {reason}")
    env = dict(os.environ, OMP_NUM_THREADS="1", CROSSREPLICA_JOB_SECRET=secrets.token_hex(16),
               PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    for rate in a.rates:
        for per_host in a.per_host:
            print(f"\n### 2 hosts x {per_host} process(es), link {rate}\n", flush=True)
            with SimulatedHosts(2, rate=rate) as hosts, tempfile.TemporaryFile("w+") as log:
                # Launched directly (the torch.distributed environment per process), not by torchrun:
                # its agents' store connections broke under a saturated link, and they then wait 300 s.
                job = {**env, "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": str(20000 + secrets.randbelow(20000)),
                       "WORLD_SIZE": str(2 * per_host)}
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(a.steps),
                       "--width", str(a.width), "--rows", str(a.rows), *(["--parts"] if a.parts else [])]
                procs = [hosts.start(h, cmd, env={**job, "RANK": str(h * per_host + i), "LOCAL_RANK": str(i)},
                                     cwd=REPO, stdout=None if h == i == 0 else log, stderr=subprocess.STDOUT)
                         for h in range(2) for i in range(per_host)]
                codes = [proc.wait(timeout=1800) for proc in procs]
                if any(codes):
                    log.seek(0)
                    print(log.read()[-5000:], file=sys.stderr)
                    raise SystemExit(f"benchmarks/hosts.py: the workers exited with {codes}")


if __name__ == "__main__":
    main()
