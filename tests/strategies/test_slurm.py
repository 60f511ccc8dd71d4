"""The job's environment (strategies/bootstrap.py's JobEnv) under SLURM's srun and torchrun.

srun gives each task SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID and the
step's node list; MultiWorkerMirroredStrategy reads them when torchrun's
variables are absent (torchrun's come first), with MASTER_ADDR / MASTER_PORT
from the environment or else the step's first node and a port derived from
SLURM_JOB_ID. No SLURM here: the parsing is tested as units, and two worker
processes given only SLURM's variables form a job and all-reduce.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from harness import REPO, subprocess_env

import crossreplica as cr
from crossreplica.strategies.bootstrap import (SLURM_BASE_PORT, JobEnv, local_placement, nodelist_hosts, slurm_port,
                                               tasks_per_node, torchrun_agent)
from crossreplica.testing import free_port

#: what srun gives task 1 of a 4-task step on 2 nodes (2 tasks each), job 4711
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4711", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[01-08]", "SLURMD_NODENAME": "gpu07"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "hostA",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "0f3c", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize(("text", "want"), [
    ("node01", ["node01"]),
    ("node[01-03],other", ["node01", "node02", "node03", "other"]),
    ("a,b", ["a", "b"]),
    ("gpu[1,3-4]", ["gpu1", "gpu3", "gpu4"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("node[1-2]-ib,login", ["node1-ib", "node2-ib", "login"]),
    ("10.0.0.5", ["10.0.0.5"]),
])
def test_a_slurm_host_list_expands_in_order(text, want):
    assert list(nodelist_hosts(text)) == want


@pytest.mark.parametrize(("text", "why"), [
    ("node[01-03", r"a '\[' is not closed"),
    ("node]01", "brackets do not pair up"),
    ("node[[1]]", "brackets do not pair up"),
    ("node[3-1]", "'3-1' is not a number or an ascending range"),
    ("node[a]", "'a' is not a number"),
    ("a,,b", "an empty name"),
    ("", "an empty name"),
])
def test_a_bad_host_list_is_named(text, why):
    with pytest.raises(ValueError, match=rf"SLURM_STEP_NODELIST must be a SLURM host list .*\({why}"):
        list(nodelist_hosts(text, "SLURM_STEP_NODELIST"))


def test_tasks_per_node_expand_their_repeats():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE must be counts such as '2\(x3\),1'; got '2x3'"):
        tasks_per_node("2x3", "SLURM_STEP_TASKS_PER_NODE")


def test_the_port_from_the_job_id_is_the_same_on_every_task_and_differs_between_jobs():
    ports = {job: slurm_port(job) for job in ("4711", "123404711", "4712")}
    assert ports["4711"] == ports["123404711"]  # its last 4 digits: every task of a job derives the same one
    assert ports["4711"] != ports["4712"]
    assert all(SLURM_BASE_PORT <= p < SLURM_BASE_PORT + 10_000 for p in ports.values())
    for bad in (None, "", "12_3"):
        with pytest.raises(ValueError, match="SLURM_JOB_ID must be the job's number .* set MASTER_PORT"):
            slurm_port(bad)


def test_srun_gives_rank_world_local_rank_and_the_store_at_the_steps_first_node():
    job = JobEnv.read(SRUN)
    assert job is not None
    assert (job.launcher, job.rank, job.world_size, job.local_rank, job.local_world_size) == ("srun", 1, 4, 1, 2)
    assert job.master_addr == next(nodelist_hosts(SRUN["SLURM_STEP_NODELIST"])) == "gpu07"
    assert job.master_port == slurm_port(SRUN["SLURM_JOB_ID"])
    assert not job.agent_store
    assert "first node of SLURM_STEP_NODELIST" in job.derived and "SLURM_JOB_ID" in job.derived
    assert local_placement(SRUN) == (1, 2)
    # Without the step's list, the job's.
    job = JobEnv.read({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"})
    assert job is not None and job.master_addr == "gpu01"


def test_master_addr_and_port_in_the_environment_come_first_under_srun():
    port = free_port()
    job = JobEnv.read({**SRUN, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": str(port)})
    assert job is not None
    assert (job.master_addr, job.master_port, job.derived) == ("10.1.2.3", port, "")


def test_torchruns_variables_come_first_when_both_are_present():
    job = JobEnv.read({**SRUN, **TORCHRUN})
    assert job is not None
    assert (job.launcher, job.rank, job.world_size, job.local_rank, job.local_world_size) == ("torchrun", 3, 8, 1, 2)
    assert (job.master_addr, job.master_port, job.agent_store) == ("hostA", 29500, True)
    assert local_placement({**SRUN, **TORCHRUN}) == (1, 2)
    hand = {k: v for k, v in TORCHRUN.items() if not k.startswith("TORCHELASTIC")}
    assert JobEnv.read(hand).launcher == "hand"
    launched = {**hand, "TORCHELASTIC_USE_AGENT_STORE": "True"}  # what crossreplica launch sets
    assert JobEnv.read(launched).launcher == "crossreplica launch"


def test_no_launcher_is_a_single_worker():
    assert JobEnv.read({}) is None
    assert local_placement({}) == (0, 1)


def test_a_batch_script_without_srun_runs_alone_and_is_told_so():
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4711",
             "SLURM_JOB_NODELIST": "gpu[01-02]"}
    with pytest.warns(cr.errors.ConfigurationWarning, match=r"SLURM allocated 4 tasks \(SLURM_NTASKS\) but this "
                                                            r"process was not started by srun .* `srun python"):
        assert JobEnv.read(batch) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert JobEnv.read({**batch, "SLURM_NTASKS": "1"}) is None  # one task: nothing to say
        assert local_placement(batch) == (0, 1)


@pytest.mark.parametrize(("change", "message"), [
    ({"SLURM_PROCID": "4"}, r"SLURM_PROCID=4 must be in \[0, SLURM_STEP_NUM_TASKS=4\)"),
    ({"SLURM_PROCID": "x"}, "environment variable SLURM_PROCID must be an integer; got 'x'"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "no node list .* set MASTER_ADDR"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID must be the job's number .* set MASTER_PORT"),
    ({"SLURM_PROCID": "0", "SLURMD_NODENAME": "gpu08"},
     r"SLURM put rank 0 on 'gpu08', not on the first node of SLURM_STEP_NODELIST \('gpu07'\).* set MASTER_ADDR"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 must be a TCP port in 1..65535"),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "SLURM_STEP_TASKS_PER_NODE must be counts"),
])
def test_a_bad_slurm_environment_is_named(change, message):
    env = {**SRUN, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        JobEnv.read(env)


def test_torchruns_agent_is_seen_from_its_workers_environment():
    assert torchrun_agent(TORCHRUN) == (2, 0)
    assert torchrun_agent({**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}) == (1, 3)
    assert torchrun_agent({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}) is None
    assert torchrun_agent(SRUN) is None


RUN = {"TORCHELASTIC_RUN_ID": "0f3c", "TORCHELASTIC_MAX_RESTARTS": "0"}


@pytest.mark.parametrize(("env", "says"), [
    ({**RUN, "LOCAL_WORLD_SIZE": "3"},  # torchrun --nproc-per-node=3
     ["torchrun started 3 workers on this host (LOCAL_WORLD_SIZE=3)", "`crossreplica launch --workers 3 -- COMMAND`"]),
    ({**RUN, "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "2"},  # restarts restart every agent's workers
     ["with --max-restarts=2 (TORCHELASTIC_MAX_RESTARTS) the agent of a failed worker starts its workers again",
      "--nproc-per-node=1 --max-restarts=0 on each host"]),
    ({**RUN, "LOCAL_WORLD_SIZE": "1"}, []),  # one worker per host, no restarts: survived
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "LOCAL_WORLD_SIZE": "3"}, []),  # crossreplica launch
])
def test_fault_tolerance_under_a_torchrun_that_would_stop_the_survivors_says_it_cannot_work(monkeypatch, env, says):
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS", "LOCAL_WORLD_SIZE", "CROSSREPLICA_JOIN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    strategy = cr.MultiWorkerMirroredStrategy(backend="gloo")  # no RANK / WORLD_SIZE: one worker
    try:
        model = strategy.mirror(torch.nn.Linear(2, 2))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cr.FaultTolerance(strategy, model)
        mine = [w for w in seen if issubclass(w.category, cr.errors.ConfigurationWarning)]
        said = [str(w.message) for w in mine]
        if says:
            assert len(said) == 1 and all(part in said[0] for part in says), said
            assert said[0].startswith("FaultTolerance cannot keep this job going when a worker fails: ")
            assert mine[0].filename == __file__  # it points at the caller's line
        else:
            assert not said, said
    finally:
        strategy.close()


_WORKER = """
import torch, crossreplica as cr
strategy = cr.MultiWorkerMirroredStrategy(backend="gloo", timeout_seconds=60)
ext = strategy.extended
x = torch.arange(4.0) * (ext.worker_rank + 1) + ext.worker_rank
total = strategy.reduce("sum", strategy.run(lambda t: t, args=(x,)))
print("RESULT", ext.worker_rank, ext.num_workers, strategy.num_replicas_in_sync, total.tolist(), flush=True)
strategy.close()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("address", ["MASTER_ADDR", "SLURM_STEP_NODELIST"])
def test_two_srun_tasks_form_a_job_and_all_reduce(address):
    """Two processes given only SLURM's variables (and MASTER_PORT; MASTER_ADDR as set, or
    the first node of the step's list) form one job; the sum is plain torch's."""
    base = subprocess_env()
    for k in list(base):
        if k.startswith(("SLURM", "TORCHELASTIC", "MASTER_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "CROSSREPLICA_JOIN"):
            del base[k]
    base |= {"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4711",
             "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "MASTER_PORT": str(free_port()),
             "CROSSREPLICA_JOB_SECRET": os.urandom(16).hex()}
    base |= {"MASTER_ADDR": "127.0.0.1"} if address == "MASTER_ADDR" else {"SLURM_STEP_NODELIST": "127.0.0.1"}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
             for rank in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    want = sum(torch.arange(4.0) * (rank + 1) + rank for rank in range(2)).tolist()
    for rank, out in enumerate(outs):
        results = [line.split(" ", 4)[1:] for line in out.splitlines() if line.startswith("RESULT ")]
        assert results == [[str(rank), "2", "2", str(want)]], out
