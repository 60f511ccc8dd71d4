"""A whole in-process reduction on one GPU in few kernels: a fused fold, then its copies.

The engines' reduction order (``reduction.py``) is a chain of binary kernels, one per
member after the first. On a GPU each launch costs the host some microseconds, and
each intermediate result is one more pass over memory. A fused fold reads every
input once and writes once, computing exactly the chain's arithmetic,
``((x0 + x1) + x2) + ...`` with every step rounded in the tensors' dtype (additions
only: nothing to contract), so its bytes are the chain's. It is built with torch's
jiterator (NVRTC, once per member count and dtype, at the first call); where the
jiterator is missing or a kernel does not build, the chain is used from then on.

Every member then needs its own copy of the result (a replica may change its output
in place): small results go into the rows of one buffer in one broadcast copy, large
ones into one allocation each, filled by one foreach copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .. import torch_private as tp
from ..reduce_op import ReduceOp
from .reduction import reduced

__all__ = ["FUSED_DTYPES", "MAX_FUSED", "fold", "fusable", "reduce_column", "reduce_in_place"]

_log = logging.getLogger(__name__)

#: The most inputs one fused kernel takes (the jiterator's limit).
MAX_FUSED = 8
#: The dtypes whose addition the fused kernel computes as torch.add does, step by step.
FUSED_DTYPES = frozenset((torch.float32, torch.float64, torch.int32, torch.int64))
# Results up to this many bytes (every member's copy together) share one buffer, one row
# each: one allocation and one copy kernel for every member. Larger ones get their own
# allocations, so that one kept output does not keep every member's copy alive.
ROWS_BYTES = 1 << 20

_kernels: dict[int, Callable[..., torch.Tensor]] = {}
_broken = False  # a kernel failed to build (NVRTC missing, say): the chain from then on


def _kernel(n: int, create: Callable[[str], Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """The fold of ``n`` inputs, built with ``create`` (the jiterator) at its first use."""
    fn = _kernels.get(n)
    if fn is None:
        args = ", ".join(f"T x{k}" for k in range(n))
        steps = "".join(f" acc = acc + x{k};" for k in range(2, n))
        code = (f"template <typename T> T crossreplica_fold{n}({args}) "
                f"{{ T acc = x0 + x1;{steps} return acc; }}")
        fn = _kernels[n] = create(code)
    return fn


def fusable(xs: Sequence[torch.Tensor]) -> bool:
    """Whether the fused kernel takes ``xs``: CUDA tensors of one dtype in FUSED_DTYPES and
    one device, none requiring grad (a fold is not differentiable)."""
    x = xs[0]
    dtype, device = x.dtype, x.device
    return (x.is_cuda and dtype in FUSED_DTYPES
            and all(t.dtype == dtype and t.device == device and not t.requires_grad for t in xs))


def fold(op: ReduceOp, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new tensor holding ``reduced(op, xs)`` (the same bytes), in one kernel where the
    fused fold applies: SUM or MEAN of 3 to 8 CUDA tensors of one dtype in FUSED_DTYPES."""
    global _broken
    n, create = len(xs), tp.create_jit_fn
    if (_broken or create is None or n < 3 or n > MAX_FUSED or (op is not ReduceOp.SUM and op is not ReduceOp.MEAN)
            or not fusable(xs)):
        return reduced(op, xs)
    try:
        out = _kernel(n, create)(*xs)
    except Exception as e:  # noqa: BLE001 - NVRTC missing or a build failure: the chain from now on
        _broken = True
        _log.info("fused GPU reduction unavailable (%s: %s); reducing with one kernel per member",
                  type(e).__name__, e)
        return reduced(op, xs)
    if op is ReduceOp.MEAN:
        out.div_(n)
    return out


def reduce_column(op: ReduceOp, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One leaf's all-reduce over ``xs`` (one CUDA device): every member's own output, in
    member order, each a copy of the same bytes."""
    n = len(xs)
    if n == 1:
        return [reduced(op, xs)]
    x = xs[0]
    small = x.numel() * x.element_size() * n <= ROWS_BYTES
    if (small and n == 2 and (op is ReduceOp.SUM or op is ReduceOp.MEAN) and x.dtype != torch.bool
            and x.is_contiguous() and xs[1].is_contiguous() and not x.requires_grad):
        # Both members' rows in one kernel: the sum computed into each row of one buffer.
        buf = torch.empty((2, *x.shape), dtype=x.dtype, device=x.device)
        torch.add(x.expand(2, *x.shape), xs[1].expand(2, *x.shape), out=buf)
        if op is ReduceOp.MEAN:
            buf.div_(2)
        return list(buf.unbind(0))
    acc = fold(op, xs)
    if small and acc.is_contiguous():
        rest = torch.empty((n - 1, *acc.shape), dtype=acc.dtype, device=acc.device)
        rest.copy_(acc)
        return [acc, *rest.unbind(0)]
    copies = [torch.empty_like(acc) for _ in range(n - 1)]
    tp.foreach_copy_(copies, [acc] * (n - 1))
    return [acc, *copies]


def reduce_in_place(op: ReduceOp, xs: Sequence[torch.Tensor]) -> None:
    """Every tensor of ``xs`` (one CUDA device) replaced by their reduction."""
    if len(xs) < 2:
        return
    tp.foreach_copy_(list(xs), [fold(op, xs)] * len(xs))  # fold: the chain below 3 members
