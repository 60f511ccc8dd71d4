"""Cross-replica collectives, called inside a replica function.

Nests in, nests out: the tensors of a nest travel in one engine call (one
rendezvous), ``None`` leaves pass through. Every collective is validated here,
locally, so a bad argument is a clear exception before any replica waits; the
engine then checks that the replicas agree with each other.

Each collective is differentiable through :class:`_Collective`, whose backward
runs the dual collective, stated beside the forward in :func:`_dual`:
all_reduce SUM/MEAN <-> itself, all_gather <-> reduce_scatter, all_to_all <->
all_to_all with split and concat swapped, broadcast <-> sum to the source,
permute <-> the inverse permutation. Backward must run inside the replica
function (as ``loss.backward()`` in a training step does).
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch.autograd.function import once_differentiable

from . import nest
from .context import ReplicaContext, get_replica_context, require_replica_context
from .engines.base import Call, Kind
from .errors import summarize
from .groups import Groups, Mesh, contiguous_groups, group_of, resolve_groups
from .reduce_op import ReduceOp, check_dtype

__all__ = [
    "all_reduce",
    "cross_replica_sum",
    "cross_replica_mean",
    "cross_replica_average",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "collective_permute",
    "replica_id",
    "num_replicas",
]


# --------------------------------------------------------------------------- plumbing

_SINGLE = nest.flatten(0)[1]  # the spec of a bare leaf


def _tensor_leaves(x: Any, api: str) -> tuple[list, Any, list[int], list[torch.Tensor]]:
    if isinstance(x, torch.Tensor):  # the common case, without walking
        return [x], _SINGLE, [0], [x]
    leaves, spec = nest.flatten(x)
    where: list[int] = []
    tensors: list[torch.Tensor] = []
    for p, leaf in enumerate(leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{api}: every leaf of x must be a torch.Tensor (or None); leaf {p} is "
                f"{type(leaf).__name__}: {summarize(leaf)}")
        where.append(p)
        tensors.append(leaf)
    return leaves, spec, where, tensors


def _repack(leaves: list, spec: Any, where: list[int], outs: Sequence[torch.Tensor]) -> Any:
    leaves = list(leaves)
    for p, o in zip(where, outs):
        leaves[p] = o
    return nest.unflatten(spec, leaves)


def _raw(rctx: ReplicaContext, kind: Kind, groups: Groups, params: tuple,
         tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # The context of the executing thread, not ``rctx``: a backward pass may run
    # in a later run with the forward's context (fine), while a replica thread
    # abandoned by a failed run still holds its old one (rejected). Autograd's
    # device threads hold none.
    current = get_replica_context()
    if current is not None:
        current.check_current("cr.", kind)
        device = current.device
        for t in tensors:
            if t.device != device:
                _wrong_device(current, kind, tensors, device)
    call = Call.of(kind, groups, params, tensors)
    return rctx.engine.execute(rctx.replica_id_in_sync_group, call, tensors)


def _wrong_device(rctx: ReplicaContext, kind: Kind, tensors: list[torch.Tensor], device: torch.device) -> None:
    """Raises in the replica that passed a tensor on another device than its own."""
    bad = next(i for i, t in enumerate(tensors) if t.device != device)
    raise ValueError(
        f"cr.{kind}: tensor {bad} (shape {list(tensors[bad].shape)}) is on {tensors[bad].device}, but "
        f"replica {rctx.replica_id_in_sync_group} runs on {device}; move it there first, e.g. "
        f"x.to(cr.get_replica_context().device)")


def _execute(rctx: ReplicaContext, kind: Kind, groups: Groups, params: tuple,
             tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if torch.is_grad_enabled() and _any_requires_grad(tensors):
        return list(_Collective.apply(rctx, kind, groups, params, *tensors))
    return _raw(rctx, kind, groups, params, tensors)


def _any_requires_grad(tensors: list[torch.Tensor]) -> bool:
    for t in tensors:
        if t.requires_grad:
            return True
    return False


class _Collective(torch.autograd.Function):
    """A collective whose backward is its dual collective."""

    @staticmethod
    def forward(ctx, rctx, kind, groups, params, *xs):  # type: ignore[override]
        outs = _raw(rctx, kind, groups, params, list(xs))
        ctx.rctx, ctx.kind, ctx.groups, ctx.params = rctx, kind, groups, params
        if kind is Kind.ALL_REDUCE and params[0] in (ReduceOp.MAX, ReduceOp.MIN):
            ctx.save_for_backward(*xs, *outs)
        for o, x in zip(outs, xs):
            if not (o.dtype.is_floating_point or o.dtype.is_complex):
                ctx.mark_non_differentiable(o)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, None, None, *_dual(ctx, list(grads)))


def _dual(ctx: Any, grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Input gradients of a collective: the dual collective on the output gradients."""
    rctx, kind, groups, params = ctx.rctx, ctx.kind, ctx.groups, ctx.params
    rid = rctx.replica_id_in_sync_group
    if kind is Kind.ALL_REDUCE:
        op = params[0]
        if op in (ReduceOp.SUM, ReduceOp.MEAN):
            return _raw(rctx, kind, groups, (op,), grads)
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            saved = ctx.saved_tensors
            xs, outs = saved[:len(grads)], saved[len(grads):]
            masks = [(x == o).to(g.dtype) for x, o, g in zip(xs, outs, grads)]
            summed = _raw(rctx, kind, groups, (ReduceOp.SUM,), grads + masks)
            total, count = summed[:len(grads)], summed[len(grads):]
            return [t * m / c for t, m, c in zip(total, masks, count)]
        raise RuntimeError(
            f"the gradient of all_reduce with op={op} is not implemented; use op='sum', 'mean', "
            f"'max' or 'min' for differentiable reductions")
    if kind is Kind.ALL_GATHER:
        dims, sizes = params[0], ctx.sizes
        user = grads[:-1]  # the last leaf carried the sizes
        out = _raw(rctx, Kind.REDUCE_SCATTER, groups, (ReduceOp.SUM, dims[:-1], sizes), user)
        return [*out, None]
    if kind is Kind.REDUCE_SCATTER:
        op, dims, _ = params
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise RuntimeError(
                f"the gradient of reduce_scatter with op={op} is not implemented; use op='sum' or 'mean'")
        out = _raw(rctx, Kind.ALL_GATHER, groups, (dims,), grads)
        if op is ReduceOp.MEAN:
            k = len(group_of(groups, rid))
            out = [o / k for o in out]
        return out
    if kind is Kind.ALL_TO_ALL:
        split_dims, concat_dims = params
        return _raw(rctx, Kind.ALL_TO_ALL, groups, (concat_dims, split_dims), grads)
    if kind is Kind.BROADCAST:
        group = group_of(groups, rid)
        total = _raw(rctx, Kind.ALL_REDUCE, groups, (ReduceOp.SUM,), grads)
        if group.index(rid) == params[0]:
            return total
        return [torch.zeros_like(t) for t in total]
    if kind is Kind.PERMUTE:
        inverse = tuple(sorted((t, s) for s, t in params[0]))
        return _raw(rctx, Kind.PERMUTE, groups, (inverse,), grads)
    raise RuntimeError(f"no gradient for collective '{kind}'")


def _groups(rctx: ReplicaContext, group_assignment: Any, mesh: Mesh | None = None,
            axes: Any = None) -> Groups:
    return resolve_groups(rctx.num_replicas_in_sync, group_assignment, mesh, axes)


def _dim(value: Any, t: torch.Tensor, argname: str, api: str) -> int:
    try:
        d = operator.index(value)
    except TypeError:
        raise TypeError(f"{api}: {argname} must be an int; got {summarize(value)}") from None
    nd = max(t.dim(), 1)
    if not -nd <= d < nd:
        raise ValueError(
            f"{api}: {argname}={value} is out of range for a tensor of shape {list(t.shape)} "
            f"(expected {-nd} <= {argname} < {nd})")
    return d % nd


# --------------------------------------------------------------------------- public API

def all_reduce(x: Any, op: ReduceOp | str = "sum", group_assignment: Any = None, *,
               mesh: Mesh | None = None, axes: Any = None) -> Any:
    """Reduces ``x`` (a tensor or nest) over each group of replicas.

    Every replica of a group gets bitwise-identical results. ``mesh`` and
    ``axes`` reduce over the named mesh axes instead of a group assignment.
    """
    rctx = require_replica_context("cr.all_reduce")
    op = ReduceOp.from_any(op)
    groups = _groups(rctx, group_assignment, mesh, axes)
    leaves, spec, where, tensors = _tensor_leaves(x, "cr.all_reduce")
    for t in tensors:
        check_dtype(op, t.dtype)
    return _repack(leaves, spec, where, _execute(rctx, Kind.ALL_REDUCE, groups, (op,), tensors))


def cross_replica_sum(x: Any, group_assignment: Any = None) -> Any:
    """Sums ``x`` over each group of replicas (TPU ``cross_replica_sum``)."""
    return all_reduce(x, ReduceOp.SUM, group_assignment)


def cross_replica_mean(x: Any, group_assignment: Any = None) -> Any:
    """Averages ``x`` over each group; MEAN divides by the group's size."""
    return all_reduce(x, ReduceOp.MEAN, group_assignment)


def cross_replica_average(x: Any, num_shards_per_group: int) -> Any:
    """Averages over groups of ``num_shards_per_group`` consecutive replicas.

    The reduction distributed batch norm uses; the group size must divide the
    number of replicas.
    """
    rctx = require_replica_context("cr.cross_replica_average")
    groups = contiguous_groups(rctx.num_replicas_in_sync, num_shards_per_group)
    return all_reduce(x, ReduceOp.MEAN, groups)


def all_gather(x: Any, dim: int = 0, group_assignment: Any = None) -> Any:
    """Concatenates the group members' ``x`` along ``dim``, in group order.

    Sizes along ``dim`` may differ between replicas (an uneven last batch);
    every other dimension must agree. 0-d tensors are stacked into a vector.
    """
    rctx = require_replica_context("cr.all_gather")
    groups = _groups(rctx, group_assignment)
    leaves, spec, where, tensors = _tensor_leaves(x, "cr.all_gather")
    dims = tuple(_dim(dim, t, "dim", "cr.all_gather") for t in tensors)
    tensors = [t.unsqueeze(0) if t.dim() == 0 else t for t in tensors]
    # The sizes along dim travel as one more leaf, so backward can scatter uneven parts.
    sizes = torch.tensor([t.shape[d] for t, d in zip(tensors, dims)], dtype=torch.int64)
    outs = _execute_gather(rctx, groups, dims + (0,), tensors + [sizes])
    return _repack(leaves, spec, where, outs[:-1])


def _execute_gather(rctx: ReplicaContext, groups: Groups, dims: tuple,
                    tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if torch.is_grad_enabled() and _any_requires_grad(tensors):
        return list(_Gather.apply(rctx, Kind.ALL_GATHER, groups, (dims,), *tensors))
    return _raw(rctx, Kind.ALL_GATHER, groups, (dims,), tensors)


class _Gather(_Collective):
    @staticmethod
    def forward(ctx, rctx, kind, groups, params, *xs):  # type: ignore[override]
        outs = _Collective.forward(ctx, rctx, kind, groups, params, *xs)
        k = len(group_of(groups, rctx.replica_id_in_sync_group))
        # outs[-1] holds each member's sizes of the user leaves only (the sizes
        # leaf itself has none): one row per user leaf, one column per member.
        per_leaf = outs[-1].view(k, -1).t().tolist()
        ctx.sizes = tuple(tuple(s) for s in per_leaf)
        return outs


def reduce_scatter(x: Any, op: ReduceOp | str = "sum", dim: int = 0, group_assignment: Any = None) -> Any:
    """Reduces ``x`` over each group and gives the member at position ``j`` the
    ``j``-th of ``group_size`` equal chunks along ``dim``."""
    rctx = require_replica_context("cr.reduce_scatter")
    op = ReduceOp.from_any(op)
    groups = _groups(rctx, group_assignment)
    k = len(group_of(groups, rctx.replica_id_in_sync_group))
    leaves, spec, where, tensors = _tensor_leaves(x, "cr.reduce_scatter")
    dims = []
    for t in tensors:
        check_dtype(op, t.dtype)
        if t.dim() == 0:
            raise ValueError("cr.reduce_scatter needs tensors with at least one dimension; got a 0-d tensor")
        d = _dim(dim, t, "dim", "cr.reduce_scatter")
        if t.shape[d] % k:
            raise ValueError(
                f"cr.reduce_scatter: x.shape[{d}]={t.shape[d]} (shape {list(t.shape)}) must be divisible "
                f"by the group size {k}")
        dims.append(d)
    outs = _execute(rctx, Kind.REDUCE_SCATTER, groups, (op, tuple(dims), None), tensors)
    return _repack(leaves, spec, where, outs)


def all_to_all(x: Any, split_dim: int, concat_dim: int, group_assignment: Any = None) -> Any:
    """Splits ``x`` into ``group_size`` chunks along ``split_dim``, sends chunk ``j``
    to the member at position ``j``, and concatenates what arrives along ``concat_dim``."""
    rctx = require_replica_context("cr.all_to_all")
    groups = _groups(rctx, group_assignment)
    k = len(group_of(groups, rctx.replica_id_in_sync_group))
    leaves, spec, where, tensors = _tensor_leaves(x, "cr.all_to_all")
    sds, cds = [], []
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("cr.all_to_all needs tensors with at least one dimension; got a 0-d tensor")
        sd = _dim(split_dim, t, "split_dim", "cr.all_to_all")
        cd = _dim(concat_dim, t, "concat_dim", "cr.all_to_all")
        if t.shape[sd] % k:
            raise ValueError(
                f"cr.all_to_all: x.shape[{sd}]={t.shape[sd]} (shape {list(t.shape)}) must be divisible "
                f"by the group size {k}")
        sds.append(sd)
        cds.append(cd)
    outs = _execute(rctx, Kind.ALL_TO_ALL, groups, (tuple(sds), tuple(cds)), tensors)
    return _repack(leaves, spec, where, outs)


def broadcast(x: Any, source: int = 0, group_assignment: Any = None) -> Any:
    """Every member of a group gets the value of the group's member at position
    ``source`` (with no group assignment, that is replica ``source``)."""
    rctx = require_replica_context("cr.broadcast")
    groups = _groups(rctx, group_assignment)
    k = len(groups[0])
    try:
        src = _replica_index(source)  # numpy and torch integers too, as group assignments accept
    except TypeError:
        src = -1
    if not 0 <= src < k:
        raise ValueError(
            f"cr.broadcast: source must be a position in the group, an int in [0, {k}); got {summarize(source)}")
    leaves, spec, where, tensors = _tensor_leaves(x, "cr.broadcast")
    return _repack(leaves, spec, where, _execute(rctx, Kind.BROADCAST, groups, (src,), tensors))


def collective_permute(x: Any, source_target_pairs: Sequence[Sequence[int]]) -> Any:
    """Sends ``x`` from each source replica to its target; replicas that are no
    target receive zeros. Each replica is at most once a source and once a target."""
    rctx = require_replica_context("cr.collective_permute")
    n = rctx.num_replicas_in_sync
    pairs = _canonical_pairs(source_target_pairs, n)
    leaves, spec, where, tensors = _tensor_leaves(x, "cr.collective_permute")
    all_ids = (tuple(range(n)),)
    return _repack(leaves, spec, where, _execute(rctx, Kind.PERMUTE, all_ids, (pairs,), tensors))


def _replica_index(v: Any) -> int:
    if isinstance(v, bool):  # operator.index accepts bools; a replica id is never one
        raise TypeError(f"a replica id must be an int, not a bool: {summarize(v)}")
    return operator.index(v)


def _canonical_pairs(pairs: Any, n: int) -> tuple[tuple[int, int], ...]:
    if hasattr(pairs, "__len__") and len(pairs) > n:  # each replica is at most once a source
        raise ValueError(
            f"source_target_pairs has {len(pairs)} pairs, but each of the {n} replicas may be a source "
            f"at most once; got {summarize(pairs)}")
    try:
        out = [(_replica_index(s), _replica_index(t)) for s, t in pairs]
    except (TypeError, ValueError):
        raise ValueError(
            f"source_target_pairs must be a list of (source, target) replica id pairs, e.g. "
            f"[[0, 1], [1, 0]]; got {summarize(pairs)}") from None
    for s, t in out:
        if not (0 <= s < n and 0 <= t < n):
            raise ValueError(
                f"source_target_pairs names a replica outside 0..{n - 1} in ({s}, {t}): {summarize(pairs)}")
    for name, col in (("source", 0), ("target", 1)):
        ids = [p[col] for p in out]
        dup = sorted({r for r in ids if ids.count(r) > 1})
        if dup:
            raise ValueError(
                f"source_target_pairs uses replicas {dup} more than once as a {name}: {summarize(pairs)}")
    return tuple(sorted(out))


def replica_id() -> int:
    """This replica's id in the sync group (0..num_replicas()-1)."""
    return require_replica_context("cr.replica_id").replica_id_in_sync_group


def num_replicas() -> int:
    """The number of replicas in sync."""
    return require_replica_context("cr.num_replicas").num_replicas_in_sync
