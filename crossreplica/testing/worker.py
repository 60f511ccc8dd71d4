"""The worker side of :class:`crossreplica.testing.WorkerPool`: one process, one strategy, many jobs.

:func:`serve` is the entry point torch's elastic launcher starts in every worker,
with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, ...)
already set. It builds ``cr.MultiWorkerMirroredStrategy(replicas_per_worker)``
on the pool's device type and backend (the CPU with gloo; GPUs with NCCL, or
with gloo where workers share a GPU) once, reports its local replica ids, then
serves jobs from its pipe until the pool closes it:

* ``{"mode": "replica", ...}``: ``fn(*args)`` in every local replica through
  ``strategy.run``; the reply maps each local replica id to its result.
* ``{"mode": "main", ...}``: ``fn(strategy)`` once, in cross-replica context;
  the reply maps the worker's rank to its result.

A job that raises is answered with a :class:`~crossreplica.testing.remote.WorkerFailure`
and the worker keeps serving; the pool decides whether to trust it again.
``fn`` travels by module, qualified name and file; arguments and results as
pickles (never shared memory).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

import crossreplica as cr
from crossreplica.logs import LOGGER_NAME
from crossreplica.testing.hosts import Host
from crossreplica.testing.remote import capture


class Box:
    """One replica's result in a fresh object: never the same object on two replicas,
    so regroup always wraps it and select_replica hands back each replica's own."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class Boxed:
    """``fn`` returning its result in a :class:`Box`."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> Box:
        return Box(self.fn(*args))


def function_spec(fn: Callable[..., Any]) -> dict[str, Any]:
    """How a worker finds ``fn``: its module, qualified name and the module's file."""
    name = getattr(fn, "__qualname__", None)
    if not callable(fn) or not isinstance(name, str) or "<" in name or not getattr(fn, "__module__", None):
        raise ValueError(f"fn must be a function defined at module level, which worker processes import "
                         f"by module and name; got {fn!r}. Move it out of the enclosing function or lambda.")
    module = sys.modules.get(fn.__module__)
    return {"module": fn.__module__, "name": fn.__qualname__, "file": getattr(module, "__file__", None)}


def load_function(spec: dict[str, Any]) -> Callable[..., Any]:
    """The function a :func:`function_spec` names: imported by module name, else from its file."""
    name = spec["module"]
    if name == "__main__":  # the parent's script: importable here only from its file
        name = "__crossreplica_main__"
    module = sys.modules.get(name)
    if module is None:
        try:
            if name == "__crossreplica_main__":
                raise ImportError(name)
            module = importlib.import_module(name)
        except ImportError:
            if not spec["file"]:
                raise
            file_spec = importlib.util.spec_from_file_location(name, spec["file"])
            if file_spec is None or file_spec.loader is None:
                raise
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
    obj: Any = module
    for part in spec["name"].split("."):
        obj = getattr(obj, part)
    return obj


DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")


def check_device_type(device: Any) -> str:
    """``device`` if it is one of :data:`DEVICE_TYPES`; a ValueError naming it otherwise."""
    if device not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {list(DEVICE_TYPES)}; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a CUDA device, but CUDA is not available here")
    return str(device)


def replica_devices(device: str, first: int, count: int) -> list[str]:
    """The devices of replicas ``first .. first + count - 1`` of a job on ``device``: the CPU, or
    the visible GPUs round-robin (replica ``i`` on ``cuda:i % gpus``)."""
    if device == "cpu":
        return ["cpu"] * count
    gpus = torch.cuda.device_count()
    return [f"cuda:{(first + i) % gpus}" for i in range(count)]


def serve(conn: Connection, replicas_per_worker: int, timeout_seconds: float, check_collectives: bool,
          path: list[str], log_level: int | str | None = None, device: str = "cpu",
          backend: str = "gloo", host: Host | None = None) -> None:
    """Entry point of a worker process (see the module docstring); never returns. ``host``: the
    simulated host it runs on, entered first."""
    try:
        os.setsid()  # its own process group, so the pool's kill reaches whatever it starts
    except OSError:
        pass
    code = 0
    if log_level is not None:
        _log_to_stderr(log_level)
    try:
        if host is not None:
            host.enter()
        _serve(conn, replicas_per_worker, timeout_seconds, check_collectives, path, device, backend)
    except BaseException:  # noqa: BLE001 - the pool sees the pipe close and reads the log
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: a worker released from a broken process group must not
        # hang in the backend's destructors.
        os._exit(code)


def _log_to_stderr(level: int | str) -> None:
    """crossreplica's records at ``level`` and above to this worker's stderr, marked with its rank."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"[rank {os.environ.get('RANK', '?')}] %(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    logger.setLevel(level)


def _serve(conn: Connection, replicas_per_worker: int, timeout_seconds: float, check_collectives: bool,
           path: list[str], device: str, backend: str) -> None:
    sys.path.extend(p for p in path if p not in sys.path)
    os.environ.pop("CROSSREPLICA_CHECK_COLLECTIVES", None)  # the pool's argument decides
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    start = time.monotonic()
    try:
        # NCCL: the strategy's own rule gives each process GPUs of its own; gloo may share them.
        devices = (None if backend == "nccl" else
                   replica_devices(device, int(os.environ["LOCAL_RANK"]) * replicas_per_worker, replicas_per_worker))
        strategy = cr.MultiWorkerMirroredStrategy(replicas_per_worker, backend, devices=devices,
                                                  timeout_seconds=timeout_seconds,
                                                  check_collectives=check_collectives)
    except BaseException as e:  # noqa: BLE001 - reported to the pool
        conn.send_bytes(pickle.dumps({"failure": capture(e, rank, time.monotonic() - start)}))
        return
    ids = list(strategy.extended.local_replica_ids)
    conn.send_bytes(pickle.dumps({"ready": ids}))
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the pool went away
        start = time.monotonic()
        try:
            fn = load_function(job)
            if job["mode"] == "main":
                results = {rank: fn(strategy, *job.get("main_args", ()))}
            else:
                # Always PerReplica (also for one replica), so a None argument is not trimmed by run.
                args = [cr.PerReplica(tuple(a)) for a in job["args"]]
                result = strategy.run(Boxed(fn), args)
                boxes = [cr.select_replica(i, result) for i in range(len(ids))]
                results = {r: box.value for r, box in zip(ids, boxes)}
            data = pickle.dumps({"results": results})
        except BaseException as e:  # noqa: BLE001 - reported to the pool
            data = pickle.dumps({"failure": capture(e, rank, time.monotonic() - start)})
        conn.send_bytes(data)
