"""The command line: --version, the launcher forms in --help, and log-friendly output."""

import io
import os
import subprocess
import sys

import pytest

import crossreplica as cr
from crossreplica import cli, demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"crossreplica {cr.__version__}"


def test_python_dash_m_crossreplica_is_the_command():
    from harness import REPO, subprocess_env

    done = subprocess.run([sys.executable, "-m", "crossreplica", "--version"], capture_output=True, text=True,
                          cwd=REPO, env=subprocess_env(), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"crossreplica {cr.__version__}", done


def test_fault_tolerance_errors_are_in_cr_errors():
    from crossreplica.engines.torch_dist import WorkerFailedError
    from crossreplica.elastic.membership import FencedOutError

    assert cr.errors.FencedOutError is cr.FencedOutError is FencedOutError
    assert cr.errors.WorkerFailedError is cr.WorkerFailedError is WorkerFailedError
    assert issubclass(cr.FencedOutError, cr.errors.CrossReplicaError)
    assert issubclass(cr.WorkerFailedError, cr.errors.CollectiveTimeoutError)


def test_train_help_shows_the_torchrun_forms(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "torchrun --standalone --nproc-per-node=4 -m crossreplica.cli train --strategy multi_worker" in out
    assert "--nnodes=2" in out and "--rdzv-backend=c10d --rdzv-endpoint=" in out
    assert "\\\n" in out  # the multi-host command keeps its line continuations (raw epilog)


def test_output_through_a_pipe_has_one_line_per_epoch_and_no_carriage_returns():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "crossreplica.cli", "train", "--epochs", "2", "--replicas", "2",
         "--batch-size", "256", "--no-compare"],
        capture_output=True, check=False, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"\r" not in proc.stdout and b"\r" not in proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert [line.split()[1] for line in lines if line.startswith("epoch")] == ["1/2", "2/2"]
    assert proc.stderr == b""


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_gets_the_progress_bar(monkeypatch):
    pytest.importorskip("tqdm")
    fake = _Terminal()
    monkeypatch.setattr(sys, "stderr", fake)
    demo.train(demo.TrainConfig(replicas=2, epochs=1, batch_size=256, compare=False), log=None)
    assert "epoch 1/1" in fake.getvalue() and "\r" in fake.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO(), None])
def test_no_terminal_no_bar(stream, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stream)
    bar = demo._progress(demo.TrainConfig(epochs=1))
    items = [1, 2]
    assert bar(items, 1, 2) is items


# ---------------------------------------------------------------------- usage errors


def _console_script() -> list[str]:
    """The ``crossreplica`` console script beside this Python (as installed), else the module."""
    script = os.path.join(os.path.dirname(sys.executable), "crossreplica")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "crossreplica.cli"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("argv,fix", [
    (["train", "--fault-tolerant"], "--fault-tolerant needs --strategy multi_worker (got --strategy mirrored)"),
    (["train", "--kill-worker-at-step", "1:4"], "--kill-worker-at-step needs --strategy multi_worker"),
    (["launch", "--workers", "0", "--", "true"], "argument --workers/--nproc-per-node: expected an integer >= 1; got '0'"),
    (["launch", "--workers", "2", "--", "no-such-program-here"],
     "'no-such-program-here' is not a program on PATH; give the worker's command after `--`"),
], ids=["fault-tolerant-in-process", "kill-in-process", "no-workers", "no-such-program"])
def test_a_usage_error_is_one_line_naming_the_fix_and_exit_code_2(argv, fix):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([*_console_script(), *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"crossreplica {argv[0]}: error: "), done.stderr
    assert fix in done.stderr


@pytest.mark.parametrize("argv,fix", [
    (["train", "--freeze-worker-at-step", "0:2", "--strategy", "one_device"],
     "--freeze-worker-at-step needs --strategy multi_worker (got --strategy one_device)"),
    (["train", "--replicas", "2", "--strategy", "one_device"], "--strategy one_device ignores it"),
    (["train", "--replicas", "2", "--strategy", "multi_worker"], "use --replicas-per-worker"),
    (["train", "--replicas-per-worker", "2"], "--replicas-per-worker applies to --strategy multi_worker"),
    (["train", "--micro-batches", "4"], "add --layout-invariant"),
    (["train", "--dropout", "1.5"], "argument --dropout: expected a probability in [0, 1); got '1.5'"),
    (["launch", "--workers", "2"], "give the worker's command after `--`"),
    (["launch", "--workers", "2", "--grace-seconds", "-1", "--", "true"], "expected a number of seconds >= 0"),
    (["launch", "--workers", "2", "--max-restarts", "-1", "--", "true"], "expected an integer >= 0; got '-1'"),
    (["launch", "--workers", "1", "--", "./not/a/program"], "'./not/a/program' is not an executable file"),
])
def test_options_the_run_would_ignore_or_cannot_use_are_refused_in_one_line(argv, fix, capsys):
    with pytest.raises(SystemExit) as info:
        sys.exit(cli.main(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fix in err, err


@pytest.mark.parametrize("argv", [
    ["train", "--strategy", "multi_worker", "--replicas-per-worker", "2", "--fault-tolerant",
     "--kill-worker-at-step", "1:4", "--freeze-worker-at-step", "2:5"],
    ["train", "--layout-invariant", "--micro-batches", "4", "--replicas", "2"],
    ["train", "--strategy", "one_device", "--dropout", "0.0"],
])
def test_options_that_go_together_pass_the_checks(argv, monkeypatch):
    seen = []

    class Reached(Exception):
        pass

    def train(config):
        seen.append(config)
        raise Reached

    monkeypatch.setattr(cli, "train", train)
    with pytest.raises(Reached):
        cli.main(argv)
    (config,) = seen
    assert config.strategy == (argv[argv.index("--strategy") + 1] if "--strategy" in argv else "mirrored")
    assert config.micro_batches == (4 if "--micro-batches" in argv else None)
