"""The fixed-tree sum of every replica's partial sums (:mod:`crossreplica.tree_sum`).

Layer: collectives (layer 3). Replica ``r`` of ``R`` holds the contiguous summands
``[r * k, (r + 1) * k)`` (``k = total / R``), already reduced to their canonical
nodes. One ``all_gather`` brings every replica's nodes to every replica, which
then adds them by the global tree: the same additions in the same order as one
device holding all ``total`` summands, so the bits do not depend on ``R``. Every
replica computes the (identical) result itself, which spares a broadcast.

A ring all-reduce moves ``2 (R - 1) / R`` of a buffer per replica; this gather
moves ``R - 1`` times the nodes, which is what keeps the order fixed. It is meant
for the layout-invariant mode's one reduction per step.
"""

from __future__ import annotations

import torch

from ..context import require_replica_context
from ..tree_sum import Node, tree_combine, tree_nodes
from .api import all_gather

__all__ = ["replica_nodes", "tree_all_sum"]


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
    slots = max(len(nodes_r) for nodes_r in layout)
    like = nodes[0][1]
    stacked = torch.zeros((slots, *like.shape), dtype=like.dtype, device=like.device)
    for j, (_, value) in enumerate(nodes):
        stacked[j].copy_(value)
    gathered = all_gather(stacked, 0, tiled=False)  # [n, slots, ...]
    found = {node: gathered[r, j] for r in range(n) for j, node in enumerate(layout[r])}
    return tree_combine(found, total)
