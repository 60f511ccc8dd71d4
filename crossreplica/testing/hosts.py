"""Simulated hosts: network namespaces on a bridge, each a host as far as a job can tell.

Each host gets its own network namespace (an address on a shared bridge, its
own loopback) and UTS and mount namespaces that every process started on it
joins: its own hostname, ``/etc/hosts`` (naming every host), ``/dev/shm`` and
``/tmp``, shared by the processes of that host and no other. So same-host
shortcuts (shared memory, loopback) work within a host and do not reach across
hosts, and a link can be cut (``link_down``) or rate-limited (``tc`` token
bucket) per host. Needs root and iproute2 (``ip``, ``tc``) and util-linux
(``unshare``, ``nsenter``); :func:`available` says why not when they are
missing.

Everything created (namespaces, veths, the bridge, processes) is removed by
:meth:`SimulatedHosts.close`, which the context manager always calls; names
carry a random suffix, so runs side by side never collide.

    with SimulatedHosts(2) as hosts:
        p = hosts.start(0, ["python", "-c", "import socket; print(socket.gethostname())"])

A process already running can become one of a host's instead: :meth:`Host.enter`
(``hosts.host(i)`` is picklable), which is how
:class:`~crossreplica.testing.WorkerPool` places its forked workers on hosts.

From a shell: ``scripts/hosts N [--rate R] [--debian-loopback] -- CMD ...`` runs CMD on
each host, ``{addr0}``, ``{addr1}``, ... and ``{i}`` (the host's index) filled in.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import dataclasses
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from shlex import quote
from typing import Any

__all__ = ["Host", "SimulatedHosts", "available"]

#: The private /24 the hosts' addresses come from (host i is .(10 + i)).
SUBNET = "10.213.{n}"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when simulated hosts can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare", "nsenter", "tc"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r} on PATH"
    name = f"crprobe{secrets.token_hex(3)}"
    try:
        made = _run("ip", "netns", "add", name, check=False)
        if made.returncode != 0:
            return f"network namespaces cannot be made here: {made.stderr.strip()}"
        probe = _run("ip", "netns", "exec", name, "unshare", "--uts", "--mount", "true", check=False)
        if probe.returncode != 0:
            return f"UTS and mount namespaces cannot be made here: {probe.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


#: unshare(2)'s flag for a thread's own root and working directory (Python 3.11's os has no
#: unshare or setns: libc's, through ctypes)
_CLONE_FS = 0x00000200


def _under_tmp(cwd: Any) -> list[str]:
    """The paths a host must still see that lie under /tmp: this checkout of crossreplica, the
    Python environment and ``cwd`` (outermost only)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = {os.path.realpath(p) for p in (os.path.dirname(package_root), sys.prefix, cwd) if p}
    under = sorted(p for p in paths if p.startswith("/tmp/"))
    return [p for p in under if not any(p.startswith(q + "/") for q in under if q != p)]


@dataclasses.dataclass(frozen=True)
class Host:
    """One simulated host, as a process needs it to run there (picklable).

    A host's namespaces (network, UTS, mount: its hostname, /dev/shm, /tmp and /etc/hosts)
    are held by one idle process, ``anchor``; every process of the host joins them, so
    processes of one host share its /dev/shm and /tmp as on a real machine."""

    index: int
    namespace: str  #: its network namespace (``ip netns``)
    hostname: str
    address: str  #: its address on the bridge
    anchor: int  #: the process id holding the host's namespaces
    machine_tmp: str  #: where the machine's /tmp stays reachable under the host's own
    debian_hosts_file: str  #: /etc/hosts as Debian's installer writes it (own name -> 127.0.1.1)

    def enter(self) -> None:
        """Makes the calling thread, and the threads and processes it starts after, one of this
        host's processes (as :meth:`SimulatedHosts.start` starts them). Namespaces are entered by
        the calling thread only: call it before the process makes the threads or sockets that
        must be on the host (e.g. first thing in a worker process)."""
        cwd = os.getcwd()
        libc = ctypes.CDLL(None, use_errno=True)
        # A mount namespace is entered only by a thread whose root and working directory are its
        # own: threads share them (torch's import starts one), so take a copy first.
        self._check(libc.unshare(_CLONE_FS), "a root and working directory of its own")
        for kind in ("net", "uts", "mnt"):
            fd = os.open(f"/proc/{self.anchor}/ns/{kind}", os.O_RDONLY)
            try:
                self._check(libc.setns(fd, 0), f"the {kind} namespace")
            finally:
                os.close(fd)
        os.chdir(cwd if os.path.isdir(cwd) else "/")  # entering a mount namespace moves to its root

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot enter host {self.index} (namespaces of process {self.anchor}): "
                                 f"{what}: {os.strerror(errno)}")

    def command(self, argv: Sequence[str], cwd: Any = None, debian_loopback: bool = False) -> list[str]:
        """``argv`` as a command that runs it on this host, in ``cwd`` (kept visible where it lies
        under /tmp); ``debian_loopback``: in a mount namespace of its own whose /etc/hosts maps
        the host's own name to 127.0.1.1, as Debian's installer writes it (/dev/shm and /tmp
        stay the host's)."""
        script = [f"{{ mountpoint -q {quote(path)} || {{ mkdir -p {quote(path)} && "
                  f"mount --bind {quote(self.machine_tmp + path[4:])} {quote(path)}; }}; }}"
                  for path in _under_tmp(cwd)]
        unshare = []
        if debian_loopback:
            unshare = ["unshare", "--mount", "--propagation", "private"]
            script.append(f"mount --bind {quote(self.debian_hosts_file)} /etc/hosts")
        if cwd is not None:
            script.append(f"cd {quote(os.path.realpath(cwd))}")
        return ["nsenter", "--target", str(self.anchor), "--net", "--uts", "--mount", *unshare,
                "sh", "-c", " && ".join([*script, 'exec "$@"']), "sh", *argv]


class SimulatedHosts:
    """``n`` hosts on one bridge; see the module docstring.

    Args:
        n: the number of hosts (2 to 200).
        rate: a ``tc`` rate for each host's link (e.g. "1gbit"); None: unlimited.
    """

    def __init__(self, n: int = 2, rate: str | None = None):
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 200:
            raise ValueError(f"n must be an int from 2 to 200 (hosts); got {n!r}")
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        self.n = n
        self.rate = rate
        tag = secrets.token_hex(3)
        self.bridge = f"crb{tag}"
        self.namespaces = [f"cr{tag}h{i}" for i in range(n)]
        self._veths = [f"cr{tag}v{i}" for i in range(n)]
        self.addresses = [f"{SUBNET.format(n=int(tag[:2], 16) % 250)}.{10 + i}" for i in range(n)]
        self.hostnames = [f"host{i}" for i in range(n)]
        # Not under /tmp: each host mounts its own /tmp over it.
        self._dir = tempfile.mkdtemp(prefix="crossreplica-hosts-",
                                     dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        self._procs: list[subprocess.Popen] = []
        self._hosts: list[Host] = []
        self._made: list[tuple[str, ...]] = []  # what close() removes, in reverse order
        atexit.register(self.close)  # the last resort: a with-block always closes first
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ set-up

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("ip", "link", "del", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        every = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
        for i, name in enumerate(self.hostnames):
            with open(self._hosts_path(i, False), "w") as f:
                f.write(every)
            with open(self._hosts_path(i, True), "w") as f:  # Debian's installer: own name -> 127.0.1.1
                f.write(f"127.0.0.1 localhost\n127.0.1.1 {name}\n" + every.split("\n", 1)[1])
        for ns, veth, address in zip(self.namespaces, self._veths, self.addresses):
            _run("ip", "netns", "add", ns)
            self._made.append(("ip", "netns", "del", ns))
            peer = veth + "p"
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            self._made.append(("ip", "link", "del", veth))
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "link", "set", peer, "netns", ns)
            _run("ip", "-n", ns, "link", "set", peer, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                     self.rate, "burst", "256kb", "latency", "50ms")
        machine_tmp = os.path.join(self._dir, "machine-tmp")
        os.makedirs(machine_tmp)
        for i in range(self.n):
            self._hosts.append(Host(i, self.namespaces[i], self.hostnames[i], self.addresses[i],
                                    self._anchor(i, machine_tmp), machine_tmp, self._hosts_path(i, True)))

    def _anchor(self, host: int, machine_tmp: str) -> int:
        """Starts the idle process that holds ``host``'s UTS and mount namespaces, set up: its
        hostname, /etc/hosts, and a /dev/shm and /tmp of its own (the machine's /tmp stays
        reachable at ``machine_tmp``, and what runs from under it visible in place)."""
        steps = [f"hostname {quote(self.hostnames[host])}", "mount -t tmpfs tmpfs /dev/shm",
                 f"mount --bind /tmp {quote(machine_tmp)}", "mount -t tmpfs tmpfs /tmp"]
        for path in _under_tmp(None):
            steps += [f"mkdir -p {quote(path)}", f"mount --bind {quote(machine_tmp + path[4:])} {quote(path)}"]
        steps += [f"mount --bind {quote(self._hosts_path(host, False))} /etc/hosts", "echo ready",
                  "exec sleep infinity"]
        errors = os.path.join(self._dir, f"anchor{host}.err")
        ready, done = os.pipe()
        with open(errors, "w") as err:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "--mount",
                                     "--propagation", "private", "sh", "-c", " && ".join(steps)],
                                    stdout=done, stderr=err, start_new_session=True)
        os.close(done)
        self._procs.append(proc)
        with os.fdopen(ready) as out:
            answered = select.select([out], [], [], 30)[0]  # the set-up's commands take milliseconds
            if not answered or out.readline().strip() != "ready":
                proc.kill()
                with open(errors) as err:
                    why = err.read().strip() or "no answer within 30 s"
                raise RuntimeError(f"host {host}'s namespaces could not be set up: {why}")
        return proc.pid  # ip netns exec, unshare and sh each exec the next: sleep has this id

    def _hosts_path(self, host: int, debian_loopback: bool) -> str:
        return os.path.join(self._dir, f"hosts{host}{'-debian' if debian_loopback else ''}")

    # ------------------------------------------------------------ processes

    def start(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None,
              debian_loopback: bool = False, **popen: Any) -> subprocess.Popen:
        """Starts ``argv`` on ``host`` (its hostname, /etc/hosts, /dev/shm and /tmp, shared by
        every process of the host), in a process group of its own; :meth:`close` kills whatever
        is still running. ``debian_loopback``: the command's /etc/hosts maps the host's own name
        to 127.0.1.1."""
        proc = subprocess.Popen(self.host(host).command(argv, popen.get("cwd"), debian_loopback), env=env,
                                start_new_session=True, **popen)
        self._procs.append(proc)
        return proc

    def host(self, host: int) -> Host:
        """Host ``host``: what a process started elsewhere needs to join it (:meth:`Host.enter`)."""
        if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < self.n:
            raise ValueError(f"host must be an int in [0, {self.n}); got {host!r}")
        return self._hosts[host]

    def link_down(self, host: int) -> None:
        """Cuts ``host``'s link: its packets are dropped, nothing is reset."""
        _run("ip", "link", "set", self._veths[host], "down")

    def link_up(self, host: int) -> None:
        _run("ip", "link", "set", self._veths[host], "up")

    # ------------------------------------------------------------ tear-down

    def close(self) -> None:
        """Kills every process started here (and anything left in the namespaces), then removes
        the namespaces, links and bridge."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        while self._made:
            _run(*self._made.pop(), check=False)
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/hosts``: a command on every simulated host; the highest exit code."""
    parser = argparse.ArgumentParser(prog="scripts/hosts", description="Runs CMD on N simulated hosts; "
                                     "{addr0}, {addr1}, ... and {i} in CMD are filled in per host.")
    parser.add_argument("n", type=int, help="the number of hosts")
    parser.add_argument("--rate", default=None, help="each link's rate (tc tbf), e.g. 1gbit")
    parser.add_argument("--debian-loopback", action="store_true",
                        help="each host's own name resolves to 127.0.1.1, as Debian's /etc/hosts has it")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)  # options after N too (REMAINDER would take them)
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1:] or args.cmd
    if not cmd:
        parser.error("no command given after --")
    reason = available()
    if reason is not None:
        print(f"scripts/hosts: {reason}", file=sys.stderr)
        return 2
    with SimulatedHosts(args.n, rate=args.rate) as hosts:
        fields = {f"addr{j}": a for j, a in enumerate(hosts.addresses)}
        procs = [hosts.start(i, [c.format(i=i, **fields) for c in cmd], debian_loopback=args.debian_loopback)
                 for i in range(args.n)]
        try:
            codes = [p.wait() for p in procs]
        except KeyboardInterrupt:
            return 130
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
