"""Interpreter exit after replica threads have run: always exit code 0, never an abort.

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

import pytest

from harness import REPO, SUPPORT  # noqa: E402

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
