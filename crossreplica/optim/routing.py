"""Where CrossShardOptimizer's gradient reductions go: the engine, or the strategy's CrossDeviceOps.

The fused packs (``optimizer.py``) and the overlapped buckets (``overlap.py``)
are in-place engine all-reduces of flat buffers. With the exact default
``AllReduceCrossDeviceOps`` and no ``timeout_seconds`` that is what the ops
would compute anyway (both reduce in replica order), so the optimizer keeps that
fast path. With any other ops (``ReductionToOneDevice(accumulation_fn=f)``, a
subclass) or a timeout, the overlap hooks leave the gradients alone and
``step()`` hands the same packs to ``cross_device_ops.replica_all_reduce`` (one
merge_call), copying the results back in place. A ``group_assignment`` other
than every replica is the TPU-style ``cross_replica_sum``: always the engine.

With ``compression``, the gradient buffers cross the wire in the narrow dtype
either way: on the engine through ``wire.execute_compressed``, through the ops
with ``CommunicationOptions(compression=...)`` (the loss and weight buffers in a
reduction of their own, uncompressed).
"""

from __future__ import annotations

from typing import cast

import torch

from ..torch_private import foreach_copy_, sparse_indices, sparse_values
from ..collectives import all_reduce
from ..context import ReplicaContext
from ..engines.base import AllReduceParams, Call, Kind
from ..engines.wire import execute_compressed, execute_on_wire
from ..groups import Groups
from ..cross_device_ops import CommunicationOptions
from ..reduce_op import ReduceOp

__all__ = ["all_reduce_buffers", "on_engine", "reduce_sparse_grads"]


def on_engine(rctx: ReplicaContext, groups: Groups, options: CommunicationOptions | None) -> bool:
    """Whether the gradients of this replica's group go straight to the engine."""
    if len(groups) > 1:
        return True
    ext = rctx.strategy.extended
    cdo = getattr(ext, "cross_device_ops", None)
    return cdo is None or bool(cdo.replica_reductions_on_engine(ext.resolve_options(options)))


def all_reduce_buffers(rctx: ReplicaContext, groups: Groups, op: ReduceOp, buffers: list[torch.Tensor],
                       options: CommunicationOptions | None, compression: torch.dtype | None = None,
                       compressed: int = 0) -> list[torch.Tensor]:
    """Reduces ``buffers`` (this replica's own) in place over its group; returns them. The
    first ``compressed`` buffers (the gradients) cross the wire in ``compression`` (if not None)."""
    if compression is None:
        compressed = 0
    if on_engine(rctx, groups, options):
        call = Call.of(Kind.ALL_REDUCE, groups, AllReduceParams(op, inplace=True), buffers)
        if compressed:
            return execute_compressed(rctx.engine, rctx.replica_id_in_sync_group, call, buffers,
                                      cast("torch.dtype", compression), compressed)
        return execute_on_wire(rctx.engine, rctx.replica_id_in_sync_group, call, buffers)
    ext = rctx.strategy.extended
    resolved = ext.resolve_options(options)
    if compressed or getattr(resolved, "compression", None) is not None:
        # The optimizer's own compression, for its gradients only (not a strategy-wide one's).
        plain = (resolved or CommunicationOptions()).with_compression(None)
        parts = [(buffers[:compressed], plain.with_compression(compression)), (buffers[compressed:], plain)]
    else:
        parts = [(buffers, resolved)]
    for part, part_options in parts:
        if part:
            outs = ext.cross_device_ops.replica_all_reduce(op, part, part_options)
            with torch.no_grad():
                foreach_copy_(part, outs)
    return buffers


def reduce_sparse_grads(groups: Groups, params: list[torch.Tensor], w: float | None,
                        divisor: float | None) -> None:
    """Sparse gradients: summed by cr.all_reduce (one gather, coalesced, in replica order,
    bitwise the dense sum of the dense views), then divided as the dense packs are."""
    grads = []
    for p in params:
        g = cast(torch.Tensor, p.grad).detach()  # _collect chose params whose grad is sparse
        if w is not None:
            g = g.coalesce()
            values = sparse_values(g) * w if w > 0 else torch.zeros_like(sparse_values(g))  # 0 * nan is nan
            g = torch.sparse_coo_tensor(sparse_indices(g), values, g.shape, is_coalesced=True, check_invariants=False)
        grads.append(g)
    for p, g in zip(params, all_reduce(grads, ReduceOp.SUM, groups)):
        p.grad = g / divisor if divisor is not None else g
