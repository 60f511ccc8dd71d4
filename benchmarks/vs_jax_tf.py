"""In-process all-reduce against JAX pmap and TF MirroredStrategy, side by side.

Four replicas in one process, float32 sums of 4 KiB, 4 MiB and 64 MiB per replica:

  ours  crossreplica's threads engine: ``cr.all_reduce`` in ``MirroredStrategy(4)``
  jax   ``jax.pmap`` with ``lax.psum`` over 4 host CPU devices
        (``--xla_force_host_platform_device_count=4``)
  tf    ``tf.distribute.MirroredStrategy`` over 4 logical CPU devices, the
        replica context's ``all_reduce``, ``strategy.run`` inside a ``tf.function``

Two forms of each, as a user meets them:

  dispatch   one replicated call that all-reduces once and returns every replica's
             result (``strategy.run`` / one ``pmap`` call / one ``strategy.run`` of
             the ``tf.function``), end to end
  in-call    per all-reduce, 32 of them chained inside one dispatch (each sums the
             last one's result; 4**32 stays far inside float32's range): what a
             training step's reductions cost

Each framework runs with its defaults on this machine (our replicas share the
caller's intra-op threads; XLA and TF use their own thread pools). JAX and TF
run in a separate environment (they are not crossreplica's dependencies), each
as a server process that the driver asks for one measurement at a time, so the
three sides are interleaved trial by trial. Medians of ``--trials`` trials.

    .venv/bin/python benchmarks/vs_jax_tf.py --setup   # once: .venv-compare/ with jax and tensorflow-cpu
    .venv/bin/python benchmarks/vs_jax_tf.py           # the table (--trials 7, --sizes ...)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import fmt_time, print_table  # noqa: E402 - stdlib only, so the servers import it too

COMPARE_ENV = os.path.join(HERE, "..", ".venv-compare")
SIZES = [4 << 10, 4 << 20, 64 << 20]
REPLICAS = 4
CHAIN = 32  # all-reduces per dispatch in the in-call form
BUDGET = 0.25  # seconds of calls per measurement
PAUSE = 0.1  # seconds between measurements: XLA's and TF's thread pools spin a while after work


def reps_for(nbytes: int, form: str) -> int:
    per_call = 2e-4 + nbytes * REPLICAS / 2e9  # a rough guess, only to size the loops
    if form == "in-call":
        per_call *= CHAIN
    return max(2, min(500, int(BUDGET / per_call)))


def seconds(loop: Any, reps: int) -> float:
    t0 = time.perf_counter()
    loop(reps)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- the three sides


class Ours:
    def __init__(self) -> None:
        import torch

        import crossreplica as cr
        self.torch, self.cr = torch, cr
        self.strategy = cr.MirroredStrategy(REPLICAS)
        self.inputs: dict[int, Any] = {}

    def version(self) -> str:
        return f"crossreplica {self.cr.__version__}, torch {self.torch.__version__}"

    def measure(self, form: str, nbytes: int, reps: int) -> float:
        cr, torch = self.cr, self.torch
        xs = self.inputs.setdefault(nbytes, cr.PerReplica([torch.randn(nbytes // 4) for _ in range(REPLICAS)]))
        if form == "dispatch":
            def once(x: Any) -> Any:
                return cr.all_reduce(x, "sum")

            def loop(n: int) -> None:
                for _ in range(n):
                    self.strategy.run(once, (xs,))
            loop(2)
            return seconds(loop, reps) / reps

        def chained(x: Any, n: int) -> None:
            for _ in range(n):
                x = cr.all_reduce(x, "sum")
        self.strategy.run(chained, (xs, 2))
        return seconds(lambda n: [self.strategy.run(chained, (xs, CHAIN)) for _ in range(n)], reps) / (reps * CHAIN)


class Jax:
    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp
        from jax import lax
        self.jax = jax
        if jax.local_device_count() < REPLICAS:
            raise SystemExit(f"jax sees {jax.local_device_count()} devices; {REPLICAS} are needed")
        self.once = jax.pmap(lambda x: lax.psum(x, "r"), axis_name="r")

        def chained(x: Any) -> Any:
            return lax.fori_loop(0, CHAIN, lambda _, v: lax.psum(v, "r"), x)
        self.chained = jax.pmap(chained, axis_name="r")
        self.jnp = jnp
        self.inputs: dict[int, Any] = {}

    def version(self) -> str:
        import jaxlib
        return f"jax {self.jax.__version__}, jaxlib {jaxlib.__version__}"

    def measure(self, form: str, nbytes: int, reps: int) -> float:
        import numpy as np
        xs = self.inputs.get(nbytes)
        if xs is None:
            host = np.random.default_rng(0).standard_normal((REPLICAS, nbytes // 4), dtype=np.float32)
            # Placed once, a row on each device (an identity pmap), so no call copies its input.
            xs = self.inputs[nbytes] = self.jax.pmap(lambda x: x)(host)
        fn = self.once if form == "dispatch" else self.chained

        def loop(n: int) -> None:
            for _ in range(n):
                fn(xs).block_until_ready()
        loop(2)
        t = seconds(loop, reps) / reps
        return t if form == "dispatch" else t / CHAIN


class Tf:
    def __init__(self) -> None:
        import tensorflow as tf
        self.tf = tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
        self.strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
        sum_ = tf.distribute.ReduceOp.SUM
        strategy = self.strategy

        def reduce_once(x: Any) -> Any:
            return tf.distribute.get_replica_context().all_reduce(sum_, x)

        def reduce_chained(x: Any) -> Any:
            for _ in range(CHAIN):  # unrolled: TF's control flow cannot hold a synchronization point
                x = tf.distribute.get_replica_context().all_reduce(sum_, x)
            return x

        # TF's way: the tf.function around strategy.run (a nested one cannot merge_call)
        self.fns = {"dispatch": tf.function(lambda xs: strategy.run(reduce_once, args=(xs,))),
                    "in-call": tf.function(lambda xs: strategy.run(reduce_chained, args=(xs,)))}
        self.inputs: dict[int, Any] = {}

    def version(self) -> str:
        return f"tensorflow {self.tf.__version__}"

    def measure(self, form: str, nbytes: int, reps: int) -> float:
        tf, strategy = self.tf, self.strategy
        xs = self.inputs.get(nbytes)
        if xs is None:
            xs = self.inputs[nbytes] = strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.random.normal([nbytes // 4], seed=ctx.replica_id_in_sync_group))
        fn = self.fns[form]

        def loop(n: int) -> None:
            for _ in range(n):
                out = fn(xs)
                for t in strategy.experimental_local_results(out):
                    t.numpy()  # the results exist (eager CPU tensors: no copy)
        loop(2)
        t = seconds(loop, reps) / reps
        return t if form == "dispatch" else t / CHAIN


def serve(side: str) -> None:
    """A side's server: one JSON request per line in, one JSON answer per line out."""
    impl = {"jax": Jax, "tf": Tf}[side]()
    print(json.dumps({"version": impl.version()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps({"seconds": impl.measure(req["form"], req["bytes"], req["reps"])}), flush=True)


class Remote:
    """A side served by another interpreter (the comparison environment)."""

    def __init__(self, python: str, side: str) -> None:
        env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={REPLICAS}")
        env.pop("PYTHONPATH", None)  # torch and crossreplica stay out of that environment
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--serve", side], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.side = side
        self._version = self._answer(600)["version"]

    def _answer(self, timeout: float) -> dict:
        import selectors
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.close()
                raise SystemExit(f"the {self.side} side did not answer within {timeout:g}s")
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.side} side exited with code {self.proc.wait()}")
        return json.loads(line)

    def version(self) -> str:
        return self._version

    def measure(self, form: str, nbytes: int, reps: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"form": form, "bytes": nbytes, "reps": reps}) + "\n")
        self.proc.stdin.flush()
        return float(self._answer(600)["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def setup(python: str) -> None:
    """Creates the comparison environment: jax and tensorflow-cpu, no torch."""
    env_dir = os.path.dirname(os.path.dirname(python))
    subprocess.run([sys.executable, "-m", "venv", env_dir], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "jax", "tensorflow-cpu"], check=True)
    print(subprocess.run([python, "-c", "import jax, tensorflow as tf; print('jax', jax.__version__, "
                          "'tensorflow', tf.__version__)"], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per replica")
    p.add_argument("--python", default=os.path.join(COMPARE_ENV, "bin", "python"),
                   help="the interpreter with jax and tensorflow (default .venv-compare/bin/python)")
    p.add_argument("--setup", action="store_true", help="create the --python environment and exit")
    p.add_argument("--serve", choices=["jax", "tf"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a.serve)
        return
    a.python = os.path.normpath(a.python)
    if a.setup:
        setup(a.python)
        return
    if not os.path.exists(a.python):
        p.error(f"--python {a.python} does not exist; create it with --setup")
    if a.trials < 1 or any(s < 4 or s % 4 for s in a.sizes):
        p.error(f"--trials must be >= 1 and --sizes multiples of 4 bytes; got {a.trials}, {a.sizes}")
    sides: dict[str, Any] = {"ours": Ours()}
    remotes: list[Remote] = []
    try:
        for name in ("jax", "tf"):
            remotes.append(Remote(a.python, name))
            sides[name] = remotes[-1]
        print("; ".join(s.version() for s in sides.values()) + f"; {os.cpu_count()} cores, {REPLICAS} replicas, "
              f"float32 sum, medians of {a.trials} interleaved trials\n")
        rows = []
        for form in ("dispatch", "in-call"):
            for nbytes in a.sizes:
                reps = reps_for(nbytes, form)
                times: dict[str, list[float]] = {name: [] for name in sides}
                for _ in range(a.trials):
                    for name, side in sides.items():
                        time.sleep(PAUSE)
                        times[name].append(side.measure(form, nbytes, reps))
                med = {name: statistics.median(ts) for name, ts in times.items()}
                rows.append([form, f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB",
                             fmt_time(med["ours"]), fmt_time(med["jax"]), fmt_time(med["tf"]),
                             f"{med['jax'] / med['ours']:.2f}x", f"{med['tf'] / med['ours']:.2f}x"])
                print(" | ".join(rows[-1]), flush=True)
    finally:
        for r in remotes:
            r.close()
    print()
    print_table(["form", "size", "ours", "jax pmap", "tf MirroredStrategy", "jax / ours", "tf / ours"], rows)


if __name__ == "__main__":
    main()
