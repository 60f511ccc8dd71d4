"""``crossreplica launch``: start a host's workers of a job and let the survivors finish.

``crossreplica launch --workers N -- COMMAND ...`` serves the job's store in this
process (the coordinator's authenticated store, :mod:`.coordinator`) and starts ``N``
copies of ``COMMAND`` with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, with the store marked as an agent's, as
torchrun does; :meth:`JobEnv.environ`), the store's address (CROSSREPLICA_COORDINATOR)
and a fresh random ``CROSSREPLICA_JOB_SECRET`` unless one is set. With ``--coordinator
HOST:PORT --nnodes H`` the job spans H hosts, each running this launcher with the same
secret: they meet at that ``crossreplica coordinator``, and each takes its place (its
workers' ranks) in the order it arrives there.

Why not torchrun: when one worker fails, torchrun's agent stops every other
worker (and, with ``--max-restarts``, starts them all again from the last
checkpoint). A job that survives losing a worker (``cr.FaultTolerance``) needs
the opposite: the store outlives any worker, and the survivors keep running.
So this launcher watches its workers without touching them; once one has
finished, the others get ``--grace-seconds`` to finish too, after which a
worker still running (frozen, say) is woken (SIGCONT, so a fenced-out worker
can say so and stop), then terminated. Workers that are all stopped (SIGSTOP:
frozen) once the others have exited can never finish by themselves, so they
are woken at once, without the grace period. Ctrl-C or SIGTERM stops them all.

With ``--max-restarts K``, a worker that fails while the others still run is
started again (at most ``K`` times in all) with ``CROSSREPLICA_JOIN=1``: it joins
the running job at a step boundary and takes the live state from a member
(``cr.FaultTolerance``), where torchrun would restart every worker.

The exit code says whether the job finished. A worker that exits with another
code than 0 is a fault the job survived when the job went on without it: the
last membership its workers agreed on (``cr.FaultTolerance``, read from the
store this launcher serves) leaves it out, and the members finished. Any other
such exit (the chief raising as it saves, after the others finished; a worker of
a job without ``cr.FaultTolerance``; a member killed after the last agreement)
fails the job: the exit code is the first such worker's (a signal: 128 plus its
number), and stderr names it with the last lines it wrote there (each worker's
stderr passes through this launcher, on a terminal through a pseudo-terminal of
its own). Exit code 0 means every member finished with 0; a summary line names
the workers the job went on without.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fcntl
import math
import os
import pty
import secrets
import shutil
import signal
import subprocess
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .. import store_keys
from ..arguments import check_address
from ..engines.deadline import Deadline
from ..strategies.bootstrap import JobEnv
from .coordinator import Coordinator
from .job_store import started_job, take_host_place
from .membership import latest
from .protocol import AuthenticationError
from .store import CoordinatorStore

__all__ = ["launch", "main"]

#: how often the launcher looks at its workers
_POLL = 0.05
#: seconds between waking a worker left behind and terminating it, and between that and SIGKILL
_WAKE, _TERM = 5.0, 5.0
#: how much of a worker's stderr is kept to quote, and how many of its last lines are quoted
_KEEP_BYTES, _QUOTED_LINES = 8192, 8
#: how long the launcher waits for the rest of its workers' stderr once they have exited
_DRAIN = 2.0


def launch(command: Sequence[str], workers: int, grace_seconds: float = 10.0,
           env: dict[str, str] | None = None, max_restarts: int = 0, coordinator: str | None = None,
           nnodes: int = 1) -> int:
    """Runs ``command`` as ``workers`` workers of one job on this host; returns the exit code
    (0: the job finished, possibly without workers it lost; the module docstring says which).
    Up to ``max_restarts`` times, a worker that fails while the others run is started
    again to join the running job (``CROSSREPLICA_JOIN=1``).

    Without ``coordinator`` the job is this host's alone, and this process serves its store
    (authenticated, :mod:`.elastic.coordinator`). With ``coordinator`` (``HOST:PORT`` of a
    ``crossreplica coordinator``), this host is one of ``nnodes`` hosts of the job, each
    running this launcher with the same arguments and ``CROSSREPLICA_JOB_SECRET``; the
    hosts take their places (ranks ``node * workers ...``) in the order they reach it.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int; got {workers!r}")
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be a positive int; got {nnodes!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0; got {max_restarts!r}")
    if not command:
        raise ValueError("command must name the program to run, e.g. `-- python train.py`")
    if nnodes > 1 and coordinator is None:
        raise ValueError(f"nnodes={nnodes} hosts meet at a coordinator: start `crossreplica coordinator --port PORT` "
                         f"on one machine and pass --coordinator HOST:PORT to every host's launcher")
    base = dict(os.environ if env is None else env)
    _check_program(command, base.get("PATH"))
    if coordinator is None:
        base.setdefault("CROSSREPLICA_JOB_SECRET", secrets.token_hex(16))
    elif not base.get("CROSSREPLICA_JOB_SECRET"):
        raise ValueError("--coordinator serves only the workers that know the job secret: set "
                         "CROSSREPLICA_JOB_SECRET to the coordinator's on every host")
    secret = base["CROSSREPLICA_JOB_SECRET"]
    server = Coordinator(secret, "127.0.0.1", 0) if coordinator is None else None
    try:
        host, port = ("127.0.0.1", server.port) if server is not None else check_address(coordinator or "",
                                                                                          "--coordinator")
        store = CoordinatorStore(host, port, secret, datetime.timedelta(seconds=60))
        node = 0 if server is not None else take_host_place(store, secret, nnodes, f"{host}:{port}")
        return _run_workers(command, workers, node, nnodes, grace_seconds, max_restarts, store, base,
                            lambda rank: JobEnv("crossreplica launch", rank, nnodes * workers, rank % workers, workers,
                                                host, port, agent_store=True, coordinator=(host, port)))
    finally:
        if server is not None:
            server.close()


def _run_workers(command: Sequence[str], workers: int, node: int, nnodes: int, grace_seconds: float,
                 max_restarts: int, store: CoordinatorStore, base: dict[str, str],
                 job: Callable[[int], JobEnv]) -> int:
    """Starts this host's workers (ranks ``node * workers`` on; ``job(rank)`` their place in
    the job) with ``base`` as the rest of their environment, watches them to the end and
    judges the job by the membership in ``store``; returns the exit code."""
    runs: list[_Run] = []  # every worker process started, the restarted ones too

    def start(local: int, join: bool) -> _Run:
        rank = node * workers + local
        launch_id = f"{node}.{len(runs)}" if join else None
        joining = {"CROSSREPLICA_JOIN": "1", "CROSSREPLICA_LAUNCH_ID": launch_id} if launch_id else {}
        output = _Output()
        try:
            proc = subprocess.Popen(list(command), stderr=output.child_fd,
                                    env={**base, **job(rank).environ(), **joining})
        finally:
            output.started()
        runs.append(_Run(rank, join, proc, output, launch_id=launch_id))
        return runs[-1]

    current = [start(r, False) for r in range(workers)]

    def stop_all(signum: int, frame: object) -> None:
        for run in current:
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGCONT)
                run.proc.terminate()
        raise SystemExit(128 + signum)

    saved = {s: signal.signal(s, stop_all) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _watch(current, grace_seconds, _Restarts(start, max_restarts, elsewhere=nnodes > 1))
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
            run.proc.wait()
            run.poll()
        drain = Deadline(_DRAIN)
        for run in runs:
            run.output.close(drain.left)
    verdict = _judge(runs, *_members(store, base["CROSSREPLICA_JOB_SECRET"], runs), across_hosts=nnodes > 1)
    for line in _summary(verdict, any(run.code == 0 for run in runs)):
        print(line, file=sys.stderr)
    if not verdict.failed:
        return 0
    code = min((run for run, _ in verdict.failed), key=lambda run: run.ended).code or 1
    return 128 - code if code < 0 else code


@dataclasses.dataclass
class _Run:
    """One worker process: ``slot`` is its RANK; ``joining``: started again to join the running
    job, as ``launch_id`` (CROSSREPLICA_LAUNCH_ID: it records the identity the job gives it
    under that name); ``code``: its exit code, once the launcher saw it exit (``ended``);
    ``stopped``: why the launcher stopped it (None: it exited by itself)."""

    slot: int
    joining: bool
    proc: subprocess.Popen
    output: _Output
    code: int | None = None
    ended: float = float("inf")
    stopped: str | None = None
    launch_id: str | None = None

    def poll(self) -> int | None:
        if self.code is None and self.proc.poll() is not None:
            self.code, self.ended = int(self.proc.returncode), time.monotonic()
        return self.code


def _members(store: dist.Store, secret: str,
             runs: Sequence[_Run]) -> tuple[tuple[int, ...] | None, dict[str, int]]:
    """The identities in the newest membership the job's workers agreed on
    (``cr.FaultTolerance``; None when they never agreed on one), and the identity each of
    ``runs`` started again to join recorded (by its launch id; absent: it never asked)."""
    try:
        job = started_job(store, secret)
        if job is None:
            return None, {}
        decision = latest(job)
        identities: dict[str, int] = {}
        for launch_id in (run.launch_id for run in runs if run.launch_id is not None):
            key = store_keys.launched(launch_id)
            if job.check([key]):
                identities[launch_id] = int(job.get(key))
    except Exception:  # noqa: BLE001 - an unreadable record is no record: every failure counts
        return None, {}
    return (None if decision is None else decision.members), identities


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """The runs that exited with another code than 0: those the job did not survive, each
    with why, and those it went on without."""

    failed: list[tuple[_Run, str]]
    survived: list[_Run]


def _judge(runs: Sequence[_Run], members: tuple[int, ...] | None, identities: dict[str, int],
           across_hosts: bool = False) -> _Verdict:
    """Which failed runs the job survived: a run that the job's newest membership ``members``
    leaves out, once a run finished with 0 (``across_hosts``: on this host or, as far as this
    launcher can know, on another). ``members`` None: no membership was agreed, so every
    worker that started the job is a member. A worker started again has the identity the
    job gave it (``identities``, by its launch id; none: it never asked to join, so it is no
    member), whichever host's launcher started it."""
    bad = [run for run in runs if run.code != 0]
    if all(run.code != 0 for run in runs) and (not across_hosts or members is None):
        return _Verdict([(run, "no worker finished") for run in bad], [])
    if members is None:
        why = "the job never went on without it (no membership agreed by cr.FaultTolerance left it out)"
        return _Verdict([(run, why) for run in bad], [])
    verdict = _Verdict([], [])
    for run in bad:
        identity = identities.get(run.launch_id or "") if run.joining else run.slot
        if identity is None or identity not in members:
            verdict.survived.append(run)
        else:
            verdict.failed.append((run, f"it was a member of the job to the end (its last membership: workers "
                                        f"{list(members)})"))
    return verdict


def _summary(verdict: _Verdict, finished_here: bool = True) -> list[str]:
    """What stderr says about the workers that did not finish with 0 (``finished_here``:
    some worker of this host finished; else the job went on on other hosts)."""
    lost = "; ".join(_exit(run) for run in verdict.survived)
    if not verdict.failed:
        if not verdict.survived:
            return []
        if not finished_here:
            return [f"crossreplica launch: every worker of this host was left out of the job, which went on on the "
                    f"other hosts without them: {lost}"]
        return [f"crossreplica launch: the job finished without the workers it lost (the others went on without "
                f"them): {lost}"]
    lines = []
    for run, why in sorted(verdict.failed, key=lambda pair: pair[0].ended):
        quoted = run.output.last_lines(_QUOTED_LINES)
        on_stderr = "; its last lines on stderr:" if quoted else ""
        lines.append(f"crossreplica launch: the job failed: {_exit(run)}, a failure the job did not survive: "
                     f"{why}{on_stderr}")
        lines.extend(f"  | {line}" for line in quoted)
    if verdict.survived:
        lines.append(f"crossreplica launch: the job had gone on without: {lost}")
    return lines


def _exit(run: _Run) -> str:
    """``worker R exited with code C``, with what else is known about it."""
    code = run.code
    text = f"worker {run.slot}{' (started again to join)' if run.joining else ''} exited with code {code}"
    if code is not None and code < 0:
        try:
            text += f" ({signal.Signals(-code).name})"
        except ValueError:
            pass
    if run.stopped is not None:
        text += f" (stopped by the launcher: {run.stopped})"
    return text


class _Output:
    """A worker's stderr: passed on to the launcher's as it comes, its end kept to quote.

    On a terminal the worker writes to a pseudo-terminal of its own (raw, the terminal's
    size), so it still sees a terminal (progress bars); elsewhere to a pipe.
    """

    def __init__(self, terminal: bool | None = None):
        self.tail = bytearray()
        self.read_fd, self.child_fd = _channel(os.isatty(2) if terminal is None else terminal)
        self._pump = threading.Thread(target=self._forward, name="crossreplica-launch-stderr", daemon=True)

    def started(self) -> None:
        """After the worker started (or failed to): the worker holds the writing end now."""
        os.close(self.child_fd)
        self._pump.start()

    def _forward(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self.read_fd, 65536)
                except OSError:  # EIO: every writer of a pseudo-terminal has gone
                    break
                if not chunk:
                    break
                _write_all(2, chunk)
                self.tail += chunk
                del self.tail[:-_KEEP_BYTES]
        finally:
            os.close(self.read_fd)

    def close(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the rest (a process the worker started may hold
        its stderr open longer)."""
        if self._pump.is_alive():
            self._pump.join(timeout)

    def last_lines(self, n: int) -> list[str]:
        """The last ``n`` non-empty lines written (a line redrawn with carriage returns: its last
        state)."""
        text = bytes(self.tail).decode(errors="replace")
        lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        return [line for line in lines if line.strip()][-n:]


def _channel(terminal: bool) -> tuple[int, int]:
    """The launcher's reading end and the worker's writing end of a worker's stderr."""
    if terminal:
        try:
            reader, writer = pty.openpty()
        except OSError:
            return os.pipe()
        try:
            tty.setraw(writer)  # the bytes as written: no "\n" -> "\r\n"
            size = fcntl.ioctl(2, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(writer, termios.TIOCSWINSZ, size)
        except OSError:
            pass
        return reader, writer
    return os.pipe()


def _write_all(fd: int, data: bytes) -> None:
    """Writes ``data`` to ``fd``; a closed or broken ``fd`` drops it (the worker goes on)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except OSError:
            return


def _check_program(command: Sequence[str], path: str | None = None) -> None:
    """Raises ValueError unless ``command[0]`` is a program that can be started: found on
    ``path`` (a PATH value; None: this process's), or an executable file."""
    if shutil.which(command[0], path=path) is None:
        where = "an executable file" if os.sep in command[0] else "a program on PATH"
        raise ValueError(f"cannot start the workers: {command[0]!r} is not {where}; give the worker's command after "
                         f"`--`, e.g. `-- python train.py` or `-- crossreplica train --strategy multi_worker` (with "
                         f".venv active, or as .venv/bin/crossreplica)")


class _Restarts:
    """Starts failed workers again, to join the running job, while restarts are left: while
    another of this host's workers still runs, or, in a job across hosts (``elsewhere``),
    while none of them has finished (the job may run on on the other hosts)."""

    def __init__(self, start: Callable[[int, bool], _Run], left: int, elsewhere: bool = False):
        self.start, self.left, self.elsewhere = start, left, elsewhere

    def __call__(self, current: list[_Run]) -> None:
        codes = [run.poll() for run in current]
        running = any(c is None for c in codes) or (self.elsewhere and 0 not in codes)
        for r, code in enumerate(codes):
            if self.left and code not in (None, 0) and running:
                self.left -= 1
                left = f"{self.left} restart{'s' if self.left != 1 else ''} left"
                print(f"crossreplica launch: worker {current[r].slot} exited with code {code}; starting it again to "
                      f"join the running job ({left})", file=sys.stderr, flush=True)
                current[r] = self.start(r, True)


def _watch(current: list[_Run], grace: float, restart: Callable[[list[_Run]], None]) -> None:
    """Returns once every worker has exited, waking and then terminating those still running
    ``grace`` seconds after the first worker finished with 0, or at once when every one still
    running is stopped and another has exited; until then, ``restart`` may start failed
    workers again (replacing them in ``current``)."""
    watch = Deadline(math.inf)  # the workers' own timeouts bound the job
    finished: Deadline | None = None  # the grace the others have once one finished
    while True:
        if finished is None:
            restart(current)
        codes = [run.poll() for run in current]
        if all(c is not None for c in codes):
            return
        if finished is None and 0 in codes:
            finished = Deadline(grace)
        running = [run for run in current if run.poll() is None]
        left_frozen = len(running) < len(current) and all(_stopped(run.proc) for run in running)
        if left_frozen or (finished is not None and finished.expired()):
            why = ("frozen (stopped) after the others had exited" if left_frozen else
                   f"still running {grace:g}s after another worker finished")
            for run in running:
                run.stopped = why
            for step, seconds in ((signal.SIGCONT, _WAKE), (signal.SIGTERM, _TERM), (signal.SIGKILL, 0.0)):
                for run in current:
                    if run.poll() is None:
                        run.proc.send_signal(step)
                _wait_all(current, seconds)
            for run in current:
                run.proc.wait()
                run.poll()
            return
        watch.sleep(_POLL)


def _stopped(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` is stopped by a signal (frozen: SIGSTOP), per ``/proc`` (False where
    there is none, or it has exited)."""
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat.rpartition(b")")[2].split()  # after the command name, which may hold spaces
    return bool(fields) and fields[0] == b"T"


def _wait_all(current: list[_Run], seconds: float) -> None:
    wait = Deadline(seconds)
    while not wait.expired() and any(run.poll() is None for run in current):
        wait.sleep(_POLL)


def _at_least(low: float, kind: type) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` (int or float) >= ``low``."""
    what = f"an integer >= {low}" if kind is int else f"a number of seconds >= {low}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "--nproc-per-node", dest="workers", type=_at_least(1, int), required=True,
                        help="worker processes to start on this host (>= 1)")
    parser.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                        help="the job's coordinator (`crossreplica coordinator`), for a job across hosts: run this "
                             "launcher on each host with the same arguments (default: a one-host job whose store "
                             "this launcher serves)")
    parser.add_argument("--nnodes", type=_at_least(1, int), default=1,
                        help="the job's hosts, each running this launcher (default 1; more need --coordinator)")
    parser.add_argument("--grace-seconds", type=_at_least(0, float), default=10.0,
                        help="once a worker has finished, how long the others may still run before they are "
                             "stopped (default 10)")
    parser.add_argument("--max-restarts", type=_at_least(0, int), default=0,
                        help="how many times in all a worker that fails while others still run is started again "
                             "to join the running job at a step boundary (cr.FaultTolerance; default 0)")
    parser.usage = ("crossreplica launch --workers N [--coordinator HOST:PORT --nnodes H] [--grace-seconds S] "
                    "[--max-restarts K] -- COMMAND [ARG ...]")
    parser.epilog = ("Exit status: 0 when the job finished (every worker exited with 0, or the job went on without "
                     "those that did not: cr.FaultTolerance left them out); otherwise the first failed worker's "
                     "code (a signal: 128 + its number), with that worker and its last lines on stderr named "
                     "(docs/reliability.md). Across hosts each host's launcher judges its own workers.")


def main(args: argparse.Namespace) -> int:
    """``crossreplica launch``: a usage error is one line on stderr and exit code 2."""
    try:
        if not args.worker_command:
            raise ValueError("give the worker's command after `--`, e.g. `crossreplica launch --workers 4 -- "
                             "crossreplica train --strategy multi_worker --fault-tolerant`")
        _check_program(args.worker_command)
        if args.coordinator is not None:
            check_address(args.coordinator, "--coordinator")
        return launch(args.worker_command, args.workers, args.grace_seconds, max_restarts=args.max_restarts,
                      coordinator=args.coordinator, nnodes=args.nnodes)
    except (ValueError, AuthenticationError) as e:
        print(f"crossreplica launch: error: {e}", file=sys.stderr)
        return 2
    except dist.DistStoreError as e:
        print(f"crossreplica launch: error: {e}", file=sys.stderr)
        return 1
