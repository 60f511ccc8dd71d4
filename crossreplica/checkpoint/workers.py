"""Who writes a checkpoint, and how the workers agree on the outcome.

Across processes only the chief (rank 0, which holds replica 0) writes. Every
worker first meets the others in the store (``Workers.meet``): a save or load
called on some workers only (DDP's ``if master_process:``) fails there at once,
naming the API, instead of pairing its collectives with the others' training
calls until the timeout. Every worker then waits for the chief in a bounded collective that also carries the chief's
success or failure, so no worker runs ahead of a checkpoint that does not exist
yet. Loading reads on the chief and sends the file's bytes (never a pickle to
trust) to every worker, so the hosts need no shared file system.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..engines.base import WorkerEngine
from ..reduce_op import ReduceOp

if TYPE_CHECKING:
    from ..strategies.base import Strategy

__all__ = ["FAILED", "MISSING", "OK", "Workers", "cross_process"]

OK, MISSING, FAILED = 0, 1, 2  # what the chief found when it read a checkpoint


class Workers:
    """Who writes, and how the workers agree on the outcome."""

    def __init__(self, is_chief: bool, max_flag: Callable[[int], int],
                 broadcast: Callable[[torch.Tensor], torch.Tensor], meet: Callable[[str], None] | None = None):
        self.is_chief = is_chief
        self.max_flag = max_flag  # int -> the maximum over every worker (a bounded collective)
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

    A multi-process strategy in scope (or passed) is used; outside any scope, an
    initialised torch.distributed world of several processes still makes rank 0
    the only writer, so a script that calls cr.save outside ``strategy.scope()``
    does not write once per process."""
    ext = getattr(strategy, "extended", None)
    engine = getattr(ext, "engine", None)
    if ext is not None and isinstance(engine, WorkerEngine) and engine.world_size > 1 and hasattr(ext, "is_chief"):
        # Through the strategy's engine: bounded, and released when another worker fails.
        n = len(ext.worker_devices)
        return Workers(ext.is_chief,
                       lambda flag: int(ext.reduce_values(ReduceOp.MAX, [torch.tensor([flag], dtype=torch.int32)] * n)
                                        .item()),
                       lambda t: ext.broadcast_values([t] * n), engine.meet)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        def max_flag(flag: int) -> int:
            t = torch.tensor([flag], dtype=torch.int32, device=_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # bounded by the process group's timeout
            return int(t.item())

        def broadcast(t: torch.Tensor) -> torch.Tensor:
            t = t.to(_device())
            dist.broadcast(t, src=0)  # bounded by the process group's timeout
            return t

        return Workers(dist.get_rank() == 0, max_flag, broadcast)
    return None


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device())
            if str(dist.get_backend()) == "nccl" else torch.device("cpu"))
