"""The "processes" engine of the test matrix: persistent worker pools on real processes.

``run_pooled(fn, num_replicas, *per_replica_args, timeout_seconds=...)`` has the
contract of ``harness.run_threads`` (and of ``harness_processes.run_processes``):
``fn`` is a module-level function run in every replica inside a replica
context, each argument is a list with one value per replica, the result is the
list of per-replica results in global replica-id order, and if a replica
raised, the exception ``strategy.run`` raised in its worker is raised here
(the culprit over the workers it released).

Launching torchrun per call costs seconds, so each layout keeps a pool of
workers for the whole pytest session:

* Layout of ``num_replicas``: 1 -> 1 worker x 1 replica, 2 -> 2 x 1, 4 -> 2 x 2
  (the hierarchical engine), other even counts -> 2 workers x n/2, odd counts ->
  n workers x 1.
* A pool is started lazily on first use, one per (num_replicas, timeout_seconds,
  check_collectives): the collective timeout is a constructor argument of the
  strategy (it also bounds process-group set-up and sizes the hierarchical
  engine's local rendezvous), so a job with another timeout gets a pool built
  with it rather than a patched engine. Only one test uses a non-default
  timeout. ``check_collectives`` (the strategy's documented opt-in that turns
  calls disagreeing across workers into CollectiveMismatchError) is on only for
  the tests marked ``detects_mismatch`` (see conftest.py).
* Workers are forked from a ``multiprocessing`` forkserver that has already
  imported torch and crossreplica (a restart costs a fork, not a torch import).
  Each worker first makes itself a session leader (so ``os.killpg`` reaches it
  and anything it starts), sets RANK / WORLD_SIZE / LOCAL_RANK /
  LOCAL_WORLD_SIZE / GROUP_RANK / MASTER_ADDR / MASTER_PORT as torchrun would
  (an OS-chosen free port), connects to a ``multiprocessing.connection.Listener``
  of this process (127.0.0.1, port 0, random authkey), waits until every worker
  of the pool has connected, then builds ``cr.MultiWorkerMirroredStrategy(
  replicas_per_worker, timeout_seconds=...)`` once and serves jobs: (module,
  qualname, file, its local replicas' arguments) -> per-replica results, or the
  exception (pickled; a repr-carrying RuntimeError when it cannot be pickled).
* The torch.distributed engine refuses further work after any failure (the
  process group is out of step), so a job that fails anywhere tears its pool
  down (SIGKILL to every worker's process group) and the next job of that
  layout starts a fresh one.
* Every wait here has a deadline. Workers exit on EOF from this process, and an
  atexit hook (plus the session finalizer in conftest) kills every pool, so no
  worker outlives pytest.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

DEFAULT_TIMEOUT = 30.0
START_LIMIT = 60.0  # seconds for a pool to start (fork, connect, process-group set-up)
PRELOAD = ["torch", "crossreplica", "harness_processes"]


def layout(num_replicas: int) -> tuple[int, int]:
    """(workers, replicas_per_worker) for ``num_replicas`` replicas."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1; got {num_replicas}")
    if num_replicas <= 2 or num_replicas % 2:
        return num_replicas, 1
    return 2, num_replicas // 2


def job_limit(timeout: float) -> float:
    """Wall-clock bound on one job: a failure ends within a few collective timeouts
    (the hierarchical engine's local rendezvous waits up to 2 x timeout + 5 s)."""
    return 3 * timeout + 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ctx: Any = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when the forkserver imports torch
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


class PoolError(RuntimeError):
    """A pool could not start, a worker died or a job ran past its bound."""


class RemoteReplicaError(RuntimeError):
    """A worker's exception that could not be pickled or rebuilt here: its type,
    message and traceback as text."""


class Pool:
    """The workers of one (num_replicas, timeout) layout; see the module docstring."""

    def __init__(self, num_replicas: int, timeout: float, check: bool = False):
        self.num_replicas = num_replicas
        self.timeout = float(timeout)
        self.check = bool(check)
        self.workers, self.rpw = layout(num_replicas)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.logdir = tempfile.mkdtemp(prefix="crossreplica-pool-")
        self.jobs = 0

    # ------------------------------------------------------------ life cycle

    def start(self) -> None:
        ctx = _context()
        authkey = secrets.token_bytes(32)
        listener = mpc.Listener(("127.0.0.1", 0), authkey=authkey)
        try:
            port = _free_port()
            for rank in range(self.workers):
                env = {"RANK": str(rank), "WORLD_SIZE": str(self.workers), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(self.workers), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                       "ROLE_WORLD_SIZE": str(self.workers), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
                log = os.path.join(self.logdir, f"worker{rank}.log")
                p = ctx.Process(target=_worker_main, name=f"crossreplica-pool-{self.num_replicas}-r{rank}",
                                args=(listener.address, authkey, env, self.rpw, self.timeout, self.check, log,
                                      list(sys.path)), daemon=True)
                p.start()
                self.procs.append(p)
            deadline = time.monotonic() + START_LIMIT
            conns: dict[int, Any] = {}
            # Listener.accept has no timeout: poll its socket with a deadline.
            sock = listener._listener._socket  # noqa: SLF001 - the only way to bound accept
            while len(conns) < self.workers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolError(f"{self.workers - len(conns)} worker(s) did not connect within {START_LIMIT:g}s")
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    raise PoolError(f"worker {dead[0].name} exited with code {dead[0].exitcode} before connecting")
                sock.settimeout(min(left, 0.5))
                try:
                    conn = listener.accept()
                except (socket.timeout, TimeoutError):
                    continue
                finally:
                    sock.settimeout(None)
                if not conn.poll(max(deadline - time.monotonic(), 0.1)):
                    conn.close()
                    continue
                rank = conn.recv()["rank"]
                conns[rank] = conn
            self.conns = [conns[r] for r in range(self.workers)]
            for c in self.conns:  # everyone is here: set up the process group together
                c.send("go")
            replies = self._gather(deadline, "start")
            errors = {r: v["error"] for r, v in replies.items() if "error" in v}
            if errors:
                raise PoolError("workers failed to build the strategy:\n" + "\n".join(
                    f"rank {r}: {e['type']}: {e['message']}\n{e['traceback']}" for r, e in errors.items()))
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def close(self) -> None:
        """Kills every worker (its whole process group) and reaps it; never blocks long."""
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.conns = []
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        for p in self.procs:
            p.join(timeout=5)
        self.procs = []

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def logs(self, limit: int = 4000) -> str:
        out = []
        for rank in range(self.workers):
            try:
                with open(os.path.join(self.logdir, f"worker{rank}.log"), errors="replace") as f:
                    text = f.read()
            except OSError:
                text = ""
            out.append(f"--- worker {rank} log ---\n{text[-limit:]}")
        return "\n".join(out)

    # ------------------------------------------------------------ jobs

    def _gather(self, deadline: float, what: str) -> dict[int, Any]:
        """One reply from every worker, by rank; PoolError past ``deadline`` or on a lost worker."""
        replies: dict[int, Any] = {}
        pending = {c: r for r, c in enumerate(self.conns)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolError(f"{what}: worker ranks {sorted(pending.values())} did not answer in time")
            for c in mpc.wait(list(pending), timeout=min(left, 1.0)):
                r = pending.pop(c)
                try:
                    replies[r] = c.recv()
                except (EOFError, OSError) as e:
                    raise PoolError(f"{what}: worker rank {r} died ({type(e).__name__})") from None
            for c, r in pending.items():
                if not self.procs[r].is_alive() and not c.poll():
                    raise PoolError(f"{what}: worker rank {r} exited with code {self.procs[r].exitcode}")
        return replies

    def run(self, fn: Callable[..., Any], per_replica_args: Sequence[Sequence[Any]]) -> tuple[dict, dict]:
        """(results by replica id, errors by worker rank) of one job."""
        module = sys.modules.get(fn.__module__)
        spec = {"module": fn.__module__, "file": getattr(module, "__file__", None), "name": fn.__qualname__}
        self.jobs += 1
        for rank, c in enumerate(self.conns):
            ids = range(rank * self.rpw, (rank + 1) * self.rpw)
            c.send_bytes(pickle.dumps({**spec, "args": [[a[i] for i in ids] for a in per_replica_args]}))
        replies = self._gather(time.monotonic() + job_limit(self.timeout), f"job {fn.__qualname__}")
        results: dict[int, Any] = {}
        errors: dict[int, dict] = {}
        for rank, reply in replies.items():
            if "error" in reply:
                errors[rank] = reply["error"]
            else:
                results.update(reply["results"])
        return results, errors


_pools: dict[tuple[int, float, bool], Pool] = {}


def pool(num_replicas: int, timeout: float, check: bool = False) -> Pool:
    key = (num_replicas, float(timeout), bool(check))
    p = _pools.get(key)
    if p is not None and not p.alive:
        p.close()
        p = None
    if p is None:
        p = Pool(num_replicas, timeout, check)
        p.start()
        _pools[key] = p
    return p


def shutdown() -> None:
    """Kills every pool, then stops the forkserver (pytest session end / interpreter exit)."""
    while _pools:
        _, p = _pools.popitem()
        p.close()
    _stop_forkserver()


def _stop_forkserver() -> None:
    """Stops the forkserver and the resource tracker it started (as their private _stop
    methods do, with bounded waits): closing a helper's 'alive' fd makes it exit, and it
    is reaped here rather than left to init as a zombie."""
    import multiprocessing.forkserver as fsm
    import multiprocessing.resource_tracker as rtm

    if _ctx is None:
        return
    fs = getattr(fsm, "_forkserver", None)
    if fs is not None and getattr(fs, "_forkserver_pid", None) is not None:
        with fs._lock:  # noqa: SLF001 - private state of the stdlib forkserver
            _end_helper(fs._forkserver_pid, fs._forkserver_alive_fd)  # noqa: SLF001
            address = fs._forkserver_address  # noqa: SLF001
            if address and os.path.exists(address):
                os.unlink(address)
            fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None  # noqa: SLF001
    rt = getattr(rtm, "_resource_tracker", None)
    if rt is not None and getattr(rt, "_pid", None) is not None:
        with rt._lock:  # noqa: SLF001
            _end_helper(rt._pid, rt._fd)  # noqa: SLF001
            rt._pid = rt._fd = None  # noqa: SLF001


def _end_helper(pid: int, alive_fd: int | None, grace: float = 5.0) -> None:
    try:
        if alive_fd is not None:
            os.close(alive_fd)
    except OSError:
        pass
    deadline = time.monotonic() + grace
    try:
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # SIGKILL cannot be ignored: returns at once
                return
            time.sleep(0.02)
    except (ChildProcessError, ProcessLookupError):
        pass


atexit.register(shutdown)


def run_pooled(fn: Callable[..., Any], num_replicas: int, *per_replica_args: Sequence[Any],
               timeout_seconds: float = DEFAULT_TIMEOUT, check_collectives: bool = False) -> list[Any]:
    """Per-replica results of ``fn`` on a persistent pool of worker processes."""
    for k, a in enumerate(per_replica_args):
        if len(a) != num_replicas:
            raise ValueError(f"per_replica_args[{k}] has {len(a)} entries for {num_replicas} replicas")
    key = (num_replicas, float(timeout_seconds), bool(check_collectives))
    p = pool(*key)
    try:
        results, errors = p.run(fn, per_replica_args)
    except BaseException as e:
        logs = p.logs()
        p.close()
        _pools.pop(key, None)
        if isinstance(e, PoolError):
            raise PoolError(f"{e}\n{logs}") from None
        raise
    if errors:
        # the engine refuses further work after a failure: the next job gets a fresh pool
        p.close()
        _pools.pop(key, None)
        raise _primary_exception(errors)
    missing = [r for r in range(num_replicas) if r not in results]
    if missing:
        raise PoolError(f"no result for replicas {missing}")
    return [results[r] for r in range(num_replicas)]


def _primary_exception(errors: dict[int, dict]) -> BaseException:
    """The exception to raise here: a worker's own failure over the workers it released
    (ReplicaAborted), then the lowest rank; rebuilt from its pickle when possible."""
    from crossreplica.errors import replica_error

    def key(item: tuple[int, dict]) -> tuple[bool, int]:
        rank, err = item
        return "ReplicaAborted" in err["mro"], rank

    rank, err = sorted(errors.items(), key=key)[0]
    exc: BaseException | None = None
    if err.get("pickled") is not None:
        try:
            kind, *rest = pickle.loads(err["pickled"])
            exc = replica_error(rest[0], rest[1]) if kind == "replica" else rest[0]
        except Exception:  # noqa: BLE001 - not rebuildable here: the text below instead
            exc = None
    if exc is None:
        exc = RemoteReplicaError(f"worker rank {rank} raised {err['type']}: {err['message']}\n{err['traceback']}")
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised in worker rank {rank}; its traceback:)\n{err['traceback']}")
    return exc


# --------------------------------------------------------------------------- worker side

def _error_info(e: BaseException, pickled: Callable[[BaseException], bytes | None]) -> dict:
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
            "traceback": traceback.format_exc(), "pickled": pickled(e)}


def _worker_main(address: Any, authkey: bytes, env: dict[str, str], rpw: int, timeout: float,
                 check: bool, log: str, path: list[str]) -> None:
    os.setsid()  # its own process group: the pool kills it with os.killpg
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 0
    try:
        code = _serve(address, authkey, env, rpw, timeout, check, path)
    except BaseException:  # noqa: BLE001 - the pool sees the connection close and the log
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: a worker released from a broken process group must not
        # hang in the backend's destructors.
        os._exit(code)


def _serve(address: Any, authkey: bytes, env: dict[str, str], rpw: int, timeout: float,
           check: bool, path: list[str]) -> int:
    for p in path:
        if p not in sys.path:
            sys.path.append(p)
    os.environ.update(env)
    os.environ.pop("CROSSREPLICA_CHECK_COLLECTIVES", None)
    import torch

    import crossreplica as cr
    from harness_processes import _Boxed, _load_fn, _pickled

    torch.set_num_threads(1)
    conn = mpc.Client(address, authkey=authkey)
    conn.send({"rank": int(env["RANK"]), "pid": os.getpid()})
    if conn.recv() != "go":
        return 1
    try:
        strategy = cr.MultiWorkerMirroredStrategy(rpw, timeout_seconds=timeout, check_collectives=check)
    except BaseException as e:  # noqa: BLE001 - reported to the pool
        conn.send({"error": _error_info(e, _pickled)})
        return 1
    ids = strategy.extended.local_replica_ids
    conn.send({"ready": list(ids)})
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return 0  # the pool (or pytest) went away
        try:
            fn = _load_fn(job)
            args = [cr.PerReplica(tuple(a)) for a in job["args"]]
            result = strategy.run(_Boxed(fn), args)
            boxes = [cr.select_replica(i, result) for i in range(len(ids))] if len(ids) > 1 or \
                isinstance(result, cr.PerReplica) else [result]
            reply: dict[str, Any] = {"results": {r: box.value for r, box in zip(ids, boxes)}}
            data = pickle.dumps(reply)
        except BaseException as e:  # noqa: BLE001 - reported to the pool
            data = pickle.dumps({"error": _error_info(e, _pickled)})
        conn.send_bytes(data)
