"""examples/ run and train what plain PyTorch trains.

Each example's ``main(argv)`` runs with small settings on in-process replicas and its final
parameters are compared with the example's own ``reference(args)``: the same model trained on
one device with plain PyTorch on the whole global batches. ddp_script also runs on 2 worker
processes (crossreplica.testing's WorkerPool and torchrun), and resuming from its checkpoint
must give the parameters of the uninterrupted run, bitwise.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

import crossreplica.testing as crt

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import ddp_script  # noqa: E402
import tf_custom_loop  # noqa: E402
import tpu_cross_shard  # noqa: E402


def assert_params_close(got: dict, want: dict, **tolerances) -> None:
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"{name}: {m}", **tolerances)


def assert_params_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ------------------------------------------------------------------------------ tf_custom_loop


def test_tf_custom_loop_matches_plain_torch(tmp_path):
    """2 replicas, global batch 64: the last batch of each epoch (29 rows) splits 15 / 14."""
    argv = ["--epochs", "2", "--quiet", "--checkpoint-dir", str(tmp_path)]
    out = tf_custom_loop.main(argv)
    ref = tf_custom_loop.reference(argv)
    assert_params_close(out["params"], ref["params"], rtol=1e-5, atol=1e-6)
    for metric in ("train_loss", "test_loss"):
        torch.testing.assert_close(torch.tensor(out[metric]), torch.tensor(ref[metric]), rtol=1e-5, atol=1e-6)
    assert out["train_accuracy"] == ref["train_accuracy"] and out["test_accuracy"] == ref["test_accuracy"]
    assert out["test_accuracy"][-1] > 0.2  # learning (10 classes)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # written after the first epoch
    assert saved["epoch"] == 1 and list(saved["model"]) == list(out["params"])


# ------------------------------------------------------------------------------ tpu_cross_shard

TPU_ARGS = ["--train-steps", "23", "--quiet"]  # 8 replicas, global batch 128


def test_tpu_cross_shard_matches_plain_torch(capsys):
    """5 steps per dispatch: 4 full loops and a short last one (3 steps). The agreement is float
    rounding, which depends on the summation order: against plain PyTorch summing as the replicas
    do (each batch's loss the mean of its 8 shards'), within 2e-6; against the whole batch's loss
    within 1e-5 here, after 23 steps, but Adam amplifies the rounding as training goes on (about
    8e-2 after the default 200 steps, as much as the two plain-PyTorch runs differ from each
    other). ``--compare`` prints all three differences."""
    argv = TPU_ARGS + ["--iterations", "5", "--compare"]
    out = tpu_cross_shard.main(argv)
    ref = tpu_cross_shard.reference(argv)
    sharded = tpu_cross_shard.reference(argv, shards=8)
    assert len(out["losses"]) == len(ref["losses"]) == 5
    assert_params_close(out["params"], ref["params"], rtol=1e-5, atol=1e-5)
    assert_params_close(out["params"], sharded["params"], rtol=0, atol=2e-6)
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert abs(out["accuracy"] - ref["accuracy"]) <= 2 / 360 and out["accuracy"] > 0.5

    def largest(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)

    got = out["differences"]
    assert got == {"whole": largest(out["params"], ref["params"]), "sharded": largest(out["params"], sharded["params"]),
                   "references": largest(ref["params"], sharded["params"])}
    assert got["sharded"] < got["whole"]  # the replicas' difference is the summation order's
    printed = capsys.readouterr().out
    assert f"against plain PyTorch on one device: {got['whole']:.3g}, after 23 Adam steps" in printed
    assert f"the two plain-PyTorch runs against each other: {got['references']:.3g}" in printed
    assert "expected: float rounding" in printed


def test_tpu_cross_shard_steps_per_dispatch_change_nothing():
    """experimental_run_steps trains as one strategy.run per step: the same bits."""
    by_loop = tpu_cross_shard.main(TPU_ARGS + ["--iterations", "10"])
    by_step = tpu_cross_shard.main(TPU_ARGS + ["--iterations", "1"])
    assert_params_equal(by_loop["params"], by_step["params"])
    assert by_loop["losses"][-1] == by_step["losses"][-1] and by_loop["accuracy"] == by_step["accuracy"]


# ------------------------------------------------------------------------------ ddp_script

DDP_ARGS = ["--max-iters", "4", "--lr-decay-iters", "6", "--warmup-iters", "2", "--batch-size", "8",
            "--n-embd", "16", "--quiet"]


@pytest.mark.parametrize("extra", [[], ["--overlap"], ["--replicas", "4", "--grad-clip", "0.5"], ["--dropout", "0.2"]],
                         ids=["default", "overlap", "4-replicas-clipping", "dropout"])
def test_ddp_script_matches_plain_torch(extra):
    argv = DDP_ARGS + extra
    out = ddp_script.main(argv)
    ref = ddp_script.reference(argv)
    assert out["start"] == 0 and len(out["losses"]) == 4
    assert_params_close(out["params"], ref["params"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert out["losses"][-1] < out["losses"][0]


def test_ddp_script_compiled_matches_plain_torch():
    argv = DDP_ARGS + ["--max-iters", "2", "--compile", "--compile-backend", "aot_eager", "--dropout", "0.1"]
    assert_params_close(ddp_script.main(argv)["params"], ddp_script.reference(argv)["params"], rtol=1e-5, atol=1e-6)


def _interrupted_and_resumed(run, tmp_path) -> tuple[dict, dict, dict]:
    """(uninterrupted, first part, resumed) results of ``run(argv)``: 4 iterations, or 2 then 2.
    With dropout: the checkpoint's random state must give the resumed run the same masks."""
    argv = DDP_ARGS + ["--dropout", "0.1"]
    whole = run(argv + ["--out-dir", str(tmp_path / "whole")])
    part = run(argv + ["--out-dir", str(tmp_path / "parts"), "--max-iters", "2"])
    resumed = run(argv + ["--out-dir", str(tmp_path / "parts"), "--resume"])
    return whole, part, resumed


def test_ddp_script_resume_is_the_uninterrupted_run(tmp_path):
    whole, part, resumed = _interrupted_and_resumed(ddp_script.main, tmp_path)
    assert resumed["start"] == 2 and len(resumed["losses"]) == 2
    assert part["losses"] + resumed["losses"] == whole["losses"]
    assert_params_equal(resumed["params"], whole["params"])


@pytest.mark.multiprocess
def test_ddp_script_on_two_worker_processes(tmp_path):
    """2 workers x 1 replica reduce in replica order as 2 in-process replicas do, and global replica
    i draws the same dropout masks: the same bits. The workers run torch with one intra-op thread,
    so the threads run does too (some CPU kernels round differently with more threads)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = ddp_script.main(DDP_ARGS + ["--dropout", "0.1"])
    finally:
        torch.set_num_threads(threads_before)
    with crt.WorkerPool(2, 1) as pool:
        def run(argv):
            out = pool.run(ddp_script.worker_main, mode="main", main_args=(argv,))
            assert out.ok, out.log
            chief, other = out.results[0], out.results[1]
            assert_params_equal(other["params"], chief["params"])
            return chief
        whole, part, resumed = _interrupted_and_resumed(run, tmp_path)
    assert_params_equal(whole["params"], threads["params"])
    assert whole["losses"] == threads["losses"]
    assert part["losses"] + resumed["losses"] == whole["losses"]
    assert_params_equal(resumed["params"], whole["params"])


@pytest.mark.multiprocess
def test_ddp_script_under_torchrun(tmp_path):
    """The command a user runs: torchrun with --strategy multi_worker, 2 processes."""
    out_file = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={crt.free_port()}", str(EXAMPLES / "ddp_script.py"),
           "--strategy", "multi_worker", "--save-params", str(out_file), *DDP_ARGS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CROSSREPLICA_TIMEOUT": "60"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # torchrun and its workers share the new session's process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log
    result = torch.load(out_file, weights_only=True)
    assert_params_equal(result["params"], ddp_script.main(DDP_ARGS)["params"])


# ------------------------------------------------------------------------------ as scripts


@pytest.mark.parametrize("script, argv", [
    ("tf_custom_loop.py", ["--epochs", "1", "--batch-per-replica", "128"]),
    ("tpu_cross_shard.py", ["--train-steps", "4", "--iterations", "2"]),
    ("ddp_script.py", ["--max-iters", "2", "--n-embd", "16"]),
], ids=["tf_custom_loop", "tpu_cross_shard", "ddp_script"])
def test_example_runs_as_a_script(script, argv):
    """``python examples/<name>.py``, as the docstrings say; --compare prints the difference."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *argv, "--compare"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "largest parameter difference against plain PyTorch on one device" in done.stdout
