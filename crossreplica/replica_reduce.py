"""Replica-context reductions through a CrossDeviceOps (TF's ``CrossDeviceOps._all_reduce``).

``ReplicaContext.all_reduce`` and CrossShardOptimizer's gradient packs reach a
strategy's cross-device ops here: the local replicas meet in ``merge_call``
(bounded by ``CommunicationOptions.timeout_seconds`` when given), the ops'
``batch_reduce`` runs once per worker on their values, with each value itself as
its destinations, and every replica gets its own copy of the result. Across
processes the ops' reducer (``strategy.extended``) reduces across workers, under
the same timeout.

The exact default :class:`~crossreplica.cross_device_ops.AllReduceCrossDeviceOps`
skips the meeting and runs one engine all-reduce instead: both reduce in replica
order, so the numbers are the same (docs/collectives.md says which call takes
which path).

Differentiable for SUM and MEAN, as TF's ``ReplicaContext.all_reduce`` is: the
backward all-reduces the cotangents the same way, through the same ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import context
from .collectives.leaves import tensor_leaves
from .context import ReplicaContext, StrategyLike
from .errors import CollectiveMismatchError
from .reduce_op import ReduceOp, check_dtype
from .values import PerReplica

if TYPE_CHECKING:
    from .cross_device_ops import CommunicationOptions, CrossDeviceOps

__all__ = ["all_reduce_in_replica", "merged_all_reduce"]


class _ReplicaTensors:
    """One replica's tensors: an object per replica, so merge_call's regroup always
    wraps them (tensors that happen to be the same object would stay unwrapped)."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors


def _check_agree(parts: list[_ReplicaTensors], names: tuple[int, ...]) -> None:
    sig = [[(tuple(t.shape), t.dtype) for t in p.tensors] for p in parts]
    if any(s != sig[0] for s in sig[1:]):
        lines = "\n".join(f"  replica {r}: {[(list(s), str(d)) for s, d in one]}" for r, one in zip(names, sig))
        raise CollectiveMismatchError(
            f"ReplicaContext.all_reduce through the strategy's cross_device_ops: the replicas passed "
            f"tensors of different shapes or dtypes:\n{lines}")


def merged_all_reduce(cdo: CrossDeviceOps, rctx: ReplicaContext, op: ReduceOp, tensors: list[torch.Tensor],
                      options: CommunicationOptions | None) -> list[torch.Tensor]:
    """Every replica's ``tensors`` reduced by ``cdo.batch_reduce`` in one merge_call;
    returns this replica's copies of the results (fresh tensors on its device)."""
    ext = rctx.strategy.extended
    timeout = options.timeout_seconds if options is not None else None

    def merge_fn(strategy: StrategyLike, mine: Any) -> PerReplica:
        parts = list(strategy.experimental_local_results(mine))
        _check_agree(parts, ext.local_replica_ids)
        values = [PerReplica([p.tensors[t] for p in parts]) for t in range(len(parts[0].tensors))]
        with ext.collective_timeout(timeout):
            reduced = cdo.batch_reduce(op, [(v, v) for v in values], options, reducer=ext)
        return PerReplica([[m.values[i] for m in reduced] for i in range(len(parts))])

    return list(ext.merge_call(rctx, merge_fn, (_ReplicaTensors(list(tensors)),), {}, timeout=timeout))


class _MergedAllReduce(torch.autograd.Function):
    """:func:`merged_all_reduce` with its derivative: SUM and MEAN are their own transpose."""

    @staticmethod
    def forward(cdo, rctx, op, options, *xs):  # type: ignore[override]
        return tuple(merged_all_reduce(cdo, rctx, op, list(xs), options))

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        ctx.cdo, ctx.rctx, ctx.op, ctx.options = inputs[:4]
        ctx.mark_non_differentiable(*[o for o in output if not (o.dtype.is_floating_point or o.dtype.is_complex)])

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if ctx.op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise RuntimeError(
                f"ReplicaContext.all_reduce with op={ctx.op} through a custom cross_device_ops is not "
                f"differentiable; use op='sum' or 'mean', or cr.all_reduce (the engine's collective)")
        return (None, None, None, None, *_reduce(ctx.cdo, ctx.rctx, ctx.op, list(grads), ctx.options))


def _reduce(cdo: CrossDeviceOps, rctx: ReplicaContext, op: ReduceOp, tensors: list[torch.Tensor],
            options: CommunicationOptions | None) -> list[torch.Tensor]:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_MergedAllReduce.apply(cdo, rctx, op, options, *tensors))
    return merged_all_reduce(cdo, rctx, op, tensors, options)


def all_reduce_in_replica(cdo: CrossDeviceOps, op: ReduceOp, value: Any, options: CommunicationOptions | None) -> Any:
    """``value`` (a tensor, a number or a nest of them) reduced over every replica in
    sync through ``cdo``; called in a replica context by every replica."""
    rctx = context.require_replica_context("CrossDeviceOps.replica_all_reduce")
    leaves = tensor_leaves(value, "ReplicaContext.all_reduce", rctx)
    for t in leaves.tensors:
        check_dtype(op, t.dtype, "value")
    if not leaves.tensors:
        return value
    return leaves.repack(_reduce(cdo, rctx, op, leaves.tensors, options))
