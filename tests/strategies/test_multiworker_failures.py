"""Failure behaviour across processes: a worker that raises, dies, hangs or calls a
different collective makes every other worker fail promptly with an error that
names the collective and the culprit, never a silent hang; on this host and across
2 simulated hosts (the ``hosts`` fixture).

``crossreplica.testing.launch`` runs each job on fresh workers and reports every
worker's outcome: nothing kills the survivors when one worker fails or exits,
so each reports what it saw.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
import torch
from harness import REPO, SUPPORT, subprocess_env

import crossreplica as cr
from crossreplica.testing import launch
from crossreplica.testing.pool import free_port

pytestmark = pytest.mark.multiprocess

COLLECTIVE_TIMEOUT = 60.0  # failures must be reported long before this


def raise_on_last(x: torch.Tensor) -> torch.Tensor:
    y = cr.all_reduce(x, "sum")
    if cr.replica_id() == cr.num_replicas() - 1:
        raise ValueError("boom from the last replica")
    return cr.all_reduce(y, "sum")


@pytest.mark.parametrize("n,rpw", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_raising_worker_releases_the_others(n, rpw, hosts):
    out = launch(raise_on_last, [torch.ones(3)] * n, num_replicas=n, replicas_per_worker=rpw,
                 timeout_seconds=COLLECTIVE_TIMEOUT, hosts=hosts)
    assert set(out.failures) == {0, 1}, out.log[-3000:]
    culprit = out.failures[1]
    assert culprit.is_instance("ValueError") and "boom from the last replica" in culprit.message
    survivor = out.failures[0]
    assert survivor.is_instance("ReplicaError"), survivor
    assert f"replica {n - 1} raised ValueError: boom" in survivor.message
    assert "worker rank 1" in survivor.message and "all_reduce" in survivor.message
    assert survivor.elapsed < COLLECTIVE_TIMEOUT / 2, survivor  # released, not timed out


def die_on_rank1(x: torch.Tensor) -> torch.Tensor:
    y = cr.all_reduce(x, "sum")
    if cr.replica_id() == 1:
        os._exit(3)  # a crash: no exception, no clean-up
    return cr.all_gather(y, 0)


def test_dead_worker_fails_the_others_promptly(hosts):
    out = launch(die_on_rank1, [torch.ones(3)] * 2, timeout_seconds=COLLECTIVE_TIMEOUT, hosts=hosts)
    assert out.exitcodes[1] == 3
    survivor = out.failures[0]
    assert survivor.is_instance("WorkerFailedError"), survivor
    assert "all_gather" in survivor.message and "worker ranks [1]" in survivor.message, survivor
    assert survivor.elapsed < COLLECTIVE_TIMEOUT / 2, survivor


def lose_the_last_two(x: torch.Tensor, how: str) -> torch.Tensor:
    y = cr.all_reduce(x, "sum")
    if cr.replica_id() >= 2 and (how == "kill" or cr.replica_id() == 2):
        if how == "kill":
            os._exit(3)
        subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"])  # thawed later
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, connections open, silent
    return cr.all_reduce(y * (1 + cr.replica_id()), "sum")  # ordered: coordinated through the store


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_lost_workers_among_four_are_all_named_within_seconds(monkeypatch, how, hosts):
    """With more than two workers the survivors may hold no broken connection to the lost
    ones (or none breaks: a frozen worker), so the heartbeats name them: every lost rank,
    in seconds rather than at the timeout. A frozen worker, once thawed, stops too (no
    second job goes on without the others)."""
    monkeypatch.setenv("CROSSREPLICA_SHARED_MEMORY", "0")  # gloo, as between hosts
    out = launch(lose_the_last_two, [torch.ones(3)] * 4, [how] * 4, replicas_per_worker=1,
                 timeout_seconds=COLLECTIVE_TIMEOUT, hosts=hosts)
    lost = [2, 3] if how == "kill" else [2]
    survivors = [0, 1] if how == "kill" else [0, 1, 3]
    for rank in survivors:
        err = out.failures[rank]
        # It saw the loss itself, or was released by the survivor that did (its message quoted).
        assert err.is_instance("CollectiveTimeoutError") or err.is_instance("ReplicaAborted"), err
        # a broken connection, or the heartbeat (which alone sees a frozen worker)
        assert f"worker ranks {lost}" in err.message, err
        assert "stopped answering" in err.message or how == "kill", err
        assert err.elapsed < 10, err  # the heartbeat's 2 s, not the 60 s timeout
    if how == "freeze":
        thawed = out.failures[2]
        assert thawed.is_instance("ReplicaAborted") and "worker ranks [2] stopped answering" in thawed.message


def freeze_in_the_chain(x: torch.Tensor) -> torch.Tensor:
    from crossreplica.engines.torch_dist import chain

    y = cr.all_reduce(x, "sum")
    eng = cr.get_replica_context().strategy.extended.engine
    eng.hosts, chain.PIECE_BYTES = [(0, 1), (2, 3)], 256  # two hosts by hand: the chain, in pieces
    if cr.replica_id() == 2:
        fold = chain.reduce_into

        def frozen(*args, **kwargs):  # after its sends to its host's owner, before its first fold
            chain.reduce_into = fold  # once
            subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])  # thawed later
            os.kill(os.getpid(), signal.SIGSTOP)
            return fold(*args, **kwargs)
        chain.reduce_into = frozen
    z = cr.all_reduce(torch.ones(4096) * (y.sum() + cr.replica_id()), "sum")
    return cr.all_reduce(z, "max")  # a thawed worker whose transfers all arrived stops here


def test_a_worker_frozen_in_the_middle_of_a_transfer_is_named_within_seconds(monkeypatch, hosts):
    """The survivors wait on point-to-point transfers from the frozen worker (gloo cannot wait
    on them in slices); they watch the heartbeats meanwhile, so they name it in seconds
    rather than at the timeout."""
    monkeypatch.setenv("CROSSREPLICA_SHARED_MEMORY", "0")  # gloo, as between hosts
    out = launch(freeze_in_the_chain, [torch.ones(3)] * 4, replicas_per_worker=1,
                 timeout_seconds=COLLECTIVE_TIMEOUT, hosts=hosts)
    for rank in (0, 1, 3):
        err = out.failures[rank]
        assert "worker ranks [2]" in err.message and "stopped answering" in err.message, err
        assert err.elapsed < 10, err  # the heartbeat's 2 s, not the 60 s timeout
    thawed = out.failures[2]  # once thawed, it stops too (at the latest at its next call): no second job
    assert thawed.is_instance("ReplicaAborted") and "worker ranks [2] stopped answering" in thawed.message, thawed


def hang_on_rank1(x: torch.Tensor) -> torch.Tensor:
    y = cr.all_reduce(x, "sum")
    if cr.replica_id() == 1:
        time.sleep(5)  # alive, but never reaches the next collective in time
        return y
    return cr.all_reduce(y, "max")


def test_missing_worker_times_out_naming_it(hosts):
    out = launch(hang_on_rank1, [torch.ones(3)] * 2, timeout_seconds=2.0, hosts=hosts)
    survivor = out.failures[0]
    assert survivor.is_instance("CollectiveTimeoutError"), survivor
    assert "all_reduce(op=max" in survivor.message and "worker ranks [1]" in survivor.message
    assert survivor.elapsed < 5, survivor


def mismatched_shapes(x: torch.Tensor) -> torch.Tensor:
    cr.all_reduce(x, "sum")  # agreed
    return cr.all_reduce(torch.ones(4 + cr.replica_id() // 2), "sum")


@pytest.mark.parametrize("n,rpw", [(4, 2)], ids=["2x2"])
def test_mismatched_shapes_with_checking(n, rpw, hosts):
    out = launch(mismatched_shapes, [torch.ones(2)] * n, num_replicas=n, replicas_per_worker=rpw,
                 timeout_seconds=COLLECTIVE_TIMEOUT, check_collectives=True, hosts=hosts)
    assert set(out.failures) == {0, 1}, out.log[-3000:]
    for err in out.failures.values():
        assert err.is_instance("CollectiveMismatchError"), err
        msg = err.message
        for r in range(n):
            shape = [4 + r // 2]
            assert f"replica {r}: all_reduce(op=sum, groups=[[0, 1, 2, 3]], shapes=[{shape}]" in msg, msg
        assert "cross-process call #2" in msg
        assert err.elapsed < COLLECTIVE_TIMEOUT / 2


def fewer_calls_on_rank1(x: torch.Tensor) -> torch.Tensor:
    y = cr.all_reduce(x, "sum")
    if cr.replica_id() == 1:
        return y  # returns while replica 0 makes one more collective
    return cr.all_gather(y, 0)


def test_different_number_of_calls_with_checking(hosts):
    out = launch(fewer_calls_on_rank1, [torch.ones(2)] * 2, timeout_seconds=COLLECTIVE_TIMEOUT,
                 check_collectives=True, hosts=hosts)
    assert set(out.failures) == {0, 1}, out.log[-3000:]
    for err in out.failures.values():
        assert err.is_instance("CollectiveMismatchError"), err
        assert "replica 0: all_gather(dim=[0, 0]" in err.message, err.message
        assert "replica 1: <returned from the replica function>" in err.message, err.message
        assert err.elapsed < COLLECTIVE_TIMEOUT / 2


def _launch_by_hand(tmp_path, args: list[str], workers: int = 2) -> list[tuple[int, str]]:
    """``tests/support/<args>`` as ``workers`` workers launched by hand (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT: rank 0 serves the store, which goes when it exits), with the
    default timeout; every worker's exit code and stderr. Nothing is left running."""
    env = {**subprocess_env(), "WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "CROSSREPLICA_JOB_SECRET": secrets.token_hex(16)}
    env.pop("CROSSREPLICA_TIMEOUT", None)
    logs = [tmp_path / f"worker{r}.err" for r in range(workers)]
    procs = []
    try:
        for r in range(workers):
            with open(logs[r], "wb") as err:
                procs.append(subprocess.Popen([sys.executable, os.path.join(SUPPORT, *args[:1]), *args[1:]],
                                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO,
                                              stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    return [(p.returncode, log.read_text(errors="replace")) for p, log in zip(procs, logs)]


@pytest.mark.parametrize("rpw", [1, 2], ids=["2x1", "2x2"])
@pytest.mark.parametrize("how", ["save", "raise"])
def test_a_chief_that_fails_and_leaves_names_its_cause_on_the_other_worker(tmp_path, how, rpw):
    """The chief fails (``cr.save`` called on it alone, or its own code raises between steps)
    while the other worker waits in the next step's collective, and its process leaves on
    the uncaught error, taking the store it serves with it. It first waits for the other
    worker to read why, so that worker names the cause, not merely a dead rank 0."""
    args = ["chief_fails.py", how, str(rpw), str(tmp_path)]
    (chief_code, chief), (other_code, other) = _launch_by_hand(tmp_path, args)
    cause = ("cr.save was called on worker rank 0, but worker ranks [1]" if how == "save"
             else "worker rank 0 failed: ValueError: the chief's own bug between steps")
    assert chief_code == 1 and ("CollectiveMismatchError" if how == "save" else "ValueError") in chief, chief
    line = next((line for line in other.splitlines() if line.startswith("worker 1 failed after")), other)
    assert other_code == 1 and "ReplicaAborted" in line and cause in line, other
    assert "died" not in line and "presumed dead" not in line, line
    assert float(line.split("after ")[1].split("s:")[0]) < 10, line  # released, not timed out
