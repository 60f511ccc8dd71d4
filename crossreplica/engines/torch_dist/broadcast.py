"""Broadcast across workers.

One byte pack per (worker set, source worker), sent with ``dist.broadcast``;
members on the source's own worker copy the source's tensors in-process.
Invariant: every worker of a worker set walks the same (worker set, source
worker) keys in the same order, and every member receives a copy of the
source's bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from ...packing import byte_pack_size, pack_bytes, unpack_bytes
from .plan import Step

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["broadcast"]


class _Source(NamedTuple):
    """A group whose broadcast crosses workers, with its source replica."""

    subgroup: Any
    local: list[int]
    source: int


def broadcast(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    index, per_worker, payloads = eng.local_index, eng.replicas_per_worker, step.payloads
    n_leaves = len(payloads[0])
    outs: list[list[Any]] = [[None] * n_leaves for _ in payloads]
    plan = eng.planner.plan(step.call.groups)
    for entry in plan:
        if not entry.local:
            continue
        source = entry.group[step.params[entry.local[0]].source]
        if source // per_worker == eng.rank:
            for leaf in range(n_leaves):
                eng.hand_out(outs, leaf, entry.local, payloads[index[source]][leaf], fresh=False)
    keys: dict[tuple[tuple[int, ...], int], list[_Source]] = {}
    for entry in plan:
        if entry.local and len(entry.workers) > 1:
            source = entry.group[step.params[entry.local[0]].source]
            keys.setdefault((entry.workers, source // per_worker), []).append(
                _Source(entry.subgroup, entry.local, source))
    for (workers, source_worker), sources in keys.items():
        specs = [(tuple(x.shape), x.dtype) for src in sources for x in payloads[index[src.local[0]]]]
        if source_worker == eng.rank:
            buf = pack_bytes([x for src in sources for x in payloads[index[src.source]]], eng.comm_device)
        else:
            buf = torch.empty(byte_pack_size(specs), dtype=torch.uint8, device=eng.comm_device)
        if buf.numel():
            eng.watchdog.wait(dist.broadcast(buf, src=source_worker, group=sources[0].subgroup, async_op=True),
                              workers)
        if source_worker == eng.rank:
            continue
        values, _ = unpack_bytes(buf, specs)
        position = 0
        for src in sources:
            for leaf in range(n_leaves):
                eng.hand_out(outs, leaf, src.local, values[position], fresh=False)
                position += 1
    return outs
