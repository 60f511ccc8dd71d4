"""MultiWorkerMirroredStrategy in this process: argument checking and the single-worker fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import crossreplica as cr


@pytest.mark.parametrize("kwargs,match", [
    ({"replicas_per_worker": 0}, "replicas_per_worker must be a positive int; got 0"),
    ({"replicas_per_worker": True}, "replicas_per_worker must be a positive int; got True"),
    ({"backend": "mpi"}, r"backend must be one of \['gloo', 'nccl'\] or None \(automatic\); got 'mpi'"),
    ({"timeout_seconds": 0}, r"timeout_seconds must be a positive number of seconds, at most 604800 \(one week\); got 0"),
    ({"replicas_per_worker": 2, "devices": ["cpu"]}, "devices must be a list with one device per local replica"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cr.MultiWorkerMirroredStrategy(**kwargs)


def test_nccl_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="backend='nccl' needs the replicas on CUDA devices"):
        cr.MultiWorkerMirroredStrategy(backend="nccl")


def test_partial_launcher_environment_is_a_clear_error(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=r"\['MASTER_ADDR', 'MASTER_PORT'\] are not set; launch with `torchrun"):
        cr.MultiWorkerMirroredStrategy()


def _double(x):
    return cr.all_reduce(x, "sum") * cr.num_replicas()


def test_without_launcher_runs_as_one_worker(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    strategy = cr.MultiWorkerMirroredStrategy(replicas_per_worker=2)
    try:
        assert strategy.num_replicas_in_sync == 2 and strategy.extended.is_chief
        out = strategy.run(_double, (cr.PerReplica((torch.ones(2), 2 * torch.ones(2))),))
        assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[6.0, 6.0]] * 2
        assert strategy.reduce("sum", out).tolist() == [12.0, 12.0]
    finally:
        strategy.close()
    assert not dist.is_initialized()


def test_check_collectives_from_environment(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CROSSREPLICA_CHECK_COLLECTIVES", "1")
    strategy = cr.MultiWorkerMirroredStrategy()
    try:
        assert strategy.extended.engine.check_collectives
        out = strategy.run(_double, (torch.ones(1),))
        assert strategy.experimental_local_results(out)[0].item() == 1.0
    finally:
        strategy.close()
    monkeypatch.setenv("CROSSREPLICA_CHECK_COLLECTIVES", "0")
    strategy = cr.MultiWorkerMirroredStrategy(check_collectives=None)
    try:
        assert not strategy.extended.engine.check_collectives
    finally:
        strategy.close()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
@pytest.mark.parametrize("secret", ["s3cret-of-this-job", None])
def test_store_listens_only_on_master_addr_and_keys_are_secret(monkeypatch, secret):
    """Launched by hand, rank 0's store serves on MASTER_ADDR alone, and its keys live under a
    prefix derived from the job secret (a warning says so when there is none)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from crossreplica.testing import free_port

    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "CROSSREPLICA_JOB_SECRET"):
        monkeypatch.delenv(k, raising=False)
    if secret is not None:
        monkeypatch.setenv("CROSSREPLICA_JOB_SECRET", secret)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = cr.MultiWorkerMirroredStrategy()
    try:
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and no wildcard address
        warned = [w for w in caught if "no job secret" in str(w.message)]
        assert bool(warned) == (secret is None)
        out = strategy.run(_double, (torch.ones(1),))
        assert strategy.experimental_local_results(out)[0].item() == 1.0
    finally:
        strategy.close()


def test_job_namespace_is_derived_from_the_secret(monkeypatch):
    """The store prefix is a digest of the job secret: different secrets, different prefixes,
    and the secret itself never appears in a key."""
    from crossreplica.elastic.job_store import job_namespace as _job_namespace

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    spaces = set()
    for secret in ("alpha", "beta"):
        monkeypatch.setenv("CROSSREPLICA_JOB_SECRET", secret)
        space = _job_namespace()
        assert secret not in space and len(space) == 32
        spaces.add(space)
    assert len(spaces) == 2
    monkeypatch.delenv("CROSSREPLICA_JOB_SECRET")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f1c-random-run-id")
    assert _job_namespace() not in spaces


@pytest.mark.parametrize("gpus,local_world,rpw,want", [
    (1, 1, 2, [[0, 0]]),                    # one process: its replicas share the GPU
    (2, 2, 1, [[0], [1]]),                  # a GPU per process
    (4, 2, 2, [[0, 1], [2, 3]]),            # two GPUs per process, one per replica
    (2, 2, 2, [[0, 0], [1, 1]]),            # more replicas than GPUs: never another process's GPU
    (4, 2, 3, [[0, 1, 0], [2, 3, 2]]),
])
def test_default_devices_give_each_process_gpus_of_its_own(monkeypatch, gpus, local_world, rpw, want):
    from crossreplica.strategies.multi_worker import MultiWorkerMirroredStrategy as MW
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    got = [[d.index for d in MW._devices(rpw, None, None, rank)] for rank in range(local_world)]
    assert got == want


def test_more_processes_than_gpus_fall_back_to_the_cpu_or_refuse_nccl(monkeypatch):
    from crossreplica.strategies.multi_worker import MultiWorkerMirroredStrategy as MW
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.warns(cr.logs.ConfigurationWarning,
                      match=r"runs on the CPU with gloo: 2 worker processes on this host \(LOCAL_WORLD_SIZE\) but 1 "
                            r"visible GPU, and NCCL cannot run two processes on one GPU; start at most 1 process "
                            r"per host \(torchrun --nproc-per-node=1\)"):
        assert MW._devices(1, None, None, 1) == [torch.device("cpu")]
    with pytest.raises(ValueError, match=r"backend='nccl': 2 worker processes .* or use backend='gloo'"):
        MW._devices(1, "nccl", None, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gloo chosen explicitly: the CPU without a warning
        assert MW._devices(1, "gloo", None, 0) == [torch.device("cpu")]


# --------------------------------------------------------------------------- a cut link


class _CutOffStore:
    """A store whose host stopped answering (a cut link: calls block, nothing is refused)."""

    def __init__(self):
        import threading

        self.release = threading.Event()

    def _block(self, *args, **kwargs):
        self.release.wait(60)
        raise RuntimeError("connection reset")

    set = get = check = add = _block


class _WaitingWork:
    """A gloo work that never completes: each wait ends its slice with gloo's timeout error."""

    def wait(self, timeout):
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Operation timed out")

    def is_completed(self):
        return False


def _cut_off_watchdog(timeout: float):
    from crossreplica.engines.torch_dist.store_probe import StoreProbe
    from crossreplica.engines.torch_dist.watchdog import Watchdog

    watchdog = Watchdog(1, 2, 1, timeout, "gloo")
    store = _CutOffStore()
    watchdog.store, watchdog.probe = store, StoreProbe(store, seconds=0.3)
    return watchdog, store


@pytest.mark.parametrize("wait", ["collective", "meeting", "point-to-point"])
def test_a_worker_cut_off_from_the_store_fails_within_the_timeout(wait):
    """Its store calls would block until TCP gives up (minutes): each is bounded, the wait runs
    to its deadline and the error says this worker is probably the one cut off."""
    watchdog, store = _cut_off_watchdog(timeout=1.5)
    start = time.monotonic()
    try:
        with pytest.raises(cr.errors.CollectiveTimeoutError, match="stopped answering this worker") as info:
            if wait == "collective":
                watchdog.wait(_WaitingWork(), range(2))
            elif wait == "point-to-point":
                watchdog.await_peers([0], range(2))
            else:
                watchdog.meet("cr.save")
    finally:
        store.release.set()
    assert time.monotonic() - start < 1.5 + 2.0, info.value
    assert watchdog.probe.unreachable


def test_a_cut_off_worker_whose_backend_times_out_first_says_so():
    """gloo's recv timeout and ours race: when gloo's wins, the error is the broken connection's,
    and it too says that this worker is probably the one cut off (not a peer's crash in gloo)."""
    watchdog, store = _cut_off_watchdog(timeout=5.0)
    try:
        # what the engine hands the watchdog when gloo's wait raises (engine.py, is_peer_loss)
        error = watchdog.lost(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms "
                                           "for recv operation to complete"))
    finally:
        store.release.set()
    assert type(error).__name__ == "WorkerFailedError", error
    assert "stopped answering this worker" in str(error), error
    assert "worker ranks [0]" in str(error) and "crashed in gloo" not in str(error), error


# --------------------------------------------------------------------------- job secrets that differ


@pytest.mark.multiprocess
def test_workers_with_different_job_secrets_fail_fast_saying_so():
    """Each worker waits under its own secret's prefix, so they never meet: once both have
    reached the store, both fail at once with the cause, not after the timeout with torch's
    opaque DistStoreError; neither reveals a secret."""

    from harness import REPO, subprocess_env

    from crossreplica.testing import free_port

    port = str(free_port())
    code = "import crossreplica as cr; cr.MultiWorkerMirroredStrategy(timeout_seconds=300)"
    procs = []
    start = time.monotonic()
    for rank, secret in enumerate(["secret-of-job-one-4f1a", "secret-of-job-two-9c3b"]):
        env = {**subprocess_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "CROSSREPLICA_JOB_SECRET": secret}
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert time.monotonic() - start < 120, outs  # far below the timeout: the cause is known once both arrive
    for p, out in zip(procs, outs):
        assert p.returncode != 0 and "the workers disagree on the job secret" in out, out
        assert "secret-of-job" not in out


def test_each_start_of_a_job_meets_under_a_token_of_its_own_whatever_the_attempt_numbers(monkeypatch):
    """torchrun's agent keeps one store for the whole job, and after a restart the agents'
    attempt numbers differ from host to host. Each start still meets under one token: the
    keys of the earlier start (its answers and arrivals) are never taken for this one's,
    even when the other ranks ask before rank 0 of the new start exists."""
    import threading

    from crossreplica.elastic.job_store import form_job
    from crossreplica.testing import free_port

    monkeypatch.setenv("CROSSREPLICA_JOB_SECRET", "a-secret-for-this-test-1234")
    port, world = free_port(), 3
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def start(order: list[int], attempts: list[str]) -> list[str]:
        tokens: list[str] = [""] * world
        errors: list[BaseException] = []

        def worker(rank: int) -> None:
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempts[rank])  # ignored by design
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
            try:
                job = form_job(client, rank, world, timeout=20)
                job.set(f"seen/{rank}", "1")
                tokens[rank] = job.get("arrivals").decode()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = []
        for rank in order:
            threads.append(threading.Thread(target=worker, args=(rank,)))
            threads[-1].start()
            time.sleep(0.3)  # the later ranks of ``order`` start late
        for t in threads:
            t.join(30)
        assert not errors, errors
        return tokens

    first = start([0, 1, 2], ["0", "0", "0"])
    assert first == ["3"] * world  # every worker counted once, under one prefix
    # The restart: ranks 1 and 2 ask before the new rank 0 exists; rank 2's agent counted a
    # restart, the others a membership change.
    second = start([1, 2, 0], ["0", "0", "1"])
    assert second == ["3"] * world  # a fresh prefix: the first start's arrivals are not counted
    answers = {server.get(f"crossreplica/answer/{r}").decode().partition(":")[0] for r in (1, 2)}
    assert len(answers) == 1


def test_a_set_up_stuck_in_the_backend_ends_the_process_with_the_cause():
    """init_process_group can block in gloo's C++ connect loop: past the timeout plus a grace
    the process says why on stderr and exits (code 1) instead of hanging."""

    from harness import REPO, subprocess_env

    code = ("import time; from crossreplica.strategies import network; network.GRACE_SECONDS = 0.2\n"
            "with network.bounded('forming the process group', 0.3, 'Set GLOO_SOCKET_IFNAME.'):\n"
            "    time.sleep(30)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and time.monotonic() - start < 20
    assert "forming the process group did not finish within the timeout (0.3s)" in done.stderr
    assert "Set GLOO_SOCKET_IFNAME." in done.stderr


_REGROUPS = r"""
import torch.distributed as dist
from crossreplica import torch_private as tp
from crossreplica.strategies.bootstrap import form_process_group
form_process_group("gloo", dist.HashStore(), 0, 1, 30)
for _ in range(3):  # what a fault-tolerant job's regrouping does
    tp.retire_default_group()
    form_process_group("gloo", dist.HashStore(), 0, 1, 30, regroup=True)
raise ValueError("boom")
"""


def test_a_traceback_after_regroupings_has_one_rank_prefix():
    from harness import REPO, subprocess_env

    done = subprocess.run([sys.executable, "-c", _REGROUPS], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=subprocess_env())
    assert done.returncode == 1
    assert "[rank0]: ValueError: boom" in done.stderr, done.stderr
    assert "[rank0]: [rank0]:" not in done.stderr, done.stderr
