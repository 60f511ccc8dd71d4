"""The demo trains end to end and matches one-device training."""

import pytest
import torch

from crossreplica import cli, demo


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("strategy,replicas", [("mirrored", 4), ("mirrored", 3), ("one_device", 1)])
def test_train_matches_one_device(strategy, replicas, dropout):
    # With dropout, the one-device reference draws each replica's masks by the documented
    # rule (replica i as after torch.manual_seed(base + i)): the same numbers, not just the
    # same statistics.
    config = demo.TrainConfig(replicas=replicas, strategy=strategy, epochs=2, dropout=dropout, progress=False)
    result = demo.train(config, log=None)
    assert len(result.history) == 2
    assert result.replicas_identical
    assert result.max_abs_param_diff is not None and result.max_abs_param_diff < 1e-4
    assert result.history[-1].test_acc > 0.7  # digits are easy
    assert result.history[-1].test_acc == pytest.approx(result.reference_test_acc, abs=0.01)


@pytest.mark.parametrize("compression", ["bfloat16", "float16"])
def test_compressed_gradients_train_as_well(compression):
    # The demo's default 10 epochs on 4 replicas: the test accuracy with the gradients
    # compressed within 0.5 percentage points of the uncompressed run's.
    plain = demo.train(demo.TrainConfig(replicas=4, progress=False, compare=False), log=None)
    ours = demo.train(demo.TrainConfig(replicas=4, progress=False, compare=False, compression=compression), log=None)
    assert ours.replicas_identical
    assert ours.history[-1].test_acc == pytest.approx(plain.history[-1].test_acc, abs=0.005)
    assert plain.history[-1].test_acc > 0.9
    # compressed for real: the final parameters are not the uncompressed run's
    assert any(not torch.equal(a, b) for a, b in zip(ours.model.parameters(), plain.model.parameters()))
    for refused in (["--layout-invariant"], ["--strategy", "one_device"]):  # nothing it could compress
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["train", "--compression", compression, *refused])
        assert exit_info.value.code == 2


def test_tiny_batches_leave_replicas_without_rows():
    # batch 3 over 4 replicas: one replica never gets a row, the mean stays exact. (A small
    # lr: with lr 0.05, 479 steps of batch 3 are chaotic and amplify float rounding.)
    result = demo.train(demo.TrainConfig(replicas=4, epochs=1, batch_size=3, lr=0.01, progress=False),
                        log=None)
    assert result.replicas_identical and result.max_abs_param_diff < 1e-4


def test_cli_train(capsys):
    assert cli.main(["train", "--epochs", "1", "--replicas", "2", "--batch-size", "50", "--lr", "0.1",
                     "--seed", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mirrored strategy, 2 replica(s)" in out
    assert "epoch   1/1" in out and "test loss" in out
    assert "max |parameter difference| =" in out
    assert "every replica's parameters bitwise identical (all workers): yes" in out
    assert "intra-op thread(s) as each replica" in out
    # Like with like: one training step on each, and what the ratio means on a CPU.
    x, y, _, _ = demo.load_digits(1)
    steps = len(demo.global_batches(x, y, 50, 1, 1))
    assert f"one training step (median of {steps}): " in out and " ms on 2 replica(s), " in out
    assert "ms on one device with plain torch (" in out
    assert "what the ratio means: on a CPU the 2 replicas are threads of this process" in out


def test_step_times_are_of_the_training_steps_alone_on_both_runs():
    config = demo.TrainConfig(replicas=2, epochs=2, batch_size=256, progress=False)
    result = demo.train(config, log=None)
    x, y, _, _ = demo.load_digits(config.seed)
    steps = sum(len(demo.global_batches(x, y, 256, epoch, config.seed)) for epoch in (1, 2))
    assert result.steps == steps and result.replicas_in_sync == 2
    assert 0 < result.step_seconds < result.seconds  # one step, not the whole run with its evaluation
    assert 0 < result.reference_step_seconds < result.reference_seconds
    times: list[float] = []
    demo.train_reference(config, demo.make_model(), x, y, 2, step_seconds=times)
    assert len(times) == steps


@pytest.mark.parametrize("cores,expected", [(1, 2), (2, 2), (3, 3), (4, 4), (64, 4)])
def test_default_replicas_are_one_per_core(monkeypatch, capsys, cores, expected):
    # One replica per core the process may use (not the machine's count), between 2 and 4:
    # more replicas than cores would be oversubscribed.
    monkeypatch.setattr(demo.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert demo.default_replicas() == expected
    assert demo.TrainConfig().replicas == expected
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert f"2 to 4; {expected} here" in " ".join(capsys.readouterr().out.split())


def test_cli_progress_bar_and_one_device(capsys):
    assert cli.main(["train", "--epochs", "1", "--strategy", "one_device", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "one_device strategy, 1 replica(s)" in out and "parameter difference" not in out


@pytest.mark.parametrize("argv,match", [
    (["train", "--replicas", "0"], "expected a positive integer"),
    (["train", "--lr", "-1"], "expected a positive number"),
    (["train", "--strategy", "tpu"], "invalid choice"),
    ([], "required"),
])
def test_cli_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert match in capsys.readouterr().err


def test_config_validation():
    with pytest.raises(ValueError, match="replicas must be a positive int"):
        demo.train(demo.TrainConfig(replicas=0), log=None)
    with pytest.raises(ValueError, match="strategy must be one of"):
        demo.train(demo.TrainConfig(strategy="tpu"), log=None)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\); got 1.0"):
        demo.train(demo.TrainConfig(dropout=1.0), log=None)


def test_multi_worker_without_launcher_is_one_worker():
    # No torchrun environment: MultiWorkerMirroredStrategy runs as a single worker.
    import torch.distributed as dist

    had_group = dist.is_initialized()
    try:
        result = demo.train(demo.TrainConfig(strategy="multi_worker", epochs=1, progress=False), log=None)
    finally:
        if dist.is_initialized() and not had_group:  # leave no process group to later tests
            dist.destroy_process_group()
    assert result.chief and result.replicas_identical and result.max_abs_param_diff < 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra", [[], ["--dropout", "0.2"]], ids=["plain", "dropout"])
def test_cli_train_multi_worker_under_torchrun(extra):
    """The README's two-process command: torchrun, 2 workers, the chief reports once; with
    dropout, each worker's replica draws from its own stream and still matches one device."""
    import os
    import re
    import signal
    import subprocess
    import sys

    from harness import REPO, subprocess_env

    from crossreplica.testing import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "crossreplica.cli",
           "train", "--strategy", "multi_worker", "--epochs", "2", "--no-progress", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, out
    assert "multi_worker strategy, 2 replica(s) in sync" in out
    assert out.count("done in ") == 1  # only the chief reports
    diff = float(re.search(r"max \|parameter difference\| = (\S+)", out).group(1))
    assert diff < 1e-4


def _identical_after_worker_1_drifts(strategy):
    import torch

    model = strategy.mirror(torch.nn.Linear(3, 2))
    copies = strategy.experimental_local_results(model)
    before = demo._identical(strategy, copies)
    if strategy.extended.input_pipeline_id == 1:
        with torch.no_grad():
            copies[-1].bias.add_(1e-6)  # only worker 1's copy: the chief's local copies still agree
    return before, demo._identical(strategy, copies)


@pytest.mark.multiprocess
@pytest.mark.parametrize("per_worker", [1, 2], ids=["2x1", "2x2"])
def test_replicas_identical_compares_every_worker(per_worker):
    from crossreplica.testing import run_workers

    assert run_workers(_identical_after_worker_1_drifts, 2, per_worker) == [(True, False), (True, False)]
