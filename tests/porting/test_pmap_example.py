"""examples/pmap_mnist.py (JAX's pmap MNIST, ported) trains what plain PyTorch trains.

Two references, both plain PyTorch on one device, computed by the example's ``reference``:

* per device shard (``per_device=True``): each device's gradient on its shard, added left to
  right in device order. The replicas do the same arithmetic in the same order (the engines sum
  in ascending replica id), so the parameters must agree **bitwise**, on 2 and 4 in-process
  replicas and on 2 worker processes x 2 replicas.
* the whole global batch: the same gradient up to float32 rounding, since the batch's rows are
  summed in another order; ``rtol=1e-5, atol=1e-6`` (measured: at most 3e-8 absolute, 1.3e-6
  relative on entries near zero, after 30 SGD steps).

Bitwise needs the same intra-op thread count on both sides: replicas compute with the caller's
threads split among them, and some CPU kernels (a matmul splitting its inner sum) round
differently with more threads. The bitwise tests run everything with one thread, as worker
processes do.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from harness import run_layout, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import pmap_mnist  # noqa: E402

# 1000 images in batches of 64: 15 full batches and a last one of 40 rows each pass (MNIST's 60000
# in batches of 128 end with 96), so the shorter last batch is split into device shards too.
ARGS = ["--epochs", "2", "--num-train", "1000", "--num-test", "300", "--batch-size", "64",
        "--layer-sizes", "784,64,64,10", "--quiet"]


def assert_params_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: largest difference {(got[name] - want[name]).abs().max()}"


@pytest.fixture
def one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("spelling", [[], ["--named-axis"]], ids=["cross_replica_sum", "mesh-axis"])
def test_bitwise_the_per_device_reference(replicas, spelling, one_intra_op_thread):
    """lax.psum as cr.cross_replica_sum or as a sum over the mesh axis 'batch': the same bits."""
    argv = ARGS + ["--replicas", str(replicas), *spelling]
    out = pmap_mnist.main(argv)
    ref = pmap_mnist.reference(argv, per_device=True)
    assert_params_equal(out["params"], ref["params"])
    assert out["train_accuracy"] == ref["train_accuracy"] and out["test_accuracy"] == ref["test_accuracy"]


@pytest.mark.parametrize("replicas", [2, 4])
def test_close_to_the_whole_batch_reference(replicas):
    argv = ARGS + ["--replicas", str(replicas)]
    out = pmap_mnist.main(argv)
    whole = pmap_mnist.reference(argv)
    per_device = pmap_mnist.reference(argv, per_device=True)
    for name, want in whole["params"].items():
        torch.testing.assert_close(out["params"][name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # The two references differ in their last bits: the bitwise test above can tell orders apart.
    assert not all(torch.equal(per_device["params"][k], v) for k, v in whole["params"].items())
    for key in ("train_accuracy", "test_accuracy"):
        assert max(abs(a - b) for a, b in zip(out[key], whole[key])) <= 2 / 300, key


def test_it_learns():
    out = pmap_mnist.main(["--quiet", "--num-test", "300"])  # the defaults: 4 replicas, 3 epochs
    assert out["test_accuracy"][-1] > max(0.5, out["test_accuracy"][0])  # 10 classes: chance is 0.1


@pytest.mark.multiprocess
def test_bitwise_on_worker_processes(one_intra_op_thread):
    """2 workers x 2 replicas: each worker builds the same stacked batches and takes its replicas'
    rows by global replica id; the gloo and in-process sums add in replica order as well."""
    argv = ARGS + ["--replicas", "4"]
    results = run_layout(pmap_mnist.worker_main, ("processes", 2, 2), argv)
    ref = pmap_mnist.reference(argv, per_device=True)
    assert len(results) == 2
    for result in results:
        assert_params_equal(result["params"], ref["params"])


@pytest.mark.parametrize("replicas, what", [("3", "--batch-size has 64 rows"),
                                             ("16", "the last batch of a pass has 40 rows")])
def test_shards_that_do_not_split_evenly_are_refused(replicas, what):
    """JAX's example raises for a ragged batch too; a smaller shard would weigh its rows more."""
    with pytest.raises(ValueError, match=f"{what}, which do not split into {replicas} equal device shards"):
        pmap_mnist.main(ARGS + ["--replicas", replicas])


def test_bad_layer_sizes_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        pmap_mnist.parse_args(["--layer-sizes", "784,64,9"])
    assert exc.value.code == 2 and "--layer-sizes must be comma-separated" in capsys.readouterr().err


def test_runs_as_a_script_and_compares():
    """``python examples/pmap_mnist.py --compare``: prints both differences and what to expect."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "pmap_mnist.py"), *ARGS, "--replicas", "2", "--compare"],
                          env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("largest parameter difference")]
    assert len(lines) == 2, done.stdout
    assert "(gradients per device shard): 0; expect 0" in lines[0]  # one thread per process: the same bits
    assert "(the whole global batches)" in lines[1] and "expect float32 rounding" in lines[1]
