"""Across hosts, on simulated hosts (crossreplica.testing.hosts): network namespaces on a
bridge, each with its own address, hostname, /etc/hosts, /dev/shm and /tmp.

* The demo trains across 2 hosts (1 and 2 processes each, launched by torchrun on each
  host) to bitwise the parameters of one device, in the layout-invariant mode.
* A cut link: both sides of the partition fail within the timeout (plus a small
  bound), the cut-off side saying the store stopped answering it.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from harness import REPO, SUPPORT, subprocess_env

from crossreplica.testing.hosts import SimulatedHosts, available

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts,
              pytest.mark.skipif(available() is not None, reason=str(available()))]


def _env() -> dict[str, str]:
    env = subprocess_env()
    env["CROSSREPLICA_JOB_SECRET"] = secrets.token_hex(16)  # every worker of the job: the same
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


def _port() -> int:
    # Each host is a fresh network namespace: nothing else listens there.
    return 20000 + secrets.randbelow(20000)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    return [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]


TRAIN = ["-m", "crossreplica.cli", "train", "--epochs", "1", "--batch-size", "48", "--no-progress",
         "--no-compare", "--layout-invariant", "--micro-batches", "8"]


@pytest.mark.parametrize("per_host, replicas_per_worker", [(1, 1), (2, 1), (1, 2)],
                         ids=["2x1", "2x2", "2x1x2-replicas"])
def test_the_demo_across_two_hosts_trains_the_bits_of_one_device(per_host, replicas_per_worker):
    out_dir = tempfile.mkdtemp(prefix="crossreplica-hosts-test-", dir="/var/tmp")
    try:
        one = os.path.join(out_dir, "one.pt")
        subprocess.run([sys.executable, *TRAIN, "--strategy", "one_device", "--save-params", one], cwd=REPO,
                       env=_env(), check=True, capture_output=True, timeout=120)
        hosts_pt = os.path.join(out_dir, "hosts.pt")
        env = _env()
        with SimulatedHosts(2) as hosts:
            endpoint = f"{hosts.addresses[0]}:{_port()}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={per_host}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={secrets.token_hex(8)}",
                   *TRAIN, "--strategy", "multi_worker", "--replicas-per-worker", str(replicas_per_worker),
                   "--save-params", hosts_pt]
            procs = [hosts.start(h, cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for h in range(2)]
            outs = _wait_all(procs, timeout=240)
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out
        replicas = 2 * per_host * replicas_per_worker
        assert f"multi_worker strategy, {replicas} replica(s) in sync" in outs[0] + outs[1]
        a, b = torch.load(one, weights_only=True), torch.load(hosts_pt, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


_LOOP = """
import sys, time
import torch
import crossreplica as cr
s = cr.MultiWorkerMirroredStrategy(timeout_seconds=float(sys.argv[1]))
print("ready", flush=True)
start = None
try:
    while True:
        s.run(lambda: cr.all_reduce(torch.ones(4)))
        start = time.monotonic()
        time.sleep(0.02)
except Exception as e:
    print(f"FAILED {type(e).__name__} after {time.monotonic() - start:.1f}s: {e}", flush=True)
    sys.exit(3)
"""


def test_both_sides_of_a_cut_link_fail_within_the_timeout():
    timeout = 8.0
    with SimulatedHosts(2) as hosts:
        port = str(_port())
        procs = []
        job = _env()
        for h in range(2):
            env = {**job, "RANK": str(h), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                   "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": port}
            procs.append(hosts.start(h, [sys.executable, "-c", _LOOP, str(timeout)], env=env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        early = ["", ""]
        for h, p in enumerate(procs):  # both in the loop (c10d may warn first)
            assert p.stdout is not None
            while (line := p.stdout.readline()) and line.strip() != "ready":
                early[h] += line
            assert line, early[h]
        time.sleep(0.5)
        cut = time.monotonic()
        hosts.link_down(1)
        outs = [a + b for a, b in zip(early, _wait_all(procs, timeout=timeout + 30))]
        took = time.monotonic() - cut
    print(f"both sides failed {took:.1f}s after the cut (timeout {timeout:g}s)")
    assert took < timeout + 10, (took, outs)
    assert all(p.returncode == 3 for p in procs), outs
    assert "CollectiveTimeoutError" in outs[0] or "WorkerFailedError" in outs[0], outs[0]
    assert "worker ranks [1]" in outs[0], outs[0]
    assert "stopped answering this worker" in outs[1], outs[1]


def _start_loop(hosts: SimulatedHosts, per_host: int, timeout: float) -> tuple[list[subprocess.Popen], list[str]]:
    """``_LOOP`` on every host, launched by hand (rank r on host r // per_host); returns once
    every worker is in the loop, with what each printed before."""
    port, job, world = str(_port()), _env(), 2 * per_host
    procs = []
    for rank in range(world):
        env = {**job, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_host),
               "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": port}
        procs.append(hosts.start(rank // per_host, [sys.executable, "-c", _LOOP, str(timeout)], env=env, cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    early = [""] * world
    for rank, p in enumerate(procs):  # all in the loop (c10d may warn first)
        assert p.stdout is not None
        while (line := p.stdout.readline()) and line.strip() != "ready":
            early[rank] += line
        assert line, early[rank]
    time.sleep(0.5)
    return procs, early


def _report(p: subprocess.Popen, deadline: float) -> str:
    """What ``p`` printed up to its FAILED line (or its end, or the deadline)."""
    assert p.stdout is not None
    out = ""
    while time.monotonic() < deadline and (line := p.stdout.readline()):
        out += line
        if line.startswith("FAILED"):
            break
    return out


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_losing_a_hosts_workers_names_every_one_within_seconds(how):
    """2 hosts x 2 workers; both of host 1's workers are killed (or frozen with SIGSTOP).
    No connection of host 0's workers need break, yet they fail within seconds (the
    heartbeats, also for a frozen worker caught in the middle of a transfer), naming both
    lost ranks, and exit within the timeout; frozen workers, once thawed, stop too."""
    timeout = 20.0
    with SimulatedHosts(2) as hosts:
        procs, early = _start_loop(hosts, 2, timeout)
        lost = time.monotonic()
        for p in procs[2:]:
            os.kill(p.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        # Read one after the other: the second report's deadline must allow the first's time.
        reports = [_report(p, lost + timeout + 5) for p in procs[:2]]
        took = time.monotonic() - lost
        # A backend operation still waiting on a frozen peer ends at its own timeout; then they exit.
        survivors = _wait_all(procs[:2], timeout=timeout + 10)
        if how == "freeze":
            for p in procs[2:]:
                os.kill(p.pid, signal.SIGCONT)
            thawed = _wait_all(procs[2:], timeout=timeout + 10)
    print(f"host 0's workers failed {took:.1f}s after host 1's were {dict(kill='killed', freeze='frozen')[how]}")
    outs = [a + b + c for a, b, c in zip(early, reports, survivors)]
    assert all(p.returncode == 3 for p in procs[:2]), outs
    # The heartbeat's 2 s (or a broken connection), not the timeout: a worker frozen in the middle
    # of a transfer too (an engine thread waits on it while the caller watches the heartbeats).
    assert took < 10, (took, outs)
    # every lost rank named, and only those (by their heartbeats, or a broken connection)
    assert all("worker ranks [2, 3]" in report for report in reports), outs
    if how == "freeze":
        assert all(p.returncode == 3 for p in procs[2:]), thawed  # no second job carries on


def test_a_worker_killed_on_one_host_is_restarted_and_the_job_resumes_from_its_checkpoint():
    """torchrun --max-restarts on each host; host 1's worker dies in the middle of step 3. Its
    agent counts a restart, host 0's a membership change (their attempt numbers differ), yet
    the restarted workers meet, resume from the chief's checkpoint (no shared directory: each
    host writes its own) and end with the parameters of the uninterrupted run."""
    from elastic_train import reference

    total, kill_at = 6, 3
    out_dir = tempfile.mkdtemp(prefix="crossreplica-hosts-test-", dir="/var/tmp")
    try:
        env = _env()
        with SimulatedHosts(2) as hosts:
            endpoint, run_id = f"{hosts.addresses[0]}:{_port()}", secrets.token_hex(8)
            procs = []
            for h in range(2):
                mine = os.path.join(out_dir, f"host{h}")
                os.makedirs(mine)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
                       "--max-restarts=1", "--monitor-interval=0.2",
                       os.path.join(SUPPORT, "elastic_train.py"), mine, str(total), str(kill_at)]
                procs.append(hosts.start(h, cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
            outs = _wait_all(procs, timeout=240)
        assert all(p.returncode == 0 for p in procs), [out[-3000:] for out in outs]
        with open(os.path.join(out_dir, "host0", "log0.txt")) as f:
            lines = f.read().splitlines()
        assert any(line.endswith(f"starts at step {kill_at}") for line in lines), lines  # resumed there
        done = [int(line.rsplit(" ", 1)[1]) for line in lines if "finished step" in line]
        assert done == list(range(total)), lines  # every step exactly once
        final = torch.load(os.path.join(out_dir, "host0", "final.pt"))
        want = reference(total, 2)
        for k in want:
            torch.testing.assert_close(final[k], want[k], msg=k)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def test_launched_by_hand_every_listening_socket_is_bound_to_the_hosts_own_address():
    """The store (rank 0's) binds to MASTER_ADDR, gloo to the host's address: nothing listens
    on every interface (docs/multi_process.md, "Where it listens"); `ss -ltn` inside each host."""
    with SimulatedHosts(2) as hosts:
        procs, _ = _start_loop(hosts, 1, 30.0)
        listening = []
        for ns in hosts.namespaces:
            out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout
            listening.append([line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()])
        for p in procs:
            p.kill()
    assert len(listening[0]) >= 2 and listening[1], listening  # the store and gloo; gloo
    for address, bound in zip(hosts.addresses, listening):
        assert set(bound) == {address}, listening


def test_the_demo_across_hosts_whose_name_resolves_to_loopback():
    """Debian's /etc/hosts maps the host's own name to 127.0.1.1: gloo would advertise that
    to the peer (which then fails, while rank 0 hung for minutes). The strategy gives gloo
    the interface that routes to MASTER_ADDR, and the job trains."""
    env = _env()
    env["CROSSREPLICA_TIMEOUT"] = "30"
    with SimulatedHosts(2) as hosts:
        port = str(_port())
        procs = [hosts.start(h, [sys.executable, *TRAIN, "--strategy", "multi_worker"], debian_loopback=True,
                             env={**env, "RANK": str(h), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                  "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": port},
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for h in range(2)]
        outs = _wait_all(procs, timeout=120)
    assert all(p.returncode == 0 for p in procs), outs
    assert "bitwise identical (all workers): yes" in outs[0]


_CHOICE = ("import crossreplica.strategies.network as n; print('CHOICE', n.choose_gloo_interface({addr!r}))")


@pytest.mark.parametrize("debian, ifname, want", [(True, None, "eth0"), (False, None, "None"),
                                                  (True, "lo", "None")])
def test_the_gloo_interface_is_chosen_only_when_the_default_cannot_work(debian, ifname, want):
    env = _env()
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname  # the user's choice stands
    with SimulatedHosts(2) as hosts:
        p = hosts.start(1, [sys.executable, "-c", _CHOICE.format(addr=hosts.addresses[0])], env=env, cwd=REPO,
                        debian_loopback=debian, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = _wait_all([p], timeout=60)[0]
    assert f"CHOICE {want}" in out, out


def test_the_script_runs_a_command_on_every_host_and_leaves_nothing():
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    done = subprocess.run([os.path.join(REPO, "scripts", "hosts"), "2", "--", "sh", "-c", "echo {i} $(hostname) {addr1}"],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.split("\n")[:2])
    assert [line.split()[:2] for line in lines] == [["0", "host0"], ["1", "host1"]], done.stdout
    assert lines[0].split()[2] == lines[1].split()[2]  # {addr1}: the same address on both
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert after == before


_CHAIN = """
import os, sys
import torch
import crossreplica as cr
from crossreplica.engines.torch_dist import all_reduce as ar
s = cr.MultiWorkerMirroredStrategy(replicas_per_worker=int(sys.argv[1]), timeout_seconds=60)
used, real = [], ar.chain_all_reduce
ar.chain_all_reduce = lambda *a, **k: (used.append(1), real(*a, **k))[1]
def value(rid, n, dtype):
    g = torch.Generator().manual_seed(rid)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    return (x * torch.exp(3 * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)
def rid():
    return cr.get_replica_context().replica_id_in_sync_group
def tx():
    for line in open("/proc/net/dev"):
        name, _, rest = line.partition(":")
        if name.strip() == "eth0":
            return int(rest.split()[8])
replicas, ok = s.num_replicas_in_sync, True
for dtype in (torch.float32, torch.float64):
    for op in ("sum", "mean"):
        out = s.experimental_local_results(s.run(lambda: cr.all_reduce(value(rid(), 1001, dtype), op)))
        want = value(0, 1001, dtype)
        for r in range(1, replicas):
            want = want + value(r, 1001, dtype)
        want = want / replicas if op == "mean" else want
        ok = ok and all(torch.equal(o, want) for o in out)
n = 1 << 20
s.extended.engine.barrier()
before = tx()
s.run(lambda: cr.all_reduce(value(rid(), n, torch.float32)))
s.extended.engine.barrier()
print(f"RESULT ok={ok} chain={len(used)} hosts={s.extended.engine.hosts} sent={(tx() - before) / (4 * n):.2f}",
      flush=True)
"""


@pytest.mark.parametrize("per_host, replicas_per_worker", [(2, 1), (1, 2)], ids=["2x2", "2x1x2-replicas"])
def test_ordered_reductions_cross_each_host_boundary_once_each_way(per_host, replicas_per_worker):
    """Across hosts the ordered all-reduce goes along the chain of hosts (engines/torch_dist/chain.py):
    bitwise the left fold in replica order, and each host sends the vector about once (the ordered
    all-reduce of ordered.py sent it twice: every replica's share, then every chunk to each peer)."""
    with SimulatedHosts(2) as hosts:
        endpoint = f"{hosts.addresses[0]}:{_port()}"
        script = os.path.join(tempfile.mkdtemp(prefix="crossreplica-chain-", dir="/var/tmp"), "chain.py")
        with open(script, "w") as f:
            f.write(_CHAIN)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={per_host}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={secrets.token_hex(8)}", script,
               str(replicas_per_worker)]
        env = _env()
        procs = [hosts.start(h, cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for h in range(2)]
        outs = _wait_all(procs, timeout=180)
    os.remove(script)
    os.rmdir(os.path.dirname(script))
    assert all(p.returncode == 0 for p in procs), outs
    layout = "[(0, 1), (2, 3)]" if per_host == 2 else "[(0,), (1,)]"
    # the workers of a host share one pipe: their lines may run together
    results = [m for out in outs for m in re.findall(r"RESULT ok=(\w+) chain=(\d+) hosts=(\[[^\]]*\]) sent=(\d+\.\d\d)", out)]
    assert len(results) == 2 * per_host, outs
    for ok, chain, layout_seen, sent in results:
        assert (ok, chain, layout_seen) == ("True", "5", layout), results
        assert float(sent) < 1.3, results  # the vector once per host (plus headers)


_FT_LOOP = """
import logging, os, subprocess, sys, time
import torch
from torch import nn
import crossreplica as cr
logging.basicConfig(level=logging.WARNING)
out, steps, timeout, members = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
cut_at = sys.argv[5]  # worker 2 takes its host's link down at this point of step 5 (or "none")
strategy = cr.MultiWorkerMirroredStrategy(backend="gloo", timeout_seconds=timeout,
                                          layout_invariant=cr.LayoutInvariant(micro_batches=6, results="sum"))
torch.manual_seed(0)
model = strategy.mirror(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)))
opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)),
                    args=(model,))
ft = cr.FaultTolerance(strategy, (model, opts))
i = 0

def cut(point):
    if point == cut_at and i == 5 and ft.identity == 2:
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)

for copy in strategy.experimental_local_results(model):
    copy.register_forward_pre_hook(lambda m, args: cut("forward"))
for opt in strategy.experimental_local_results(opts):
    opt.optimizer.register_step_pre_hook(lambda o, args, kwargs: cut("optimizer"))

def step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()

g = torch.Generator().manual_seed(1)
print("ready", flush=True)
deadline = time.monotonic() + 60
try:
    for i in range(1, steps + 1):
        batch = (torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g))
        if i <= ft.completed:  # a joining worker: done before it came
            continue
        ft.run(step, batch, args=(model, opts), reduce="sum")
        # Short-handed (a worker lost, one to join): slower, so the joining one can come.
        time.sleep(0.3 if len(ft.members) < members and time.monotonic() < deadline else 0.05)
except Exception as e:
    print(f"FAILED {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
torch.save(strategy.experimental_local_results(model)[0].state_dict(), f"{out}.{ft.identity}")
print(f"members {list(ft.members)}", flush=True)
"""


def _ft_reference(out_dir: str, steps: int, timeout: float) -> str:
    """``_FT_LOOP`` on one worker, without a launcher: the parameters a fault-tolerant run of it
    ends at on any worker count (layout-invariant); returns the path its worker 0 saved to."""
    reference = os.path.join(out_dir, "reference")
    subprocess.run([sys.executable, "-c", _FT_LOOP, reference, str(steps), str(timeout), "1", "none"], cwd=REPO,
                   env=_env(), check=True, capture_output=True, timeout=120)
    return reference


@pytest.mark.parametrize("how", ["cut", "kill", "rejoin", "cut-in-forward", "cut-in-optimizer"])
def test_a_fault_tolerant_job_goes_on_without_a_host_cut_off_which_stops_itself(how):
    """Workers 0 and 1 on host 0 (worker 0 serves the store), worker 2 on host 1, in a
    fault-tolerant job; host 1's link goes down mid-training (or its worker is killed). The
    survivors agree without worker 2 and finish with the parameters of the uninterrupted run
    (layout-invariant: any worker count gives the same bits); worker 2, cut off from the
    store, cannot take part in any agreement and stops within the timeout without writing
    anything: no second job. "cut-in-forward", "cut-in-optimizer": worker 2 takes its
    host's link down itself at that point of step 5. "rejoin": the killed worker is started again by hand on host 1
    (CROSSREPLICA_JOIN=1), joins at a step boundary with the live state from host 0, and all
    three finish."""
    timeout, steps = 8.0, 80
    out_dir = tempfile.mkdtemp(prefix="crossreplica-hosts-test-", dir="/var/tmp")
    try:
        out = os.path.join(out_dir, "params")
        reference = _ft_reference(out_dir, steps, timeout)
        with SimulatedHosts(2) as hosts:
            port, job = str(_port()), _env()
            procs = []
            members = "3" if how == "rejoin" else "2"
            point = how.removeprefix("cut-in-") if how.startswith("cut-in-") else "none"
            envs = [{**job, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
                     "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": port} for rank in range(3)]
            for rank, host in enumerate((0, 0, 1)):
                procs.append(hosts.start(host, [sys.executable, "-c", _FT_LOOP, out, str(steps), str(timeout),
                                                members, point], env=envs[rank], cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
            early = [""] * 3
            for rank, p in enumerate(procs):
                assert p.stdout is not None
                while (line := p.stdout.readline()) and line.strip() != "ready":
                    early[rank] += line
                assert line, early[rank]
            time.sleep(0.5)
            cut = time.monotonic()
            if how == "cut":
                hosts.link_down(1)
            elif how in ("kill", "rejoin"):
                procs[2].kill()
            cut_off = _wait_all(procs[2:], timeout=timeout + 30)[0]
            took = time.monotonic() - cut
            if how == "rejoin":
                procs.append(hosts.start(1, [sys.executable, "-c", _FT_LOOP, out, str(steps), str(timeout), members,
                                             "none"],
                                         env={**envs[2], "CROSSREPLICA_JOIN": "1"}, cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            survivors = _wait_all(procs[:2] + procs[3:], timeout=120)
        outs = [early[0] + survivors[0], early[1] + survivors[1], early[2] + cut_off, *survivors[2:]]
        print(f"the cut-off worker stopped {took:.1f}s after the cut (timeout {timeout:g}s)")
        assert [p.returncode for p in procs] == [0, 0, 3 if how.startswith("cut") else -signal.SIGKILL,
                                                 *([0] if how == "rejoin" else [])], outs
        assert all("lost workers [2]" in o for o in outs[:2]), outs
        if how == "rejoin":  # the joining worker is worker 3, rank 2 on host 1 again
            assert all("members [0, 1, 3]" in o and "admitted joining workers [3]" in o for o in outs[:2]), outs
            assert "worker 3: joined the running job" in outs[3] and "members [0, 1, 3]" in outs[3], outs[3]
        else:
            assert all("members [0, 1]" in o for o in outs[:2]), outs
        if how.startswith("cut"):
            assert "cut off from the job's store" in outs[2] or "cannot reach the job's store" in outs[2], outs[2]
        assert took < timeout + 10, (took, outs[2])
        assert not os.path.exists(f"{out}.2")  # it wrote nothing
        want = torch.load(f"{reference}.0", weights_only=True)
        for identity in (0, 1, 3) if how == "rejoin" else (0, 1):
            got = torch.load(f"{out}.{identity}", weights_only=True)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


_ATTACK = r"""
import datetime, sys
import torch.distributed as dist
from crossreplica.elastic.store import CoordinatorStore
host, port = sys.argv[1], int(sys.argv[2])
try:  # torch's own client: list every key, write the abort key
    plain = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=1))
    print("plain client connected:", plain.list_keys() if hasattr(plain, "list_keys") else plain.num_keys())
    plain.set("crossreplica/abort", "attacker says stop")
except Exception as e:
    print("plain client refused:", type(e).__name__, flush=True)
try:  # our own client with a wrong secret
    ours = CoordinatorStore(host, port, "f" * 32, datetime.timedelta(seconds=5))
    print("wrong secret connected:", ours.num_keys())
except Exception as e:
    print("wrong secret refused:", type(e).__name__, flush=True)
"""


@pytest.mark.parametrize("how", ["kill"])  # a cut host: tests/elastic/test_chaos.py
def test_a_job_at_a_coordinator_survives_losing_the_chiefs_host_and_shuts_out_a_third_host(how):
    """``crossreplica coordinator`` on host 0 and ``crossreplica launch --coordinator`` on hosts 1
    and 2 (2 workers each); host 1, the chief's, is lost (every process killed; a cut host is
    tests/elastic/test_chaos.py's) mid-training. Host 2's workers regroup and finish with the parameters of the uninterrupted
    run. Meanwhile host 3, without the job secret, tries what an attacker would, with torch's
    own store client and with ours: both are refused, and the job is untouched."""
    timeout, steps = 8.0, 160
    out_dir = tempfile.mkdtemp(prefix="crossreplica-hosts-test-", dir="/var/tmp")
    try:
        out = os.path.join(out_dir, "params")
        reference = _ft_reference(out_dir, steps, timeout)
        with SimulatedHosts(4) as hosts:
            port, job = _port(), _env()
            coordinator = hosts.start(0, [sys.executable, "-m", "crossreplica", "coordinator", "--port", str(port)],
                                      env=job, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert coordinator.stdout is not None
            assert "serving the job's store" in coordinator.stdout.readline()
            launchers = []
            for host in (1, 2):
                launchers.append(hosts.start(
                    host, [sys.executable, "-m", "crossreplica", "launch", "--coordinator",
                           f"{hosts.addresses[0]}:{port}", "--nnodes", "2", "--nproc-per-node", "2",
                           "--grace-seconds", "5", "--", sys.executable, "-c", _FT_LOOP, out, str(steps),
                           str(timeout), "2", "none"],
                    env=job, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                if host == 1:
                    time.sleep(1.0)  # host 1 reaches the coordinator first: workers 0 and 1, the chief's host
            for p in launchers:  # every worker of a host in the loop (each prints "ready")
                assert p.stdout is not None
                early, ready = "", 0
                while ready < 2 and (line := p.stdout.readline()):
                    ready += line.strip() == "ready"
                    early += line
                assert ready == 2, early
            time.sleep(0.5)
            lost = time.monotonic()
            if how == "kill":
                os.killpg(launchers[0].pid, signal.SIGKILL)
            else:
                hosts.link_down(1)
            # while the survivors regroup and train on
            attack = hosts.start(3, [sys.executable, "-c", _ATTACK, hosts.addresses[0], str(port)], env=job,
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            survivor_out, survivor_err = launchers[1].communicate(timeout=timeout + 120)
            took = time.monotonic() - lost
            first_out, first_err = launchers[0].communicate(timeout=timeout + 60)
            attacked = attack.communicate(timeout=60)[0]
            coordinator.terminate()
            _, coordinator_err = coordinator.communicate(timeout=30)
        print(f"host 2's workers finished {took:.1f}s after host 1 was lost ({how})")
        assert "plain client refused" in attacked and "wrong secret refused" in attacked, attacked
        assert "refused" in coordinator_err, coordinator_err  # the coordinator counted the attempts
        assert launchers[1].returncode == 0, survivor_err
        assert "lost workers [0, 1]" in survivor_err and survivor_out.count("members [2, 3]") == 2, (
            survivor_out + survivor_err)
        if how == "cut":  # host 1's workers, cut off from the coordinator, stop without writing
            assert launchers[0].returncode != 0, first_err
        assert not os.path.exists(f"{out}.0") and not os.path.exists(f"{out}.1")
        want = torch.load(f"{reference}.0", weights_only=True)
        for identity in (2, 3):
            got = torch.load(f"{out}.{identity}", weights_only=True)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
