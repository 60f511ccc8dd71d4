"""The public collectives, called inside a replica function.

Each function validates its arguments here, locally, so a bad argument is a
clear exception before any replica waits (naming the argument, the value and
what was expected); the engine then checks that the replicas agree with each
other. Groups come from ``group_assignment``, from ``mesh``/``axes``, or from
both (the assignment then groups positions within the named axes; see
:func:`crossreplica.groups.resolve_groups`).

Under ``torch.compile`` the same functions trace to custom operators
(``compiled.py``); the replica context is then read when the compiled code
runs, not when it is traced, so one compiled step serves every replica.
Every global a traced line reads is a guard that each call of the compiled
code checks again, so what depends on no tensor is worked out in one constant
function (``torch.compiler.assume_constant_result``) while tracing: the groups
of every collective, and all of ``all_reduce``'s arguments for a tensor or a
flat list or tuple of tensors (the gradients: 13 guards of crossreplica's
instead of about 85).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..context import ReplicaContext, require_replica_context
from ..engines.kinds import (AllReduceParams, AllToAllParams, BroadcastParams, Kind, PermuteParams,
                             ReduceScatterParams)
from ..errors import summarize
from ..groups import Groups, Mesh, canonical_groups, contiguous_groups, mesh_groups, resolve_groups
from ..reduce_op import ReduceOp, check_dtype
from ..types import Axes, GroupAssignment, Nest
from . import autodiff, compiled
from .sparse import all_reduce_sparse, check_sparse
from .leaves import check_dim, check_splits, replica_index, tensor_leaves

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "collective_permute",
    "cross_replica_average",
    "cross_replica_mean",
    "cross_replica_sum",
    "num_replicas",
    "reduce_scatter",
    "replica_id",
]


# --------------------------------------------------------------------------- plumbing

_is_compiling = torch.compiler.is_compiling
# One record per op, built once: the common call then builds no parameter record.
_ALL_REDUCE = {op: AllReduceParams(op) for op in ReduceOp}


def _context(api: str) -> ReplicaContext | None:
    """The replica context; None while torch.compile traces (the operators find it at run time)."""
    if _is_compiling():
        return None
    return require_replica_context(api)


@torch.compiler.assume_constant_result
def _traced_num_replicas() -> int:
    # Read once while tracing; the compiled operators check it against the engine's.
    return require_replica_context("cr.collectives under torch.compile").num_replicas_in_sync


def _groups(rctx: ReplicaContext | None, group_assignment: Any, mesh: Mesh | None, axes: Any) -> Groups:
    if rctx is None and _constant_assignment(group_assignment, mesh, axes):
        return _raised(_traced_groups(group_assignment))  # one constant while tracing, not a guard per line
    n = rctx.num_replicas_in_sync if rctx is not None else _traced_num_replicas()
    return resolve_groups(n, group_assignment, mesh, axes)


def _constant_assignment(group_assignment: Any, mesh: Mesh | None, axes: Any) -> bool:
    """Whether the groups can be one constant while tracing: no mesh, and the assignment
    None or a list or tuple (a tensor or numpy array is traced as before)."""
    return mesh is None and axes is None and (group_assignment is None or type(group_assignment) in (list, tuple))


def _raised(spec: tuple) -> Any:
    """``spec`` from a constant function, or the ``(exception name, message)`` it returned for a
    bad argument raised here, so tracing fails as the line-by-line path does."""
    if isinstance(spec[0], str):
        raise (TypeError if spec[0] == "TypeError" else ValueError)(spec[1])
    return spec


@torch.compiler.assume_constant_result
def _traced_groups(group_assignment: Any) -> tuple:
    """The canonical groups while torch.compile traces, or ``(exception name, message)``."""
    try:
        return resolve_groups(_traced_num_replicas(), group_assignment)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)


def _flat_tensors(x: Any) -> list[torch.Tensor] | None:
    """``x`` as a list of dense tensors when it is one or a plain list or tuple of them; else None."""
    if isinstance(x, torch.Tensor):
        return [x] if x.layout is torch.strided else None
    if type(x) in (list, tuple) and x and all(isinstance(t, torch.Tensor) and t.layout is torch.strided
                                              for t in x):
        return list(x)
    return None


@torch.compiler.assume_constant_result
def _traced_all_reduce(op: Any, group_assignment: Any, dtypes: tuple[torch.dtype, ...]) -> tuple:
    """The compiled all-reduce's constant arguments, worked out once while tracing:
    ``(flat groups, group size, encoded params)``, or ``(exception name, message)``."""
    try:
        op = ReduceOp.from_any(op)
        for dtype in dtypes:
            check_dtype(op, dtype)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    groups = _traced_groups(group_assignment)  # called here, not traced: a plain call
    if isinstance(groups[0], str):
        return groups
    return tuple(r for g in groups for r in g), len(groups[0]), compiled.encode(_ALL_REDUCE[op])


def _compiled_all_reduce(x: Any, tensors: list[torch.Tensor], op: Any, group_assignment: Any) -> Any:
    flat, size, params = _raised(_traced_all_reduce(op, group_assignment, tuple(t.dtype for t in tensors)))
    outs = torch.ops.crossreplica.all_reduce(tensors, list(flat), size, params)
    return outs[0] if isinstance(x, torch.Tensor) else type(x)(outs)


def _execute(rctx: ReplicaContext | None, kind: Kind, groups: Groups, params: Any,
             tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if rctx is None:
        return compiled.execute(kind, groups, params, tensors)
    return autodiff.execute(rctx, kind, groups, params, tensors)


# --------------------------------------------------------------------------- reductions

def all_reduce(x: Nest, op: ReduceOp | str = "sum", group_assignment: GroupAssignment = None, *,
               mesh: Mesh | None = None, axes: Axes = None) -> Any:
    """Reduces ``x`` (a tensor, a number or a nest of them) over each group of replicas.

    Every replica of a group gets bitwise-identical results; MEAN divides by
    the group's size. ``mesh`` and ``axes`` reduce over the named mesh axes.
    """
    if (isinstance(x, torch.Tensor) and x.layout is torch.strided and group_assignment is None
            and mesh is None and axes is None and not _is_compiling()):
        # The common call, one dense tensor over every replica, in fewer Python calls: with
        # many replica threads each one's Python work is serialised by the GIL.
        here = require_replica_context("cr.all_reduce")
        op = ReduceOp.from_any(op)
        check_dtype(op, x.dtype)
        return autodiff.execute_one(here, Kind.ALL_REDUCE, canonical_groups(None, here.num_replicas_in_sync),
                                    _ALL_REDUCE[op], x)
    if _is_compiling() and _constant_assignment(group_assignment, mesh, axes):
        tensors = _flat_tensors(x)
        if tensors is not None:
            return _compiled_all_reduce(x, tensors, op, group_assignment)
    rctx = _context("cr.all_reduce")
    op = ReduceOp.from_any(op)
    groups = _groups(rctx, group_assignment, mesh, axes)
    leaves = tensor_leaves(x, "cr.all_reduce", rctx, sparse=True)
    sparse = False
    for t in leaves.tensors:
        check_dtype(op, t.dtype)
        if t.layout is not torch.strided:
            check_sparse(t, "cr.all_reduce")
            sparse = True
    if sparse:
        return leaves.repack(_all_reduce_with_sparse(rctx, op, groups, leaves.tensors))
    return leaves.repack(_execute(rctx, Kind.ALL_REDUCE, groups, _ALL_REDUCE[op], leaves.tensors))


def _all_reduce_with_sparse(rctx: ReplicaContext | None, op: ReduceOp, groups: Groups,
                            tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The dense leaves in one all_reduce, the sparse COO ones in one gather (sparse.py)."""
    if rctx is None:
        raise TypeError("cr.all_reduce of sparse tensors is not supported under torch.compile; "
                        "reduce them outside the compiled function")
    dense = [i for i, t in enumerate(tensors) if t.layout is torch.strided]
    coo = [i for i, t in enumerate(tensors) if t.layout is not torch.strided]
    outs: list[Any] = [None] * len(tensors)
    if dense:
        outs_dense = _execute(rctx, Kind.ALL_REDUCE, groups, AllReduceParams(op), [tensors[i] for i in dense])
        for i, o in zip(dense, outs_dense):
            outs[i] = o
    for i, o in zip(coo, all_reduce_sparse(rctx, op, groups, [tensors[i] for i in coo])):
        outs[i] = o
    return outs


def cross_replica_sum(x: Nest, group_assignment: GroupAssignment = None, name: str | None = None, *,
                      mesh: Mesh | None = None, axes: Axes = None) -> Nest:
    """Sums ``x`` over each group of replicas (TPU ``cross_replica_sum(x, group_assignment=None,
    name=None)``, TF's positional order). ``name`` labels the call in a torch profiler trace
    (:func:`_named`); the sum does not depend on it."""
    with _named("cr.cross_replica_sum", name, group_assignment):
        return all_reduce(x, ReduceOp.SUM, group_assignment, mesh=mesh, axes=axes)


def cross_replica_mean(x: Nest, group_assignment: GroupAssignment = None, name: str | None = None, *,
                       mesh: Mesh | None = None, axes: Axes = None) -> Nest:
    """Averages ``x`` over each group; MEAN divides by the group's size. ``name`` as for
    :func:`cross_replica_sum`."""
    with _named("cr.cross_replica_mean", name, group_assignment):
        return all_reduce(x, ReduceOp.MEAN, group_assignment, mesh=mesh, axes=axes)


def _named(api: str, name: Any, group_assignment: Any = None) -> contextlib.AbstractContextManager[Any]:
    """TF's ``name`` of a TPU op: a str or None; the call runs inside a profiler range of that
    name (``torch.profiler.record_function``; none while torch.compile traces). A str in the
    group_assignment position is a TF name put where TF puts the group: a ValueError."""
    if isinstance(group_assignment, str):
        raise ValueError(
            f"{api}: group_assignment={group_assignment!r} is a str, which looks like TF's op name; TF's order is "
            f"(x, group_assignment=None, name=None), as here: pass it as name={group_assignment!r}")
    if name is None:
        return contextlib.nullcontext()
    if not isinstance(name, str):
        raise TypeError(f"{api}: name must be a str (TF's op name) or None; got {summarize(name)}")
    if _is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


def cross_replica_average(x: Nest, *args: int | None, num_shards: int | None = None,
                          num_shards_per_group: int | None = None, distributed_group_size: int | None = None,
                          physical_shape: Any = None, tile_shape: Any = None,
                          use_spatial_partitioning: bool = False) -> Any:
    """Averages over groups of consecutive replicas (distributed batch norm's reduction).

    Every spelling of the seeds works, with groups ``[[0..k-1], [k..2k-1], ...]``:
    ``cross_replica_average(x, k)``, ``(x, num_shards_per_group=k)``, TF's
    ``(x, num_shards, num_shards_per_group)`` (positional or keywords) and
    ``(x, num_shards, distributed_group_size)`` (``distributed_group_size=k`` as a
    keyword). ``num_shards``, when given, must be the number of replicas in sync;
    ``k`` must divide it. ``physical_shape`` / ``tile_shape`` (TPU topology) are not
    supported: pass the groups to ``cr.cross_replica_mean(x, group_assignment)``.
    """
    rctx = require_replica_context("cr.cross_replica_average")
    n = rctx.num_replicas_in_sync
    if len(args) > 2:
        raise TypeError(f"cr.cross_replica_average takes at most 2 positional arguments after x "
                        f"(num_shards, num_shards_per_group); got {len(args)}")
    if len(args) == 1:  # the short form: the group size alone
        if num_shards_per_group is not None or distributed_group_size is not None:
            num_shards = args[0] if num_shards is None else num_shards
        else:
            num_shards_per_group = args[0]
    elif len(args) == 2:
        num_shards, num_shards_per_group = args[0] if num_shards is None else num_shards, args[1]
    if num_shards_per_group is not None and distributed_group_size is not None:
        raise ValueError(f"cr.cross_replica_average: pass num_shards_per_group or distributed_group_size, "
                         f"not both; got {summarize(num_shards_per_group)} and {summarize(distributed_group_size)}")
    k = num_shards_per_group if num_shards_per_group is not None else distributed_group_size
    if physical_shape is not None or tile_shape is not None or use_spatial_partitioning:
        raise ValueError("cr.cross_replica_average: physical_shape, tile_shape and use_spatial_partitioning "
                         "describe a TPU topology, which crossreplica does not model; build the groups "
                         "yourself and call cr.cross_replica_mean(x, group_assignment)")
    if k is None:
        raise TypeError("cr.cross_replica_average needs the group size: cross_replica_average(x, k), "
                        "(x, num_shards, num_shards_per_group) or distributed_group_size=k")
    if num_shards is not None and num_shards != n:
        raise ValueError(f"cr.cross_replica_average: num_shards={summarize(num_shards)}, but {n} replicas are "
                         f"in sync; pass num_shards={n} (or leave it out)")
    return all_reduce(x, ReduceOp.MEAN, contiguous_groups(n, k))


def reduce_scatter(x: Nest, op: ReduceOp | str = "sum", dim: int = 0, group_assignment: GroupAssignment = None, *,
                   mesh: Mesh | None = None, axes: Axes = None) -> Any:
    """Reduces ``x`` over each group and gives the member at position ``j`` the
    ``j``-th of ``group_size`` equal chunks along ``dim``."""
    api = "cr.reduce_scatter"
    rctx = _context(api)
    op = ReduceOp.from_any(op)
    groups = _groups(rctx, group_assignment, mesh, axes)
    k = len(groups[0])
    leaves = tensor_leaves(x, api, rctx)
    dims = []
    for t in leaves.tensors:
        check_dtype(op, t.dtype)
        if t.dim() == 0:
            raise ValueError(f"{api} needs tensors with at least one dimension; got a 0-d tensor")
        d = check_dim(dim, t.dim(), "dim", api, t.shape)
        if t.shape[d] % k:
            raise ValueError(
                f"{api}: x.shape[{d}]={t.shape[d]} (shape {list(t.shape)}) must be divisible "
                f"by the group size {k}")
        dims.append(d)
    return leaves.repack(_execute(rctx, Kind.REDUCE_SCATTER, groups, ReduceScatterParams(op, tuple(dims)),
                                        leaves.tensors))


# --------------------------------------------------------------------------- data movement

def all_gather(x: Nest, dim: int = 0, group_assignment: GroupAssignment = None, tiled: bool = True, *,
               mesh: Mesh | None = None, axes: Axes = None) -> Any:
    """Gathers the group members' ``x`` in group order.

    ``tiled=True`` concatenates along ``dim`` (sizes along ``dim`` may differ
    between replicas, e.g. an uneven last batch; a 0-d ``x`` is stacked into a
    vector); ``tiled=False`` stacks along a new axis at ``dim`` (JAX's default
    form: the result has one more dimension, of the group's size, and every
    shape must agree).
    """
    api = "cr.all_gather"
    rctx = _context(api)
    if not isinstance(tiled, bool):
        raise TypeError(f"{api}: tiled must be a bool; got {tiled!r}")
    groups = _groups(rctx, group_assignment, mesh, axes)
    leaves = tensor_leaves(x, api, rctx)
    dims, tensors = [], []
    for t in leaves.tensors:
        if tiled:
            d = check_dim(dim, max(t.dim(), 1), "dim", api, t.shape)
            t = t.unsqueeze(0) if t.dim() == 0 else t
        else:
            d = check_dim(dim, t.dim() + 1, "dim", api, t.shape)
            t = t.unsqueeze(d)
        dims.append(d)
        tensors.append(t)
    run = functools.partial(_execute, rctx)
    device = rctx.device if rctx is not None else None
    return leaves.repack(autodiff.gather(run, groups, tuple(dims), tensors, device))


def all_to_all(x: Nest, split_dim: int | None = None, concat_dim: int | None = None, *args: Any,
               group_assignment: GroupAssignment = None,
               input_split_sizes: Sequence[int] | None = None, output_split_sizes: Sequence[int] | None = None,
               mesh: Mesh | None = None, axes: Axes = None, split_dimension: int | None = None,
               concat_dimension: int | None = None, split_count: int | None = None,
               name: str | None = None) -> Any:
    """Splits ``x`` along ``split_dim``, sends chunk ``j`` to the member at position ``j``,
    and concatenates what arrives along ``concat_dim``, in group order.

    Positionally ``all_to_all(x, split_dim, concat_dim, group_assignment)``. TF's
    ``tpu_ops.all_to_all(x, concat_dimension, split_dimension, split_count,
    group_assignment=None, name=None)`` works too: by keyword, or positionally, told
    apart by the int ``split_count`` in the fourth place (where crossreplica's order has
    a group assignment, never an int), so ``all_to_all(x, 1, 0, 4)`` concatenates
    along 1 and splits along 0. ``split_count`` must equal the group size. ``name``
    (TF's) labels the call in a profiler trace.

    Chunks are equal (``x.shape[split_dim] // group_size``) unless split sizes are
    given, as torch's ``all_to_all_single``: ``input_split_sizes[j]`` rows go to
    member ``j``, ``output_split_sizes[i]`` rows arrive from member ``i`` (they
    must match what member ``i`` sends; None on either side means equal chunks
    of this replica's ``x``). Uneven sizes need ``split_dim == concat_dim``.
    """
    api = "cr.all_to_all"
    if args:
        if _int_or_none(args[0]) is not None:  # TF's positional order
            tf = _tf_all_to_all_positional(api, split_dim, concat_dim, args, split_dimension, concat_dimension,
                                           split_count)
            split_dim = concat_dim = None
            concat_dimension, split_dimension, split_count = tf[0], tf[1], tf[2]
            group_assignment = _positional(api, "group_assignment", args, 1, group_assignment)
            name = _positional(api, "name", args, 2, name)
        else:
            if len(args) > 1:
                raise TypeError(
                    f"{api} takes x, split_dim, concat_dim and group_assignment positionally (or TF's order, "
                    f"x, concat_dimension, split_dimension, split_count, group_assignment, name, with an int "
                    f"split_count fourth); got {len(args) + 3} positional arguments")
            group_assignment = _positional(api, "group_assignment", args, 0, group_assignment)
    with _named(api, name):
        return _all_to_all(api, x, split_dim, concat_dim, group_assignment, input_split_sizes, output_split_sizes,
                           mesh, axes, split_dimension, concat_dimension, split_count)


def _tf_all_to_all_positional(api: str, first: Any, second: Any, args: tuple, split_dimension: Any,
                              concat_dimension: Any, split_count: Any) -> tuple[Any, Any, Any]:
    """``(concat_dimension, split_dimension, split_count)`` of TF's positional call
    ``all_to_all(x, first, second, args[0], ...)``; TF's keywords as well are a TypeError."""
    if len(args) > 3:
        raise TypeError(f"{api} in TF's positional order takes at most x, concat_dimension, split_dimension, "
                        f"split_count, group_assignment and name; got {len(args) + 3} positional arguments")
    given = [k for k, v in (("split_dimension", split_dimension), ("concat_dimension", concat_dimension),
                            ("split_count", split_count)) if v is not None]
    if given:
        raise TypeError(
            f"{api}(x, {summarize(first)}, {summarize(second)}, {summarize(args[0])}, ...) is TF's positional order "
            f"(concat_dimension, split_dimension, split_count), which already gives {', '.join(given)}; pass them "
            f"once, positionally or by keyword")
    return first, second, args[0]


def _positional(api: str, argname: str, args: tuple, index: int, keyword: Any) -> Any:
    """``args[index]`` when there is one (and ``keyword`` is None), else ``keyword``."""
    if len(args) <= index:
        return keyword
    if keyword is not None:
        raise TypeError(f"{api} got {argname} twice: positionally ({summarize(args[index])}) and by keyword "
                        f"({summarize(keyword)})")
    return args[index]


def _all_to_all(api: str, x: Nest, split_dim: Any, concat_dim: Any, group_assignment: GroupAssignment,
                input_split_sizes: Sequence[int] | None, output_split_sizes: Sequence[int] | None,
                mesh: Mesh | None, axes: Axes, split_dimension: Any, concat_dimension: Any,
                split_count: Any) -> Any:
    split_dim = _one_spelling(api, "split_dim", split_dim, "split_dimension", split_dimension)
    concat_dim = _one_spelling(api, "concat_dim", concat_dim, "concat_dimension", concat_dimension)
    rctx = _context(api)
    groups = _groups(rctx, group_assignment, mesh, axes)
    k = len(groups[0])
    if split_count is not None and _int_or_none(split_count) != k:
        raise ValueError(f"{api}: split_count={summarize(split_count)} must equal the group size {k} "
                         f"(TF's split_count: one chunk per member); pass {k} or leave it out")
    in_splits = check_splits(input_split_sizes, k, "input_split_sizes", api)
    out_splits = check_splits(output_split_sizes, k, "output_split_sizes", api)
    leaves = tensor_leaves(x, api, rctx)
    sds, cds = [], []
    for t in leaves.tensors:
        if t.dim() == 0:
            raise ValueError(f"{api} needs tensors with at least one dimension; got a 0-d tensor")
        sd = check_dim(split_dim, t.dim(), "split_dim", api, t.shape)
        cd = check_dim(concat_dim, t.dim(), "concat_dim", api, t.shape)
        if (in_splits is not None or out_splits is not None) and sd != cd:
            raise ValueError(
                f"{api}: split sizes need split_dim == concat_dim (as all_to_all_single splits and "
                f"concatenates one dim); got split_dim={split_dim}, concat_dim={concat_dim}")
        if in_splits is not None and sum(in_splits) != t.shape[sd]:
            raise ValueError(
                f"{api}: input_split_sizes={list(in_splits)} must add up to x.shape[{sd}]={t.shape[sd]} "
                f"(shape {list(t.shape)})")
        if (in_splits is None or out_splits is None) and t.shape[sd] % k:
            raise ValueError(
                f"{api}: x.shape[{sd}]={t.shape[sd]} (shape {list(t.shape)}) must be divisible "
                f"by the group size {k}, or pass input_split_sizes and output_split_sizes")
        sds.append(sd)
        cds.append(cd)
    params = AllToAllParams(tuple(sds), tuple(cds), in_splits, out_splits)
    return leaves.repack(_execute(rctx, Kind.ALL_TO_ALL, groups, params, leaves.tensors))


def _int_or_none(value: Any) -> int | None:
    try:
        return replica_index(value)  # an int (numpy and torch integers too), never a bool
    except TypeError:
        return None


def _one_spelling(api: str, name: str, value: Any, tf_name: str, tf_value: Any) -> Any:
    """The argument given as ``name`` or as TF's ``tf_name``: exactly one of them."""
    if value is not None and tf_value is not None:
        raise TypeError(f"{api} got {name}={summarize(value)} and TF's {tf_name}={summarize(tf_value)}; "
                        f"they are one argument: pass one of them")
    if value is None and tf_value is None:
        raise TypeError(f"{api} missing the argument {name} (TF's {tf_name})")
    return value if value is not None else tf_value


def broadcast(x: Nest, source: int = 0, group_assignment: GroupAssignment = None, *,
              mesh: Mesh | None = None, axes: Axes = None) -> Any:
    """Every member of a group gets the value of the group's member at position
    ``source`` (with no group assignment, that is replica ``source``)."""
    api = "cr.broadcast"
    rctx = _context(api)
    groups = _groups(rctx, group_assignment, mesh, axes)
    k = len(groups[0])
    try:
        src = replica_index(source)  # numpy and torch integers too, as group assignments accept
    except TypeError:
        src = -1
    if not 0 <= src < k:
        raise ValueError(
            f"{api}: source must be a position in the group, an int in [0, {k}); got {summarize(source)}")
    leaves = tensor_leaves(x, api, rctx)
    return leaves.repack(_execute(rctx, Kind.BROADCAST, groups, BroadcastParams(src), leaves.tensors))


def collective_permute(x: Nest, source_target_pairs: Sequence[Sequence[int]] | None = None,
                       name: str | None = None, *, mesh: Mesh | None = None, axis: Any = None,
                       shift: int | None = None) -> Any:
    """Sends ``x`` from each source replica to its target; replicas that are no
    target receive zeros. Each replica is at most once a source and once a target.
    (TPU ``collective_permute(x, source_target_pairs, name=None)``: ``name`` labels the
    call in a profiler trace.)

    With ``mesh`` and ``axis`` (a mesh axis name, or several), the permutation
    acts within every group along that axis: ``source_target_pairs`` then name
    positions in the group (as ``jax.lax.ppermute`` over a named axis), or
    ``shift`` sends position ``p`` to ``(p + shift) % size`` (a cyclic shift, a
    ring): ``collective_permute(x, mesh=m, axis="model", shift=1)``.
    """
    api = "cr.collective_permute"
    with _named(api, name):
        return _collective_permute(api, x, source_target_pairs, mesh, axis, shift)


def _collective_permute(api: str, x: Nest, source_target_pairs: Sequence[Sequence[int]] | None,
                        mesh: Mesh | None, axis: Any, shift: int | None) -> Any:
    rctx = _context(api)
    n = rctx.num_replicas_in_sync if rctx is not None else _traced_num_replicas()
    if mesh is None:
        if axis is not None or shift is not None:
            raise ValueError(
                f"{api}: axis={axis!r} and shift={summarize(shift)} need a mesh; pass mesh=cr.Mesh(...) as well")
        if source_target_pairs is None:
            raise ValueError(f"{api}: pass source_target_pairs, e.g. [[0, 1], [1, 0]], or mesh, axis and shift")
        pairs = _canonical_pairs(source_target_pairs, n)
    else:
        if axis is None:
            raise ValueError(f"{api}: mesh={mesh!r} needs axis, the axis to permute along; got axis=None")
        groups = mesh_groups(n, mesh, axis)
        m = len(groups[0])
        if (source_target_pairs is None) == (shift is None):
            raise ValueError(
                f"{api}: with a mesh pass exactly one of source_target_pairs (positions along {axis!r}) and "
                f"shift; got source_target_pairs={source_target_pairs!r} and shift={summarize(shift)}")
        if shift is not None:
            try:
                s = replica_index(shift)
            except TypeError:
                raise ValueError(f"{api}: shift must be an int; got {summarize(shift)}") from None
            within = tuple((p, (p + s) % m) for p in range(m))
        else:
            within = _canonical_pairs(source_target_pairs, m)
        pairs = tuple(sorted((g[a], g[b]) for g in groups for a, b in within))
    leaves = tensor_leaves(x, api, rctx)
    return leaves.repack(_execute(rctx, Kind.PERMUTE, (tuple(range(n)),), PermuteParams(pairs),
                                        leaves.tensors))


def _canonical_pairs(pairs: Any, n: int) -> tuple[tuple[int, int], ...]:
    if hasattr(pairs, "__len__") and len(pairs) > n:  # each replica is at most once a source
        raise ValueError(
            f"source_target_pairs has {len(pairs)} pairs, but each of the {n} replicas may be a source "
            f"at most once; got {summarize(pairs)}")
    try:
        out = [(replica_index(s), replica_index(t)) for s, t in pairs]
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
