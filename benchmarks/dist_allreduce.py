"""All-reduce across processes: crossreplica's engine vs raw torch.distributed.all_reduce.

Run as a driver (it launches torchrun itself, on an OS-chosen port):

    PYTHONPATH=$PWD python benchmarks/dist_allreduce.py [--sizes 4K,256K,64M] [--layouts 2x1,4x1,2x2]

Layouts are WORKERSxREPLICAS_PER_WORKER. For each layout and size the workers
alternate the two paths in the same run, on the same process group:

* raw: ``dist.all_reduce(buf)`` in place on a preallocated float32 buffer
  (only for one replica per worker, where it is the like-for-like baseline);
* raw on a fresh copy: ``y = buf.clone(); dist.all_reduce(y)``, what a
  functional all-reduce (input untouched, new output) costs with raw torch;
* engine: ``cr.all_reduce(x, "sum")`` inside ``strategy.run`` (validation,
  call description, a fresh output copy, the sliced wait that checks the abort
  key, and for several replicas per worker the in-process reduction first);
* shared memory (one replica per worker): what CrossShardOptimizer(overlap=True)
  pays per bucket on workers of one host: the copy of the gradient into the
  engine's shared buffer (``engine.shared_buffer``), then the in-place
  all-reduce of that buffer through /dev/shm (``engines/torch_dist/shared_memory.py``).

It prints the median seconds per call on rank 0 and the ratio engine/raw; for
the hierarchical layout (2x2) it compares with the flat layout of the same
replica count (4x1). Results of a run are written as JSON with --json, and
drawn in docs/img/dist_allreduce.png (--plot PATH, --no-plot).
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

UNITS = {"K": 1024, "M": 1024 ** 2}


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


def fmt_size(n: int) -> str:
    return f"{n // UNITS['M']} MiB" if n >= UNITS["M"] else f"{n // UNITS['K']} KiB"


def reps_for(nbytes: int) -> int:
    return max(5, min(200, (256 * UNITS["M"]) // max(nbytes, 1) // 8))


# --------------------------------------------------------------------------- worker

def worker(sizes: list[int], rpw: int, out_path: str, ordered: bool) -> None:
    import torch
    import torch.distributed as dist

    import crossreplica as cr
    from crossreplica.engines.base import AllReduceParams, Call, Kind
    from crossreplica.reduce_op import ReduceOp

    strategy = cr.MultiWorkerMirroredStrategy(rpw, timeout_seconds=600, ordered_reductions=ordered)
    rank = strategy.extended.worker_rank
    engine = strategy.extended.engine
    results = []
    for nbytes in sizes:
        n = nbytes // 4
        reps = reps_for(nbytes)
        raw_t: list[float] = []
        clone_t: list[float] = []
        eng_t: list[float] = []
        shm_t: list[float] = []
        buf = torch.ones(n)
        shared = engine.shared_buffer(n, torch.float32, torch.device("cpu")) if rpw == 1 else None
        if shared is not None:
            call = Call.of(Kind.ALL_REDUCE, (tuple(range(engine.num_replicas)),),
                           AllReduceParams(ReduceOp.SUM, inplace=True), [shared])

            def shared_call(shared: torch.Tensor = shared, buf: torch.Tensor = buf, call: Call = call) -> None:
                shared.copy_(buf)  # the gradient into the bucket, as the optimizer's hook does
                engine.execute_async(rank, call, [shared]).wait()
            shared_call()  # warm-up

        def engine_calls(x: torch.Tensor, k: int) -> list[float]:
            ts = []
            for _ in range(k):
                t0 = time.perf_counter()
                cr.all_reduce(x, "sum")
                ts.append(time.perf_counter() - t0)
            return ts

        xs = cr.PerReplica(tuple(torch.ones(n) for _ in range(rpw)))
        strategy.run(engine_calls, (xs, 2))  # warm-up
        if rpw == 1:
            for _ in range(2):
                dist.all_reduce(buf)
        chunk = max(1, reps // 5)
        done = 0
        while done < reps:
            k = min(chunk, reps - done)
            if rpw == 1:
                dist.barrier()
                for _ in range(k):
                    t0 = time.perf_counter()
                    dist.all_reduce(buf)
                    raw_t.append(time.perf_counter() - t0)
                dist.barrier()
                for _ in range(k):
                    t0 = time.perf_counter()
                    y = buf.clone()
                    dist.all_reduce(y)
                    clone_t.append(time.perf_counter() - t0)
                    del y
            if shared is not None:
                dist.barrier()
                for _ in range(k):
                    t0 = time.perf_counter()
                    shared_call()
                    shm_t.append(time.perf_counter() - t0)
            dist.barrier()
            per = strategy.run(engine_calls, (xs, k))
            eng_t.extend(strategy.experimental_local_results(per)[0])
            done += k
        results.append({"bytes": nbytes, "reps": reps,
                        "raw": statistics.median(raw_t) if raw_t else None,
                        "raw_clone": statistics.median(clone_t) if clone_t else None,
                        "engine": statistics.median(eng_t),
                        "shm": statistics.median(shm_t) if shm_t else None})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    strategy.close()


# --------------------------------------------------------------------------- driver

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(workers: int, rpw: int, sizes: list[int], timeout: float, ordered: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
               os.path.abspath(__file__), "--worker", "--rpw", str(rpw), "--out", out,
               "--sizes", ",".join(str(s) for s in sizes)] + ([] if ordered else ["--unordered"])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                proc.wait(timeout=30)
        if rc != 0:
            raise SystemExit(f"layout {workers}x{rpw} failed with exit code {rc}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M")
    p.add_argument("--layouts", default="2x1,4x1,2x2")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="sizes 4K,64K,1M only (a smoke run)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _plot import add_plot_arguments
    add_plot_arguments(p, "dist_allreduce")
    p.add_argument("--unordered", action="store_true",
                   help="ordered_reductions=False: the backend's ring all-reduce for groups of 3+")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rpw", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.sizes = "4K,64K,1M"
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    if a.worker:
        worker(sizes, a.rpw, a.out, not a.unordered)
        return
    layouts = [tuple(int(v) for v in lay.split("x")) for lay in a.layouts.split(",")]
    all_results = {}
    for w, r in layouts:
        all_results[f"{w}x{r}"] = run_layout(w, r, sizes, a.timeout, not a.unordered)
    print(f"\nall_reduce float32, median seconds per call on rank 0 (torch {__import__('torch').__version__}, "
          f"{os.cpu_count()} CPUs, gloo, ordered_reductions={not a.unordered})\n")
    print("| layout | size | raw in place | raw on a fresh copy | crossreplica engine | engine / raw "
          "| engine / raw-on-copy | shared memory (copy in + in place) | shared memory / raw in place |")
    print("|---|---|---|---|---|---|---|---|---|")
    for lay, res in all_results.items():
        for row in res:
            ms = lambda v: f"{v * 1e3:.3f} ms" if v else "-"  # noqa: E731
            ratio = lambda v, row=row: f"{row['engine'] / v:.3f}" if v else "-"  # noqa: E731
            shm, raw = row.get("shm"), row["raw"]
            shm_ratio = f"{shm / raw:.3f}" if shm and raw else "-"
            print(f"| {lay} | {fmt_size(row['bytes'])} | {ms(raw)} | {ms(row['raw_clone'])} | "
                  f"{ms(row['engine'])} | {ratio(raw)} | {ratio(row['raw_clone'])} | {ms(shm)} | {shm_ratio} |")
    if "2x2" in all_results and "4x1" in all_results:
        print("\nhierarchical (2 workers x 2 replicas) vs flat (4 workers x 1 replica), 4 replicas in sync\n")
        print("| size | flat 4x1 engine | hierarchical 2x2 engine | hierarchical / flat |")
        print("|---|---|---|---|")
        for f_row, h_row in zip(all_results["4x1"], all_results["2x2"]):
            print(f"| {fmt_size(f_row['bytes'])} | {f_row['engine'] * 1e3:.3f} ms | "
                  f"{h_row['engine'] * 1e3:.3f} ms | {h_row['engine'] / f_row['engine']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(all_results, f, indent=1)
    if not a.no_plot:
        from _plot import SMOKE_NOTE, plot_dist_allreduce
        plot_dist_allreduce(all_results, a.plot, SMOKE_NOTE if a.quick else None)


if __name__ == "__main__":
    main()
