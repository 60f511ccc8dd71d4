"""Who writes a checkpoint, and how the workers agree on the outcome.

Across processes only the chief (rank 0, which holds replica 0) writes. Every
worker first meets the others in the store (``Workers.meet``): a save or load
called on some workers only (DDP's ``if master_process:``) fails there at once,
naming the API, instead of pairing its collectives with the others' training
calls until the timeout. Every worker then waits for the chief in a bounded collective that also carries the chief's
success or failure, so no worker runs ahead of a checkpoint that does not exist
yet, and whose failure reaches every worker with the chief's message. Loading
reads on the chief and sends the file's bytes (never a pickle to trust) to every
worker, so the hosts need no shared file system.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..engines.base import WorkerEngine
from ..strategies.multi_worker import running

if TYPE_CHECKING:
    from ..strategies.base import Strategy

__all__ = ["FAILED", "MISSING", "OK", "Workers", "cross_process"]

OK, MISSING, FAILED = 0, 1, 2  # what the chief found when it read (or wrote) a checkpoint


class Workers:
    """Who writes, and how the workers agree on the outcome."""

    def __init__(self, is_chief: bool, broadcast: Callable[[torch.Tensor], torch.Tensor],
                 meet: Callable[[str], None] | None = None):
        self.is_chief = is_chief
        self.broadcast = broadcast  # a tensor -> the chief's (a bounded collective)
        self._meet = meet

    def share_from_chief(self, status: int, payload: bytes) -> tuple[int, bytes]:
        """The chief's ``(status, payload)`` on every worker, as tensors: a header with the
        status and length, then the bytes."""
        header = self.broadcast(torch.tensor([status, len(payload)], dtype=torch.int64))
        status, size = (int(v) for v in header.tolist())
        if not size:
            return status, b""
        if self.is_chief:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(size, dtype=torch.uint8)
        return status, bytes(self.broadcast(data).cpu().contiguous().untyped_storage())

    def meet(self, api: str) -> None:
        """Waits until every worker has called ``api``; fails fast if one went past it."""
        if self._meet is not None:
            self._meet(api)


def cross_process(strategy: Strategy) -> Workers | None:
    """How to reach the other workers, or None when everything is in this process.

    A multi-process strategy in scope (or passed) is used. Outside any scope, an
    initialised torch.distributed world of several processes still makes rank 0
    the only writer, so a script that calls cr.save outside ``strategy.scope()``
    does not write once per process; its traffic goes through the engine of the
    MultiWorkerMirroredStrategy running that world (``multi_worker.running``), so
    a worker lost meanwhile is named within seconds, as in any collective. Only a
    world no strategy runs (the user's own process group) gets torch.distributed's
    calls, bounded by the group's timeout."""
    ext = getattr(strategy, "extended", None)
    engine = getattr(ext, "engine", None)
    if not (isinstance(engine, WorkerEngine) and engine.world_size > 1 and hasattr(ext, "is_chief")):
        outer = running()
        if outer is not None:
            ext = outer.extended
            engine = getattr(ext, "engine", None)
    if ext is not None and isinstance(engine, WorkerEngine) and engine.world_size > 1 and hasattr(ext, "is_chief"):
        # Through the strategy's engine: bounded, watched, and released when another worker fails.
        n = len(ext.worker_devices)
        return Workers(ext.is_chief, lambda t: ext.broadcast_values([t] * n), engine.meet)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        def broadcast(t: torch.Tensor) -> torch.Tensor:
            t = t.to(_device())
            dist.broadcast(t, src=0)  # bounded by the process group's timeout
            return t

        return Workers(dist.get_rank() == 0, broadcast)
    return None


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device())
            if str(dist.get_backend()) == "nccl" else torch.device("cpu"))
