"""Point-to-point messages, all_to_all and permute.

Each exchange sends one byte pack per peer worker through
``batch_isend_irecv``; receivers know the sizes from their own shapes (shapes
agree within a group), so nothing but the payload travels. Invariant: both
sides of a pair of workers list their messages in the same order (senders and
receivers walk groups and pairs in the same canonical order), and on gloo a
transfer starts only once the peer has arrived (through the store), so a
missing peer is a bounded, abort-aware wait rather than a lost receive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError
from ...packing import byte_pack_size, pack_bytes, unpack_bytes
from ..base import scatter_slice
from .gather import gather_fixed
from .plan import Step

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["all_to_all", "exchange", "permute"]

Spec = tuple[tuple[int, ...], torch.dtype]


def exchange(eng: TorchDistEngine, sends: dict[int, list[torch.Tensor]],
             recvs: dict[int, list[Spec]]) -> dict[int, list[torch.Tensor]]:
    """Sends one packed message per peer worker and receives one from each expected peer."""
    ops, inbox = [], {}
    for worker in sorted(set(sends) | set(recvs)):
        if worker in recvs:
            nbytes = byte_pack_size(recvs[worker])
            buf = torch.empty(nbytes, dtype=torch.uint8, device=eng.comm_device)
            inbox[worker] = buf
            if nbytes:
                ops.append(dist.P2POp(dist.irecv, buf, worker))
        if worker in sends:
            buf = pack_bytes(sends[worker], eng.comm_device)
            if buf.numel():
                ops.append(dist.P2POp(dist.isend, buf, worker))
    if ops:
        peers = tuple(sorted(set(sends) | set(recvs) | {eng.rank}))
        works = dist.batch_isend_irecv(ops)
        # On gloo: the peers' arrival through the store, then the works on the transfer thread
        # while this one watches the heartbeats (Watchdog.transfers).
        wait = eng.watchdog.transfers([worker for worker in peers if worker != eng.rank])
        wait.expect(works)
        for work in works:
            wait(work)
    return {worker: unpack_bytes(inbox[worker], recvs[worker])[0] for worker in recvs}


def _chunk(x: torch.Tensor, split_dim: int, position: int, k: int, splits: Sequence[int] | None) -> torch.Tensor:
    """The chunk of ``x`` along ``split_dim`` for the member at ``position`` of ``k``:
    equal chunks, or the sender's own split sizes."""
    start, length = scatter_slice(x.shape[split_dim], position, k, splits)
    return x.narrow(split_dim, start, length)


def _check_split_sizes(eng: TorchDistEngine, step: Step) -> None:
    """Every worker learns every replica's split sizes (one small all-gather), so sizes that
    do not match (member i sends j other than j expects from i) are a CollectiveMismatchError
    on every worker, never a corrupt exchange. Every all_to_all pays it: whether a peer
    passes split sizes is not known locally."""
    groups = step.call.groups
    k = len(groups[0])
    rows = []
    for i, rid in enumerate(eng.local_replica_ids):
        p = step.params[rid]
        split_dims, in_splits, out_splits = p.split_dims, p.input_splits, p.output_splits
        extent = step.payloads[i][0].shape[split_dims[0]] if step.payloads[i] else 0
        even = [extent // k] * k
        rows.extend([*(in_splits or even), *(out_splits or even)])
    meta = torch.tensor(rows, dtype=torch.int64, device=eng.comm_device)
    sizes = gather_fixed(eng, meta, None, tuple(range(eng.world_size))).cpu().view(-1, 2, k).tolist()
    for group in groups:
        for i, sender in enumerate(group):
            for j, receiver in enumerate(group):
                if sizes[sender][0][j] != sizes[receiver][1][i]:
                    lines = "\n".join(f"  replica {r}: input_split_sizes={sizes[r][0]}, "
                                      f"output_split_sizes={sizes[r][1]}" for r in group)
                    raise CollectiveMismatchError(
                        f"all_to_all split sizes do not match: replica {sender} sends replica {receiver} "
                        f"{sizes[sender][0][j]} rows, which expects {sizes[receiver][1][i]} (each member's "
                        f"output_split_sizes[i] must equal member i's input_split_sizes for it):\n{lines}")


def all_to_all(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    _check_split_sizes(eng, step)
    index, per_worker, payloads = eng.local_index, eng.replicas_per_worker, step.payloads
    n_leaves = len(payloads[0])
    leaves = range(n_leaves)
    sends: dict[int, list[torch.Tensor]] = {}
    recvs: dict[int, list[Spec]] = {}
    order: dict[int, list[tuple[int, int]]] = {}  # peer worker -> (sender, receiver) pairs
    for entry in eng.planner.plan(step.call.groups):
        if not entry.local:
            continue
        group, k = entry.group, len(entry.group)
        for sender in group:
            for receiver in group:
                sender_worker, receiver_worker = sender // per_worker, receiver // per_worker
                if sender_worker == eng.rank and receiver_worker != eng.rank:
                    split_dims, in_splits = step.params[sender].split_dims, step.params[sender].input_splits
                    sends.setdefault(receiver_worker, []).extend(
                        _chunk(payloads[index[sender]][leaf], split_dims[leaf], group.index(receiver), k, in_splits)
                        for leaf in leaves)
                elif receiver_worker == eng.rank and sender_worker != eng.rank:
                    # what arrives: the receiver's own shape, cut by its output split sizes
                    mine = payloads[index[receiver]]
                    split_dims, out_splits = step.params[receiver].split_dims, step.params[receiver].output_splits
                    recvs.setdefault(sender_worker, []).extend(
                        (_incoming(mine[leaf].shape, split_dims[leaf], group.index(sender), k, out_splits),
                         mine[leaf].dtype)
                        for leaf in leaves)
                    order.setdefault(sender_worker, []).append((sender, receiver))
    inbox = exchange(eng, sends, recvs)
    received: dict[tuple[int, int], list[torch.Tensor]] = {}
    for worker, pairs in order.items():
        for n, pair in enumerate(pairs):
            received[pair] = inbox[worker][n * n_leaves:(n + 1) * n_leaves]
    outs = []
    for i, receiver in enumerate(eng.local_replica_ids):
        group = next(group for group in step.call.groups if receiver in group)
        k, device = len(group), eng.devices[i]
        concat_dims = step.params[receiver].concat_dims
        row = []
        for leaf in leaves:
            pieces = []
            for sender in group:
                if sender // per_worker == eng.rank:
                    split_dims, in_splits = step.params[sender].split_dims, step.params[sender].input_splits
                    pieces.append(_chunk(payloads[index[sender]][leaf], split_dims[leaf], group.index(receiver),
                                         k, in_splits).to(device))
                else:
                    pieces.append(received[(sender, receiver)][leaf].to(device))
            row.append(torch.cat(pieces, concat_dims[leaf]))
        outs.append(row)
    return outs


def _incoming(shape: Sequence[int], dim: int, position: int, k: int,
              out_splits: Sequence[int] | None) -> tuple[int, ...]:
    """The shape of what a receiver of ``shape`` gets from the member at ``position``: equal
    chunks of its own extent, or its own output split sizes (shapes agree off ``dim``)."""
    out = list(shape)
    out[dim] = shape[dim] // k if out_splits is None else out_splits[position]
    return tuple(out)


def permute(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    pairs: Sequence[tuple[int, int]] = step.call.params.pairs
    index, per_worker, payloads = eng.local_index, eng.replicas_per_worker, step.payloads
    ref = payloads[0]
    specs = [(tuple(x.shape), x.dtype) for x in ref]
    sends: dict[int, list[torch.Tensor]] = {}
    recvs: dict[int, list[Spec]] = {}
    order: dict[int, list[int]] = {}  # peer worker -> the local targets of its messages
    for source, target in pairs:
        source_worker, target_worker = source // per_worker, target // per_worker
        if source_worker == eng.rank and target_worker != eng.rank:
            sends.setdefault(target_worker, []).extend(payloads[index[source]])
        elif target_worker == eng.rank and source_worker != eng.rank:
            recvs.setdefault(source_worker, []).extend(specs)
            order.setdefault(source_worker, []).append(target)
    inbox = exchange(eng, sends, recvs)
    outs: list[list[torch.Tensor]] = [[torch.zeros_like(x) for x in p] for p in payloads]
    n_leaves = len(ref)
    for worker, targets in order.items():
        for n, target in enumerate(targets):
            i = index[target]
            outs[i] = [v.to(eng.devices[i], copy=True) for v in inbox[worker][n * n_leaves:(n + 1) * n_leaves]]
    for source, target in pairs:
        if source // per_worker == eng.rank and target // per_worker == eng.rank:
            i = index[target]
            outs[i] = [x.to(eng.devices[i], copy=True) for x in payloads[index[source]]]
    return outs
