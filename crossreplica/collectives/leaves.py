"""The arguments of a collective, validated and canonicalised once.

Nests in, nests out: a nest is flattened once (``None`` leaves pass through),
its tensor leaves travel in one engine call, and the outputs are put back in
the same structure. Python numbers are leaves too, turned into 0-d tensors by
torch's own rules: a ``bool`` becomes ``torch.bool``, an ``int`` ``torch.int64``,
a ``float`` the default dtype (``torch.get_default_dtype()``), a ``complex`` the
matching complex dtype; on the replica's device.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from .. import nest
from ..context import ReplicaContext
from ..errors import summarize

__all__ = ["Leaves", "check_dim", "check_splits", "replica_index", "tensor_leaves"]

_SINGLE = nest.flatten(0)[1]  # the spec of a bare leaf
_NUMBERS = (bool, int, float, complex)


class Leaves:
    """A flattened nest: where its tensors are, and how to rebuild it around outputs."""

    __slots__ = ("leaves", "spec", "tensors", "where")

    def __init__(self, leaves: list, spec: Any, where: list[int], tensors: list[torch.Tensor]):
        self.leaves, self.spec, self.where, self.tensors = leaves, spec, where, tensors

    def repack(self, outs: Sequence[torch.Tensor]) -> Any:
        if self.spec is _SINGLE:  # a bare tensor: the hot path
            return outs[0]
        leaves = list(self.leaves)
        for p, o in zip(self.where, outs):
            leaves[p] = o
        return nest.unflatten(self.spec, leaves)


def tensor_leaves(x: Any, api: str, rctx: ReplicaContext | None, sparse: bool = False) -> Leaves:
    """The nest ``x`` flattened, numbers turned into 0-d tensors on the device of the
    replica context ``rctx`` (None while torch.compile traces: the default device).
    Only a reduction (``sparse``) takes sparse tensors; other collectives reject them here."""
    if isinstance(x, torch.Tensor):  # the common case, without walking
        if x.layout is not torch.strided and not sparse:
            _dense_only(x, api)
        return Leaves([x], _SINGLE, [0], [x])
    leaves, spec = nest.flatten(x)
    where: list[int] = []
    tensors: list[torch.Tensor] = []
    for p, leaf in enumerate(leaves):
        if leaf is None:
            continue
        if isinstance(leaf, _NUMBERS):
            leaf = torch.tensor(leaf, device=rctx.device if rctx is not None else None)
        elif not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{api}: every leaf of x must be a torch.Tensor, a Python number (bool, int, float, "
                f"complex) or None; leaf {p} is {type(leaf).__name__}: {summarize(leaf)}")
        elif leaf.layout is not torch.strided and not sparse:
            _dense_only(leaf, api)
        where.append(p)
        tensors.append(leaf)
    return Leaves(leaves, spec, where, tensors)


def _dense_only(t: torch.Tensor, api: str) -> None:
    raise TypeError(
        f"{api} takes dense (strided) tensors; got a {t.layout} tensor of shape {list(t.shape)}. Only "
        f"cr.all_reduce (and cross_replica_sum / cross_replica_mean) reduces sparse COO tensors; pass "
        f"x.to_dense() here")


def check_dim(value: Any, ndim: int, argname: str, api: str, shape: Sequence[int]) -> int:
    """``value`` as a dim in ``[0, ndim)`` (negative dims count from the end)."""
    try:
        d = operator.index(value)
    except TypeError:
        raise TypeError(f"{api}: {argname} must be an int; got {summarize(value)}") from None
    if not -ndim <= d < ndim:
        raise ValueError(
            f"{api}: {argname}={value} is out of range for a tensor of shape {list(shape)} "
            f"(expected {-ndim} <= {argname} < {ndim})")
    return d % ndim


def replica_index(v: Any) -> int:
    """An int replica id or position (numpy and torch integers too; never a bool)."""
    if isinstance(v, bool):  # operator.index accepts bools; a replica id is never one
        raise TypeError(f"a replica id must be an int, not a bool: {summarize(v)}")
    return operator.index(v)


def check_splits(value: Any, k: int, argname: str, api: str) -> tuple[int, ...] | None:
    """``None``, or ``k`` non-negative int sizes (one per group member)."""
    if value is None:
        return None
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    try:
        sizes = tuple(replica_index(s) for s in value)
    except TypeError:
        sizes = ()
    if len(sizes) != k or any(s < 0 for s in sizes):
        raise ValueError(
            f"{api}: {argname} must be None or {k} non-negative ints, one per member of the group "
            f"(group size {k}); got {summarize(value)}")
    return sizes
