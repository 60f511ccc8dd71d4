"""Interpreter exit after replica threads have run: always exit code 0, never an abort;
and a job whose survivors are done ends promptly, whatever they fenced out.

A replica thread still awake while the interpreter finalizes is killed where it
stands; inside libtorch that is std::terminate ("terminate called without an
active exception", exit code 134). The stress script forks many children (torch
imported once) that each run a workload and exit normally.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import REPO, SUPPORT, subprocess_env  # noqa: E402

pytestmark = pytest.mark.reliability
CHILDREN = 40


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the stress script forks")
def test_many_processes_exit_cleanly_after_collectives():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, os.path.join(SUPPORT, "exit_stress.py"), str(CHILDREN), "10"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # leave nothing running: the script and its children
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    text = out.decode(errors="replace")
    results = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(tuple(SCENARIO_NAMES))]
    assert len(results) == CHILDREN, text[-4000:]
    bad = [(name, code) for name, code in results if code != "0"]
    assert not bad, f"children that did not exit with 0: {bad}\n{text[-4000:]}"
    assert proc.returncode == 0, text[-4000:]


SCENARIO_NAMES = ("kept_until_exit", "dropped_before_exit", "failed_and_abandoned", "multi_worker_local")


def _crossreplica() -> list[str]:
    """The ``crossreplica`` command the docs use (the console script beside this Python)."""
    script = os.path.join(os.path.dirname(sys.executable), "crossreplica")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "crossreplica.cli"]


def _documented_launch(tmp_path, *train_args: str) -> tuple[subprocess.CompletedProcess, float]:
    """docs/reliability.md's ``crossreplica launch --workers 4 -- crossreplica train ...`` with
    every default (the 300 s collective timeout among them); its outcome and wall time."""
    cr_command = _crossreplica()
    cmd = [*cr_command, "launch", "--workers", "4", "--", *cr_command, "train", "--strategy", "multi_worker",
           *train_args]
    env = subprocess_env()
    for name in ("CROSSREPLICA_TIMEOUT", "CROSSREPLICA_HEARTBEAT_SECONDS", "CROSSREPLICA_SLOW_SECONDS"):
        env.pop(name, None)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:  # leave nothing running: the launcher and its workers
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - started


@pytest.mark.multiprocess
def test_the_documented_freeze_run_ends_promptly_with_the_uninterrupted_bits(tmp_path):
    """docs/reliability.md: 4 workers, worker 2 frozen as step 5 starts, default timeout. The
    survivors end at the uninterrupted run's bits, then leave at once (the process group
    they retired, with the frozen worker's receive pending in it, is never destroyed), and
    the launcher wakes the frozen worker at once (nothing else runs), which finds itself
    fenced out and stops: the whole launch ends in seconds, not one collective timeout
    (300 s) after training."""
    flags = ["--layout-invariant", "--micro-batches", "12"]
    done, _ = _documented_launch(tmp_path, *flags, "--save-params", "uninterrupted.pt")
    assert done.returncode == 0, done.stderr[-3000:]
    frozen, seconds = _documented_launch(tmp_path, "--fault-tolerant", *flags, "--freeze-worker-at-step", "2:5",
                                         "--save-params", "frozen.pt")
    assert frozen.returncode == 0, frozen.stderr[-3000:]
    assert seconds < 60, (seconds, frozen.stderr[-3000:])
    assert "every replica's parameters bitwise identical (all workers): yes" in frozen.stdout, frozen.stdout
    assert "worker 2 was left out of the job's membership" in frozen.stderr, frozen.stderr[-3000:]
    assert "worker 2 exited with code 3" in frozen.stderr, frozen.stderr[-3000:]
    want, got = torch.load(tmp_path / "uninterrupted.pt"), torch.load(tmp_path / "frozen.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
