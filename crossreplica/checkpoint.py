"""Checkpoints of mirrored training state: the chief writes atomically, everyone agrees.

``cr.save(path, state)`` takes a nest of tensors, modules, optimizers and
distributed values. Modules and optimizers are saved as their ``state_dict``;
a ``Mirrored`` value is saved from replica 0's copy (replicas hold identical
copies, and on the chief local replica 0 is global replica 0); a ``PerReplica``
is refused, since which replica's value to keep is the caller's decision.
Tensors are saved on the CPU so a checkpoint loads on any device.

Across processes (cr.MultiWorkerMirroredStrategy with more than one worker)
only the chief (rank 0, which holds replica 0) writes; the write goes to a
temporary file in the same directory, is flushed to disk and renamed over
``path`` (``os.replace`` is atomic), so a worker killed mid-write leaves the
previous checkpoint intact. Every worker then waits for the chief (a bounded
collective that also carries the chief's success or failure), so no worker
runs ahead of a checkpoint that does not exist yet. ``cr.load`` reads on the
chief and broadcasts, so every replica gets the same state even without a
shared file system; a missing file is a FileNotFoundError on every worker.

In one process both are plain atomic save and load.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from . import context, nest
from .errors import ReplicaContextError
from .reduce_op import ReduceOp
from .values import Mirrored, PerReplica

__all__ = ["save", "load"]


class _Workers:
    """Who writes, and how the workers agree on the outcome."""

    def __init__(self, is_chief: bool, max_flag: Any):
        self.is_chief = is_chief
        self.max_flag = max_flag  # int -> the maximum over every worker (a bounded collective)


def _cross_process(strategy: Any) -> _Workers | None:
    """How to reach the other workers, or None when everything is in this process.

    A multi-process strategy in scope (or passed) is used; outside any scope, an
    initialised torch.distributed world of several processes still makes rank 0
    the only writer, so a script that calls cr.save outside ``strategy.scope()``
    does not write once per process."""
    ext = getattr(strategy, "extended", None)
    engine = getattr(ext, "engine", None)
    if ext is not None and getattr(engine, "world_size", 1) > 1 and hasattr(ext, "is_chief"):
        n = len(ext.worker_devices)
        return _Workers(ext.is_chief, lambda flag: int(ext.reduce_values(
            ReduceOp.MAX, [torch.tensor([flag], dtype=torch.int32)] * n).item()))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        def max_flag(flag: int) -> int:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if str(dist.get_backend()) == "nccl" else torch.device("cpu")
            t = torch.tensor([flag], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # bounded by the process group's timeout
            return int(t.item())
        return _Workers(dist.get_rank() == 0, max_flag)
    return None


def _resolve(strategy: Any, api: str) -> Any:
    if context.get_replica_context() is not None:
        raise ReplicaContextError(
            f"cr.{api} must be called in cross-replica context (outside strategy.run), once per "
            f"process; it saves or loads the state every replica shares")
    return strategy if strategy is not None else context.get_strategy()


def _plain(state: Any, path: tuple = ()) -> Any:
    """``state`` with modules/optimizers as state_dicts, Mirrored as replica 0's copy, tensors on CPU."""
    if isinstance(state, torch.nn.Module) or isinstance(state, torch.optim.Optimizer):
        return _plain(state.state_dict(), path)
    if isinstance(state, Mirrored):
        return _plain(state.values[0], path)
    if isinstance(state, PerReplica):
        where = "/".join(str(p) for p in path) or "<root>"
        raise TypeError(
            f"cr.save: state at {where} is a PerReplica (one different value per replica); reduce it "
            f"first (strategy.reduce) or pick a replica's value (strategy.experimental_local_results)")
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if nest.is_container(state):
        keys, items = nest.children(state)
        return nest.rebuild(state, keys, (_plain(v, path + (k,)) for k, v in zip(keys, items)))
    return state


def _atomic_save(obj: Any, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def save(path: str | os.PathLike, state: Any, *, strategy: Any = None) -> None:
    """Saves ``state`` to ``path``: written once by the chief, atomically; every worker returns
    only after the file is in place.

    Raises:
        TypeError: ``path`` is not a path, or ``state`` holds a PerReplica.
        RuntimeError: the chief failed to write (on the other workers).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cr.save: path must be a str or os.PathLike; got {path!r}")
    path = os.fspath(path)
    strategy = _resolve(strategy, "save")
    workers = _cross_process(strategy)
    plain = _plain(state)
    if workers is None:
        _atomic_save(plain, path)
        return
    failure: BaseException | None = None
    if workers.is_chief:
        try:
            _atomic_save(plain, path)
        except BaseException as e:  # noqa: BLE001 - reported to every worker below
            failure = e
    # The barrier carries the outcome: every worker learns whether the chief succeeded.
    failed = workers.max_flag(1 if failure is not None else 0)
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"cr.save: the chief (rank 0) failed to write {path!r}; see its log")


def load(path: str | os.PathLike, *, map_location: Any = "cpu", strategy: Any = None,
         weights_only: bool = True) -> Any:
    """Loads a checkpoint written by :func:`save`; every worker gets the chief's copy.

    Raises:
        FileNotFoundError: on every worker, when the chief has no file at ``path``.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cr.load: path must be a str or os.PathLike; got {path!r}")
    path = os.fspath(path)
    strategy = _resolve(strategy, "load")
    workers = _cross_process(strategy)
    if workers is None:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    import torch.distributed as dist

    box: list[Any] = [None]
    if workers.is_chief:
        try:
            box[0] = ("ok", torch.load(path, map_location="cpu", weights_only=weights_only))
        except FileNotFoundError as e:
            box[0] = ("missing", str(e))
        except Exception as e:  # noqa: BLE001 - every worker raises it
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "missing":
        raise FileNotFoundError(f"cr.load: no checkpoint at {path!r} on the chief (rank 0): {value}")
    if status == "error":
        raise RuntimeError(f"cr.load: the chief (rank 0) could not read {path!r}: {value}")
    if map_location not in (None, "cpu"):
        value = nest.map_structure(
            lambda t: t.to(map_location) if isinstance(t, torch.Tensor) else t, value)
    return value
