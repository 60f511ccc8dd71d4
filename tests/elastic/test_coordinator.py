"""The job's coordinator: a store that answers as torch's TCPStore does, only to clients
that know the job secret, and a job across launchers that meet there."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from crossreplica.elastic import protocol
from crossreplica.elastic.coordinator import Coordinator
from crossreplica.elastic.store import CoordinatorStore
from crossreplica.testing import free_port

PYTHON = sys.executable
SECRET = "4f1c2a9e8b7d6c5a4f1c2a9e8b7d6c5a"
SECONDS = datetime.timedelta(seconds=10)


@pytest.fixture
def coordinator():
    with Coordinator(SECRET, "127.0.0.1", 0) as c:
        yield c


def _client(c: Coordinator, secret: str = SECRET, seconds: float = 10) -> CoordinatorStore:
    return CoordinatorStore("127.0.0.1", c.port, secret, datetime.timedelta(seconds=seconds))


def _script(store) -> list:
    """A run of every store call, the answers recorded (compared with torch's TCPStore)."""
    out = []
    store.set("a", b"1")
    store.set("text", "hello")
    out.append(store.get("a"))
    out.append(store.get("text"))
    out.append(store.add("n", 5))
    out.append(store.add("n", -2))
    out.append(store.get("n"))
    out.append(store.compare_set("cs", "", "first"))       # missing, empty expectation: set
    out.append(store.compare_set("cs", "wrong", "second"))  # mismatch: the current value
    out.append(store.compare_set("cs", "first", "third"))   # match: replaced
    out.append(store.compare_set("missing", "x", "y"))      # missing, an expectation: answered back
    out.append(store.check(["a", "n"]))
    out.append(store.check(["a", "absent"]))
    store.wait(["a", "cs"])
    out.append(store.multi_get(["a", "cs"]))
    store.multi_set(["m1", "m2"], ["v1", "v2"])
    out.append(store.multi_get(["m1", "m2"]))
    store.append("log", "x")
    store.append("log", "y")
    out.append(store.get("log"))
    out.append(store.delete_key("a"))
    out.append(store.delete_key("a"))
    out.append(store.check(["a"]))
    prefixed = dist.PrefixStore("job", store)
    prefixed.set("k", "v")
    out.append(prefixed.get("k"))
    out.append(prefixed.add("c", 3))
    return out


def test_the_store_answers_every_call_as_torchs_tcpstore_does(coordinator):
    reference = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=SECONDS, wait_for_workers=False)
    want = _script(reference)
    got = _script(_client(coordinator))
    assert got == want
    # A second connection sees the same keys (a clone: the heartbeat's own connection).
    clone = _client(coordinator).clone()
    assert clone.get("cs") == b"third" and clone.add("n", 0) == 3


def test_a_wait_past_the_timeout_names_the_keys(coordinator):
    store = _client(coordinator, seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 0.3s .*keys: \['never'\]"):
        store.get("never")
    assert 0.25 < time.monotonic() - t0 < 5
    with pytest.raises(dist.DistStoreError, match=r"keys: \['never'\]"):
        store.wait(["never"], datetime.timedelta(seconds=0.1))


def test_a_waiting_get_returns_once_another_client_sets_the_key(coordinator):
    waiter, writer = _client(coordinator), _client(coordinator)
    got = []
    t = threading.Thread(target=lambda: got.append(waiter.get("late")))
    t.start()
    time.sleep(0.2)
    writer.set("late", "here")
    t.join(5)
    assert got == [b"here"]


def test_a_client_without_the_secret_reads_lists_and_writes_nothing(coordinator):
    owner = _client(coordinator)
    owner.set("crossreplica/abort", "no")
    keys = owner.num_keys()
    with pytest.raises(protocol.AuthenticationError, match="does not know the job secret"):
        _client(coordinator, secret="0" * 32)  # the coordinator's proof does not check out: the secrets differ
    # torch's own client cannot even connect (its handshake is refused), so no list_keys, no set
    with pytest.raises(dist.DistError):
        dist.TCPStore("127.0.0.1", coordinator.port, is_master=False, timeout=datetime.timedelta(seconds=1))
    # bytes of any other protocol are refused
    with socket.create_connection(("127.0.0.1", coordinator.port), timeout=5) as raw:
        raw.sendall(b"\x00" * 200)
        assert raw.recv(16) in (protocol.DENIED, b"")
    # a client that knows the protocol but not the secret: its proof is refused
    with socket.create_connection(("127.0.0.1", coordinator.port), timeout=5) as raw:
        raw.sendall(protocol.MAGIC + os.urandom(32))
        raw.recv(len(protocol.MAGIC) + 64)
        raw.sendall(os.urandom(32))
        assert raw.recv(1) == protocol.DENIED
    deadline = time.monotonic() + 5
    while coordinator.refused < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert coordinator.refused >= 4
    assert owner.num_keys() == keys and owner.get("crossreplica/abort") == b"no"


def test_a_worker_refuses_a_server_that_is_not_its_coordinator():
    tcp = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=SECONDS, wait_for_workers=False)
    with pytest.raises(protocol.AuthenticationError, match="is not a crossreplica coordinator"):
        CoordinatorStore("127.0.0.1", tcp.port, SECRET, datetime.timedelta(seconds=3))
    # A server that speaks the protocol but does not know the secret accepts anything:
    # the worker checks the server's proof and refuses it.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def impostor():
            conn, _ = listener.accept()
            with conn:
                conn.recv(len(protocol.MAGIC) + 32)
                conn.sendall(protocol.MAGIC + os.urandom(64))
                conn.recv(32)
                conn.sendall(protocol.ACCEPTED)
                time.sleep(1)

        t = threading.Thread(target=impostor, daemon=True)
        t.start()
        with pytest.raises(protocol.AuthenticationError, match="does not know the job secret"):
            CoordinatorStore("127.0.0.1", port, SECRET, datetime.timedelta(seconds=3))
        t.join(5)


def test_a_frame_changed_on_the_way_is_refused_and_the_connection_dropped(coordinator):
    store = _client(coordinator)
    store.set("k", "v")
    channel = store._channel
    # an on-path writer re-sends a valid-looking frame with a tag made without the session key
    payload = protocol.pack(protocol.Op.SET, [b"k", b"evil"])
    tag = hmac.new(b"guess", payload, hashlib.sha256).digest()[:16]
    channel.sock.sendall(len(payload).to_bytes(4, "big") + payload + tag)
    channel.sock.settimeout(5)
    assert channel.sock.recv(1) == b""  # the coordinator hung up
    assert _client(coordinator).get("k") == b"v"


def test_a_coordinator_that_is_gone_makes_every_call_name_it():
    c = Coordinator(SECRET, "127.0.0.1", 0)
    store = _client(c)
    store.set("k", "v")
    c.close()
    with pytest.raises(dist.DistStoreError, match=rf"the job's coordinator at 127.0.0.1:{c.port} stopped answering"):
        store.add("k2", 1)
    with pytest.raises(dist.DistStoreError, match=rf"cannot reach the job's coordinator at 127.0.0.1:{c.port} "
                                                  rf"within 0.3s"):
        CoordinatorStore("127.0.0.1", c.port, SECRET, datetime.timedelta(seconds=0.3))


def test_the_coordinator_refuses_a_short_secret():
    with pytest.raises(ValueError, match="at least 16 characters"):
        Coordinator("short")


def test_the_command_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != "CROSSREPLICA_JOB_SECRET"}
    done = subprocess.run([PYTHON, "-m", "crossreplica", "coordinator", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "crossreplica coordinator: error: set CROSSREPLICA_JOB_SECRET" in done.stderr


# ---------------------------------------------------------------------- a job at a coordinator

def _coordinator_process(port: int, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, "-m", "crossreplica", "coordinator", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "serving the job's store on 127.0.0.1" in line, line + proc.stderr.read()
    return proc


def _launcher(port: int, env: dict, params: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PYTHON, "-m", "crossreplica", "launch", "--coordinator", f"127.0.0.1:{port}", "--nnodes", "2",
         "--nproc-per-node", "1", "--grace-seconds", "3", "--",
         PYTHON, "-m", "crossreplica", "train", "--strategy", "multi_worker", "--layout-invariant",
         "--micro-batches", "6", "--epochs", "1", "--no-compare", "--no-progress", "--fault-tolerant",
         "--save-params", params, "--log-level", "WARNING", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _job_env() -> dict:
    # every other setting at its default: the documented cluster launch as users run it
    env = {**os.environ, "CROSSREPLICA_JOB_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CROSSREPLICA_COORDINATOR",
              "CROSSREPLICA_TIMEOUT"):
        env.pop(k, None)
    return env


def _train_alone(tmp_path, name: str) -> dict:
    """The same training on one worker: what a layout-invariant job ends at on any worker count."""
    params = str(tmp_path / f"{name}.pt")
    done = subprocess.run([PYTHON, "-m", "crossreplica", "train", "--strategy", "multi_worker", "--layout-invariant",
                           "--micro-batches", "6", "--epochs", "1", "--no-compare", "--no-progress",
                           "--save-params", params], env=_job_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return torch.load(params)


@pytest.mark.multiprocess
def test_two_launchers_meet_at_the_coordinator_and_survive_losing_the_chief(tmp_path):
    """Two hosts' launchers (here on one machine) meet at a coordinator of their own; the
    chief (worker 0, on the first launcher) is killed in step 4; the other finishes alone
    at the parameters of the uninterrupted run: the store was never the chief's."""
    want = _train_alone(tmp_path, "alone")
    env, port = _job_env(), free_port()
    coordinator = _coordinator_process(port, env)
    try:
        params = str(tmp_path / "job.pt")
        first = _launcher(port, env, params, "--kill-worker-at-step", "0:4")
        time.sleep(1.0)  # the first to arrive is host 0: the chief's
        second = _launcher(port, env, params, "--kill-worker-at-step", "0:4")
        outs = [p.communicate(timeout=240) for p in (first, second)]
    finally:
        coordinator.terminate()
        coordinator.communicate(timeout=30)
    assert first.returncode != 0 and "worker 0 exited with code 1" in outs[0][1], outs[0][1]
    assert second.returncode == 0, outs[1][1]
    assert "lost workers [0] during step 4" in outs[1][1], outs[1][1]
    got = torch.load(params)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


_LOOP = r"""
import sys, time, torch
import crossreplica as cr
strategy = cr.MultiWorkerMirroredStrategy()
model = strategy.mirror(torch.nn.Linear(4, 2))
opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)), args=(model,))
ft = cr.FaultTolerance(strategy, (model, opts))

def step(model, opt, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()

print("ready", flush=True)
try:
    for i in range(10_000):
        ft.run(step, torch.ones(8, 4), args=(model, opts))
        time.sleep(0.01)
        if i % 10 == 0:
            ft.call(lambda: open(sys.argv[1] + f".{ft.identity}", "w").write(str(ft.completed)))
except Exception as e:
    print(f"STOPPED {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
"""


@pytest.mark.multiprocess
def test_losing_the_coordinator_stops_every_worker_naming_it_and_nobody_writes_after(tmp_path):
    env, port = _job_env(), free_port()
    coordinator = _coordinator_process(port, env)
    marker = str(tmp_path / "written")
    env = {**env, "CROSSREPLICA_TIMEOUT": "20"}
    procs = [subprocess.Popen([PYTHON, "-c", _LOOP, marker], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                              "CROSSREPLICA_COORDINATOR": f"127.0.0.1:{port}"})
             for r in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None
            early = ""
            while (line := p.stdout.readline()) and line.strip() != "ready":
                early += line
            assert line, early
        time.sleep(1.0)
        coordinator.kill()
        coordinator.wait(10)
        lost_at = time.monotonic()
        written = {r: os.path.getmtime(f"{marker}.{r}") for r in range(2) if os.path.exists(f"{marker}.{r}")}
        outs = [p.communicate(timeout=60)[0] for p in procs]
        took = time.monotonic() - lost_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [3, 3], outs
    # stopped at a step's start (the heartbeat found it gone) or at its first store call, naming it
    assert all(("lost the job's store" in o or "cannot reach the job's store" in o)
               and f"coordinator at 127.0.0.1:{port}" in o for o in outs), outs
    assert took < 20, took  # within the timeout
    assert written and all(os.path.getmtime(f"{marker}.{r}") == t for r, t in written.items())


# ---------------------------------------------------------------------- the environment and the launcher

def test_a_worker_with_a_coordinator_meets_there_under_any_launcher():
    from crossreplica.strategies.bootstrap import JobEnv

    hand = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "CROSSREPLICA_COORDINATOR": "coord:29400"}
    job = JobEnv.read(hand)
    assert job is not None and job.coordinator == ("coord", 29400)
    assert (job.master_addr, job.master_port, job.agent_store, job.rank) == ("coord", 29400, True, 1)
    srun = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0",
            "CROSSREPLICA_COORDINATOR": "[fe80::1]:29400"}  # no node list needed: the coordinator serves
    job = JobEnv.read(srun)
    assert job is not None and (job.launcher, job.coordinator, job.rank) == ("srun", ("fe80::1", 29400), 2)
    with pytest.raises(ValueError, match=r"CROSSREPLICA_COORDINATOR must be HOST:PORT .*got 'coord'"):
        JobEnv.read({**hand, "CROSSREPLICA_COORDINATOR": "coord"})


def test_a_worker_given_a_coordinator_but_no_secret_is_told_to_set_it(monkeypatch):
    from crossreplica.strategies.bootstrap import JobEnv, _coordinator_store

    monkeypatch.delenv("CROSSREPLICA_JOB_SECRET", raising=False)
    job = JobEnv.read({"RANK": "0", "WORLD_SIZE": "2", "CROSSREPLICA_COORDINATOR": "127.0.0.1:1"})
    assert job is not None and job.coordinator == ("127.0.0.1", 1)
    with pytest.raises(ValueError, match="set CROSSREPLICA_JOB_SECRET to the coordinator's"):
        _coordinator_store(*job.coordinator, SECONDS)


def test_the_launcher_names_what_a_job_across_hosts_needs(monkeypatch):
    from crossreplica.elastic.launch import launch

    with pytest.raises(ValueError, match="nnodes=2 hosts meet at a coordinator"):
        launch([PYTHON, "-c", ""], 1, nnodes=2)
    with pytest.raises(ValueError, match="set CROSSREPLICA_JOB_SECRET to the coordinator's on every host"):
        launch([PYTHON, "-c", ""], 1, coordinator="127.0.0.1:1", nnodes=2,
               env={k: v for k, v in os.environ.items() if k != "CROSSREPLICA_JOB_SECRET"})
    with pytest.raises(ValueError, match=r"--coordinator must be HOST:PORT"):
        launch([PYTHON, "-c", ""], 1, coordinator="nohost", nnodes=2, env={**os.environ,
                                                                          "CROSSREPLICA_JOB_SECRET": SECRET})


def test_a_launcher_beyond_nnodes_is_refused(coordinator):
    from crossreplica.elastic.job_store import take_host_place

    store = _client(coordinator)
    assert [take_host_place(store, SECRET, 2, "here") for _ in range(2)] == [0, 1]
    assert take_host_place(_client(coordinator), "another-job-secret-0123", 2, "here") == 0  # its own count
    with pytest.raises(ValueError, match=r"launcher 3 to reach the coordinator at here, but the job has --nnodes 2"):
        take_host_place(store, SECRET, 2, "here")


def test_the_launchers_own_job_goes_through_its_coordinator(tmp_path):
    """A one-host launch serves the authenticated store: its workers are given its address."""
    from crossreplica.elastic.launch import launch

    code = (f"import os; open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').write(' '.join(os.environ[k] "
            "for k in ('CROSSREPLICA_COORDINATOR', 'MASTER_ADDR', 'MASTER_PORT')))")
    assert launch([PYTHON, "-c", code], 2) == 0
    rows = [(tmp_path / str(r)).read_text().split() for r in range(2)]
    assert rows[0] == rows[1] and rows[0][0] == f"127.0.0.1:{rows[0][2]}" and rows[0][1] == "127.0.0.1"


class _Store:
    """A store whose add fails, or blocks, on demand."""

    def __init__(self):
        self.fail = None
        self.block = threading.Event()
        self.block.set()

    def clone(self):
        return self

    def add(self, key, n):
        self.block.wait(30)
        if self.fail:
            raise dist.DistStoreError(self.fail)
        return 1


def test_the_heartbeat_says_when_the_store_failed_or_stopped_answering():
    from crossreplica.engines.torch_dist.heartbeat import Heartbeat

    store = _Store()
    beat = Heartbeat(store, "p", 0, period=0.01)
    try:
        time.sleep(0.1)
        assert beat.store_lost(after=0.5) is None
        store.block.clear()  # frozen: a beat waits for its answer
        time.sleep(0.8)
        assert "has not answered a heartbeat for" in (beat.store_lost(after=0.5) or "")
        store.fail = "the job's coordinator at c:1 stopped answering"
        store.block.set()
        deadline = time.monotonic() + 5
        while "failed" not in (beat.store_lost(after=0.5) or "") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beat.store_lost(after=0.5) == ("it failed a heartbeat (DistStoreError: the job's coordinator at c:1 "
                                              "stopped answering)")
    finally:
        beat.stop()
        store.block.set()


@pytest.mark.parametrize("coordinator", [None, ("coord", 29400), ("fe80::1", 29400)])
def test_the_environment_a_launcher_writes_reads_back_as_the_same_place_in_the_job(coordinator):
    from crossreplica.strategies.bootstrap import JobEnv

    job = JobEnv("crossreplica launch", 5, 8, 1, 2, "coord" if coordinator is None else coordinator[0],
                 29400, agent_store=True, coordinator=coordinator)
    env = job.environ()
    assert env["GROUP_RANK"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
    assert JobEnv.read(env) == job
