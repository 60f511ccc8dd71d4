"""Worker processes for tests: a pool of torchrun-style workers that serves many jobs.

A :class:`WorkerPool` starts ``num_workers`` processes through torch's elastic
launcher (``torch.distributed.elastic.multiprocessing.start_processes``), each
with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, ROLE_RANK, MASTER_ADDR=127.0.0.1 or, with ``hosts``, host 0's
address on simulated hosts, MASTER_PORT an OS-chosen free port, and this
process's ``CROSSREPLICA_*`` settings) and its stdout/stderr in
the launcher's log files; with ``log_level`` each worker logs crossreplica's
records to its stderr (:meth:`WorkerPool.logs` shows them). Each worker builds
``cr.MultiWorkerMirroredStrategy(replicas_per_worker)`` once and then runs jobs
sent down its pipe (:mod:`crossreplica.testing.worker`).

A pool, not one launch per call, because importing torch and setting up a
process group costs seconds and a suite makes hundreds of calls; the launcher
keeps what it does (start, environment, logs, exit codes, kill) and a pipe per
worker carries the jobs (why one ``start_processes`` call per worker, and the
forkserver: docs/architecture.md, "testing/pool.py").

Invariants:

* Every wait has a deadline: a pool starts within ``START_LIMIT`` seconds, a job
  ends within :func:`job_limit` of the collective timeout, or the call fails.
* A job that fails anywhere leaves the pool's engine out of step (torch.distributed
  refuses further work), so ``run_replicas`` closes that pool and the next call
  starts a fresh one.
* :meth:`WorkerPool.close` kills each worker's process group and reaps it;
  ``shutdown_pools`` (also run at interpreter exit) closes every persistent pool,
  so no worker outlives the program. The forkserver exits with the program.
* Starting a pool leaves the caller's signal handlers as they were (torch's
  launcher installs its own; ``_callers_signal_handlers``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    PContext,
    Std,
    start_processes,
)

from crossreplica.engines.deadline import Deadline
from crossreplica.testing.remote import WorkerFailure, WorkerPoolError
from crossreplica.testing.worker import check_device_type, function_spec, serve

if TYPE_CHECKING:
    from typing_extensions import Self

    from crossreplica.testing.hosts import SimulatedHosts

#: The collective timeout of a test job, in seconds (short, so a broken test fails fast; the
#: library's own default is ``CROSSREPLICA_TIMEOUT``, 300 s).
DEFAULT_TEST_TIMEOUT = 30.0
START_LIMIT = 60.0  # seconds for a pool to start: fork, process-group set-up, strategy
_PRELOAD = ["torch", "crossreplica", "crossreplica.testing.worker"]
_LAUNCHER_LOG = logging.getLogger(PContext.__module__)
_log = logging.getLogger(__name__)


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    """Silences the launcher's log while the pool kills workers or reads the exit code of
    one that died: both are reported by the pool, the launcher would log them as errors."""
    level = _LAUNCHER_LOG.level
    _LAUNCHER_LOG.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        _LAUNCHER_LOG.setLevel(level)


def layout(num_replicas: int) -> tuple[int, int]:
    """The (workers, replicas_per_worker) the suite uses for ``num_replicas`` replicas.

    1 -> 1x1, 2 -> 2x1, 4 -> 2x2 (the hierarchical engine), other even counts ->
    2 x n/2, odd counts -> n x 1.
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int; got {num_replicas!r}")
    if num_replicas <= 2 or num_replicas % 2:
        return num_replicas, 1
    return 2, num_replicas // 2


def resolve_layout(num_replicas: int, replicas_per_worker: int | None = None) -> tuple[int, int]:
    """(workers, replicas_per_worker): :func:`layout` unless ``replicas_per_worker`` is given."""
    if replicas_per_worker is None:
        return layout(num_replicas)
    if (not isinstance(replicas_per_worker, int) or replicas_per_worker < 1
            or num_replicas % replicas_per_worker):
        raise ValueError(f"replicas_per_worker must be a positive int dividing num_replicas={num_replicas}; "
                         f"got {replicas_per_worker!r}")
    return num_replicas // replicas_per_worker, replicas_per_worker


def job_limit(timeout_seconds: float) -> float:
    """Wall-clock bound on one job: a failure ends within a few collective timeouts
    (the hierarchical engine's local rendezvous waits up to 2 x timeout + 5 s)."""
    return 3 * timeout_seconds + 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one job produced on every worker; see :meth:`WorkerPool.run`.

    Attributes:
        results: replica id -> result (worker rank -> result for ``mode="main"``).
        failures: worker rank -> what its job raised.
        exitcodes: worker rank -> exit code, for workers that exited during the job
            (``None`` when the code could not be read).
        unanswered: ranks of workers still running that did not answer in time.
        log: the tail of every worker's log when the job did not succeed, else "".
        elapsed: seconds the job took, as seen by the caller.
    """

    results: dict[int, Any]
    failures: dict[int, WorkerFailure]
    exitcodes: dict[int, int | None]
    unanswered: tuple[int, ...]
    log: str
    elapsed: float

    @property
    def ok(self) -> bool:
        return not (self.failures or self.exitcodes or self.unanswered)


@dataclasses.dataclass
class _Worker:
    rank: int
    process: PContext
    conn: mpc.Connection


class WorkerPool:
    """``num_workers`` worker processes joined by ``cr.MultiWorkerMirroredStrategy``.

    Use as a context manager, or call :meth:`start` and :meth:`close`.

    Args:
        num_workers: worker processes (torch.distributed ranks).
        replicas_per_worker: replicas in each worker (threads of the hierarchical engine).
        timeout_seconds: the strategy's collective timeout.
        check_collectives: the strategy's opt-in comparison of every call across workers.
        log_level: a ``logging`` level (``"INFO"``, ``logging.DEBUG``) at which each worker
            writes crossreplica's log records to its stderr; None (default): none.
        device: ``"cpu"`` (default, gloo) or ``"cuda"``: with a GPU for every worker, NCCL
            and the strategy's default devices (each worker's GPUs its own); else gloo, worker
            ``w``'s replicas on the GPUs from ``cuda:w * replicas_per_worker`` round-robin
            (:attr:`backend` says which).
        hosts: place the workers on these simulated hosts (:mod:`crossreplica.testing.hosts`),
            ``num_workers / hosts.n`` consecutive ranks on each, with torchrun's per-host
            environment (LOCAL_RANK, GROUP_RANK, MASTER_ADDR host 0's address); None
            (default): every worker on this host.
    """

    def __init__(self, num_workers: int, replicas_per_worker: int = 1, *,
                 timeout_seconds: float = DEFAULT_TEST_TIMEOUT, check_collectives: bool = False,
                 log_level: int | str | None = None, device: str = "cpu",
                 hosts: SimulatedHosts | None = None):
        for name, value in (("num_workers", num_workers), ("replicas_per_worker", replicas_per_worker)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be a positive number; got {timeout_seconds!r}")
        self.num_workers = num_workers
        self.replicas_per_worker = replicas_per_worker
        self.timeout_seconds = float(timeout_seconds)
        self.check_collectives = bool(check_collectives)
        level = logging.getLevelName(log_level.upper()) if isinstance(log_level, str) else log_level
        if isinstance(log_level, bool) or not (level is None or isinstance(level, int)):
            raise ValueError(f"log_level must be a logging level such as 'INFO' or logging.DEBUG, or None; "
                             f"got {log_level!r}")
        self.log_level: int | None = level
        self.device = check_device_type(device)
        # NCCL runs one process per GPU; with fewer GPUs the workers share them through gloo.
        self.backend = "nccl" if device == "cuda" and num_workers <= torch.cuda.device_count() else "gloo"
        if hosts is not None and num_workers % hosts.n:
            raise ValueError(f"num_workers must be a multiple of the {hosts.n} simulated hosts; "
                             f"got {num_workers!r}")
        self.hosts = hosts
        self._workers: list[_Worker] = []
        self._logroot: str | None = None

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.replicas_per_worker

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"WorkerPool(num_workers={self.num_workers}, replicas_per_worker={self.replicas_per_worker}, "
                f"timeout_seconds={self.timeout_seconds:g}, check_collectives={self.check_collectives}, "
                f"device={self.device!r}, backend={self.backend!r}, "
                f"hosts={self.hosts.n if self.hosts else 1}, alive={self.alive})")

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Self:
        """Starts the workers and waits until each has built its strategy."""
        if self._workers:
            raise WorkerPoolError(f"{self!r} is already started")
        multiprocessing.set_forkserver_preload(_PRELOAD)  # no effect once the forkserver runs
        self._logroot = logroot = tempfile.mkdtemp(prefix="crossreplica-workers-")
        port = free_port()
        self._secret = secrets.token_hex(16)  # the job secret every worker of this pool shares
        _log.info("starting worker processes: %d workers x %d replicas on %d host(s), MASTER_PORT=%d, timeout %gs",
                  self.num_workers, self.replicas_per_worker, self.hosts.n if self.hosts else 1, port,
                  self.timeout_seconds)
        try:
            # OMP_NUM_THREADS is read when the forkserver imports torch.
            with _one_omp_thread(), _callers_signal_handlers():
                for rank in range(self.num_workers):
                    self._workers.append(self._launch(rank, port, os.path.join(logroot, f"rank{rank}")))
            replies = self._collect(list(range(self.num_workers)), Deadline(START_LIMIT, math.inf))
            failures = {r: v["failure"] for r, v in replies.answers.items() if "failure" in v}
            if failures or replies.exited or replies.unanswered:
                why = describe(failures, replies.exited, replies.unanswered, START_LIMIT)
                _log.error("%s did not start: %s", repr(self), why)
                raise WorkerPoolError(f"{self!r} did not start: {why}\n{self.logs()}")
        except BaseException:
            self.close()
            raise
        return self

    def _launch(self, rank: int, port: int, logdir: str) -> _Worker:
        # This process's crossreplica settings reach the workers, as torchrun's environment does.
        env = {k: v for k, v in os.environ.items() if k.startswith("CROSSREPLICA_")}
        num_hosts = self.hosts.n if self.hosts else 1
        per_host = self.num_workers // num_hosts
        host = self.hosts.host(rank // per_host) if self.hosts else None
        env |= {"RANK": str(rank), "WORLD_SIZE": str(self.num_workers), "LOCAL_RANK": str(rank % per_host),
                "LOCAL_WORLD_SIZE": str(per_host), "GROUP_RANK": str(rank // per_host),
                "GROUP_WORLD_SIZE": str(num_hosts), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.num_workers),
                "MASTER_ADDR": self.hosts.addresses[0] if self.hosts else "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "TORCHELASTIC_RUN_ID": f"crossreplica-{port}",  # one run
                "CROSSREPLICA_JOB_SECRET": self._secret}  # the store's keys are not guessable
        mine, theirs = multiprocessing.Pipe()
        try:
            process = start_processes(
                name=f"crossreplica-worker-{rank}", entrypoint=serve,
                args={0: (theirs, self.replicas_per_worker, self.timeout_seconds, self.check_collectives,
                          list(sys.path), self.log_level, self.device, self.backend, host)},
                envs={0: env}, logs_specs=DefaultLogsSpecs(log_dir=logdir, redirects=Std.ALL),
                start_method="forkserver")
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()  # the worker holds the only other end: its death is EOF here
        return _Worker(rank, process, mine)

    def close(self) -> None:
        """Kills every worker (its whole process group), reaps it and removes the logs."""
        if self._workers:
            _log.debug("closing %s", repr(self))
        for w in self._workers:
            w.conn.close()
            for pid in w.process.pids().values():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        with _launcher_quiet():
            for w in self._workers:
                w.process.close(death_sig=signal.SIGKILL, timeout=5)
        self._workers = []
        if self._logroot is not None:
            shutil.rmtree(self._logroot, ignore_errors=True)
            self._logroot = None

    @property
    def alive(self) -> bool:
        """Whether the pool is started and every worker is still running."""
        with _launcher_quiet():
            return bool(self._workers) and all(w.process.wait(timeout=0) is None for w in self._workers)

    def logs(self, limit: int = 4000) -> str:
        """The last ``limit`` characters of each worker's stdout and stderr."""
        out = []
        for w in self._workers:
            for stream, paths in (("stdout", w.process.stdouts), ("stderr", w.process.stderrs)):
                try:
                    with open(paths[0], errors="replace") as f:
                        text = f.read()[-limit:]
                except (OSError, KeyError, TypeError):
                    text = ""
                if text.strip():
                    out.append(f"--- worker {w.rank} {stream} ---\n{text}")
        return "\n".join(out)

    # ------------------------------------------------------------------ jobs

    def run(self, fn: Callable[..., Any], *per_replica_args: Sequence[Any], mode: str = "replica",
            main_args: Sequence[Any] = ()) -> Outcome:
        """Runs one job on every worker and reports what each did; never raises for a worker's failure.

        ``mode="replica"``: ``fn(*args)`` in every replica inside a replica context,
        replica ``i`` getting entry ``i`` of each ``per_replica_args`` sequence.
        ``mode="main"``: ``fn(strategy, *main_args)`` once per worker, in cross-replica context.
        ``fn`` must be importable by its module and qualified name; arguments and
        results must be picklable.
        """
        if mode not in ("replica", "main"):
            raise ValueError(f"mode must be 'replica' or 'main'; got {mode!r}")
        if not self._workers:
            raise WorkerPoolError(f"{self!r} is not started: call start() or use it in a with statement")
        check_per_replica_args(self.num_replicas, per_replica_args)
        wait = Deadline(job_limit(self.timeout_seconds), math.inf)
        spec = {**function_spec(fn), "mode": mode, "main_args": list(main_args)}
        rpw = self.replicas_per_worker
        # Every payload is pickled before any is sent: an unpicklable argument leaves no worker
        # waiting in a collective for the others.
        jobs = [pickle.dumps({**spec, "args": [[a[i] for i in range(w.rank * rpw, (w.rank + 1) * rpw)]
                                               for a in per_replica_args]})
                for w in self._workers]
        sent, broken = [], {}
        for w, job in zip(self._workers, jobs):
            try:
                w.conn.send_bytes(job)
                sent.append(w.rank)
            except OSError:
                broken[w.rank] = self._exitcode(w)
        replies = self._collect(sent, wait)
        results: dict[int, Any] = {}
        failures: dict[int, WorkerFailure] = {}
        for rank, reply in replies.answers.items():
            if "failure" in reply:
                failures[rank] = reply["failure"]
            else:
                results.update(reply["results"])
        exitcodes = {**broken, **replies.exited}
        ok = not (failures or exitcodes or replies.unanswered)
        return Outcome(results, failures, exitcodes, replies.unanswered, "" if ok else self.logs(), wait.waited)

    def _collect(self, ranks: list[int], wait: Deadline) -> _Replies:
        """One message from each of ``ranks``, until ``wait`` expires; a worker that exits is noted."""
        pending = {self._workers[r].conn: self._workers[r] for r in ranks}
        answers: dict[int, Any] = {}
        exited: dict[int, int | None] = {}
        while pending and not wait.expired():
            for conn in mpc.wait(list(pending), timeout=min(wait.left, 1.0)):
                w = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    answers[w.rank] = pickle.loads(w.conn.recv_bytes())
                except (EOFError, OSError):
                    exited[w.rank] = self._exitcode(w)
        return _Replies(answers, exited, tuple(sorted(w.rank for w in pending.values())))

    @staticmethod
    def _exitcode(w: _Worker, grace: float = 2.0) -> int | None:
        with _launcher_quiet():
            result = w.process.wait(timeout=grace, period=0.05)
        if result is None:
            return None
        if result.failures:
            return next(iter(result.failures.values())).exitcode
        return 0


@dataclasses.dataclass
class _Replies:
    answers: dict[int, Any]
    exited: dict[int, int | None]
    unanswered: tuple[int, ...]


@contextlib.contextmanager
def _callers_signal_handlers() -> Iterator[None]:
    """Keeps this process's handlers of the signals torch's launcher takes over when it
    starts a worker (SIGTERM, SIGINT, SIGHUP, SIGQUIT: it raises its SignalException on
    them, so Ctrl-C would no longer be a KeyboardInterrupt). A pool does not need them: a
    worker exits when its pipe closes, so a parent ended by any signal leaves none behind."""
    if threading.current_thread() is not threading.main_thread():
        yield  # the launcher installs handlers from the main thread only
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = [(sig, signal.getsignal(sig)) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))]
    try:
        yield
    finally:
        for sig, handler in saved:
            if handler is not None:  # None: a handler not installed from Python; left as it is
                signal.signal(sig, handler)


@contextlib.contextmanager
def _one_omp_thread() -> Iterator[None]:
    """OMP_NUM_THREADS=1 while workers start (unless set): workers share the machine's cores."""
    had = "OMP_NUM_THREADS" in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        yield
    finally:
        if not had:
            os.environ.pop("OMP_NUM_THREADS", None)


def check_per_replica_args(num_replicas: int, per_replica_args: Sequence[Sequence[Any]]) -> None:
    """ValueError unless every per-replica argument has one entry per replica."""
    for k, a in enumerate(per_replica_args):
        if len(a) != num_replicas:
            raise ValueError(f"per-replica argument {k} must have one entry per replica ({num_replicas}); "
                             f"got {len(a)}")


def describe(failures: dict[int, WorkerFailure], exited: dict[int, int | None], unanswered: Sequence[int],
             bound: float) -> str:
    """One line per worker that raised, exited or did not answer within ``bound`` seconds."""
    parts = [f"worker rank {r} raised {f.type_name}: {f.message}" for r, f in sorted(failures.items())]
    parts += [f"worker rank {r} exited with code {c}" for r, c in sorted(exited.items())]
    if unanswered:
        parts.append(f"worker ranks {list(unanswered)} did not answer within {bound:g}s")
    return "; ".join(parts)
