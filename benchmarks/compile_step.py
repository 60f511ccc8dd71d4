"""Training step with collectives: torch.compile(fullgraph=True) against eager.

A small MLP 64-128-128-10 (global batch 128, SGD lr 0.1) on 2 in-process
replicas (MirroredStrategy, one intra-op thread each). The step is one
function: forward with a cross-replica mean of the hidden activations (a
distributed-batch-norm-like statistic, so the backward crosses replicas too),
gradients by ``torch.autograd.grad``, then ``cr.all_reduce(grads, "mean")`` and
the update. The compiled variant compiles the loss and the update with
``torch.compile(fullgraph=True)`` (the backward is AOTAutograd's, compiled with
the loss); the collectives are custom operators in their graphs.
(``torch.func.grad`` of a compiled collective is not supported by torch 2.13's
custom-operator autograd, so the step is not one function transform.)

The baseline is plain torch's own gain: the same step without collectives (the
statistic over the replica's rows, no gradient all-reduce) on one thread of the
caller, with the same 64 rows, eager and compiled. The target (issue: compiled
code pays only torch's own cost) is crossreplica's compiled/eager ratio at most
1.05x plain torch's.

Every variant runs in the same process, interleaved round by round; the table
gives the median ms per step over the rounds and the ratio compiled / eager.
Compilation (the first call of the compiled step) is timed separately.

    PYTHONPATH=. python benchmarks/compile_step.py [--rounds 7] [--steps 20] [--per-call]

``--per-call`` adds where a compiled collective's time goes, on one replica (no
peer to wait for): a 4 KiB all-reduce eagerly, through its custom operator
eagerly, and compiled (through ``cr.all_reduce`` and through the operator
directly), beside a compiled ``x * 2 + 1``, with the guards each compiled
function checks on every call.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any
from collections.abc import Callable

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median_time  # noqa: E402

import crossreplica as cr  # noqa: E402

SIZES = (64, 128, 128, 10)


def init_params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        params.append(torch.randn(fan_in, fan_out, generator=gen) / fan_in ** 0.5)
        params.append(torch.zeros(fan_out))
    return params


def loss_fn(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2, w3, b3 = params
    h = torch.relu(x @ w1 + b1)
    h = h - cr.cross_replica_mean(h.mean(0))  # a statistic over the global batch
    h = torch.relu(h @ w2 + b2)
    return F.cross_entropy(h @ w3 + b3, y)


def update(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = cr.all_reduce(grads, "mean")
    return [p - 0.1 * g for p, g in zip(params, grads)]


def make_step(loss: Callable[..., torch.Tensor], upd: Callable[..., list[torch.Tensor]]) -> Callable[..., Any]:
    def step(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        params = [p.detach().requires_grad_(True) for p in params]
        value = loss(params, x, y)
        grads = torch.autograd.grad(value, params)
        with torch.no_grad():
            return upd([p.detach() for p in params], list(grads)), value.detach()
    return step


def plain_loss_fn(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2, w3, b3 = params
    h = torch.relu(x @ w1 + b1)
    h = h - h.mean(0)  # the statistic over the rows at hand
    h = torch.relu(h @ w2 + b2)
    return F.cross_entropy(h @ w3 + b3, y)


def plain_update(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p - 0.1 * g for p, g in zip(params, grads)]


step = make_step(loss_fn, update)
compiled_step = make_step(torch.compile(loss_fn, fullgraph=True), torch.compile(update, fullgraph=True))
plain_step = make_step(plain_loss_fn, plain_update)
plain_compiled_step = make_step(torch.compile(plain_loss_fn, fullgraph=True),
                                torch.compile(plain_update, fullgraph=True))


def replica(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, fn_name: str, steps: int) -> float:
    fn = compiled_step if fn_name == "compiled" else step
    t0 = time.perf_counter()
    for _ in range(steps):
        params, loss = fn(params, x, y)
    return (time.perf_counter() - t0) / steps


def per_call(calls: int = 3000, rounds: int = 7) -> None:
    strategy = cr.MirroredStrategy(num_replicas=1)
    x = torch.ones(1024)
    op = torch.ops.crossreplica.all_reduce.default
    variants: dict[str, Callable[[torch.Tensor], Any]] = {
        "cr.all_reduce, eager": lambda t: cr.all_reduce(t, "sum"),
        "its custom operator, eager": lambda t: op([t], [0], 1, "SUM;F"),
        "cr.all_reduce, compiled": torch.compile(lambda t: cr.all_reduce(t, "sum"), fullgraph=True),
        "its custom operator, compiled": torch.compile(lambda t: op([t], [0], 1, "SUM;F")[0], fullgraph=True),
        "x * 2 + 1, eager": lambda t: t * 2 + 1,
        "x * 2 + 1, compiled": torch.compile(lambda t: t * 2 + 1, fullgraph=True),
    }

    def measure() -> list[list[str]]:
        rows = []
        for name, fn in variants.items():
            fn(x)  # compiles
            guards = (str(len(torch._dynamo.explain(fn._torchdynamo_orig_callable)(x).out_guards))  # type: ignore[attr-defined]
                      if hasattr(fn, "_torchdynamo_orig_callable") else "-")
            rows.append([name, f"{median_time(functools.partial(fn, x), calls, rounds) * 1e6:.1f}", guards])
        return rows

    rows = strategy.run(measure)
    print()
    print(f"One replica, 4 KiB, medians of {rounds} x {calls} calls:")
    print()
    print("| call | us per call | guards per call |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-call", action="store_true", help="also time one compiled collective's layers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = cr.MirroredStrategy(num_replicas=2)
    gen = torch.Generator().manual_seed(1)
    xs = cr.PerReplica([torch.randn(64, SIZES[0], generator=gen) for _ in range(2)])
    ys = cr.PerReplica([torch.randint(0, SIZES[-1], (64,), generator=gen) for _ in range(2)])
    params = init_params()

    def run(name: str, steps: int) -> float:
        if name.startswith("plain"):
            fn, p = (plain_compiled_step if name == "plain compiled" else plain_step), params
            x, y = strategy.experimental_local_results(xs)[0], strategy.experimental_local_results(ys)[0]
            t0 = time.perf_counter()
            for _ in range(steps):
                p, _ = fn(p, x, y)
            return (time.perf_counter() - t0) / steps
        out = strategy.run(replica, args=(params, xs, ys, name, steps))
        return max(strategy.experimental_local_results(out))  # the step ends when both replicas are done

    t0 = time.perf_counter()
    run("compiled", 1)
    compile_s = time.perf_counter() - t0
    run("plain compiled", 1)
    run("eager", 2)  # warm-up
    run("plain eager", 2)

    # the same numbers: one step each
    same = strategy.run(lambda p, x, y: max((a - b).abs().max().item() for a, b in
                                            zip(step(p, x, y)[0], compiled_step(p, x, y)[0])),
                        args=(params, xs, ys))
    times: dict[str, list[float]] = {"eager": [], "compiled": [], "plain eager": [], "plain compiled": []}
    for _ in range(args.rounds):
        for name in times:
            times[name].append(run(name, args.steps))
    eager, comp = statistics.median(times["eager"]), statistics.median(times["compiled"])
    plain_eager, plain_comp = statistics.median(times["plain eager"]), statistics.median(times["plain compiled"])
    print(f"MLP {'-'.join(map(str, SIZES))}, 2 in-process replicas x 64 rows, {args.rounds} rounds x "
          f"{args.steps} steps; first compiled call (compilation) {compile_s:.1f} s; "
          f"max |eager - compiled| after one step {max(strategy.experimental_local_results(same)):.2e}")
    print()
    print("| variant                            | median ms / step | ratio to its eager |")
    print("|------------------------------------|------------------|--------------------|")
    print(f"| crossreplica, 2 replicas, eager    | {eager * 1e3:16.3f} | {1.0:18.2f} |")
    print(f"| crossreplica, 2 replicas, compiled | {comp * 1e3:16.3f} | {comp / eager:18.2f} |")
    print(f"| plain torch, one thread, eager     | {plain_eager * 1e3:16.3f} | {1.0:18.2f} |")
    print(f"| plain torch, one thread, compiled  | {plain_comp * 1e3:16.3f} | {plain_comp / plain_eager:18.2f} |")
    print()
    print(f"crossreplica's compiled/eager over plain torch's: {(comp / eager) / (plain_comp / plain_eager):.3f}x "
          f"(target at most 1.05x)")
    if args.per_call:
        per_call()


if __name__ == "__main__":
    main()
