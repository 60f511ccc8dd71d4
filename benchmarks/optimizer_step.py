"""Optimizer step with many small parameters: fused packs vs one all-reduce per tensor.

200 parameter tensors of 64..1024 floats, 4 in-process replicas. Each replica
function sets its gradients and steps:

* fused:   cr.CrossShardOptimizer(SGD).step(): every gradient packed into flat
           buffers, all of them in ONE engine call;
* per-tensor: cr.all_reduce(grad, "mean") for each gradient (200 engine
           calls, the baseline), then SGD.step().

The gradients are set once: a mean of identical values is the value again
(exactly, for a power-of-two replica count), so every step does the same work
without re-creating 200 gradients in the timed loop. Both variants use
SGD(foreach=True); the table also times the gradient reduction alone
(``synchronize()`` vs the per-tensor all-reduces), which is what fusion changes.

All variants run interleaved in the same process; the table gives the median
time per step over rounds and the ratio against the per-tensor baseline.

    PYTHONPATH=. python benchmarks/optimizer_step.py [--replicas 4] [--params 200] [--rounds 15]
    PYTHONPATH=. python benchmarks/optimizer_step.py --quick   # a smoke run: 3 rounds x 3 steps

It also draws docs/img/optimizer_step.png (--plot PATH, --no-plot).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _plot import SMOKE_NOTE, add_plot_arguments, plot_optimizer_step

import crossreplica as cr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20, help="steps per round and variant")
    ap.add_argument("--quick", action="store_true", help="3 rounds x 3 steps (checks the script, measures little)")
    add_plot_arguments(ap, "optimizer_step")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 3
    torch.set_num_threads(1)
    n = args.replicas
    s = cr.MirroredStrategy(n, devices=["cpu"] * n)
    g = torch.Generator().manual_seed(0)
    sizes = [int(x) for x in torch.randint(64, 1025, (args.params,), generator=g)]
    params = s.mirror([torch.zeros(k, requires_grad=True) for k in sizes])
    grads = cr.PerReplica([[torch.randn(k, generator=g) for k in sizes] for _ in range(n)])
    fused = s.run(lambda ps: cr.CrossShardOptimizer(torch.optim.SGD(ps, lr=0.01, foreach=True)), args=(params,))
    plain = s.run(lambda ps: torch.optim.SGD(ps, lr=0.01, foreach=True), args=(params,))

    def set_grads(ps, gs):
        for p, gr in zip(ps, gs):
            p.grad = gr.clone()

    def fused_step(ps, gs, opt):
        for _ in range(args.steps):
            opt.step()

    def per_tensor_step(ps, gs, opt):
        for _ in range(args.steps):
            for p in ps:
                p.grad.copy_(cr.all_reduce(p.grad, "mean"))
            opt.step()

    def fused_reduce(ps, gs, opt):
        for _ in range(args.steps):
            opt.synchronize()
            opt.zero_grad(set_to_none=False)  # forgets the synchronize (zeroing: extra work for fused only)

    def per_tensor_reduce(ps, gs, opt):
        for _ in range(args.steps):
            for p in ps:
                p.grad.copy_(cr.all_reduce(p.grad, "mean"))

    # Same numbers either way (checked once, bitwise).
    def check(ps, gs, opt_f, opt_p):
        set_grads(ps, gs)
        ref = [cr.all_reduce(p.grad, "mean") for p in ps]
        opt_f.synchronize()
        ok = all(torch.equal(p.grad, r) for p, r in zip(ps, ref))
        opt_f.zero_grad()
        return torch.tensor(ok)

    assert all(bool(v) for v in s.experimental_local_results(s.run(check, args=(params, grads, fused, plain))))

    s.run(set_grads, args=(params, grads))
    variants = {"reduce: per-tensor all_reduce (baseline)": (per_tensor_reduce, plain),
                "reduce: fused synchronize()": (fused_reduce, fused),
                "step: per-tensor all_reduce + SGD (baseline)": (per_tensor_step, plain),
                "step: fused CrossShardOptimizer.step()": (fused_step, fused)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn, opt in variants.values():  # warm-up
        s.run(fn, args=(params, grads, opt))
    for _ in range(args.rounds):
        for name, (fn, opt) in variants.items():
            t0 = time.perf_counter()
            s.run(fn, args=(params, grads, opt))
            times[name].append((time.perf_counter() - t0) / args.steps)
    total = sum(sizes) * 4
    print(f"optimizer step, {args.params} params ({total / 1024:.0f} KiB of fp32 gradients), {n} replicas, "
          f"torch threads 1, {args.rounds} rounds x {args.steps} steps, interleaved")
    print(f"| {'variant':<46} | {'median ms':>10} | {'min ms':>8} | {'speed-up vs baseline':>20} |")
    print(f"|{'-' * 48}|{'-' * 12}:|{'-' * 9}:|{'-' * 21}:|")
    names = list(times)
    for i, name in enumerate(names):
        base = statistics.median(times[names[i - i % 2]])
        med = statistics.median(times[name])
        print(f"| {name:<46} | {med * 1e3:>10.3f} | {min(times[name]) * 1e3:>8.3f} | {base / med:>19.1f}x |")
    if not args.no_plot:
        plot_optimizer_step(times, args.plot, f"CrossShardOptimizer: {args.params} gradients "
                            f"({total / 1024:.0f} KiB), {n} in-process replicas", SMOKE_NOTE if args.quick else None)


if __name__ == "__main__":
    main()
