"""examples/horovod_mnist.py trains bitwise what plain PyTorch trains.

The port of Horovod's pytorch_mnist.py runs with small settings on 2 and 4 in-process
replicas (and on 2 worker processes) and is compared with its own ``reference(args)``:
plain torch on one device that runs each replica's rows after that replica's seed
(dropout) and averages the gradients in the replicas' order. Two epochs, so the
``model.eval()`` of the first epoch's test and the ``model.train()`` of the second (in
cross-replica context, drawing nothing) lie between the compared steps.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import crossreplica as cr
import crossreplica.testing as crt
from crossreplica import values as cr_values

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import horovod_mnist  # noqa: E402

SMALL = ["--epochs", "2", "--train-size", "256", "--test-size", "128", "--batch-size", "16",
         "--test-batch-size", "32", "--quiet"]


def assert_same_run(got: dict, want: dict) -> None:
    assert list(got["params"]) == list(want["params"])
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), (
            f"{name}: largest difference {(got['params'][name] - value).abs().max().item():.3g}")
    assert got["losses"] == want["losses"]
    assert got["test_loss"] == want["test_loss"] and got["test_accuracy"] == want["test_accuracy"]


@pytest.fixture
def one_thread():
    """One intra-op thread, as each of 2 replicas gets on 2 cores: the runs stay fast on a loaded
    machine (the reference computes with the replicas' share, whatever the count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("extra", [
    ["--replicas", "2"],
    ["--replicas", "4"],
    ["--replicas", "4", "--use-mixed-precision", "--grad-clip", "0.5"],
    ["--replicas", "2", "--use-mixed-precision", "--amp-dtype", "bfloat16"],
    ["--replicas", "2", "--backward-passes-per-step", "3"],
    ["--strategy", "one_device"],
], ids=["2-replicas", "4-replicas", "4-replicas-fp16-scaler-clip", "bf16-scaler", "backward-passes-3", "one-device"])
def test_horovod_mnist_is_bitwise_plain_torch(extra, one_thread):
    argv = SMALL + extra
    out = horovod_mnist.main(argv)
    ref = horovod_mnist.reference(argv)
    assert_same_run(out, ref)
    args = horovod_mnist.parse_args(argv)
    replicas = 1 if args.strategy == "one_device" else args.replicas
    batches = args.train_size // (args.batch_size * replicas)
    assert len(out["losses"]) == args.epochs * -(-batches // args.backward_passes_per_step)
    assert out["losses"][-1] < out["losses"][0]


def test_a_mode_switch_that_draws_would_be_seen(monkeypatch, one_thread):
    """The comparison is not blind to the random streams: with each mode switch made through
    strategy.run (the porter's workaround, one more draw from the caller's generator), every
    later dropout mask moves and the run no longer matches the reference."""
    real = cr_values._every_copy

    def through_run(value, name):
        if name == "training":
            return real(value, name)

        def switch(*args, **kwargs):
            cr.get_strategy().run(lambda m: getattr(m, name)(*args, **kwargs), args=(value,))
            return value
        return switch

    monkeypatch.setattr(cr_values, "_every_copy", through_run)
    argv = SMALL + ["--replicas", "2"]
    out = horovod_mnist.main(argv)
    ref = horovod_mnist.reference(argv)
    assert out["losses"] != ref["losses"]
    assert any(not torch.equal(out["params"][k], ref["params"][k]) for k in ref["params"])


@pytest.mark.multiprocess
def test_horovod_mnist_on_two_worker_processes():
    """MultiWorkerMirroredStrategy (what torchrun runs) on 2 processes x 1 replica: the same
    bits as the reference, which computes with the workers' one intra-op thread."""
    argv = SMALL + ["--strategy", "multi_worker"]
    with crt.WorkerPool(2, 1) as pool:
        run = pool.run(horovod_mnist.worker_main, mode="main", main_args=(argv,))
    assert run.ok, run.log
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the reference gives each of its 2 replicas 2 // 2 = 1 thread
    try:
        ref = horovod_mnist.reference(argv, num_replicas=2)
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        assert_same_run(run.results[rank], ref)


def test_horovod_mnist_runs_as_a_script():
    """``python examples/horovod_mnist.py ... --compare``: Horovod's log lines and a difference of 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    argv = ["--epochs", "2", "--train-size", "64", "--test-size", "64", "--batch-size", "16", "--replicas", "2",
            "--use-mixed-precision", "--compare"]
    done = subprocess.run([sys.executable, str(EXAMPLES / "horovod_mnist.py"), *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Train Epoch: 2" in done.stdout and "Test set: Average loss:" in done.stdout
    assert "largest parameter difference against plain PyTorch on one device: 0 (expected: 0;" in done.stdout


@pytest.mark.parametrize("flag", ["--batch-size", "--backward-passes-per-step", "--epochs"])
def test_bad_sizes_are_usage_errors(flag, capsys):
    with pytest.raises(SystemExit) as info:
        horovod_mnist.parse_args([flag, "0"])
    assert info.value.code == 2
    assert f"{flag} must be at least 1; got 0" in capsys.readouterr().err
