"""The reduction order every engine shares.

Invariant: a reduction of ``xs`` is ``((xs[0] op xs[1]) op xs[2]) op ...``,
left to right, in the order the caller passes (engines pass ascending replica
id), and MEAN is that SUM divided by ``len(xs)``. Every engine reduces with
these two functions, so the in-process and the ordered cross-process results
are the same bytes. bool tensors reduce with logical or (SUM, MAX, MEAN) and
logical and (PROD, MIN), never through a number type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import torch_private as tp
from ..reduce_op import ReduceOp

__all__ = ["reduce_into", "reduced"]


def reduce_into(op: ReduceOp, out: torch.Tensor, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out = xs[0] (op) xs[1] (op) ...`` left to right; MEAN also divides by len(xs)."""
    if len(xs) == 1:
        out.copy_(xs[0])
    else:
        _binary(op, xs[0], xs[1], out)
        _fold(op, out, xs)
    if op is ReduceOp.MEAN:
        out.div_(len(xs))
    return out


def reduced(op: ReduceOp, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new tensor holding the left-to-right reduction of ``xs`` (as :func:`reduce_into`)."""
    if len(xs) == 1:
        out = xs[0].clone(memory_format=torch.contiguous_format)
    else:
        first = _FIRST[op] if xs[0].dtype != torch.bool else _FIRST_BOOL[op]
        out = first(xs[0], xs[1])
        _fold(op, out, xs)
    if op is ReduceOp.MEAN:
        out.div_(len(xs))
    return out


def _fold(op: ReduceOp, out: torch.Tensor, xs: Sequence[torch.Tensor]) -> None:
    """``out = out (op) xs[2] (op) xs[3] ...``: the rest of a reduction, left to right."""
    if len(xs) < 3:
        return
    # On the CPU a foreach op with ``out`` repeated is one call that applies the same
    # in-place kernel to each operand in turn: the same bytes, without a Python call per
    # replica. (Elsewhere a foreach op may run its operands concurrently.)
    fold = _FOLD.get(op) if out.is_cpu and out.dtype != torch.bool else None
    if fold is not None and not out.requires_grad:
        fold([out] * (len(xs) - 2), list(xs[2:]))
        return
    for x in xs[2:]:
        _binary(op, out, x, out)


def _binary(op: ReduceOp, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if out.dtype == torch.bool:
        if op is ReduceOp.SUM or op is ReduceOp.MAX:
            torch.logical_or(a, b, out=out)
        else:  # PROD, MIN
            torch.logical_and(a, b, out=out)
    elif op is ReduceOp.SUM or op is ReduceOp.MEAN:
        torch.add(a, b, out=out)
    elif op is ReduceOp.MAX:
        torch.maximum(a, b, out=out)
    elif op is ReduceOp.MIN:
        torch.minimum(a, b, out=out)
    else:
        torch.mul(a, b, out=out)


# The first step of :func:`reduced`, which allocates its result.
_FIRST: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.MEAN: torch.add, ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum, ReduceOp.PROD: torch.mul}
_FIRST_BOOL: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.logical_or, ReduceOp.MAX: torch.logical_or, ReduceOp.MEAN: torch.logical_or,
    ReduceOp.MIN: torch.logical_and, ReduceOp.PROD: torch.logical_and}

# The in-place foreach form of each reduction's step (see :func:`_fold`).
_FOLD: dict[ReduceOp, Callable[..., None]] = {
    ReduceOp.SUM: tp.foreach_add_, ReduceOp.MEAN: tp.foreach_add_, ReduceOp.MAX: tp.foreach_maximum_,
    ReduceOp.MIN: tp.foreach_minimum_, ReduceOp.PROD: tp.foreach_mul_}
