"""``crossreplica launch``: start the workers of a one-host job and let the survivors finish.

``crossreplica launch --workers N -- COMMAND ...`` hosts the job's store in this
process and starts ``N`` copies of ``COMMAND`` with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, with
the store marked as an agent's, as torchrun does) and a fresh random
``CROSSREPLICA_JOB_SECRET`` unless one is set.

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

The exit code is 0 when at least one worker finished with 0 (a fault-tolerant
job that lost workers finished), otherwise the first failure's code; a
summary line on stderr names every worker that did not finish with 0.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

__all__ = ["launch", "main"]

#: how often the launcher looks at its workers
_POLL = 0.05
#: seconds between waking a worker left behind and terminating it, and between that and SIGKILL
_WAKE, _TERM = 5.0, 5.0


def launch(command: Sequence[str], workers: int, grace_seconds: float = 10.0,
           env: dict[str, str] | None = None, max_restarts: int = 0) -> int:
    """Runs ``command`` as ``workers`` workers of one job on this host; returns the exit code.
    Up to ``max_restarts`` times, a worker that fails while the others run is started
    again to join the running job (``CROSSREPLICA_JOIN=1``)."""
    if workers < 1:
        raise ValueError(f"workers must be a positive int; got {workers!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0; got {max_restarts!r}")
    if not command:
        raise ValueError("command must name the program to run, e.g. `-- python train.py`")
    base = dict(os.environ if env is None else env)
    _check_program(command, base.get("PATH"))
    store = dist.TCPStore("127.0.0.1", 0, workers, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    base.setdefault("CROSSREPLICA_JOB_SECRET", secrets.token_hex(16))
    base.update({"WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"})

    def start(r: int, join: bool) -> subprocess.Popen:
        joining = {"CROSSREPLICA_JOIN": "1"} if join else {}
        return subprocess.Popen(list(command), env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0",
                                                    "ROLE_RANK": str(r), **joining})

    procs = [start(r, False) for r in range(workers)]

    def stop_all(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        raise SystemExit(128 + signum)

    saved = {s: signal.signal(s, stop_all) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = _watch(procs, grace_seconds, _Restarts(start, max_restarts))
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = {r: c for r, c in enumerate(codes) if c != 0}
    if failed:
        fate = "finished" if len(failed) < workers else "failed"
        print(f"crossreplica launch: the job {fate}; "
              + "; ".join(f"worker {r} exited with code {c}" for r, c in failed.items()), file=sys.stderr)
    if len(failed) < workers:
        return 0
    return next(iter(failed.values()))


def _check_program(command: Sequence[str], path: str | None = None) -> None:
    """Raises ValueError unless ``command[0]`` is a program that can be started: found on
    ``path`` (a PATH value; None: this process's), or an executable file."""
    if shutil.which(command[0], path=path) is None:
        where = "an executable file" if os.sep in command[0] else "a program on PATH"
        raise ValueError(f"cannot start the workers: {command[0]!r} is not {where}; give the worker's command after "
                         f"`--`, e.g. `-- python train.py` or `-- crossreplica train --strategy multi_worker` (with "
                         f".venv active, or as .venv/bin/crossreplica)")


class _Restarts:
    """Starts failed workers again, to join the running job, while restarts are left."""

    def __init__(self, start: Callable[[int, bool], subprocess.Popen], left: int):
        self.start, self.left = start, left

    def __call__(self, procs: list[subprocess.Popen]) -> None:
        codes = [p.poll() for p in procs]
        for r, code in enumerate(codes):
            if self.left and code not in (None, 0) and any(c is None for c in codes):
                self.left -= 1
                print(f"crossreplica launch: worker {r} exited with code {code}; starting it again to join the "
                      f"running job ({self.left} restart{'s' if self.left != 1 else ''} left)", file=sys.stderr,
                      flush=True)
                procs[r] = self.start(r, True)


def _watch(procs: list[subprocess.Popen], grace: float, restart: Callable[[list[subprocess.Popen]], None]) -> list[int]:
    """Every worker's exit code, waking and then terminating those still running ``grace``
    seconds after the first worker finished with 0, or at once when every one still
    running is stopped and another has exited; until then, ``restart`` may start failed
    workers again (replacing them in ``procs``)."""
    finished_at: float | None = None
    while True:
        if finished_at is None:
            restart(procs)
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None]
        if finished_at is None and 0 in codes:
            finished_at = time.monotonic()
        left_frozen = any(c is not None for c in codes) and all(_stopped(p) for p in procs if p.poll() is None)
        if left_frozen or (finished_at is not None and time.monotonic() - finished_at > grace):
            for step, seconds in ((signal.SIGCONT, _WAKE), (signal.SIGTERM, _TERM), (signal.SIGKILL, 0.0)):
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(step)
                _wait_all(procs, seconds)
            return [int(p.wait()) for p in procs]
        time.sleep(_POLL)


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


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL)


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
    parser.add_argument("--workers", type=_at_least(1, int), required=True, help="worker processes to start (>= 1)")
    parser.add_argument("--grace-seconds", type=_at_least(0, float), default=10.0,
                        help="once a worker has finished, how long the others may still run before they are "
                             "stopped (default 10)")
    parser.add_argument("--max-restarts", type=_at_least(0, int), default=0,
                        help="how many times in all a worker that fails while others still run is started again "
                             "to join the running job at a step boundary (cr.FaultTolerance; default 0)")
    parser.usage = "crossreplica launch --workers N [--grace-seconds S] [--max-restarts K] -- COMMAND [ARG ...]"


def main(args: argparse.Namespace) -> int:
    """``crossreplica launch``: a usage error is one line on stderr and exit code 2."""
    try:
        if not args.worker_command:
            raise ValueError("give the worker's command after `--`, e.g. `crossreplica launch --workers 4 -- "
                             "crossreplica train --strategy multi_worker --fault-tolerant`")
        _check_program(args.worker_command)
    except ValueError as e:
        print(f"crossreplica launch: error: {e}", file=sys.stderr)
        return 2
    return launch(args.worker_command, args.workers, args.grace_seconds, max_restarts=args.max_restarts)
