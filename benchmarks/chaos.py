"""Chaos, measured: random kills, freezes, link cuts and re-joins of a fault-tolerant job across hosts.

    sudo .venv/bin/python benchmarks/chaos.py [--hosts 3] [--per-host 2] [--faults 6] [--seed 0]
    sudo .venv/bin/python benchmarks/chaos.py --hosts 5 --per-host 2 --faults 10 --epochs 16 --seed 1

Simulated hosts (``crossreplica.testing.hosts``): ``crossreplica coordinator`` on
host 0, which runs no worker, and ``crossreplica launch --coordinator ...
--max-restarts R`` on each of ``--hosts`` worker hosts, ``--per-host`` workers
each, running the demo (``crossreplica train --strategy multi_worker
--fault-tolerant --layout-invariant``). While it trains, faults are injected
one after another, each once the job has recovered from the one before and
grown back to every worker it can have (or the wait for that ran out):

* ``kill``: SIGKILL one worker process (its launcher starts it again to join,
  while it has restarts left and another of its workers still runs);
* ``freeze``: SIGSTOP one worker for ``--freeze-seconds`` (longer than the
  heartbeat), then SIGCONT: it must find itself fenced out and exit without
  writing anything; its launcher starts it again to join;
* ``cut``: take one worker host's link down for ``--cut-seconds``, then up: the
  others go on without its workers, which stop by themselves; its launcher
  starts again each that exits while the other still runs, to join once the
  link is back.

The first fault of each kind in ``--kinds`` comes in a seeded random order, the
rest are drawn at random; a fault that cannot be made (a cut needs workers on
two hosts at least, a kill or freeze two members) is replaced by one that can.
The target is drawn at random among the members (any worker, the chief's
included) or the hosts with live workers.

Measured per fault, from the workers' WARNING records (``--log-level WARNING``:
each carries its wall-clock time, and the seconds its agreement and regrouping
took) and the chief's stdout (timestamped here as read, unbuffered):

* detected: from the injection to the moment the first survivor began to
  recover (its record's time less the seconds it reports);
* agree + regroup: what that record reports;
* recovered: from detection to the chief's line saying the step was redone
  (agreement, regrouping, hand-over and the redo: the step's result in hand);
* redone: steps started again for this fault (a survivor's "redoing step N",
  one per regrouping);
* rejoined: from the injection to the restarted worker's "joined the running
  job" record.

Against the targets of issue 38: detection within the heartbeat
(``--heartbeat``, 2 s) for a kill and within the timeout (``--timeout``) for a
cut or freeze; recovery at most 2 s after detection. The summary says whether
the run ended bitwise at the uninterrupted one-worker run (the layout-invariant
mode gives the same bits for any worker count), whether every process exited
by itself (launchers, workers; the coordinator on SIGTERM), and whether any
worker that was fenced out or cut off wrote its parameters (split brain: each
worker saves to a file named by its process id, and only the chief saves).

Needs root (``crossreplica.testing.hosts.available``). ``run_chaos`` is what
``tests/elastic/test_chaos.py`` calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from crossreplica.testing.hosts import SimulatedHosts, available  # noqa: E402

KINDS = ("kill", "freeze", "cut")
#: the recovery target of issue 38: agree + regroup + redo within this many seconds of detection
RECOVERY_TARGET = 2.0
#: how often the driver looks at the processes
_POLL = 0.05
#: the workers' log prefix (crossreplica.cli's handler): [rank SLOT] asctime LEVEL logger: message
_RECORD = re.compile(r"^\[rank (\d+)\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) ([\w.]+): (.*)$")
_LOST = re.compile(r"worker (\d+): lost workers \[([^\]]*)\] during (?:the call after )?(?:step (\d+)|(.+?)) \(")
_REGROUPED = re.compile(r"regrouped into (\d+) workers \([^)]*epoch (\d+)\) in ([\d.]+)s; (.*)$")
_ADMITTED = re.compile(r"worker (\d+): admitted joining workers \[([^\]]*)\] as step (\d+) starts")
_JOINED = re.compile(r"worker (\d+): joined the running job as step (\d+) starts, as worker rank (\d+) of (\d+) "
                     r"\(epoch (\d+)\)")
_CHIEF_LOST = re.compile(r"^crossreplica train: lost worker\(s\) ([\d, ]+) during (.+?)(?:, worker\(s\) [\d, ]+ "
                         r"joined)?; going on with (\d+) worker")
_RESTARTED = re.compile(r"^crossreplica launch: worker (\d+) exited with code (-?\d+); starting it again")


@dataclasses.dataclass
class ChaosConfig:
    """One chaos run: the job, the faults and their timing (seconds)."""

    hosts: int = 3  #: worker hosts (the coordinator has one more of its own)
    per_host: int = 2  #: workers per worker host
    epochs: int = 20
    batch_size: int = 16
    micro_batches: int | None = None  #: None: the most workers the job can have (at least 8)
    faults: int = 6
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    timeout: float = 8.0  #: the workers' collective timeout (CROSSREPLICA_TIMEOUT)
    heartbeat: float = 2.0  #: CROSSREPLICA_HEARTBEAT_SECONDS
    freeze_seconds: float = 4.0  #: how long a frozen worker stays stopped
    cut_seconds: float | None = None  #: how long a cut link stays down; None: the timeout plus 2 s
    gap: float = 1.0  #: healthy training between a recovery and the next fault: gap to 2 gap, at random
    settle: float | None = None  #: the most to wait for the job to grow back; None: 3 timeouts
    max_restarts: int | None = None  #: each launcher's --max-restarts; None: one per worker of the host
    grace: float = 10.0  #: the launchers' --grace-seconds
    deadline: float = 900.0  #: the whole chaos run (start to the last process's exit)
    log: str | None = None  #: write every line read (timestamped) to this file

    def validate(self) -> None:
        """Raises ValueError naming the first field that cannot make a run, and what it must be."""
        for name, low in (("hosts", 1), ("per_host", 1), ("epochs", 1), ("batch_size", 1), ("faults", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
        if self.hosts > 198:
            raise ValueError(f"hosts must be at most 198 (worker hosts; the coordinator takes one more of the 200 "
                             f"simulated hosts can have); got {self.hosts!r}")
        unknown = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or unknown:
            raise ValueError(f"kinds must be a non-empty selection of {list(KINDS)}; got {list(self.kinds)!r}")
        for name in ("timeout", "heartbeat", "freeze_seconds", "gap", "grace", "deadline", "cut_seconds", "settle"):
            value = getattr(self, name)
            if value is None and name in ("cut_seconds", "settle"):
                continue
            low_ok = value >= 0 if name == "gap" else value > 0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low_ok:
                rule = "a number of seconds >= 0" if name == "gap" else "a positive number of seconds"
                raise ValueError(f"{name} must be {rule}; got {value!r}")
        if self.max_restarts is not None and (isinstance(self.max_restarts, bool)
                                              or not isinstance(self.max_restarts, int) or self.max_restarts < 0):
            raise ValueError(f"max_restarts must be an int >= 0 or None; got {self.max_restarts!r}")
        if self.micro_batches is not None and (isinstance(self.micro_batches, bool)
                                               or not isinstance(self.micro_batches, int)
                                               or self.micro_batches < self.workers):
            raise ValueError(f"micro_batches must be an int >= the job's {self.workers} workers (the layout-invariant "
                             f"mode gives the same bits for any worker count up to it), or None; got "
                             f"{self.micro_batches!r}")
        if self.freeze_seconds <= self.heartbeat:
            raise ValueError(f"freeze_seconds ({self.freeze_seconds:g}) must exceed the heartbeat ({self.heartbeat:g} "
                             f"s), or a freeze goes unnoticed by design")

    @property
    def workers(self) -> int:
        return self.hosts * self.per_host

    @property
    def layout_micro_batches(self) -> int:
        return self.micro_batches if self.micro_batches is not None else max(8, self.workers)

    @property
    def link_seconds(self) -> float:
        return self.cut_seconds if self.cut_seconds is not None else self.timeout + 2.0

    @property
    def settle_seconds(self) -> float:
        return self.settle if self.settle is not None else 3 * self.timeout

    @property
    def restarts(self) -> int:
        return self.max_restarts if self.max_restarts is not None else self.per_host


@dataclasses.dataclass
class Fault:
    """One injected fault and what was measured about it (seconds; None: not seen)."""

    index: int
    kind: str
    host: int  #: the simulated host (1.. are worker hosts)
    pids: list[int]  #: the worker processes it hit
    slots: list[int]  #: their RANKs as launched (a restarted one takes the same)
    identities: list[int]  #: their identities in the job
    at: float  #: wall-clock time of the injection
    since_start: float  #: seconds from the training's start
    ended: float | None = None  #: SIGCONT / link up (wall clock)
    step: str | None = None  #: the step the survivors were in ("step 17")
    detected: float | None = None
    regroup: float | None = None  #: agreement + regrouping, as the first survivor's record says
    recovered: float | None = None  #: detection to the chief's "redone" line
    redone: int = 0
    rejoined: float | None = None  #: injection to the last restarted worker's join
    target: float = 0.0  #: the detection target: the heartbeat for a kill, the timeout for a freeze or cut
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ChaosReport:
    """What a chaos run measured."""

    config: ChaosConfig
    faults: list[Fault]
    steps: int  #: training steps of the run
    bitwise: bool  #: the parameters saved equal the uninterrupted run's, bit for bit
    params_files: list[str]  #: every parameters file written (only the last chief's should be)
    split_brain: list[str]  #: files written by a fenced or cut-off worker, or a second writer
    exited: bool  #: every launcher and worker exited by itself, the coordinator on SIGTERM
    exit_codes: dict[str, int | None]  #: each launcher's and the coordinator's
    strays: list[str]  #: processes left on a host after the launchers exited
    finished: bool  #: the chief reported the run done
    reference_seconds: float
    run_seconds: float
    lines: list[tuple[float, str, str]]  #: every line read: (wall clock, source, text)

    @property
    def survived(self) -> int:
        """Faults detected and recovered from, in a run that finished bitwise."""
        if not (self.finished and self.bitwise):
            return 0
        return sum(1 for f in self.faults if f.detected is not None and f.recovered is not None)

    @property
    def ok(self) -> bool:
        return (self.finished and self.bitwise and self.exited and not self.split_brain
                and len(self.faults) == self.config.faults and self.survived == len(self.faults))

    def table(self) -> list[str]:
        """The faults as a Markdown table, then the summary lines."""
        c = self.config
        headers = ["#", "kind", "target", "at", "during", "detected", "vs target", "agree+regroup", "recovered",
                   "vs 2 s", "redone", "rejoined", "notes"]
        rows = []
        for f in self.faults:
            who = (f"host {f.host} (workers {_ids(f.identities)})" if f.kind == "cut"
                   else f"worker {_ids(f.identities)} (host {f.host})")
            rows.append([str(f.index), f.kind, who, f"{f.since_start:.1f} s", f.step or "-", _s(f.detected),
                         _ratio(f.detected, f.target), _s(f.regroup), _s(f.recovered),
                         _ratio(f.recovered, RECOVERY_TARGET), str(f.redone), _s(f.rejoined), "; ".join(f.notes)])
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        out = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
               "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += ["| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " |" for r in rows]
        out.append("")
        out.append(f"{c.hosts} worker hosts x {c.per_host} workers, coordinator on its own host; {self.steps} steps "
                   f"(batch {c.batch_size}, {c.layout_micro_batches} micro-batches, {c.epochs} epochs); timeout "
                   f"{c.timeout:g} s, heartbeat {c.heartbeat:g} s, freezes {c.freeze_seconds:g} s, cuts "
                   f"{c.link_seconds:g} s; seed {c.seed}")
        out.append(f"faults survived: {self.survived} of {len(self.faults)} injected ({c.faults} asked); steps redone "
                   f"in all: {sum(f.redone for f in self.faults)}; the chaos run took {self.run_seconds:.1f} s (the "
                   f"uninterrupted one-worker run {self.reference_seconds:.1f} s)")
        for kind in KINDS:
            times = [f.detected for f in self.faults if f.kind == kind and f.detected is not None]
            target, what = (c.heartbeat, "the heartbeat's") if kind == "kill" else (c.timeout, "the timeout's")
            if times:
                out.append(f"detection of a {kind}: {_against(times, target, f'{what} {target:g} s')}")
        recovered = [f.recovered for f in self.faults if f.recovered is not None]
        if recovered:
            out.append(f"recovery after detection: {_against(recovered, RECOVERY_TARGET, f'{RECOVERY_TARGET:g} s')}")
        rejoined = [f.rejoined for f in self.faults if f.rejoined is not None]
        if rejoined:
            out.append(f"a restarted worker back in the job (injection to its join; it imports torch first): "
                       f"median {statistics.median(rejoined):.1f} s, worst {max(rejoined):.1f} s, over "
                       f"{len(rejoined)} fault(s)")
        out.append(f"bitwise equal to the uninterrupted run: {'yes' if self.bitwise else 'NO'}; the chief finished: "
                   f"{'yes' if self.finished else 'NO'}")
        codes = ", ".join(f"{k}: {v}" for k, v in self.exit_codes.items())
        out.append(f"every process exited: {'yes' if self.exited else 'NO'} (exit codes: {codes}"
                   f"{'; left running: ' + '; '.join(self.strays) if self.strays else ''})")
        out.append(f"no split brain (no parameters written by a fenced or cut-off worker, one writer): "
                   f"{'yes' if not self.split_brain else 'NO: ' + ', '.join(self.split_brain)} "
                   f"(files: {', '.join(os.path.basename(p) for p in self.params_files) or 'none'})")
        return out


def _against(times: Sequence[float], target: float, name: str) -> str:
    """``times``' median and worst against ``target``: met, or missed by how much."""
    worst = max(times)
    verdict = "met" if worst <= target else f"missed by {worst - target:.2f} s ({worst / target:.2f}x)"
    return (f"median {statistics.median(times):.2f} s, worst {worst:.2f} s over {len(times)} fault(s), against "
            f"{name}: {verdict}")


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(map(str, ids)) if ids else "?"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _ratio(x: float | None, target: float) -> str:
    return "-" if x is None or not target else f"{x / target:.2f}x"


# --------------------------------------------------------------------------- processes and lines


class Lines:
    """Every line the job's processes write to the pipes read here, timestamped as read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[tuple[float, str, str]] = []
        self._threads: list[threading.Thread] = []

    def follow(self, stream: IO[str], source: str) -> None:
        def read() -> None:
            for line in stream:
                with self._lock:
                    self.items.append((time.time(), source, line.rstrip("\n")))
        thread = threading.Thread(target=read, name=f"chaos-{source}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def snapshot(self) -> list[tuple[float, str, str]]:
        with self._lock:
            return list(self.items)

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (/proc; no psutil)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return found


def _state(pid: int) -> str | None:
    """``pid``'s state letter (R, S, T: stopped, Z: exited, not reaped), None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError):
        return None


def _started(pid: int) -> float:
    """When ``pid`` started, in wall-clock seconds (/proc: clock ticks since boot); now when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rpartition(b")")[2].split()[19])
        with open("/proc/uptime") as f:
            boot = time.time() - float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return time.time()
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _record_time(asctime: str) -> float:
    """A log record's asctime (local time, milliseconds) as wall-clock seconds."""
    stamp, ms = asctime.split(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


@dataclasses.dataclass
class _Worker:
    pid: int
    host: int
    slot: int  #: its RANK as launched
    joining: bool
    started: float  #: when it started (wall clock)
    identity: int | None = None


class _Job:
    """The running job as the driver sees it: the launchers' workers and the records so far
    (read incrementally: the driver asks many times a second)."""

    def __init__(self, launchers: dict[int, subprocess.Popen], lines: Lines, size: int):
        self.launchers, self.lines = launchers, lines
        self.workers: dict[int, _Worker] = {}
        self._read = 0  # lines taken in so far
        self._newest = -1.0  # the newest membership record's time
        self.members = size  # its member count (the founders before any)
        self.joins: list[tuple[float, int, int, int]] = []  # (record time, host, slot, identity)
        self.done = False  # the chief said the run is done

    def _take_in(self) -> None:
        items = self.lines.snapshot()
        for _, source, text in items[self._read:]:
            if source.endswith(":out") and text.startswith("done in "):
                self.done = True
            m = _RECORD.match(text)
            if m is None:
                continue
            at, message = _record_time(m.group(2)), m.group(5)
            g, j = _REGROUPED.search(message), _JOINED.search(message)
            if j is not None and source.startswith("host"):
                self.joins.append((at, int(source[4:].split(":")[0]), int(m.group(1)), int(j.group(1))))
            n = int(g.group(1)) if g else int(j.group(4)) if j else None
            if n is not None and at >= self._newest:
                self._newest, self.members = at, n
        self._read = len(items)

    def refresh(self) -> list[_Worker]:
        """The live worker processes (exited ones that are not reaped yet excluded), each with
        its identity once known (a restarted worker's: from its "joined" record)."""
        self._take_in()
        live = []
        for host, launcher in self.launchers.items():
            for pid in _children(launcher.pid):
                if _state(pid) in (None, "Z", "X"):
                    continue
                w = self.workers.get(pid)
                if w is None:
                    env = _environ(pid)
                    if "RANK" not in env:
                        continue
                    w = _Worker(pid, host, int(env["RANK"]), env.get("CROSSREPLICA_JOIN") == "1", _started(pid))
                    if not w.joining:
                        w.identity = w.slot
                    self.workers[pid] = w
                if w.identity is None:  # one process of a slot at a time: a join of the slot after it started
                    taken = {x.identity for x in self.workers.values()}
                    found = [i for t, h, s, i in self.joins
                             if (h, s) == (w.host, w.slot) and t >= w.started - 0.1 and i not in taken]
                    w.identity = found[-1] if found else None
                live.append(w)
        return live

    def healthy(self) -> bool:
        """Every live worker is a running member, and the members are all of them."""
        live = self.refresh()
        return (bool(live) and all(_state(w.pid) != "T" and w.identity is not None for w in live)
                and len(live) == self.members)

    def finished(self) -> bool:
        self._take_in()
        return self.done


# --------------------------------------------------------------------------- the runs


def _env(config: ChaosConfig) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "CROSSREPLICA_COORDINATOR", "CROSSREPLICA_JOIN"):
        env.pop(k, None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"  # the chief's lines are timestamped as they come
    env["OMP_NUM_THREADS"] = "1"
    env["CROSSREPLICA_TIMEOUT"] = f"{config.timeout:g}"
    env["CROSSREPLICA_HEARTBEAT_SECONDS"] = f"{config.heartbeat:g}"
    env["CROSSREPLICA_JOB_SECRET"] = secrets.token_hex(16)
    return env


def _train_args(config: ChaosConfig) -> list[str]:
    return [sys.executable, "-m", "crossreplica.cli", "train", "--strategy", "multi_worker", "--fault-tolerant",
            "--layout-invariant", "--micro-batches", str(config.layout_micro_batches), "--epochs", str(config.epochs),
            "--batch-size", str(config.batch_size), "--no-compare", "--no-progress", "--log-level", "WARNING"]


def reference_run(config: ChaosConfig, path: str) -> float:
    """The uninterrupted run: one worker, no launcher (the same bits as any worker count in
    the layout-invariant mode); returns its seconds."""
    started = time.monotonic()
    subprocess.run([*_train_args(config), "--save-params", path], env=_env(config), cwd=REPO, check=True,
                   capture_output=True, timeout=config.deadline)
    return time.monotonic() - started


def steps_of(config: ChaosConfig) -> int:
    """The training steps of the demo run: epochs x global batches per epoch."""
    from crossreplica.demo import load_digits

    rows = len(load_digits(0)[0])
    return config.epochs * math.ceil(rows / config.batch_size)


def run_chaos(config: ChaosConfig, say: Callable[[str], None] | None = None) -> ChaosReport:
    """The reference run, then the chaos run on simulated hosts; see the module docstring."""
    config.validate()
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    say = say or (lambda line: None)
    out_dir = tempfile.mkdtemp(prefix="crossreplica-chaos-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    try:
        reference = os.path.join(out_dir, "reference.pt")
        reference_seconds = reference_run(config, reference)
        say(f"reference run (one worker, uninterrupted): {reference_seconds:.1f} s")
        report = _chaos(config, out_dir, say)
        report.reference_seconds = reference_seconds
        report.bitwise = _bitwise(report.params_files, reference) if report.params_files else False
        return report
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _bitwise(files: list[str], reference: str) -> bool:
    import torch

    want = torch.load(reference, weights_only=True)
    for path in files:
        got = torch.load(path, weights_only=True)
        if got.keys() != want.keys() or not all(torch.equal(got[k], want[k]) for k in got):
            return False
    return True


def _chaos(config: ChaosConfig, out_dir: str, say: Callable[[str], None]) -> ChaosReport:
    rng = random.Random(config.seed)
    env = _env(config)
    lines = Lines()
    faults: list[Fault] = []
    faulted: dict[int, str] = {}  # pid -> why it may not write (fenced out or cut off)
    started = time.monotonic()
    end = started + config.deadline
    # Each worker saves to a file of its own, named by its slot and process id (only the chief saves).
    save = f"exec \"$@\" --save-params {shlex.quote(out_dir)}/params.$RANK.$$"
    worker = ["sh", "-c", save, "sh", *_train_args(config)]
    exit_codes: dict[str, int | None] = {}
    strays: list[str] = []
    with SimulatedHosts(config.hosts + 1) as hosts:
        port = 20000 + secrets.randbelow(20000)  # host 0 is a fresh network namespace: nothing else listens there
        coordinator = hosts.start(0, [sys.executable, "-m", "crossreplica", "coordinator", "--port", str(port)],
                                  env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert coordinator.stdout is not None and coordinator.stderr is not None
        first = coordinator.stdout.readline()
        if "serving the job's store" not in first:
            raise RuntimeError(f"the coordinator did not start: {first}{coordinator.stderr.read()}")
        lines.follow(coordinator.stdout, "coordinator:out")
        lines.follow(coordinator.stderr, "coordinator:err")
        launchers: dict[int, subprocess.Popen] = {}
        for host in range(1, config.hosts + 1):
            launchers[host] = hosts.start(
                host, [sys.executable, "-m", "crossreplica", "launch", "--coordinator", f"{hosts.addresses[0]}:{port}",
                       "--nnodes", str(config.hosts), "--nproc-per-node", str(config.per_host), "--max-restarts",
                       str(config.restarts), "--grace-seconds", f"{config.grace:g}", "--", *worker],
                env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lines.follow(launchers[host].stdout, f"host{host}:out")  # type: ignore[arg-type]
            lines.follow(launchers[host].stderr, f"host{host}:err")  # type: ignore[arg-type]
        job = _Job(launchers, lines, config.workers)
        training = _wait(lambda: _training_started(lines), end, launchers)
        if training is None:
            raise RuntimeError("the job did not start training:\n" + "\n".join(t for _, _, t in lines.snapshot()[-40:]))
        say(f"training started {time.monotonic() - started:.1f} s after the launch")
        plan = _plan(config, rng)
        for index, kind in enumerate(plan, 1):
            _settle(job, rng.uniform(config.gap, 2 * config.gap), min(end, time.monotonic() + config.settle_seconds))
            if job.finished() or all(p.poll() is not None for p in launchers.values()):
                say(f"the run ended before fault {index} could be injected")
                break
            fault = _inject(config, kind, index, hosts, job, rng, training, faulted)
            if fault is None:
                say(f"fault {index}: no worker or host could take a fault (or the target exited meanwhile); stopped "
                    f"injecting")
                break
            faults.append(fault)
            what = f"host {fault.host}" if fault.kind == "cut" else f"worker {_ids(fault.identities)}"
            say(f"fault {index}: {fault.kind} of {what} at {fault.since_start:.1f} s")
            _end_fault(config, fault, hosts, end)
        # The job runs to its end; every launcher must exit by itself.
        _wait(lambda: all(p.poll() is not None for p in launchers.values()), end, {})
        for host, p in launchers.items():
            exit_codes[f"launcher {host}"] = p.poll()
        coordinator.terminate()
        try:
            coordinator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        exit_codes["coordinator"] = coordinator.poll()
        for i in range(hosts.n):
            anchor = hosts.host(i).anchor
            pids = subprocess.run(["ip", "netns", "pids", hosts.namespaces[i]], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                if int(pid) != anchor and _state(int(pid)) not in (None, "Z"):
                    strays.append(f"host {i}: {_cmdline(int(pid))} (pid {pid})")
        lines.join(5.0)
    run_seconds = time.monotonic() - started
    records = lines.snapshot()
    if config.log:
        with open(config.log, "w") as f:
            for t, source, text in records:
                f.write(f"{t:.3f} {source} {text}\n")
    _measure(config, faults, records)
    files = sorted(os.path.join(out_dir, n) for n in os.listdir(out_dir) if n.startswith("params."))
    split = [f"{os.path.basename(p)} ({faulted[_pid_of(p)]})" for p in files if _pid_of(p) in faulted]
    if len(files) > 1:
        split.append(f"{len(files)} workers wrote their parameters (the chief alone should)")
    exited = (all(c is not None for c in exit_codes.values()) and not strays)
    finished = any(s.endswith(":out") and t.startswith("done in ") for _, s, t in records)
    return ChaosReport(config, faults, steps_of(config), False, files, split, exited, exit_codes, strays, finished,
                       0.0, run_seconds, records)


def _pid_of(path: str) -> int:
    return int(path.rsplit(".", 1)[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)[:160]
    except OSError:
        return "?"


def _training_started(lines: Lines) -> float | None:
    for t, source, text in lines.snapshot():
        if source.endswith(":out") and text.startswith("crossreplica train: multi_worker strategy"):
            return t
    return None


def _wait(ready: Callable[[], Any], end: float, launchers: dict[int, subprocess.Popen]) -> Any:
    """Polls ``ready`` until it answers something true, the monotonic ``end`` or every launcher
    exited; returns its last answer."""
    while True:
        answer = ready()
        if answer or time.monotonic() >= end or (launchers and all(p.poll() is not None for p in launchers.values())):
            return answer
        time.sleep(_POLL)


def _settle(job: _Job, quiet: float, end: float) -> None:
    """Waits until the job has been healthy (:meth:`_Job.healthy`) for ``quiet`` seconds in a row
    (a worker that just exited is not restarted yet for a moment), it finished, or ``end``."""
    since: float | None = None
    while time.monotonic() < end and not job.finished():
        if not job.healthy():
            since = None
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(_POLL)


def _plan(config: ChaosConfig, rng: random.Random) -> list[str]:
    """The faults' kinds: each kind once in a random order, then random ones."""
    first = list(config.kinds)[:config.faults]
    rng.shuffle(first)
    return first + [rng.choice(config.kinds) for _ in range(config.faults - len(first))]


def _inject(config: ChaosConfig, kind: str, index: int, hosts: SimulatedHosts, job: _Job, rng: random.Random,
            training: float, faulted: dict[int, str]) -> Fault | None:
    """Injects a fault of ``kind`` (or, where that cannot be made, another kind) now."""
    live = [w for w in job.refresh() if w.identity is not None and _state(w.pid) != "T"]
    by_host: dict[int, list[_Worker]] = {}
    for w in live:
        by_host.setdefault(w.host, []).append(w)
    kinds = [kind] + [k for k in config.kinds if k != kind]
    for k in kinds:
        if k == "cut" and len(by_host) >= 2:
            host = rng.choice(sorted(by_host))
            victims = by_host[host]
            now = time.time()  # taken before: the times measured from it err long, not short
            hosts.link_down(host)
            for w in victims:
                faulted[w.pid] = f"on host {host}, cut off at fault {index}"
            break
        if k in ("kill", "freeze") and len(live) >= 2:
            victim = rng.choice(sorted(live, key=lambda w: w.identity or 0))
            victims, host = [victim], victim.host
            now = time.time()
            try:
                os.kill(victim.pid, signal.SIGKILL if k == "kill" else signal.SIGSTOP)
            except ProcessLookupError:  # it exited meanwhile (the job is ending): no fault made
                return None
            if k == "freeze":
                faulted[victim.pid] = f"frozen at fault {index}"
            break
    else:
        return None
    identities = sorted(w.identity for w in victims if w.identity is not None)
    fault = Fault(index, k, host, [w.pid for w in victims], [w.slot for w in victims], identities, now,
                  now - training)
    fault.target = config.heartbeat if k == "kill" else config.timeout
    if k != kind:
        fault.notes.append(f"a {kind} could not be made")
    return fault


def _end_fault(config: ChaosConfig, fault: Fault, hosts: SimulatedHosts, end: float) -> None:
    """Ends a freeze or cut when its time is up (SIGCONT, link up), and waits for the hit
    processes to exit by themselves (a frozen worker once woken, a cut-off one within the
    timeout), noting when each did."""
    hold = {"freeze": config.freeze_seconds, "cut": config.link_seconds}.get(fault.kind)
    limit = min(end, time.monotonic() + (hold or 0.0) + config.timeout + 20)
    gone: dict[int, float] = {}
    while time.monotonic() < limit:
        now = time.time()
        for pid in fault.pids:
            if pid not in gone and _state(pid) in (None, "Z"):
                gone[pid] = now - fault.at
        if hold is not None and fault.ended is None and now >= fault.at + hold:
            if fault.kind == "freeze":
                try:
                    os.kill(fault.pids[0], signal.SIGCONT)
                except ProcessLookupError:
                    pass
            else:
                hosts.link_up(fault.host)
            fault.ended = time.time()
        if len(gone) == len(fault.pids) and (hold is None or fault.ended is not None):
            break
        time.sleep(_POLL)
    alive = [p for p in fault.pids if p not in gone]
    if alive:
        fault.notes.append(f"process(es) {alive} still running {time.time() - fault.at:.0f} s after the injection")
    if fault.kind == "kill" and not alive:
        fault.notes.append(f"gone {gone[fault.pids[0]]:.2f} s after SIGKILL")
    if fault.kind == "freeze" and not alive:
        woken = (fault.ended or fault.at) - fault.at
        exited = gone[fault.pids[0]]
        fault.notes.append(f"it exited {exited - woken:.1f} s after SIGCONT" if exited >= woken
                           else f"it exited {exited:.1f} s after SIGSTOP, before SIGCONT")
    elif fault.kind == "cut" and gone:
        fault.notes.append("its workers exited " + ", ".join(f"{t:.1f} s" for t in sorted(gone.values()))
                           + f" after the cut (link up at {hold:g} s)")


def _measure(config: ChaosConfig, faults: list[Fault], records: list[tuple[float, str, str]]) -> None:
    """Fills in each fault's times from the records (see the module docstring)."""
    lost: list[tuple[float, float, set[int], str, int, str]] = []  # (began, logged, lost, during, epoch, rest)
    joined: list[tuple[float, int, int]] = []  # (time, host, slot)
    restarted: list[tuple[float, int, int, int]] = []  # (time, host, slot, code)
    chief: list[tuple[float, set[int]]] = []  # the chief's "lost ... redone" lines
    for t, source, text in records:
        host = int(source[4:].split(":")[0]) if source.startswith("host") else -1
        m = _RECORD.match(text)
        if m is not None:
            at, message = _record_time(m.group(2)), m.group(5)
            lo, rg = _LOST.search(message), _REGROUPED.search(message)
            if lo and rg:
                during = f"step {lo.group(3)}" if lo.group(3) else lo.group(4)
                lost.append((at - float(rg.group(3)), at, set(_numbers(lo.group(2))), during, int(rg.group(2)),
                             rg.group(4)))
            if _JOINED.search(message):
                joined.append((at, host, int(m.group(1))))
            continue
        r = _RESTARTED.match(text)
        if r is not None and source.endswith(":err"):
            restarted.append((t, host, int(r.group(1)), int(r.group(2))))
        c = _CHIEF_LOST.match(text)
        if c is not None and source.endswith(":out"):
            chief.append((t, set(_numbers(c.group(1)))))
    for i, f in enumerate(faults):
        until = faults[i + 1].at if i + 1 < len(faults) else math.inf
        mine = [x for x in lost if x[2] & set(f.identities) and x[1] >= f.at - 1.0 and x[0] < until]
        if mine:
            first = min(mine, key=lambda x: x[0])
            f.detected = max(0.0, first[0] - f.at)
            f.regroup = first[1] - first[0]
            f.step = first[3]
            f.redone = len({x[4] for x in mine if x[5].startswith("redoing")})
            done = [t for t, ids in chief if ids & set(f.identities) and t >= first[0]]
            if done:
                f.recovered = min(done) - first[0]
        # Each hit slot's first restart after the fault, and that worker's join.
        back: list[float] = []
        for slot in f.slots:
            again = [(t, code) for t, h, s, code in restarted if (h, s) == (f.host, slot) and f.at - 1.0 <= t < until]
            if not again:
                f.notes.append(f"slot {slot} not restarted")
                continue
            joins = [t for t, h, s in joined if (h, s) == (f.host, slot) and t >= again[0][0]]
            f.notes.append(f"slot {slot} restarted (it exited with {again[0][1]})"
                           + (f", and {len(again) - 1} more time(s)" if len(again) > 1 else "")
                           + ("" if joins else ", never joined"))
            if joins:
                back.append(joins[0] - f.at)
        if back and len(back) == len(f.slots):
            f.rejoined = max(back)


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--hosts", type=int, default=d.hosts, help=f"worker hosts, 3 to 6 in issue 38 (default {d.hosts})")
    p.add_argument("--per-host", type=int, default=d.per_host, help=f"workers per host (default {d.per_host})")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"the demo's epochs (default {d.epochs})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"global batch (default {d.batch_size})")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="the layout-invariant micro-batches (default: the most workers, at least 8)")
    p.add_argument("--faults", type=int, default=d.faults, help=f"faults to inject (default {d.faults})")
    p.add_argument("--kinds", default=",".join(d.kinds), help=f"fault kinds (default {','.join(d.kinds)})")
    p.add_argument("--seed", type=int, default=d.seed, help="the faults' order, targets and gaps")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help=f"the workers' collective timeout, CROSSREPLICA_TIMEOUT (default {d.timeout:g})")
    p.add_argument("--heartbeat", type=float, default=d.heartbeat,
                   help=f"CROSSREPLICA_HEARTBEAT_SECONDS (default {d.heartbeat:g})")
    p.add_argument("--freeze-seconds", type=float, default=d.freeze_seconds,
                   help=f"how long a frozen worker stays stopped (default {d.freeze_seconds:g})")
    p.add_argument("--cut-seconds", type=float, default=None, help="how long a cut link stays down (default: the "
                   "timeout plus 2)")
    p.add_argument("--gap", type=float, default=d.gap,
                   help=f"healthy training before the next fault: GAP to 2 GAP seconds (default {d.gap:g})")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="each launcher's --max-restarts (default: --per-host; a launcher whose workers all joined "
                        "late goes on restarting them after the job ended, until its restarts are spent)")
    p.add_argument("--deadline", type=float, default=d.deadline,
                   help=f"seconds the whole chaos run may take (default {d.deadline:g})")
    p.add_argument("--log", default=None, help="write every line read from the job, timestamped, to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = ChaosConfig(hosts=args.hosts, per_host=args.per_host, epochs=args.epochs, batch_size=args.batch_size,
                         micro_batches=args.micro_batches, faults=args.faults,
                         kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()), seed=args.seed,
                         timeout=args.timeout, heartbeat=args.heartbeat, freeze_seconds=args.freeze_seconds,
                         cut_seconds=args.cut_seconds, gap=args.gap, max_restarts=args.max_restarts,
                         deadline=args.deadline, log=args.log)
    try:
        config.validate()
    except ValueError as e:
        print(f"chaos.py: error: {e}", file=sys.stderr)
        return 2
    reason = available()
    if reason is not None:
        print(f"chaos.py: {reason}", file=sys.stderr)
        return 2
    report = run_chaos(config, say=lambda line: print(f"[{datetime.datetime.now():%H:%M:%S}] {line}", flush=True))
    print()
    for line in report.table():
        print(line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
