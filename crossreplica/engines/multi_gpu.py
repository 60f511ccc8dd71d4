"""In-process reductions over replicas on several GPUs (TF MirroredStrategy's default layout).

One leaf's all-reduce over members on several devices goes one of two ways, both
giving every member the bytes of the engines' reduction order (``reduction.py``):

- **NCCL all-reduce** (``torch.cuda.nccl``), one tensor per GPU, where the order of
  the reduction cannot change the result: the SUM or MEAN of two members
  (``a + b == b + a``), or SUM/MAX/MIN of integers (sums wrap exactly in any order).
  Not MAX/MIN of floats: NCCL's drop a NaN where ``torch.maximum`` keeps it.
- **Ordered**, everywhere else: every input copied to the first member's GPU (peer
  to peer), folded there in ascending replica id (one fused kernel,
  ``cuda_fold.py``), and the result broadcast to the other GPUs in one NCCL call
  (``torch.cuda.comm.broadcast``, which copies where NCCL is missing).

TF's NcclAllReduce sums in NCCL's ring order, so its bytes depend on the number of
GPUs; ours do not. Several members on one GPU each get their own copy there.
:func:`placement` is the device plan, kept apart from the copies so that it can be
tested without GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.cuda.comm
import torch.cuda.nccl as nccl

from ..reduce_op import ReduceOp
from . import cuda_fold

__all__ = ["Placement", "all_reduce_column", "order_free", "placement"]


class Placement(NamedTuple):
    """Where one leaf's reduction runs and how its result reaches every member."""

    home: torch.device  #: where the ordered fold runs: the first member's device
    devices: tuple[torch.device, ...]  #: every member's device once, home first
    first: tuple[bool, ...]  #: per member: the first on its device (gets that device's copy)
    one_per_device: bool  #: no two members share a device


def placement(devices: Sequence[torch.device]) -> Placement:
    """The plan for members on ``devices`` (in member order)."""
    seen: dict[torch.device, None] = {}
    first = []
    for d in devices:
        first.append(d not in seen)
        seen.setdefault(d)
    distinct = tuple(seen)
    return Placement(devices[0], distinct, tuple(first), len(distinct) == len(devices))


def order_free(op: ReduceOp, dtype: torch.dtype, members: int) -> bool:
    """Whether any reduction order gives the same bytes for ``members`` values of ``dtype``."""
    integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    if members <= 2 and op in (ReduceOp.SUM, ReduceOp.MEAN) and dtype != torch.bool:
        return True  # commutative: a + b == b + a, bit for bit (MEAN: the sum, then / 2)
    # (not MAX/MIN of floats: NCCL's drop NaNs where torch.maximum keeps them)
    return integer and op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)


def all_reduce_column(op: ReduceOp, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One leaf's all-reduce over ``xs`` (member order, CUDA tensors on several devices):
    every member's own output, on its own device."""
    plan = placement([x.device for x in xs])
    x = xs[0]
    if (plan.one_per_device and order_free(op, x.dtype, len(xs))
            and all(t.is_contiguous() and t.dtype == x.dtype for t in xs) and nccl.is_available(list(xs))):
        outs = [torch.empty_like(t) for t in xs]
        nccl.all_reduce(list(xs), outputs=outs, op=_NCCL_OPS[ReduceOp.SUM if op is ReduceOp.MEAN else op])
        if op is ReduceOp.MEAN:
            for out in outs:
                out.div_(len(xs))
        return outs
    acc = cuda_fold.fold(op, [t.to(plan.home, non_blocking=True) for t in xs])
    copies = dict(zip(plan.devices, torch.cuda.comm.broadcast(acc, devices=list(plan.devices))))
    outs = []
    for t, first in zip(xs, plan.first):
        copy = copies[t.device]
        outs.append(copy if first else copy.clone())
    return outs


# torch.cuda.nccl's reduction codes (NCCL's ncclRedOp_t): sum, prod, max, min.
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}
