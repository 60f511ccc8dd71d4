"""The single-controller design, measured before it is built (issue 23).

    PYTHONPATH=$PWD python benchmarks/single_controller.py [--replicas 1 2 4 64] [--runs 300] [--rounds 7]
    PYTHONPATH=$PWD python benchmarks/single_controller.py --vs-jax   # + JAX pmap (vs_jax_tf.py --setup first)

The threads engine runs each in-process replica on a thread of its own; every
``strategy.run`` and every collective hands the GIL from thread to thread, and
each hand-off is a futex wake-up (about 25 us on a 2-core VM). The design the
issue names first runs every replica on the caller's thread instead, as a
greenlet, switching only where a replica must wait for the others (a
collective). This script measures that design's ceiling with a prototype
scheduler, side by side with the real ``strategy.run``:

* **per run**: an empty replica function, and one 4 KiB all-reduce (target 3:
  at most 60 us at 2 replicas, 15 us per extra replica at 64). The prototype
  does per replica what the threads engine does (the caller's torch state
  applied, the replica's random stream entered, a context frame pushed) and, at
  every switch, what a real engine would have to add: the waiting replica's
  torch state, context stack and random stream taken out and put back. A bare
  column leaves all of that out: the mechanism alone.
* **the demo's step** at 2 replicas (MLP 64-128-128-10, 32 rows each,
  ``CrossShardOptimizer.step(weight=rows)``): the threads engine, the
  prototype running the same arithmetic (the weighted gradients packed in one
  buffer, summed in replica order, divided by the summed weight; the
  parameters are checked bitwise equal to the threads engine's), plain torch
  on the whole batch (target 1: at most 1.3x), and the floor of any design
  that runs each replica's step as its own computation: plain torch's step on
  one replica's rows, once per replica.
* **inside the threads engine's demo step**: a timeline of one step (medians
  of timestamps taken in the replica function), and the demo's step timed
  inside the replica bodies, four in a row, with the two replicas stepping at
  the same time and one after the other (a lock): the GIL, not the cores,
  decides what two replicas of a small step cost.
* with ``--vs-jax``: issue 23's target 5 for the design, a 4 KiB all-reduce on
  4 replicas in ``benchmarks/vs_jax_tf.py``'s two forms (one dispatch; per
  all-reduce of 32 chained in one dispatch), the threads engine, the prototype
  and JAX ``pmap`` interleaved trial by trial (JAX served from
  ``.venv-compare/``, as in that script).

The prototype is a measuring instrument, not an engine: it has no timeouts, no
error handling and no autograd (a collective inside backward cannot switch:
autograd keeps its ready queue per OS thread, so a second replica's backward
would run the first's nodes). BENCHMARKS.md ("The single-controller design")
has the figures and what building it would take. Needs ``greenlet``
(crossreplica's ``benchmarks`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_time, median_time, print_table, timeit  # noqa: E402

import crossreplica as cr  # noqa: E402
from crossreplica import context, demo, torch_state  # noqa: E402
from crossreplica import random_streams as rs  # noqa: E402
from crossreplica import torch_private as tp  # noqa: E402

try:
    import greenlet  # type: ignore[import-not-found]
except ImportError:
    sys.exit("single_controller.py needs greenlet: pip install greenlet (or scripts/setup.sh, the benchmarks extra)")

X = torch.ones(1024)  # 4 KiB of float32


class Prototype:
    """``n`` replicas as greenlets of the calling thread; ``all_reduce`` switches to the
    caller's greenlet until the last replica arrives and sums in replica order."""

    def __init__(self, n: int, bookkeeping: bool = True):
        self.n, self.bookkeeping = n, bookkeeping

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        n, book = self.n, self.bookkeeping
        self.deposits: list[Any] = [None] * n
        self.arrived = 0
        self.runnable = list(range(n))
        self.outer_frames = list(context._stack.frames)
        state = torch_state.capture() if book else None
        base = rs.draw_base() if book else None
        results: list[Any] = [None] * n

        def body(i: int) -> None:
            if not book:
                results[i] = fn(i)
                return
            context.push(self, None)
            try:
                with torch_state.applied(state), rs.replica_stream(base, i):
                    results[i] = fn(i)
            finally:
                context.pop()

        self.greenlets = [greenlet.greenlet(body) for _ in range(n)]
        while self.runnable:
            i = self.runnable.pop(0)
            g = self.greenlets[i]
            g.switch() if g else g.switch(i)
        return results

    def all_reduce(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.deposits[i] = x
        self.arrived += 1
        if self.arrived == self.n:  # the leader: sums in replica order, wakes the others
            total = self.deposits[0].clone()
            for d in self.deposits[1:]:
                total += d
            self.arrived, self.total = 0, total
            self.runnable.extend(j for j in range(self.n) if j != i)
            return total.clone() if self.n > 1 else total
        if not self.bookkeeping:
            self.greenlets[i].parent.switch()
            return self.total.clone()
        # What a real engine must swap at every switch: the replica's torch state, its
        # context stack and its random stream (with the stream's dispatch key).
        state = torch_state.capture()
        frames = list(context._stack.frames)
        context._stack.frames[:] = self.outer_frames
        with rs.suspended(), tp.ExcludeDispatchKeyGuard(tp.DispatchKeySet(rs.KEY)):
            self.greenlets[i].parent.switch()
        context._stack.frames[:] = frames
        with torch_state.applied(state):
            return self.total.clone()


def _runs_of(n: int, reps: int, rounds: int) -> list[float]:
    """Microseconds per run on ``n`` replicas: empty (threads engine, prototype), one 4 KiB
    all-reduce (threads engine, prototype, bare prototype)."""
    strategy = cr.MirroredStrategy(num_replicas=n, devices=["cpu"] * n)
    proto, bare = Prototype(n), Prototype(n, bookkeeping=False)
    runs: list[Callable[[], object]] = [
        lambda: strategy.run(lambda: None), lambda: proto.run(lambda i: None),
        lambda: strategy.run(lambda: cr.all_reduce(X, "sum")), lambda: proto.run(lambda i: proto.all_reduce(i, X)),
        lambda: bare.run(lambda i: bare.all_reduce(i, X))]
    return [median_time(fn, reps, rounds) * 1e6 for fn in runs]


def per_run(replica_counts: list[int], runs: int, rounds: int) -> None:
    headers = ["replicas", "threads engine: empty", "prototype: empty", "threads engine: 4 KiB all-reduce",
               "prototype: 4 KiB all-reduce", "prototype, bare: 4 KiB all-reduce", "threads / prototype"]
    rows, at2, last = [], {}, {}
    for n in replica_counts:
        t = _runs_of(n, max(10, runs * 2 // n) if n > 4 else runs, rounds)
        if n == 2:
            at2 = {"threads": t[2], "proto": t[3], "bare": t[4]}
        last = {"n": n, "threads": t[2], "proto": t[3], "bare": t[4]}
        rows.append([str(n)] + [fmt_time(v / 1e6) for v in t] + [f"{t[2] / t[3]:.2f}x"])
        print(f"  measured {n} replica(s)", file=sys.stderr, flush=True)
    print_table(headers, rows)
    if at2 and last.get("n", 2) > 2:
        extra = last["n"] - 2
        print(f"\nper extra replica, 2 -> {last['n']} replicas (4 KiB all-reduce run): threads engine "
              f"{(last['threads'] - at2['threads']) / extra:.1f} us, prototype "
              f"{(last['proto'] - at2['proto']) / extra:.1f} us, bare {(last['bare'] - at2['bare']) / extra:.1f} us "
              f"(target 3: 60 us per run at 2 replicas, 15 us per extra replica)")


def demo_step(rounds: int, steps: int) -> None:
    n, rows = 2, 64
    config = demo.TrainConfig(replicas=n)
    x, y, _, _ = demo.load_digits(0)
    xb, yb = x[:rows], y[:rows]
    net = demo.make_model()
    strategy = demo.make_strategy(config)
    model = strategy.mirror(copy.deepcopy(net))
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(demo._make_optimizer(m, config)), args=(model,))
    batch = next(iter(strategy.distribute_dataset([(xb, yb)])))
    parts = [(xb[:rows // n], yb[:rows // n]), (xb[rows // n:], yb[rows // n:])]
    proto = Prototype(n)
    models = [copy.deepcopy(net) for _ in range(n)]
    optims = [demo._make_optimizer(m, config) for m in models]

    def proto_step(i: int) -> torch.Tensor:
        # demo._train_step with CrossShardOptimizer.step(weight=rows)'s arithmetic
        m, opt = models[i], optims[i]
        px, py = parts[i]
        opt.zero_grad()
        logits = m(px)
        loss_sum = F.cross_entropy(logits, py, reduction="sum")
        (loss_sum / px.shape[0]).backward()
        grads = [p.grad for p in m.parameters()]
        w = float(px.shape[0])
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(w)
        flat = proto.all_reduce(i, flat)
        total = proto.all_reduce(i, torch.tensor([w], dtype=torch.float64))
        flat.div_(float(total.item()))
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
        opt.step()
        correct = (logits.argmax(1) == py).sum()
        return torch.stack([loss_sum.detach(), correct.to(loss_sum.dtype), torch.tensor(float(px.shape[0]))])

    plain_model = copy.deepcopy(net)
    plain_opt = demo._make_optimizer(plain_model, config)

    def plain(bx: torch.Tensor, by: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            plain_opt.zero_grad()
            F.cross_entropy(plain_model(bx), by).backward()
            plain_opt.step()
        return step

    # The same arithmetic: after the same steps the prototype's parameters are the threads engine's
    # (each replica computing with one intra-op thread, as the threads engine gives each of 2 on 2 cores).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            strategy.run(demo._train_step, args=(model, opts, batch))
            proto.run(proto_step)
    finally:
        torch.set_num_threads(saved)
    ours = strategy.experimental_local_results(model)[0]
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), models[0].parameters()))
    print(f"\nprototype's parameters bitwise the threads engine's after 3 steps: {'yes' if same else 'NO'}")

    variants: dict[str, tuple[Callable[[], object], int]] = {
        "threads engine, 2 replicas x 1 intra-op thread": (
            lambda: strategy.run(demo._train_step, args=(model, opts, batch)), 1),
        "prototype, 2 replicas on the caller's thread (1 intra-op thread)": (lambda: proto.run(proto_step), 1),
        "plain torch, 64 rows, 1 intra-op thread": (plain(xb, yb), 1),
        "plain torch, 64 rows, 2 intra-op threads (baseline)": (plain(xb, yb), 2),
        "floor: plain torch on 32 rows, twice (1 intra-op thread)": (plain(*parts[0]), 1),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(rounds):
            for name, (fn, threads) in variants.items():
                torch.set_num_threads(threads)
                times[name].append(timeit(fn, steps))
    finally:
        torch.set_num_threads(saved)
    med = {k: statistics.median(v) * (2 if k.startswith("floor") else 1) for k, v in times.items()}
    base = med["plain torch, 64 rows, 2 intra-op threads (baseline)"]
    print_table(["variant (the demo's step, 2 replicas)", "median per step", "vs baseline"],
                [[k, fmt_time(v), f"{v / base:.2f}x"] for k, v in med.items()])


def inside_threads(runs: int) -> None:
    n, rows = 2, 64
    config = demo.TrainConfig(replicas=n)
    x, y, _, _ = demo.load_digits(0)
    xb, yb = x[:rows], y[:rows]
    strategy = demo.make_strategy(config)
    model = strategy.mirror(demo.make_model())
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(demo._make_optimizer(m, config)), args=(model,))
    batch = next(iter(strategy.distribute_dataset([(xb, yb)])))
    marks: dict[int, list[tuple[str, float]]] = {}
    clock = time.perf_counter

    def timed_step(m: torch.nn.Module, opt: cr.CrossShardOptimizer, part: Any) -> torch.Tensor:
        # demo._train_step, with a timestamp after each phase
        mark = marks.setdefault(cr.replica_id(), []).append
        mark(("starts", clock()))
        px, py = part
        opt.zero_grad()
        logits = m(px)
        loss_sum = F.cross_entropy(logits, py, reduction="sum")
        mark(("forward done", clock()))
        (loss_sum / px.shape[0]).backward()
        mark(("backward done", clock()))
        opt.synchronize(weight=px.shape[0])
        mark(("gradients reduced", clock()))
        opt.step()
        mark(("optimizer stepped", clock()))
        correct = (logits.argmax(1) == py).sum()
        out = torch.stack([loss_sum.detach(), correct.to(loss_sum.dtype), torch.tensor(float(px.shape[0]))])
        mark(("returns", clock()))
        return out

    timeline: dict[str, list[float]] = {}
    for k in range(runs + 50):
        marks.clear()
        t0 = clock()
        strategy.run(timed_step, args=(model, opts, batch))
        t1 = clock()
        if k >= 50:  # warm
            for r, events in marks.items():
                for name, t in events:
                    timeline.setdefault(f"replica {r} {name}", []).append((t - t0) * 1e6)
            timeline.setdefault("run returns", []).append((t1 - t0) * 1e6)
    order = sorted(timeline, key=lambda k: statistics.median(timeline[k]))
    print()
    print_table(["one threads-engine demo step, 2 replicas", "us from the call (median)"],
                [[k, f"{statistics.median(timeline[k]):.0f}"] for k in order])

    lock = threading.Lock()

    def four_steps(m: torch.nn.Module, opt: cr.CrossShardOptimizer, part: Any, serial: bool) -> list[float]:
        px, py = part
        with lock if serial else contextlib.nullcontext():
            out = []
            for _ in range(4):
                t0 = clock()
                opt.zero_grad()
                (F.cross_entropy(m(px), py, reduction="sum") / px.shape[0]).backward()
                opt.optimizer.step()  # the wrapped optimizer: no collective, so the lock cannot deadlock
                out.append((clock() - t0) * 1e6)
            return out

    table = []
    for serial in (False, True):
        samples = [strategy.experimental_local_results(strategy.run(four_steps, args=(model, opts, batch, serial)))
                   for _ in range(runs)]
        for r in range(n):
            per_step = [statistics.median(s[r][k] for s in samples[20:]) for k in range(4)]
            table.append([f"replica {r}, {'one after the other' if serial else 'at the same time'}"]
                         + [f"{v:.0f}" for v in per_step])
    print()
    print_table(["forward, backward and step inside a body (us, medians)", "1st", "2nd", "3rd", "4th"], table)


class PrototypeSide:
    """The prototype as a side of ``vs_jax_tf.py``'s comparison (its ``measure`` protocol)."""

    def __init__(self, replicas: int):
        self.proto = Prototype(replicas)
        self.inputs: dict[int, list[torch.Tensor]] = {}

    def version(self) -> str:
        return f"single-controller prototype, greenlet {greenlet.__version__}"

    def measure(self, form: str, nbytes: int, reps: int) -> float:
        from vs_jax_tf import CHAIN, seconds
        xs = self.inputs.setdefault(nbytes, [torch.randn(nbytes // 4) for _ in range(self.proto.n)])
        proto = self.proto

        def chained(i: int, n: int) -> None:
            x = xs[i]
            for _ in range(n):
                x = proto.all_reduce(i, x)
        if form == "dispatch":
            proto.run(lambda i: chained(i, 1))
            return seconds(lambda k: [proto.run(lambda i: chained(i, 1)) for _ in range(k)], reps) / reps
        proto.run(lambda i: chained(i, 2))
        return seconds(lambda k: [proto.run(lambda i: chained(i, CHAIN)) for _ in range(k)], reps) / (reps * CHAIN)


def vs_jax(python: str, trials: int) -> None:
    import vs_jax_tf as cmp
    if not os.path.exists(python):
        sys.exit(f"--python {python} does not exist; create it with benchmarks/vs_jax_tf.py --setup")
    nbytes = 4 << 10
    sides: dict[str, Any] = {"threads engine": cmp.Ours(), "prototype": PrototypeSide(cmp.REPLICAS)}
    jax = cmp.Remote(python, "jax")
    sides["jax pmap"] = jax
    rows = []
    try:
        for form in ("dispatch", "in-call"):
            reps = cmp.reps_for(nbytes, form)
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(trials):
                for name, side in sides.items():
                    time.sleep(cmp.PAUSE)
                    times[name].append(side.measure(form, nbytes, reps))
            med = {name: statistics.median(ts) for name, ts in times.items()}
            jax_time = med["jax pmap"]
            rows.append([form, fmt_time(med["threads engine"]), fmt_time(med["prototype"]), fmt_time(jax_time),
                         f"{jax_time / med['threads engine']:.2f}x", f"{jax_time / med['prototype']:.2f}x"])
    finally:
        jax.close()
    print(f"\n4 KiB float32 sum on {cmp.REPLICAS} replicas, {jax.version()}, medians of {trials} interleaved "
          f"trials (target 5: jax / ours at least 1.0x)")
    print_table(["form", "threads engine", "prototype", "jax pmap", "jax / threads engine", "jax / prototype"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 64])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100, help="demo steps per timed loop")
    parser.add_argument("--vs-jax", action="store_true", help="also the 4 KiB all-reduce against JAX pmap")
    parser.add_argument("--python", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                         ".venv-compare", "bin", "python"),
                        help="with --vs-jax: the interpreter with jax (default .venv-compare/bin/python)")
    parser.add_argument("--trials", type=int, default=7, help="with --vs-jax: interleaved trials")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"torch {torch.__version__}, greenlet {greenlet.__version__}, {os.cpu_count()} cores; "
          f"medians of {args.rounds} loops")
    per_run(args.replicas, args.runs, args.rounds)
    demo_step(args.rounds * 3, args.steps)
    inside_threads(args.runs)
    if args.vs_jax:
        vs_jax(os.path.normpath(args.python), args.trials)


if __name__ == "__main__":
    main()
