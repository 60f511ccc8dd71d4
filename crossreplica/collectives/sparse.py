"""``all_reduce`` of sparse COO tensors, by gather (never densified).

Each member's coalesced ``(indices, values)`` travel in one all_gather (sizes
may differ between members), and every member reduces the parts in ascending
replica id with the shared arithmetic of ``engines/sparse.py``: the result is
coalesced, bitwise the same on every member, and bitwise the dense all_reduce
of the dense views, for every op. Traffic and memory grow with the number of
stored entries, not with the dense shape (a 1e6 x 4 embedding gradient with a
few hundred rows moves a few hundred rows).
"""

from __future__ import annotations

import torch

from ..context import ReplicaContext
from ..engines.base import AllGatherParams, Kind
from ..engines.sparse import reduce_gathered, sparse_leaves
from ..groups import Groups, group_of
from ..reduce_op import ReduceOp
from .autodiff import raw

__all__ = ["all_reduce_sparse", "check_sparse"]


def check_sparse(t: torch.Tensor, api: str, argname: str = "x") -> None:
    """Rejects, before any replica waits, what the sparse reduction cannot do."""
    if t.layout is not torch.sparse_coo:
        raise TypeError(
            f"{api}: {argname} has layout {t.layout}; only strided (dense) and torch.sparse_coo "
            f"tensors can be reduced (convert with x.to_sparse_coo() or x.to_dense())")
    if t.requires_grad and torch.is_grad_enabled():
        raise TypeError(
            f"{api}: {argname} is a sparse tensor that requires grad, but the sparse reduction is not "
            f"differentiable; reduce x.detach() (or a dense tensor)")


def all_reduce_sparse(rctx: ReplicaContext, op: ReduceOp, groups: Groups,
                      tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every sparse COO tensor of ``tensors`` reduced over this replica's group (one gather)."""
    leaves = sparse_leaves(tensors, rctx.device)
    outs = raw(rctx, Kind.ALL_GATHER, groups, AllGatherParams((0,) * len(leaves)), leaves)
    rid = rctx.replica_id_in_sync_group
    return reduce_gathered(op, outs, group_of(groups, rid), rid, tensors)
