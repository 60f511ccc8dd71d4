"""``crossreplica launch``'s exit status: a failed job from a finished one.

A worker that exits with another code than 0 is a fault the job survived only
when the job went on without it: the newest membership its workers agreed on
(cr.FaultTolerance, in the store the launcher serves) leaves it out, and the
members finished. Anything else (the chief raising after the others finished, a
worker of a job without cr.FaultTolerance) fails the launch, naming the worker,
its exit code and its last lines on stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from harness import subprocess_env

from crossreplica.elastic.launch import _judge, _Output, _Run, launch

PYTHON = sys.executable


def _run(slot: int, code: int, joining: bool = False, launch_id: str | None = None) -> _Run:
    return _Run(slot, joining, proc=None, output=None, code=code, launch_id=launch_id)  # type: ignore[arg-type]


def _names(runs) -> list[tuple[int, bool]]:
    return [(run.slot, run.joining) for run in runs]


@pytest.mark.parametrize(("codes", "members", "failed", "survived"), [
    ([0, 0, 0], None, [], []),
    ([0, 3, 0], None, [1], []),                 # no membership agreed: every worker must finish
    ([0, 1, 0], (0, 2), [], [1]),               # the others went on without worker 1
    ([1, 1, 0], (0, 2), [0], [1]),              # the chief was a member to the end
    ([-9, 0, 0], (1, 2), [], [0]),              # the chief killed, the others went on
    ([1, 1, 1], (0, 2), [0, 1, 2], []),         # nobody finished
])
def test_a_failure_is_survived_only_when_the_job_went_on_without_it(codes, members, failed, survived):
    verdict = _judge([_run(slot, code) for slot, code in enumerate(codes)], members, {})
    assert [run.slot for run, _ in verdict.failed] == failed
    assert [run.slot for run in verdict.survived] == survived


def test_a_restarted_worker_is_judged_by_the_identity_it_recorded():
    # Worker 1 lost, started again (launch id "0.3"): it joined as identity 3 (members [0, 2, 3]) and finished.
    runs = [_run(0, 0), _run(1, 1), _run(2, 0), _run(1, 0, joining=True, launch_id="0.3")]
    verdict = _judge(runs, (0, 2, 3), {"0.3": 3})
    assert not verdict.failed and _names(verdict.survived) == [(1, False)]
    # It joined but then failed: a member that did not finish.
    runs[3] = _run(1, 1, joining=True, launch_id="0.3")
    verdict = _judge(runs, (0, 2, 3), {"0.3": 3})
    assert _names(run for run, _ in verdict.failed) == [(1, True)]
    assert "a member of the job to the end (its last membership: workers [0, 2, 3])" in verdict.failed[0][1]
    # It failed before it was admitted: the job went on without it.
    verdict = _judge(runs, (0, 2), {"0.3": 3})
    assert not verdict.failed and _names(verdict.survived) == [(1, False), (1, True)]
    # It joined, then was lost again, while another host's restarted worker (identity 4) finished
    # as a member: this host's joiner is judged by its own identity, not by a count of joiners.
    verdict = _judge(runs, (0, 2, 4), {"0.3": 3})
    assert not verdict.failed and _names(verdict.survived) == [(1, False), (1, True)]
    # It never asked to join (it died importing torch): no member.
    verdict = _judge(runs, (0, 2, 3), {})
    assert not verdict.failed


def test_a_host_whose_workers_were_all_left_out_survived_them_when_the_job_runs_across_hosts():
    runs = [_run(2, -9), _run(3, 1)]  # this host's two workers: killed, then cut off
    assert _names(run for run, _ in _judge(runs, (0, 1), {}).failed) == [(2, False), (3, False)]  # one host
    verdict = _judge(runs, (0, 1), {}, across_hosts=True)  # the job went on on the other host
    assert not verdict.failed and _names(verdict.survived) == [(2, False), (3, False)]
    verdict = _judge(runs, (0, 1, 3), {}, across_hosts=True)  # worker 3 was a member to the end
    assert _names(run for run, _ in verdict.failed) == [(3, False)]
    assert [r.slot for r, _ in _judge(runs, None, {}, across_hosts=True).failed] == [2, 3]


@pytest.mark.multiprocess
def test_a_worker_of_a_job_without_fault_tolerance_that_fails_fails_the_launch(capfd):
    code = ("import os, sys; rank = os.environ['RANK']; "
            "print('could not write the checkpoint', file=sys.stderr) if rank == '1' else None; "
            "sys.exit(3 if rank == '1' else 0)")
    assert launch([PYTHON, "-c", code], 3) == 3
    err = capfd.readouterr().err
    assert "could not write the checkpoint" in err  # passed on as the worker wrote it
    assert ("crossreplica launch: the job failed: worker 1 exited with code 3, a failure the job did not survive: "
            "the job never went on without it (no membership agreed by cr.FaultTolerance left it out)") in err
    assert err.rstrip().endswith("  | could not write the checkpoint"), err


@pytest.mark.multiprocess
def test_a_worker_killed_or_left_behind_is_named_with_the_signal(capfd):
    code = "import os, signal; os.environ['RANK'] == '1' and os.kill(os.getpid(), signal.SIGKILL)"
    assert launch([PYTHON, "-c", code], 2) == 128 + signal.SIGKILL
    assert "the job failed: worker 1 exited with code -9 (SIGKILL)" in capfd.readouterr().err
    code = "import os, time; os.environ['RANK'] == '1' and time.sleep(600)"
    t0 = time.monotonic()
    assert launch([PYTHON, "-c", code], 2, grace_seconds=0.5) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 30
    assert ("worker 1 exited with code -15 (SIGTERM) (stopped by the launcher: still running 0.5s after another "
            "worker finished)") in capfd.readouterr().err


@pytest.mark.multiprocess
def test_on_a_terminal_a_worker_still_writes_to_a_terminal(capfd):
    output = _Output(terminal=True)
    proc = subprocess.Popen([PYTHON, "-c", "import sys; print('\\rtty', sys.stderr.isatty(), file=sys.stderr)"],
                            stderr=output.child_fd)
    output.started()
    assert proc.wait(timeout=60) == 0
    output.close(10)
    assert output.last_lines(5) == ["tty True"]
    assert "tty True\n" in capfd.readouterr().err  # raw: the bytes as written


# ---------------------------------------------------------------------- real jobs

_JOB = """
import os, sys, torch, crossreplica as cr
lose, chief_fails, out = sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3]
strategy = cr.MultiWorkerMirroredStrategy(backend="gloo")
model = strategy.mirror(torch.nn.Linear(4, 2))
opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)), args=(model,))
ft = cr.FaultTolerance(strategy, (model, opts))

def step(m, opt, batch):
    opt.zero_grad()
    m(batch).sum().backward()
    opt.step()

for i in range(1, 6):
    if lose and i == 3 and ft.identity == 1:
        os._exit(1)  # lost: no clean-up, as a crash
    ft.run(step, torch.ones(6, 4) * i, args=(model, opts))
if strategy.extended.is_chief:
    if chief_fails:
        import time; time.sleep(1)  # the others have finished
    torch.save(strategy.experimental_local_results(model)[0].state_dict(), out)
"""


def _launch(tmp_path, workers: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [PYTHON, "-m", "crossreplica.cli", "launch", "--workers", str(workers), "--grace-seconds", "5", "--",
           *args]
    env = subprocess_env()
    env.pop("CROSSREPLICA_TIMEOUT", None)  # the default timeout: no wait in these runs may depend on it
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("chief_fails", [False, True], ids=["chief-saves", "chief-cannot-save"])
def test_a_lost_worker_is_survived_and_a_chief_that_cannot_save_is_not(tmp_path, chief_fails):
    """3 fault-tolerant workers; worker 1 dies in step 3 and the others go on. Then the chief
    saves its parameters, or fails to (into a folder that does not exist), after the others finished."""
    out = tmp_path / ("missing" if chief_fails else "") / "params.pt"
    done = _launch(tmp_path, 3, PYTHON, "-c", _JOB, "1", "1" if chief_fails else "0", str(out))
    if not chief_fails:
        assert done.returncode == 0, done.stderr
        assert out.exists()
        assert ("crossreplica launch: the job finished without the workers it lost (the others went on without "
                "them): worker 1 exited with code 1") in done.stderr, done.stderr
        return
    assert done.returncode == 1, done.stderr
    assert ("crossreplica launch: the job failed: worker 0 exited with code 1, a failure the job did not survive: it "
            "was a member of the job to the end (its last membership: workers [0, 2])") in done.stderr, done.stderr
    quoted = [line for line in done.stderr.splitlines() if line.startswith("  | ")]
    assert quoted and f"{os.sep}missing" in quoted[-1], done.stderr  # the error, naming the folder
    assert "crossreplica launch: the job had gone on without: worker 1 exited with code 1" in done.stderr, \
        done.stderr


@pytest.mark.multiprocess
def test_the_demos_chief_that_cannot_save_its_parameters_fails_the_launch(tmp_path):
    """The issue's case: `crossreplica train` on 2 workers, no fault tolerance; the chief cannot
    write --save-params after the other worker finished."""
    done = _launch(tmp_path, 2, PYTHON, "-m", "crossreplica.cli", "train", "--strategy", "multi_worker",
                   "--epochs", "1", "--no-compare", "--no-progress", "--save-params",
                   os.path.join(str(tmp_path), "missing", "params.pt"))
    assert done.returncode == 1, done.stderr
    assert "crossreplica launch: the job failed: worker 0 exited with code 1" in done.stderr, done.stderr
    assert "worker 1 exited" not in done.stderr, done.stderr  # it finished
    quoted = [line for line in done.stderr.splitlines() if line.startswith("  | ")]
    assert quoted and f"{os.sep}missing" in quoted[-1], done.stderr  # the error, naming the folder
