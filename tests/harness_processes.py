"""Run a replica function on real processes: the multi-process twin of ``run_replicas``.

``run_processes(fn, num_replicas, *per_replica_args, replicas_per_worker=1)``
has the contract of the in-process fixture: ``fn`` is a module-level function
run inside a replica context, each argument is a list with one value per
replica, and the result is the list of per-replica results (picklable). Here
the replicas live in ``num_replicas // replicas_per_worker`` worker processes
launched by ``torchrun --standalone`` (an OS-chosen free port), joined by
cr.MultiWorkerMirroredStrategy. ``fn`` travels by module and name, arguments
and results through ``torch.save`` files in a temporary directory.

Every launch is bounded by ``timeout``; whatever happens, the launcher's
process group and every worker (their pids are recorded) are killed before
returning, so no process outlives a test.

``launch`` is the lower level: it returns every worker's outcome (result or
error) instead of raising, and can start the workers directly (``launcher=
"direct"``, env RANK/WORLD_SIZE/MASTER_*), which failure tests use so that no
elastic agent tears the survivors down before they report.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Outcome:
    """What one launch produced: per-rank results or errors, and the combined log."""

    returncodes: list[int | None]
    results: dict[int, Any]  # global replica id -> result
    errors: dict[int, dict]  # worker rank -> {"type", "mro", "message", "traceback", "elapsed"}
    log: str
    elapsed: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CROSSREPLICA_CHECK_COLLECTIVES", None)
    env.update(extra or {})
    return env


def launch(fn: Callable[..., Any], num_replicas: int, *per_replica_args: Sequence[Any],
           replicas_per_worker: int = 1, timeout: float = 120.0, collective_timeout: float = 60.0,
           check_collectives: bool = False, launcher: str = "torchrun",
           env: dict[str, str] | None = None, mode: str = "replica") -> Outcome:
    """Runs ``fn`` on ``num_replicas`` replicas in worker processes; never raises for worker failures.

    ``mode="replica"``: ``fn(*args)`` runs in every replica (strategy.run).
    ``mode="main"``: ``fn(strategy)`` runs once per worker in cross-replica context;
    its result is stored under the worker's rank."""
    if num_replicas % replicas_per_worker:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of replicas_per_worker="
                         f"{replicas_per_worker}")
    for i, a in enumerate(per_replica_args):
        if len(a) != num_replicas:
            raise ValueError(f"per_replica_args[{i}] must have one value per replica ({num_replicas}); "
                             f"got {len(a)}")
    module = sys.modules[fn.__module__]
    workers = num_replicas // replicas_per_worker
    with tempfile.TemporaryDirectory(prefix="crossreplica-proc-") as tmp:
        spec = {"mode": mode, "module": fn.__module__, "file": getattr(module, "__file__", None),
                "name": fn.__qualname__,
                "args": [list(a) for a in per_replica_args], "replicas_per_worker": replicas_per_worker,
                "timeout": collective_timeout, "check": check_collectives}
        spec_path = os.path.join(tmp, "spec.pt")
        torch.save(spec, spec_path)
        cmd_tail = [os.path.abspath(__file__), spec_path]
        procs: list[subprocess.Popen] = []
        logs = [os.path.join(tmp, f"log{r}.txt") for r in range(workers if launcher == "direct" else 1)]
        start = time.monotonic()
        try:
            if launcher == "torchrun":
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={workers}", "--max-restarts=0", "--monitor-interval=0.2",
                       *cmd_tail]
                with open(logs[0], "wb") as log:
                    procs.append(subprocess.Popen(cmd, env=_env(env), stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True, cwd=REPO))
            elif launcher == "direct":
                port = free_port()
                for r in range(workers):
                    e = _env({"RANK": str(r), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(r),
                              "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(port), **(env or {})})
                    with open(logs[r], "wb") as log:
                        procs.append(subprocess.Popen([sys.executable, *cmd_tail], env=e, stdout=log,
                                                      stderr=subprocess.STDOUT, start_new_session=True,
                                                      cwd=REPO))
            else:
                raise ValueError(f"launcher must be 'torchrun' or 'direct'; got {launcher!r}")
            deadline = start + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    break
        finally:
            _kill_all(procs, tmp)
        elapsed = time.monotonic() - start
        results: dict[int, Any] = {}
        errors: dict[int, dict] = {}
        for r in range(workers):
            path = os.path.join(tmp, f"out{r}.pt")
            if os.path.exists(path):
                out = torch.load(path, weights_only=False)
                if "error" in out:
                    errors[r] = out["error"]
                else:
                    results.update(out["results"])
        log = ""
        for path in logs:
            with open(path, errors="replace") as f:
                log += f.read()
        return Outcome([p.returncode for p in procs], results, errors, log, elapsed)


def run_processes(fn: Callable[..., Any], num_replicas: int, *per_replica_args: Sequence[Any],
                  replicas_per_worker: int = 1, timeout: float = 120.0,
                  timeout_seconds: float | None = None, **kwargs: Any) -> list[Any]:
    """Per-replica results of ``fn`` run on real processes (see the module docstring).

    ``timeout_seconds`` is the collective timeout (the option name of the in-process
    runner in tests/harness.py, so this function can be registered there as is);
    ``timeout`` bounds the whole launch.

    If a replica raised, the exception ``strategy.run`` raised in the worker is raised
    here too (a ReplicaError that is also an instance of the original type, or the
    collective error itself), so ``pytest.raises`` works as with in-process replicas;
    the failing worker wins over the workers it released. Anything else (a worker that
    died or never reported) is a RuntimeError with the logs."""
    if timeout_seconds is not None:
        kwargs["collective_timeout"] = timeout_seconds
    out = launch(fn, num_replicas, *per_replica_args, replicas_per_worker=replicas_per_worker,
                 timeout=timeout, **kwargs)
    primary = _primary_exception(out)
    if primary is not None:
        raise primary
    if out.errors or len(out.results) != num_replicas:
        details = "\n".join(f"worker {r}: {e['type']}: {e['message']}\n{e['traceback']}"
                            for r, e in sorted(out.errors.items()))
        raise RuntimeError(
            f"run_processes({fn.__qualname__}) failed after {out.elapsed:.1f}s (exit codes "
            f"{out.returncodes}):\n{details}\n--- log ---\n{out.log[-6000:]}")
    return [out.results[r] for r in range(num_replicas)]


def run_workers(main: Callable[[Any], Any], num_workers: int, replicas_per_worker: int = 1,
                timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Per-worker results of ``main(strategy)``, run once per worker in cross-replica context."""
    out = launch(main, num_workers * replicas_per_worker, replicas_per_worker=replicas_per_worker,
                 timeout=timeout, mode="main", **kwargs)
    if out.errors or len(out.results) != num_workers:
        details = "\n".join(f"worker {r}: {e['type']}: {e['message']}\n{e['traceback']}"
                            for r, e in sorted(out.errors.items()))
        raise RuntimeError(f"run_workers({main.__qualname__}) failed after {out.elapsed:.1f}s (exit codes "
                           f"{out.returncodes}):\n{details}\n--- log ---\n{out.log[-6000:]}")
    return [out.results[r] for r in range(num_workers)]


def _primary_exception(out: Outcome) -> BaseException | None:
    """The exception a worker's strategy.run raised, rebuilt here; the culprit over the released."""
    from crossreplica.errors import replica_error

    candidates = []
    for rank, err in sorted(out.errors.items()):
        blob = err.get("pickled")
        if blob is None:
            continue
        try:
            kind, *rest = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - not rebuildable here: reported with the logs instead
            continue
        exc = replica_error(rest[0], rest[1]) if kind == "replica" else rest[0]
        released = "ReplicaAborted" in err["mro"]
        candidates.append((released, rank, exc, err))
    if not candidates:
        return None
    released, rank, exc, err = sorted(candidates, key=lambda c: (c[0], c[1]))[0]
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised in worker rank {rank}; its traceback:)\n{err['traceback']}")
    return exc


def _kill_all(procs: list[subprocess.Popen], tmp: str) -> None:
    """Stops the launchers (SIGTERM, then SIGKILL) and every worker that recorded its pid."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)
    for name in os.listdir(tmp):
        if name.startswith("pid"):
            try:
                pid = int(open(os.path.join(tmp, name)).read())
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if tmp.encode() not in f.read():
                        continue  # the pid was reused by someone else's process
                os.kill(pid, signal.SIGKILL)
            except (ValueError, OSError):
                pass


# --------------------------------------------------------------------------- worker side

def _load_fn(spec: dict) -> Callable[..., Any]:
    try:
        module = importlib.import_module(spec["module"])
    except ImportError:
        if not spec["file"]:
            raise
        sys.path.insert(0, os.path.dirname(spec["file"]))
        s = importlib.util.spec_from_file_location(spec["module"], spec["file"])
        module = importlib.util.module_from_spec(s)
        sys.modules[spec["module"]] = module
        s.loader.exec_module(module)
    obj: Any = module
    for part in spec["name"].split("."):
        obj = getattr(obj, part)
    return obj


class _Box:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class _Boxed:
    """``fn`` returning its result in a fresh box: never the same object on two replicas."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> _Box:
        return _Box(self.fn(*args))


def _pickled(e: BaseException) -> bytes | None:
    """``e`` in a form the parent can rebuild (ReplicaError types are made on the fly)."""
    from crossreplica.errors import ReplicaError

    try:
        if isinstance(e, ReplicaError):
            return pickle.dumps(("replica", e.replica_id, e.original))
        return pickle.dumps(("plain", e))
    except Exception:  # noqa: BLE001 - unpicklable: the parent reports the message instead
        return None


def _worker_main(spec_path: str) -> None:
    tmp = os.path.dirname(spec_path)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(tmp, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    start = time.monotonic()
    out: dict[str, Any]
    try:
        import crossreplica as cr

        spec = torch.load(spec_path, weights_only=False)
        fn = _load_fn(spec)
        strategy = cr.MultiWorkerMirroredStrategy(spec["replicas_per_worker"],
                                                  timeout_seconds=spec["timeout"],
                                                  check_collectives=spec["check"])
        ids = strategy.extended.local_replica_ids
        if spec["mode"] == "main":
            out = {"results": {strategy.extended.worker_rank: fn(strategy)}}
        else:
            # Always PerReplica (also for one replica), so a None argument is not trimmed by run;
            # results travel in a box so regroup/select_replica hand back each replica's object.
            args = [cr.PerReplica(tuple(a[r] for r in ids)) for a in spec["args"]]
            result = strategy.run(_Boxed(fn), args)
            boxes = [cr.select_replica(i, result) for i in range(len(ids))]
            out = {"results": {r: box.value for r, box in zip(ids, boxes)}}
        strategy.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out = {"error": {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                         "message": str(e), "traceback": traceback.format_exc(),
                         "elapsed": time.monotonic() - start, "pickled": _pickled(e)}}
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
    sys.stdout.flush()
    # Skip interpreter teardown: a worker released from a broken process group must not hang in
    # the backend's destructors.
    os._exit(0 if "results" in out else 1)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
