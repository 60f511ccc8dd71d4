"""The repository's own scripts that the suite does not run otherwise: scripts/test-shards, and
scripts/setup.sh (which scripts/demo and scripts/test run first) with stand-ins for python and pip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDS = os.path.join(REPO, "scripts", "test-shards")


def _shard(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run([SHARDS, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          check=False)


def _collected(log: str) -> set[str]:
    with open(log) as f:
        return {line.strip() for line in f if "::" in line and not line.startswith(("FAILED", "ERROR"))}


def test_shards_cover_the_suite_once_each_and_leave_out_what_is_ignored(tmp_path):
    logs = str(tmp_path / "logs")
    done = _shard(["3", logs, "--collect-only", "--ignore=tests/devices/test_cuda.py"])
    assert done.returncode == 0, done.stdout + done.stderr
    shards = [_collected(os.path.join(logs, f"shard-{k}.log")) for k in range(3)]
    assert all(shards)
    assert sum(map(len, shards)) == len(set().union(*shards))  # no test in two shards
    files = {test.split("::")[0] for shard in shards for test in shard}
    on_disk = {os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(os.path.join(REPO, "tests"))
               for f in fs if f.startswith("test_") and f.endswith(".py")}
    assert files == on_disk - {os.path.join("tests", "devices", "test_cuda.py")}
    assert done.stdout.count("shard ") == 3  # each shard's last line, printed at the end


def test_a_bad_shard_count_says_what_was_expected(tmp_path):
    done = _shard(["zero", str(tmp_path)])
    assert done.returncode == 2
    assert "N: a count of shards, at least 1; got 'zero'" in done.stderr


# ---------------------------------------------------------------------- scripts/setup.sh

# A stand-in for .venv's python: it logs each call; torch is importable once "installed".
_VENV_PYTHON = """#!/bin/sh
venv=$(dirname "$0")/..
echo "$*" >>"$venv/calls.log"
case "$*" in
  "-c import torch") [ -f "$venv/torch-installed" ] ;;
  *" install "*" torch=="*) touch "$venv/torch-installed" ;;
esac
"""

# A stand-in for the machine's python: `-m venv .venv` makes .venv with the python above.
_SYSTEM_PYTHON = """#!/bin/sh
[ "$*" = "-m venv .venv" ] || exit 9
mkdir -p .venv/bin && cp "$(dirname "$0")/venv-python" .venv/bin/python && chmod +x .venv/bin/python
"""


def _checkout(tmp_path) -> str:
    """A copy of what scripts/setup.sh reads, with stand-ins for python and pip."""
    tree = tmp_path / "checkout"
    (tree / "scripts").mkdir(parents=True)
    (tree / "crossreplica").mkdir()
    for name in ("scripts/setup.sh", "pyproject.toml", "crossreplica/version.py"):
        (tree / name).write_bytes(open(os.path.join(REPO, name), "rb").read())
    (tree / "scripts" / "setup.sh").chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "venv-python").write_text(_VENV_PYTHON)
    (tools / "python").write_text(_SYSTEM_PYTHON)
    (tools / "python").chmod(0o755)
    return str(tree)


def _setup(tree: str, **env: str) -> tuple[list[str], str]:
    """Runs the checkout's scripts/setup.sh; returns the calls it made to .venv's python, and its stderr."""
    log = os.path.join(tree, ".venv", "calls.log")
    before = open(log).read().splitlines() if os.path.exists(log) else []
    done = subprocess.run([os.path.join(tree, "scripts", "setup.sh")], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": os.path.join(os.path.dirname(tree), "tools", "python"),
                               **env}, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    after = open(log).read().splitlines() if os.path.exists(log) else []
    return after[len(before):], done.stderr


def _installs(calls: list[str]) -> list[str]:
    return [call.rsplit(" ", 1)[-1] for call in calls if call.startswith("-m pip install")]


PACKAGE = ".[examples,dev,benchmarks]"


@pytest.mark.multiprocess
def test_setup_installs_pinned_torch_then_the_package_once_and_again_only_when_the_checkout_changed(tmp_path):
    tree = _checkout(tmp_path)
    calls, err = _setup(tree)  # a fresh machine: .venv, torch first, then the package
    assert _installs(calls) == ["torch==2.13.0", PACKAGE], calls
    assert "installing crossreplica" in err
    calls, err = _setup(tree)  # nothing changed: nothing installed, nothing run
    assert calls == [] and err == ""
    with open(os.path.join(tree, "pyproject.toml"), "a") as f:
        f.write("\n# a change\n")
    calls, _ = _setup(tree)
    assert _installs(calls) == [PACKAGE], calls  # torch is there and its requirement is the same
    assert _setup(tree)[0] == []
    calls, _ = _setup(tree, CROSSREPLICA_TORCH="torch==2.12.1")  # another torch asked for: it comes first
    assert _installs(calls) == ["torch==2.12.1", PACKAGE], calls
    assert _setup(tree, CROSSREPLICA_TORCH="torch==2.12.1")[0] == []
