"""The repository's own scripts that the suite does not run otherwise: scripts/test-shards."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    done = _shard(["3", logs, "--collect-only", "--ignore=tests/test_cuda.py"])
    assert done.returncode == 0, done.stdout + done.stderr
    shards = [_collected(os.path.join(logs, f"shard-{k}.log")) for k in range(3)]
    assert all(shards)
    assert sum(map(len, shards)) == len(set().union(*shards))  # no test in two shards
    files = {test.split("::")[0] for shard in shards for test in shard}
    on_disk = {os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(os.path.join(REPO, "tests"))
               for f in fs if f.startswith("test_") and f.endswith(".py")}
    assert files == on_disk - {os.path.join("tests", "test_cuda.py")}
    assert done.stdout.count("shard ") == 3  # each shard's last line, printed at the end


def test_a_bad_shard_count_says_what_was_expected(tmp_path):
    done = _shard(["zero", str(tmp_path)])
    assert done.returncode == 2
    assert "N: a count of shards, at least 1; got 'zero'" in done.stderr
