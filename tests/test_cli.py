"""The command line: --version, the launcher forms in --help, and log-friendly output."""

import io
import os
import subprocess
import sys

import pytest

import crossreplica as cr
from crossreplica import cli, demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"crossreplica {cr.__version__}"


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
