"""Logging and warnings: silent by default, set-up at INFO, slow collectives and failures at
WARNING/ERROR (threads and processes), misuse warnings, and ``crossreplica train --log-level``."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import REPO, subprocess_env

import crossreplica as cr
import crossreplica.testing as crt
from crossreplica import cli
from crossreplica.logs import ConfigurationWarning, CrossReplicaWarning, SharedModuleWarning, slow_seconds

LOGGER = "crossreplica"


def _records(caplog, level=logging.DEBUG, name=LOGGER):
    return [r for r in caplog.records if r.levelno == level and r.name.startswith(name)]


# --------------------------------------------------------------------------- silent by default

_SILENT_SCRIPT = """
import time, torch, crossreplica as cr
s = cr.MirroredStrategy(num_replicas=2, timeout_seconds=20)
def slow(x):
    if cr.replica_id() == 1:
        time.sleep(0.4)
    return cr.all_reduce(x)
def fails(x):
    if cr.replica_id() == 1:
        raise ValueError("boom")
    return cr.all_reduce(x)
s.run(slow, args=(torch.ones(2),))
try:
    s.run(fails, args=(torch.ones(2),))
except ValueError:
    pass
print("done")
"""


@pytest.mark.parametrize("configured", [False, True])
def test_nothing_is_printed_unless_the_application_configures_logging(configured):
    """A slow collective and a failing replica print nothing by themselves; the same
    program with logging.basicConfig prints the warnings (so the check can fail)."""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger(LOGGER).handlers)
    script = ("import logging; logging.basicConfig(level=logging.INFO)\n" if configured else "") + _SILENT_SCRIPT
    env = dict(subprocess_env(), CROSSREPLICA_SLOW_SECONDS="0.1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, timeout=120, cwd=REPO,
                          check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == "done"
    err = proc.stderr.decode()
    if not configured:
        assert err == ""
    else:
        assert "INFO:crossreplica.strategies.mirrored:MirroredStrategy: 2 replicas" in err
        assert "WARNING:crossreplica.engines.rendezvous:collective all_reduce(" in err
        assert "WARNING:crossreplica.engines.threads:replica 1 raised ValueError: boom" in err


# --------------------------------------------------------------------------- set-up at INFO

def test_setup_is_logged_at_info_on_threads(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    cr.MirroredStrategy(num_replicas=3, timeout_seconds=7)
    cr.OneDeviceStrategy("cpu")
    messages = [r.getMessage() for r in _records(caplog, logging.INFO)]
    assert "MirroredStrategy: 3 replicas (threads engine, one thread per replica) on ['cpu', 'cpu', 'cpu'], " \
           "timeout 7s" in messages
    assert "OneDeviceStrategy: 1 replica on cpu (threads engine, in the calling thread)" in messages


def test_debug_adds_engine_detail(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    cr.MirroredStrategy(num_replicas=2, timeout_seconds=10)
    debug = [r.getMessage() for r in _records(caplog, logging.DEBUG)]
    assert any(m.startswith("threads engine: replicas [0, 1] on ['cpu', 'cpu'], timeout 10s, slow-collective "
                            "warning after 1s") for m in debug), debug


def _no_launcher(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)


def _sum(x):
    return cr.all_reduce(x, "sum")


def test_setup_of_a_single_worker_and_calls_at_debug(caplog, monkeypatch):
    _no_launcher(monkeypatch)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    strategy = cr.MultiWorkerMirroredStrategy(replicas_per_worker=2, timeout_seconds=9)
    try:
        out = strategy.run(_sum, (cr.PerReplica((torch.ones(2), 2 * torch.ones(2))),))
        assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[3.0, 3.0]] * 2
    finally:
        strategy.close()
    info = [r.getMessage() for r in _records(caplog, logging.INFO)]
    assert "no launcher environment (RANK, WORLD_SIZE): running as a single worker (backend gloo)" in info
    assert any(m.startswith("torch_dist engine: worker rank 0 of 1 (backend gloo), local replicas [0, 1] of 2 "
                            "on ['cpu', 'cpu'], timeout 9s") for m in info), info
    assert "hierarchical layout: 1 workers x 2 local replicas (threads); worker rank 0 holds replicas [0, 1]" in info
    assert any(m.startswith("MultiWorkerMirroredStrategy: 2 replicas in sync, 1 workers x 2 local replicas "
                            "(hierarchical engine), worker rank 0 on ['cpu', 'cpu'], backend gloo") for m in info)
    debug = [r.getMessage() for r in _records(caplog, logging.DEBUG)]
    assert any(m.startswith("cross-process call #") and "all_reduce(op=sum, groups=[[0, 1]]" in m
               for m in debug), debug


def test_elastic_restart_is_a_warning(caplog, monkeypatch):
    _no_launcher(monkeypatch)
    port = crt.free_port()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "2",
                 "CROSSREPLICA_JOB_SECRET": "test-logging"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    strategy = cr.MultiWorkerMirroredStrategy(timeout_seconds=20)
    strategy.close()
    warned = [r.getMessage() for r in _records(caplog, logging.WARNING)]
    assert warned == ["worker rank 0 was restarted by the elastic agent (TORCHELASTIC_RESTART_COUNT=2): the "
                      "previous attempt failed; resume from the last checkpoint"]
    info = [r.getMessage() for r in _records(caplog, logging.INFO)]
    assert (f"initialising the process group: rank 0 of 1, backend gloo, store at MASTER_ADDR=127.0.0.1 "
            f"MASTER_PORT={port} (served by this worker), timeout 20s") in info


# --------------------------------------------------------------------------- slow collectives

def test_slow_threshold():
    assert slow_seconds(300.0) == 10.0 and slow_seconds(30.0) == 3.0


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "inf"])
def test_bad_slow_threshold_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("CROSSREPLICA_SLOW_SECONDS", raw)
    with pytest.raises((ValueError, TypeError), match="CROSSREPLICA_SLOW_SECONDS"):
        cr.MirroredStrategy(num_replicas=2)


def _late_replica_1(x, delay):
    if cr.replica_id() == 1:
        time.sleep(delay)
    return cr.all_reduce(x, "sum")


def test_slow_collective_names_the_replicas_not_arrived(caplog, monkeypatch):
    monkeypatch.setenv("CROSSREPLICA_SLOW_SECONDS", "0.2")
    strategy = cr.MirroredStrategy(num_replicas=3, timeout_seconds=20)
    caplog.set_level(logging.INFO, logger=LOGGER)
    xs = [torch.randn(4) for _ in range(3)]
    out = strategy.run(_late_replica_1, args=(cr.PerReplica(xs), 1.0))
    expected = (xs[0] + xs[1]) + xs[2]
    assert all(torch.equal(v, expected) for v in out.values)
    warned = [r.getMessage() for r in _records(caplog, logging.WARNING)]
    # the wait it reports is measured: 0.2 s plus however late a loaded machine wakes the waiter
    match = re.fullmatch(
        r"collective all_reduce\(op=sum, groups=\[\[0, 1, 2\]\], shapes=\[\[4\]\], dtypes=\['float32'\]\) has "
        r"waited ([0-9.]+)s: replicas \[1\] have not arrived yet \(replicas \[0, 2\] are waiting\); it fails "
        r"after 20s", warned[0]) if len(warned) == 1 else None
    assert match and 0.2 <= float(match.group(1)) < 1.0, warned
    done = [r.getMessage() for r in _records(caplog, logging.INFO) if "completed after" in r.getMessage()]
    assert len(done) == 1, done
    caplog.clear()
    strategy.run(_late_replica_1, args=(cr.PerReplica(xs), 0.0))  # on time: nothing
    assert not _records(caplog, logging.WARNING)


def test_a_slow_overlapped_bucket_reduction_names_the_replicas_not_arrived(caplog, monkeypatch):
    # The buckets' all-reduces are asynchronous rounds: each replica deposits and goes on.
    monkeypatch.setenv("CROSSREPLICA_SLOW_SECONDS", "0.2")
    strategy = cr.MirroredStrategy(num_replicas=2, timeout_seconds=20)
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = strategy.mirror(torch.nn.Linear(4, 2))
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), overlap=True),
                        args=(model,))

    def step(model, opt, x, delay):
        opt.zero_grad()
        if cr.replica_id() == 1:
            time.sleep(delay)
        model(x).sum().backward()
        opt.step()

    x = cr.PerReplica([torch.ones(3, 4), torch.full((3, 4), 2.0)])
    strategy.run(step, args=(model, opts, x, 1.0))
    warned = [r.getMessage() for r in _records(caplog, logging.WARNING)]
    # the wait it reports is measured: 0.2 s plus however late a loaded machine wakes the waiter
    match = re.search(
        r"has waited ([0-9.]+)s: replicas \[1\] have not arrived yet \(replicas \[0\] are waiting; "
        r"asynchronous round #1 of this run\); it fails after 20s", warned[0]) if len(warned) == 1 else None
    assert match and 0.2 <= float(match.group(1)) < 1.0, warned
    caplog.clear()
    strategy.run(step, args=(model, opts, x, 0.0))  # on time: nothing
    assert not _records(caplog, logging.WARNING)


# --------------------------------------------------------------------------- failures

def _raise_on_1(x):
    if cr.replica_id() == 1:
        raise ValueError("boom")
    return cr.all_reduce(x)


def test_a_raising_replica_is_one_warning(caplog):
    strategy = cr.MirroredStrategy(num_replicas=3, timeout_seconds=20)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with pytest.raises(ValueError, match="boom"):
        strategy.run(_raise_on_1, args=(torch.ones(2),))
    warned = [r.getMessage() for r in _records(caplog, logging.WARNING)]
    assert warned == ["replica 1 raised ValueError: boom; the other replicas are released"]
    released = [r.getMessage() for r in _records(caplog, logging.DEBUG) if "stopped: ReplicaAborted" in r.getMessage()]
    assert len(released) == 2, released


def test_a_timeout_is_one_error(caplog):
    strategy = cr.MirroredStrategy(num_replicas=2, timeout_seconds=0.5)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with pytest.raises(cr.CollectiveTimeoutError):
        strategy.run(_late_replica_1, args=(torch.ones(2), 1.5))
    errors = [r.getMessage() for r in _records(caplog, logging.ERROR)]
    assert errors == ["collective all_reduce(op=sum, groups=[[0, 1]], shapes=[[2]], dtypes=['float32']) timed "
                      "out after 0.5s: replicas [1] never arrived (replicas [0] were waiting)"], errors


def _mismatched(x):
    return cr.all_reduce(torch.ones(2 + cr.replica_id()))


def test_a_mismatch_is_one_error(caplog):
    strategy = cr.MirroredStrategy(num_replicas=2, timeout_seconds=20)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with pytest.raises(cr.CollectiveMismatchError):
        strategy.run(_mismatched, args=(torch.ones(1),))
    errors = [r.getMessage() for r in _records(caplog, logging.ERROR)]
    assert len(errors) == 1 and "replicas made different collective calls" in errors[0], errors
    assert "replica 1: all_reduce(op=sum, groups=[[0, 1]], shapes=[[3]]" in errors[0]


def _raise_or_dawdle(x):
    if cr.replica_id() == 0:
        raise ValueError("boom")
    time.sleep(2.0)  # outside any collective: the run abandons this thread
    return x


def test_an_abandoned_replica_thread_is_a_warning(caplog):
    strategy = cr.MirroredStrategy(num_replicas=2, timeout_seconds=0.3)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with pytest.raises(ValueError, match="boom"):
        strategy.run(_raise_or_dawdle, args=(torch.ones(1),))
    warned = [r.getMessage() for r in _records(caplog, logging.WARNING)]
    assert "1 of 2 replica threads were still busy outside any collective 0.3s after replica 0 failed; they are " \
           "abandoned and new threads serve the next run" in warned, warned


# --------------------------------------------------------------------------- processes

def _slow_then_sum(x):
    if cr.replica_id() == 2:
        time.sleep(1.5)
    return cr.all_reduce(x, "sum")


@pytest.mark.multiprocess
def test_workers_log_setup_slow_collectives_and_failures(monkeypatch):
    """Each worker of a pool started with log_level writes crossreplica's records to its
    stderr: set-up, the straggler seen from both workers, a raising replica, the released one."""
    monkeypatch.setenv("CROSSREPLICA_SLOW_SECONDS", "0.3")  # the workers inherit crossreplica's settings
    with crt.WorkerPool(2, 2, timeout_seconds=30, log_level="INFO") as pool:
        out = pool.run(_slow_then_sum, [torch.full((2,), float(i)) for i in range(4)])
        assert out.ok, out.log
        assert all(r.tolist() == [6.0, 6.0] for r in out.results.values())
        failed = pool.run(_raise_on_1, [torch.ones(2)] * 4)
        assert not failed.ok
        logs = pool.logs(limit=200_000)
    assert "[rank 0]" in logs and "[rank 1]" in logs
    for rank in (0, 1):
        assert f"INFO crossreplica.strategies.bootstrap: initialising the process group: rank {rank} of 2, " \
               f"backend gloo, store at MASTER_ADDR=127.0.0.1" in logs
    assert "hierarchical layout: 2 workers x 2 local replicas (threads); worker rank 1 holds replicas [2, 3]" in logs
    assert "MultiWorkerMirroredStrategy: 4 replicas in sync, 2 workers x 2 local replicas (hierarchical engine)" \
           in logs
    # worker 1: its local replica 3 waits for replica 2; worker 0: its leader waits for worker 1
    assert "WARNING crossreplica.engines.rendezvous: collective all_reduce(op=sum, groups=[[0, 1, 2, 3]]" in logs
    assert "replicas [2] have not arrived yet (replicas [3] are waiting)" in logs
    assert "WARNING crossreplica.engines.torch_dist.watchdog: collective all_reduce(op=sum, groups=[[0, 1, 2, 3]]" \
           in logs
    assert "on worker rank 0: worker ranks [1] (replicas [2, 3]) have not reached it yet (ranks taking part: " \
           "[0, 1]); it fails after 30s" in logs
    assert "WARNING crossreplica.engines.torch_dist.engine: worker rank 0: replica 1 raised ValueError: boom; the " \
           "other replicas are released" in logs


@pytest.mark.parametrize("level", ["loud", True, 2.5])
def test_a_bad_pool_log_level_is_a_clear_error(level):
    with pytest.raises(ValueError, match=f"log_level must be a logging level such as 'INFO' or logging.DEBUG, "
                                         f"or None; got {level!r}"):
        crt.WorkerPool(2, log_level=level)


def _raise_everywhere(x):
    raise KeyError("nope")


@pytest.mark.multiprocess
def test_a_failed_job_closes_its_pool_with_a_warning(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with pytest.raises(KeyError):
        crt.run_replicas(_raise_everywhere, [torch.ones(1)] * 2, engine="processes", timeout_seconds=20)
    warned = [r.getMessage() for r in _records(caplog, logging.WARNING, "crossreplica.testing")]
    assert len(warned) == 1 and warned[0].startswith("_raise_everywhere failed on WorkerPool(num_workers=2") \
        and "the next job starts a fresh one" in warned[0], warned
    again = crt.run_replicas(_sum, [torch.ones(1)] * 2, engine="processes", timeout_seconds=20)
    assert [t.tolist() for t in again] == [[2.0], [2.0]]
    started = [r.getMessage() for r in _records(caplog, logging.INFO, "crossreplica.testing.pool")]
    assert any(m.startswith("starting worker processes: 2 workers x 1 replicas") for m in started), started


# --------------------------------------------------------------------------- misuse warnings

def _forward(model, x):
    return model(x)


def test_a_module_shared_by_replicas_warns():
    strategy = cr.MirroredStrategy(num_replicas=2)
    model = torch.nn.Linear(3, 1)
    with pytest.warns(SharedModuleWarning, match=r"args holds a Linear with trainable parameters that all 2 "
                                                 r"replicas share.*strategy\.mirror\(model\)"):
        strategy.run(_forward, args=(model, torch.ones(3)))
    frozen = torch.nn.Linear(3, 1).requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CrossReplicaWarning)
        strategy.run(_forward, args=(strategy.mirror(model), torch.ones(3)))  # one copy each
        strategy.run(_forward, args=(frozen, torch.ones(3)))  # read-only: sharing is fine
        cr.OneDeviceStrategy().run(_forward, args=(model, torch.ones(3)))  # one replica


def test_an_unrecognised_check_collectives_value_is_an_error(monkeypatch):
    _no_launcher(monkeypatch)
    monkeypatch.setenv("CROSSREPLICA_CHECK_COLLECTIVES", "enabled")
    with pytest.raises(ValueError, match=r"environment variable CROSSREPLICA_CHECK_COLLECTIVES must be one of "
                                         r"\['1', 'true', 'yes', 'on', '0', 'false', 'no', 'off'\] \(any case\); "
                                         r"got 'enabled'"):
        cr.MultiWorkerMirroredStrategy()
    assert not dist.is_initialized()  # refused before any set-up
    monkeypatch.setenv("CROSSREPLICA_CHECK_COLLECTIVES", "Yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CrossReplicaWarning)
        strategy = cr.MultiWorkerMirroredStrategy()
    try:
        assert strategy.extended.engine.check_collectives
    finally:
        strategy.close()


def test_a_backend_the_existing_process_group_overrides_warns(monkeypatch):
    _no_launcher(monkeypatch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.warns(ConfigurationWarning, match="backend='nccl' is ignored: the process group already "
                                                      "exists with backend 'gloo'"):
            strategy = cr.MultiWorkerMirroredStrategy(backend="nccl")
        assert strategy.extended.engine.backend == "gloo"
        out = strategy.run(_sum, (torch.ones(2),))
        assert strategy.experimental_local_results(out)[0].tolist() == [1.0, 1.0]
        strategy.close()
    finally:
        dist.destroy_process_group()


def test_a_missing_job_secret_is_a_configuration_warning(monkeypatch):
    from crossreplica.elastic.job_store import job_namespace as _job_namespace

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("CROSSREPLICA_JOB_SECRET", raising=False)
    with pytest.warns(ConfigurationWarning, match="no job secret"):
        _job_namespace()


@pytest.mark.parametrize("run_id, warned", [("crossreplica-demo", True), ("my-job", True),
                                            ("3f9a1c0be4d27a65e8c1f04b9d2a7e31", False)])
def test_a_short_torchrun_run_id_is_a_configuration_warning(monkeypatch, run_id, warned):
    """torchrun's run id is the job secret when CROSSREPLICA_JOB_SECRET is unset: a short one
    (--rdzv-id=my-job) or a name without digits is guessable, and the warning says how to make
    it random."""
    from crossreplica.elastic.job_store import job_namespace as _job_namespace

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.delenv("CROSSREPLICA_JOB_SECRET", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _job_namespace()
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigurationWarning)]
    assert bool(messages) == warned, messages
    if warned:
        assert "easy to guess" in messages[0] and "openssl rand -hex 16" in messages[0]
    monkeypatch.setenv("CROSSREPLICA_JOB_SECRET", "a-secret-of-this-job")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigurationWarning)
        _job_namespace()  # a job secret set explicitly is the user's choice


# --------------------------------------------------------------------------- uneven batches, the CLI

def test_an_uneven_batch_is_logged_once_per_dataset(caplog):
    strategy = cr.MirroredStrategy(num_replicas=2)
    data = [torch.ones(4, 2), torch.ones(3, 2), torch.ones(5, 2)]
    caplog.set_level(logging.INFO, logger=LOGGER)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CrossReplicaWarning)  # supported and often handled: not a warning
        for _ in range(2):
            assert len(list(strategy.distribute_dataset(data))) == 3
    info = [r.getMessage() for r in _records(caplog, logging.INFO, "crossreplica.data")]
    assert len(info) == 2 and info[0].startswith("a global batch of 3 rows splits unevenly over 2 replicas "
                                                 "(parts of [2, 1] rows)"), info


def test_cli_log_level_writes_records_to_stderr_and_restores_logging(capsys):
    logger = logging.getLogger(LOGGER)
    handlers, level = list(logger.handlers), logger.level
    args = ["train", "--epochs", "1", "--replicas", "2", "--batch-size", "512", "--no-compare", "--no-progress"]
    assert cli.main(args + ["--log-level", "info"]) == 0
    err = capsys.readouterr().err
    assert "INFO crossreplica.strategies.mirrored: MirroredStrategy: 2 replicas (threads engine" in err
    assert logger.handlers == handlers and logger.level == level
    assert cli.main(args) == 0
    assert "crossreplica.strategies" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(args + ["--log-level", "loud"])


def _late_sum(x):
    first = cr.all_reduce(x, "sum")  # the workers agree on shared memory here (the probe)
    if cr.replica_id() == 1:
        time.sleep(1.5)
    return cr.all_reduce(first, "sum")


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm: the workers use the backend")
def test_a_slow_collective_through_shared_memory_is_logged(monkeypatch):
    """One replica per worker on one host: the all-reduce goes through shared memory,
    whose wait logs the same WARNING naming the worker not arrived."""
    monkeypatch.setenv("CROSSREPLICA_SLOW_SECONDS", "0.3")
    with crt.WorkerPool(2, 1, timeout_seconds=30, log_level="INFO") as pool:
        out = pool.run(_late_sum, [torch.full((2,), float(i)) for i in range(2)])
        assert out.ok, out.log
        assert all(r.tolist() == [2.0, 2.0] for r in out.results.values())
        logs = pool.logs(limit=200_000)
    assert "same-host shared-memory all-reduce on" in logs
    assert "WARNING crossreplica.engines.torch_dist.watchdog: collective all_reduce(op=sum, groups=[[0, 1]]" in logs
    assert "on worker rank 0: worker ranks [1] (replicas [1]) have not reached it yet (ranks taking part: " \
           "[0, 1]); it fails after 30s" in logs
