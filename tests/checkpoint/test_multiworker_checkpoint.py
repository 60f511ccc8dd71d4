"""Checkpoints: atomic in-process save/load, and a torchrun job killed mid-training that
resumes from its last checkpoint with no lost or repeated steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import elastic_train
from harness import REPO, SUPPORT, subprocess_env

import crossreplica as cr


def test_save_load_in_process_is_atomic_and_unwraps_mirrored(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ck.pt"
    strategy = cr.MirroredStrategy(2)
    with strategy.scope():
        cr.save(path, {"model": model, "opt": opt, "step": 7,
                       "m": cr.Mirrored((torch.ones(2), torch.ones(2)))})
        assert sorted(os.listdir(tmp_path)) == ["ck.pt"]  # no temporary file left behind
        state = cr.load(path)
    assert state["step"] == 7 and torch.equal(state["m"], torch.ones(2))
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(state["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert state["opt"]["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    # A PerReplica is saved per replica (docs/checkpoints.md); outside its strategy's scope the
    # replica count does not fit, and the error says so.
    with pytest.raises(ValueError, match=r"state\['loss'\] is a PerReplica of 2 values"):
        cr.save(path, {"loss": cr.PerReplica((torch.ones(1), torch.zeros(1)))})
    with pytest.raises(TypeError, match="path must be a str"):
        cr.save(3, {})
    with pytest.raises(FileNotFoundError):
        cr.load(tmp_path / "missing.pt")


@pytest.mark.multiprocess
def test_killed_run_resumes_from_checkpoint_under_torchrun_restarts(tmp_path):
    total, kill_at = 6, 3
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.2", os.path.join(SUPPORT, "elastic_train.py"),
           str(tmp_path), str(total), str(kill_at)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
    text = log.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    lines = (tmp_path / "log0.txt").read_text().splitlines()
    assert lines[0] == "attempt 0 starts at step 0"
    assert f"attempt 1 starts at step {kill_at}" in lines, lines  # resumed where it stopped
    done = [int(line.rsplit(" ", 1)[1]) for line in lines if "finished step" in line]
    assert done == list(range(total)), lines  # every step exactly once
    final = torch.load(tmp_path / "final.pt")
    want = elastic_train.reference(total, 2)
    for k in want:
        torch.testing.assert_close(final[k], want[k], msg=k)


UNPICKLED = []


class Sneaky:
    """An object the safe loader must refuse; unpickling it records that it happened."""

    def __setstate__(self, state):
        UNPICKLED.append(state)


def _load_refused_object(strategy):
    import shutil
    import tempfile

    # one directory per job (every worker of it shares MASTER_PORT); the chief reads and writes it
    directory = os.path.join(tempfile.gettempdir(), f"crossreplica-safe-load-{os.environ['MASTER_PORT']}")
    path = os.path.join(directory, "ckpt.pt")
    if strategy.extended.is_chief:
        os.makedirs(directory, exist_ok=True)
        obj = Sneaky()
        obj.payload = 1
        torch.save({"w": torch.ones(2), "sneaky": obj}, path)
    try:
        cr.load(path, strategy=strategy)
        outcome = "loaded"
    except cr.errors.CheckpointError as e:
        outcome = str(e)
    good = os.path.join(os.path.dirname(path), "good.pt")
    cr.save(good, {"w": torch.arange(3.0)}, strategy=strategy)
    loaded = cr.load(good, strategy=strategy)["w"].tolist()
    cr.load(good, strategy=strategy)  # a last collective: every worker is done before the chief cleans up
    if strategy.extended.is_chief:
        shutil.rmtree(directory, ignore_errors=True)
    return outcome, len(UNPICKLED), loaded


@pytest.mark.multiprocess
def test_workers_load_the_chiefs_checkpoint_with_the_safe_loader():
    """Every worker receives the chief's file as bytes and reads them with the safe loader:
    an object it refuses is a CheckpointError on every worker and is never unpickled."""
    from crossreplica.testing import run_workers

    results = run_workers(_load_refused_object, 2)
    for outcome, unpickled, good in results:
        assert "safe loader does not read" in outcome and "Sneaky" in outcome
        assert unpickled == 0
        assert good == [0.0, 1.0, 2.0]


class _LostInSave(torch.nn.Linear):
    """A module whose state, read inside ``cr.save`` on every worker (after the workers met,
    before the chief's outcome reaches them), loses worker 1 there: killed, or frozen (and
    thawed a while later, so its process ends)."""

    how = "kill"

    def state_dict(self, *args, **kwargs):
        import crossreplica.strategies.multi_worker as mw

        strategy = mw.running()
        if strategy is not None and strategy.extended.worker_rank == 1:
            if self.how == "kill":
                os._exit(3)
            subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().state_dict(*args, **kwargs)


def _save_losing_worker_1(strategy, how: str, where: str, directory: str):
    import time

    model = _LostInSave(2, 2)
    model.how = how
    path = os.path.join(directory, "ckpt.pt")
    strategy.run(lambda: cr.all_reduce(torch.ones(1), "sum"))
    started = time.monotonic()
    try:
        if where == "scope":
            with strategy.scope():
                cr.save(path, {"model": model})
        else:  # outside any scope, as docs/multi_process.md's loop does
            cr.save(path, {"model": model})
    except Exception as e:  # noqa: BLE001 - the test reads what the chief saw
        return time.monotonic() - started, f"{type(e).__name__}: {e}"
    return time.monotonic() - started, "saved"


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["scope", "outside"])
@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_worker_lost_inside_cr_save_is_named_within_seconds(tmp_path, how, where):
    """cr.save's traffic goes through the strategy's watchdog, in its scope or outside any
    (the strategy that runs the process group): a worker killed or frozen there is named
    within the heartbeat's seconds, not after a bare gloo wait of the whole timeout."""
    from crossreplica.testing import WorkerPool

    with WorkerPool(2, 1, timeout_seconds=60) as pool:
        out = pool.run(_save_losing_worker_1, mode="main", main_args=(how, where, str(tmp_path)))
    if how == "kill":
        assert out.exitcodes.get(1) == 3, out
    elapsed, seen = out.results[0]
    assert seen.startswith("WorkerFailedError") and "worker ranks [1]" in seen, seen
    if how == "freeze":
        assert "stopped answering (no heartbeat for 2s" in seen, seen
    else:
        assert "presumed dead" in seen or "died" in seen, seen
    assert elapsed < 10, (elapsed, seen)  # the heartbeat's 2 s, not the 60 s timeout
