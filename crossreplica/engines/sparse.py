"""The reduction arithmetic of sparse COO tensors, shared by every path.

A sparse reduction never densifies. Each replica's value is coalesced and
travels as its ``(indices, values)`` pair (gathered by the caller, in any
transport); :func:`reduce_coo` then reduces the pairs over the union of their
index patterns. For every stored index it lays out one row per replica (the
replica's value there, or an exact zero where the replica has none, as its
dense view has) and folds the rows left to right with the dense arithmetic of
``reduction.py``, in the wire dtype of ``reduce_op``. So every op (SUM, MEAN,
MAX, MIN, PROD) gives exactly the bytes of the same reduction of the dense
views, and an index no replica stores is a zero there as well (the reduction
of zeros is zero). Memory is O(union of the patterns), never O(dense shape).

Invariant: the result is coalesced (indices sorted and unique, the union of
the inputs' patterns; a stored entry may be an explicit zero), and the same
inputs in the same order give the same bytes on every replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import torch_private as tp
from ..errors import CollectiveMismatchError
from ..reduce_op import ReduceOp, from_wire, to_wire
from .reduction import reduce_into

__all__ = ["coo_parts", "reduce_coo", "reduce_coo_tensors", "reduce_gathered", "sparse_leaves"]


def coo_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The coalesced ``t`` as ``(indices [nnz, sparse_dim], values [nnz, *dense_shape])``,
    both contiguous, so they travel as dense tensors gathered along dim 0."""
    c = t.coalesce()
    return tp.sparse_indices(c).t().contiguous(), tp.sparse_values(c).contiguous()


def _linear(indices: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Row-major linear positions of ``indices`` ([nnz, len(sizes)]) in a grid of ``sizes``
    (they fit int64: torch refuses a tensor of 2**63 elements or more, as torch's coalesce relies on)."""
    lin = torch.zeros(indices.shape[0], dtype=torch.int64, device=indices.device)
    for d, s in enumerate(sizes):
        lin.mul_(s).add_(indices[:, d])
    return lin


def _unlinear(lin: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`_linear`, as COO indices ``[len(sizes), nnz]``."""
    rows = []
    for s in reversed(sizes):
        rows.append(lin % s)
        lin = lin // s
    return torch.stack(rows[::-1]) if rows else lin.new_zeros((0, lin.shape[0]))


def reduce_coo(op: ReduceOp, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], size: Sequence[int],
               dtype: torch.dtype) -> torch.Tensor:
    """The coalesced sparse reduction of ``parts`` (one :func:`coo_parts` pair per replica,
    in reduction order, on one device) into a tensor of shape ``size`` and ``dtype``."""
    sparse_dim = parts[0][0].shape[1]
    sizes = tuple(size[:sparse_dim])
    device = parts[0][1].device
    counts = [idx.shape[0] for idx, _ in parts]
    lin = torch.cat([_linear(idx.to(device), sizes) for idx, _ in parts])
    union, inverse = torch.unique(lin, sorted=True, return_inverse=True)
    fold = ReduceOp.SUM if op is ReduceOp.MEAN else op
    pieces = list(zip(parts, inverse.split(counts)))
    # One row per replica, folded as it is made: two rows of the union live at a time.
    acc = _row(op, pieces[0][0][1], pieces[0][1], union.shape[0], device)
    for (_, values), where in pieces[1:]:
        reduce_into(fold, acc, [acc, _row(op, values, where, union.shape[0], device)])
    if op is ReduceOp.MEAN:
        acc.div_(len(parts))
    return torch.sparse_coo_tensor(_unlinear(union, sizes), from_wire(op, acc, dtype), tuple(size), dtype=dtype,
                                   device=device, is_coalesced=True, check_invariants=False)


def _row(op: ReduceOp, values: torch.Tensor, where: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """One replica's values at the ``n`` indices of the union (in the wire dtype), and the
    wire form of zero where the replica stores nothing (as its dense view holds)."""
    values = values.to(device)
    row = to_wire(op, values.new_zeros((n, *values.shape[1:])))
    row.index_copy_(0, where, to_wire(op, values))  # a coalesced part stores each index once
    return row


def reduce_coo_tensors(op: ReduceOp, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`reduce_coo` of sparse COO ``tensors`` (one per replica, in reduction order),
    on the device of the first."""
    device = tensors[0].device
    parts = [coo_parts(t.to(device)) for t in tensors]
    return reduce_coo(op, parts, tensors[0].shape, tensors[0].dtype)


# --------------------------------------------------------------------------- by gather

def sparse_leaves(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """What one replica contributes to the all_gather (along dim 0) of a sparse reduction:
    ``indices, values`` of each tensor, then one int64 leaf with their sizes along dim 0
    (they differ between replicas) and every tensor's shape (checked by :func:`reduce_gathered`)."""
    leaves: list[torch.Tensor] = []
    for t in tensors:
        leaves.extend(coo_parts(t))
    meta = [x.shape[0] for x in leaves] + _shapes_key(tensors)
    leaves.append(torch.tensor(meta, dtype=torch.int64, device=device))
    return leaves


def _shapes_key(tensors: Sequence[torch.Tensor]) -> list[int]:
    return [s for t in tensors for s in (t.dim(), *t.shape)]


def reduce_gathered(op: ReduceOp, gathered: Sequence[torch.Tensor], members: Sequence[int], me: int,
                    tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced from ``gathered``: the all_gather of every member's
    :func:`sparse_leaves`, concatenated in the order of ``members`` (replica ids); the parts
    are reduced in ascending replica id, as every dense reduction is.

    Raises:
        CollectiveMismatchError: the members disagree on a shape (every member raises).
    """
    n_leaves = 2 * len(tensors)
    rows = gathered[-1].view(len(members), -1).tolist()
    shapes = _shapes_key(tensors)
    for member, row in zip(members, rows):
        if row[n_leaves:] != shapes:
            raise CollectiveMismatchError(
                f"a sparse reduction: replica {member} passed shapes {_decode(row[n_leaves:])}, replica "
                f"{me} passed {_decode(shapes)}; every replica of a group must pass the same shapes")
    order = sorted(range(len(members)), key=lambda p: members[p])
    results = []
    for j, t in enumerate(tensors):
        indices = gathered[2 * j].split([row[2 * j] for row in rows])
        values = gathered[2 * j + 1].split([row[2 * j + 1] for row in rows])
        results.append(reduce_coo(op, [(indices[p], values[p]) for p in order], t.shape, t.dtype))
    return results


def _decode(flat: list[int]) -> list[list[int]]:
    """The shapes of :func:`_shapes_key` (``[ndim, *shape, ndim, *shape, ...]``)."""
    out, i = [], 0
    while i < len(flat):
        out.append(flat[i + 1:i + 1 + flat[i]])
        i += 1 + flat[i]
    return out
