"""The fixed-tree sum of every replica's partial sums (:mod:`crossreplica.tree_sum`).

Replica ``r`` of ``R`` holds the contiguous summands ``[r * k, (r + 1) * k)``
(``k = total / R``), already reduced to their canonical nodes. One
``all_gather`` brings every replica's nodes to every replica, which then adds
them by the global tree: the same additions in the same order as one device
holding all ``total`` summands, so the bits do not depend on ``R``. Every
replica computes the (identical) result itself, which spares a broadcast.

The tree is elementwise, so for large buffers the work is sharded instead: an
``all_to_all`` gives each replica its slice of every replica's nodes, it adds its
slice by the tree, and an ``all_gather`` joins the slices (about twice the nodes'
bytes per replica, as a reduce-scatter and all-gather move, instead of ``R - 1``
times). Both forms give the same bits; it is meant for the layout-invariant mode's
one reduction per step.
"""

from __future__ import annotations

import torch

from ..context import require_replica_context
from ..tree_sum import Node, tree_combine, tree_nodes
from .api import all_gather, all_to_all

__all__ = ["SHARD_NUMEL", "replica_nodes", "tree_all_sum"]

#: From this many elements per replica on, the sum is sharded (an all_to_all, each replica adds its
#: slice of every replica's nodes, an all_gather of the slices) instead of a gather of every node.
SHARD_NUMEL = 16 * 1024
#: Forces one form (True: sharded, False: gathered) for benchmarks; None chooses by size.
SHARDED: bool | None = None


def replica_nodes(replica: int, num_replicas: int, total: int) -> list[Node]:
    """The canonical nodes replica ``replica`` holds when ``total`` summands are dealt out
    contiguously to ``num_replicas`` replicas."""
    k = total // num_replicas
    return tree_nodes(replica * k, (replica + 1) * k)


def tree_all_sum(nodes: list[tuple[Node, torch.Tensor]], total: int) -> torch.Tensor:
    """The tree sum over ``total`` summands of every replica's ``nodes`` (this replica's
    canonical nodes, in index order, tensors of one shape, dtype and device), on every
    replica; called by every replica in sync, as any collective."""
    rctx = require_replica_context("the layout-invariant tree sum")
    n, rid = rctx.num_replicas_in_sync, rctx.replica_id_in_sync_group
    layout = [replica_nodes(r, n, total) for r in range(n)]
    if [node for node, _ in nodes] != layout[rid]:
        raise ValueError(f"replica {rid} holds the partial sums {[node for node, _ in nodes]} of {total} summands; "
                         f"the tree sum expects {layout[rid]}")
    if n == 1:
        return tree_combine(dict(nodes), total)
    like = nodes[0][1]
    slots = max(len(nodes_r) for nodes_r in layout)
    sharded = SHARDED if SHARDED is not None else like.numel() >= SHARD_NUMEL * n
    if not sharded:
        gathered = all_gather(_stacked(nodes, slots, like.numel()), 0, tiled=False)  # [n, slots, numel]
        found = {node: gathered[r, j] for r in range(n) for j, node in enumerate(layout[r])}
        return tree_combine(found, total).view(like.shape)
    # Each replica sums a slice of the elements (the tree is elementwise), then the slices meet.
    chunk = -(-like.numel() // n)
    stacked = _stacked(nodes, slots, chunk * n)  # [slots, n * chunk]
    mine = all_to_all(stacked, 1, 0)  # [n * slots, chunk]: every replica's nodes, this replica's slice
    found = {node: mine[r * slots + j] for r in range(n) for j, node in enumerate(layout[r])}
    whole = all_gather(tree_combine(found, total), 0)  # [n * chunk]
    return whole[:like.numel()].view(like.shape)


def _stacked(nodes: list[tuple[Node, torch.Tensor]], slots: int, width: int) -> torch.Tensor:
    """The nodes as rows of one ``[slots, width]`` buffer (zero padded)."""
    like = nodes[0][1]
    if len(nodes) == slots and width == like.numel() and slots == 1:
        return like.reshape(1, -1)
    out = torch.zeros((slots, width), dtype=like.dtype, device=like.device)
    for j, (_, value) in enumerate(nodes):
        out[j, :value.numel()].copy_(value.reshape(-1))
    return out
