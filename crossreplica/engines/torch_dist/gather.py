"""``all_gather`` across workers.

Shapes may differ along the gather dim (an uneven last batch), so the sizes
travel first (a small int64 all-gather), then one byte pack per worker, padded
to the widest. Invariant: every member of a group concatenates the same
members' bytes in group order, so every member gets the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...packing import byte_pack_size, pack_bytes, unpack_bytes
from .plan import GroupPlan, Step, by_worker_set

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["all_gather", "gather_fixed"]


def all_gather(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    n_leaves = len(step.payloads[0])
    # replica id -> its leaves, for every member we learn of
    parts: dict[int, list[torch.Tensor]] = {rid: step.payloads[eng.local_index[rid]]
                                            for rid in eng.local_replica_ids}
    for workers, entries in by_worker_set(eng.planner.plan(step.call.groups)).items():
        if len(workers) > 1:
            gather_dims = {rid: step.params[entry.local[0]].dims for entry in entries for rid in entry.group}
            parts.update(_gather_bucket(eng, workers, entries, parts, gather_dims, n_leaves))
    outs: list[list[torch.Tensor]] = []
    for i, rid in enumerate(eng.local_replica_ids):
        group = next(group for group in step.call.groups if rid in group)
        device, dims = eng.devices[i], step.params[rid].dims
        outs.append([torch.cat([parts[member][leaf].to(device) for member in group], dims[leaf])
                     for leaf in range(n_leaves)])
    return outs


def _gather_bucket(eng: TorchDistEngine, workers: tuple[int, ...], entries: list[GroupPlan],
                   mine: dict[int, list[torch.Tensor]], gather_dims: dict[int, tuple],
                   n_leaves: int) -> dict[int, list[torch.Tensor]]:
    """Every member's leaves for the groups of one worker set, given this worker's members'
    leaves in ``mine``; sizes along each group's gather dims may differ."""
    per_worker = eng.replicas_per_worker
    pg = entries[0].subgroup
    # what each worker of the set contributes: its members of every group, in group order
    owned = {worker: [rid for entry in entries for rid in entry.group if rid // per_worker == worker]
             for worker in workers}
    refs = {rid: mine[entry.local[0]] for entry in entries for rid in entry.group}
    own = owned[eng.rank]
    meta_len = max(len(rids) for rids in owned.values()) * n_leaves
    meta = torch.zeros(meta_len, dtype=torch.int64)
    meta[:len(own) * n_leaves] = torch.tensor(
        [mine[rid][leaf].shape[gather_dims[rid][leaf]] for rid in own for leaf in range(n_leaves)],
        dtype=torch.int64)
    metas = gather_fixed(eng, meta.to(eng.comm_device), pg, workers).cpu().view(len(workers), -1)
    specs: dict[int, list[tuple[tuple[int, ...], torch.dtype]]] = {}
    for wi, worker in enumerate(workers):
        if worker == eng.rank:
            continue
        sizes = metas[wi].tolist()
        for j, rid in enumerate(owned[worker]):
            row = []
            for leaf in range(n_leaves):
                ref = refs[rid][leaf]
                shape = list(ref.shape)
                shape[gather_dims[rid][leaf]] = sizes[j * n_leaves + leaf]
                row.append((tuple(shape), ref.dtype))
            specs[rid] = row
    send = pack_bytes([x for rid in own for x in mine[rid]], eng.comm_device)
    lengths = {worker: byte_pack_size([spec for rid in owned[worker] for spec in specs[rid]])
               for worker in workers if worker != eng.rank}
    lengths[eng.rank] = send.numel()
    width = max(lengths.values())
    got: dict[int, list[torch.Tensor]] = {}
    if not width:
        for rid, row in specs.items():
            got[rid] = [torch.empty(shape, dtype=dtype, device=eng.comm_device) for shape, dtype in row]
        return got
    if send.numel() < width:
        send = torch.cat([send, send.new_zeros(width - send.numel())])
    recv = gather_fixed(eng, send, pg, workers).view(len(workers), width)
    for wi, worker in enumerate(workers):
        if worker == eng.rank:
            continue
        offset = 0
        for rid in owned[worker]:
            got[rid], offset = unpack_bytes(recv[wi], specs[rid], offset)
    return got


def gather_fixed(eng: TorchDistEngine, x: torch.Tensor, pg: Any, workers: Sequence[int]) -> torch.Tensor:
    """The same-sized ``x`` of every worker of ``workers``, end to end, in worker order."""
    out = torch.empty(len(workers) * x.numel(), dtype=x.dtype, device=x.device)
    chunks = list(out.chunk(len(workers))) if x.numel() else [out[:0]] * len(workers)
    eng.watchdog.wait(dist.all_gather(chunks, x, group=pg, async_op=True), workers)
    return out
