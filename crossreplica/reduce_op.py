"""The reduction operators every reducing API accepts."""

from __future__ import annotations

import cmath
import enum
from typing import Any

import torch
from .errors import summarize

__all__ = ["COMPRESSION_DTYPES", "WIRE_DTYPES", "ReduceOp", "all_finite", "canonical_compression", "compress",
           "compresses", "compression_scale", "decompress", "from_wire", "mean_scale", "to_wire", "wire_dtype"]


class ReduceOp(enum.Enum):
    """How values from several replicas are combined.

    Every API that takes an op also accepts its name as a string in any case
    (``"sum"``, ``"MEAN"``); :meth:`from_any` does that conversion.
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"
    PROD = "PROD"

    @classmethod
    def from_any(cls, op: "ReduceOp | str", argname: str = "op") -> "ReduceOp":
        """Returns ``op`` as a ReduceOp; raises ValueError naming the valid ones."""
        if op.__class__ is cls:
            return op
        if isinstance(op, str):
            member = _BY_NAME.get(op) or cls.__members__.get(op.upper())
            if member is not None:
                return member
        valid = ", ".join(m.name for m in cls)
        converted = getattr(op, "_cr_reduce_op", _NOT_AGGREGATION)
        if converted is not _NOT_AGGREGATION:
            # A cr.VariableAggregation (a layer above), as TF 1.x passed it to reduce and
            # batch_reduce: TF's ReduceOp.from_variable_aggregation maps SUM and MEAN only.
            if isinstance(converted, ReduceOp):
                return converted
            raise ValueError(
                f"{argname}=cr.{op} has no cr.ReduceOp: a cr.VariableAggregation reduces only as SUM or MEAN (TF's "
                f"ReduceOp.from_variable_aggregation); pass one of {valid}, or VariableAggregation.SUM or MEAN "
                f"(ONLY_FIRST_REPLICA, replica 0's value, is taken by strategy.reduce and extended.reduce_to / "
                f"batch_reduce_to only)")
        raise ValueError(
            f"{argname} must be a cr.ReduceOp or one of {valid} (any case); got {summarize(op)}")

    def __str__(self) -> str:
        return self.name.lower()


_NOT_AGGREGATION = object()
_BY_NAME = {name: ReduceOp[name] for name in ReduceOp.__members__}
_BY_NAME.update({name.lower(): op for name, op in _BY_NAME.items()})


def check_dtype(op: ReduceOp, dtype: torch.dtype, argname: str = "x") -> None:
    """Rejects op/dtype pairs torch itself has no meaning for, before any replica waits."""
    if op is ReduceOp.MEAN and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"{argname} has dtype {dtype}, but op=mean needs a floating-point or complex "
            f"tensor (as torch.mean does); cast it first or use op='sum'")
    if op in (ReduceOp.MAX, ReduceOp.MIN) and dtype.is_complex:
        raise TypeError(
            f"{argname} has dtype {dtype}, but op={op} is not defined for complex tensors")


def reduce_non_distributed_value(op: ReduceOp, value: Any, num_replicas: int, hint: str = "") -> Any:
    """The reduction of a value that is the same object on every replica (tf.distribute's
    ``reduce_non_distributed_value``).

    MEAN, MAX and MIN of identical values are the value; a zero (TF's ``0``: a Python
    zero, or a tensor whose elements are all zero) is its own SUM and PROD too, so any
    op returns it; SUM or PROD of another value is only defined when a single replica
    holds it, and is a ValueError over several (``hint`` ends its message).
    """
    if op is ReduceOp.MEAN or op is ReduceOp.MAX or op is ReduceOp.MIN or num_replicas == 1 or _is_zero(value):
        return value
    raise ValueError(
        f"a non-distributed value {summarize(value)} cannot be reduced with op={op} over {num_replicas} "
        f"replicas; pass a cr.PerReplica (one value per replica), or use op='mean'{hint}")


def _is_zero(value: Any) -> bool:
    """Whether every element of ``value`` (a number or a tensor) is zero (an empty tensor too)."""
    if isinstance(value, torch.Tensor):
        if value.layout is torch.sparse_coo:
            value = value.coalesce().values()
        elif value.layout is not torch.strided:
            return False
        try:
            return not bool(value.any())
        except (RuntimeError, NotImplementedError):  # no data to read (a meta tensor)
            return False
    return isinstance(value, (int, float, complex)) and value == 0


# --------------------------------------------------------------------------- wire dtypes
#
# Engines reduce in the dtype they are handed. Two kinds of dtype are handed over in
# another one, by the semantic layer (collectives, strategies' reduce_values), before
# the engine call, and brought back after it, so every engine sees the same bytes:
#
# * low precision floats (float16, bfloat16, float8 types, complex32): SUM, MEAN and
#   PROD accumulate in float32 / complex64 and round once at the end (no overflow of
#   the partial sums where the result is representable). A float8 product of a few
#   values is exact in float32, so its result is the correctly rounded product, not
#   that of a fold rounding after each step (docs/collectives.md, "Numbers and dtypes").
#   MAX/MIN need no upcast, except for float8, which torch cannot compare (the round
#   trip is exact).
# * unsigned ints torch cannot add or compare (uint16, uint32, uint64): viewed as the
#   signed int of the same width. SUM and PROD wrap bit for bit the same; for MAX and
#   MIN the sign bit is flipped before and after, which maps unsigned order onto
#   signed order. uint16 widens to int32 instead (gloo cannot reduce int16): its values
#   compare as they are, and the low 16 bits of an int32 sum or product are the
#   wrapped uint16 result.

_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                            "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
_WIDE: dict[torch.dtype, torch.dtype] = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
                                         torch.complex32: torch.complex64}
_WIDE.update({d: torch.float32 for d in _FLOAT8})
_SIGNED: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.uint16: (torch.int32, 0), torch.uint32: (torch.int32, -(1 << 31)),
    torch.uint64: (torch.int64, -(1 << 63))}


#: Every dtype :func:`to_wire` may change (a cheap test before the per-tensor work).
WIRE_DTYPES: frozenset[torch.dtype] = frozenset((*_WIDE, *_SIGNED))


def wire_dtype(op: ReduceOp | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` with ``op`` is carried and computed in (``op``
    None: a collective that only moves data, which changes only the unsigned ints)."""
    if dtype in _WIDE and op is not None and (op not in (ReduceOp.MAX, ReduceOp.MIN) or dtype in _FLOAT8):
        return _WIDE[dtype]
    signed = _SIGNED.get(dtype)
    return signed[0] if signed is not None else dtype


def to_wire(op: ReduceOp | None, t: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``t`` in :func:`wire_dtype` (``t`` itself when that is its own dtype), divided by
    ``scale`` when given (a MEAN's power of two, :func:`mean_scale`)."""
    wire = _to_wire(op, t)
    return wire if scale is None else wire * (1.0 / scale)


def _to_wire(op: ReduceOp | None, t: torch.Tensor) -> torch.Tensor:
    dtype = t.dtype
    if dtype in _SIGNED:
        signed, sign = _SIGNED[dtype]
        if dtype is torch.uint16:
            return t.to(torch.int32)
        v = t.contiguous().view(signed)
        return v ^ sign if op in (ReduceOp.MAX, ReduceOp.MIN) else v
    wire = wire_dtype(op, dtype)
    return t if wire is dtype else t.to(wire)


def from_wire(op: ReduceOp | None, t: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """The inverse of :func:`to_wire` for a result of a reduction of ``dtype`` (multiplied
    back by ``scale`` when given)."""
    if scale is not None:
        t = t * scale
    if t.dtype is dtype:
        return t
    if dtype is torch.uint16:
        return t.to(torch.int16).view(torch.uint16)  # keeps the low 16 bits
    if dtype in _SIGNED:
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            t = t ^ _SIGNED[dtype][1]
        return t.contiguous().view(dtype)
    return t.to(dtype)


# --------------------------------------------------------------------------- MEAN without overflow
#
# MEAN is the sum divided by n, so values above max/n overflow the sum although their
# mean is finite. float16 cannot (its float32 wire sum holds any n of its values); for
# bfloat16 (summed in float32), float32 and float64 the reducing layers divide every
# value by a power of two 2**k >= n first and multiply the result by it after. Scaling
# by a power of two is exact and commutes with every rounding of the sum and the
# division, so the result is bitwise sum / n wherever that is finite and no scaled
# value is subnormal (below 2**k times the smallest normal number).

_SCALED_MEAN = frozenset((torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128))


def mean_scale(op: ReduceOp, n: int, dtype: torch.dtype) -> float | None:
    """The power of two ``2**k >= n`` a MEAN of ``n`` values of ``dtype`` scales its values by
    (see above); None for another op, one value, or a dtype whose sum cannot overflow."""
    if op is not ReduceOp.MEAN or n < 2 or dtype not in _SCALED_MEAN:
        return None
    return float(1 << (n - 1).bit_length())


def all_finite(t: torch.Tensor) -> bool:
    """Whether a MEAN's result may stand: every element is finite. An overflow of the sum
    (or an inf or nan from the inputs) is not; such a call is redone scaled. Decided per
    element, so it splits across shares of the tensor; one read-only sum in the common
    case (a finite sum means finite elements; torch.isfinite(t).all() costs 40x more)."""
    if cmath.isfinite(t.sum().item()):
        return True
    return cmath.isfinite((t * 0).sum().item())  # 0 for finite elements, nan for inf and nan


# --------------------------------------------------------------------------- compressed reductions
#
# ``compression=torch.bfloat16 | torch.float16`` (CrossShardOptimizer, CommunicationOptions):
# a SUM or MEAN of floating-point tensors wider than that dtype crosses the wire in it.
# Each replica's tensor is divided by a power of two 2**k >= n (n: the replicas reduced),
# rounded once to the narrow dtype (:func:`compress`), and the engine sums the narrow
# tensors as they are: every addition a transport makes (a fold's step, a ring's hop)
# adds in float32 and rounds to the narrow dtype. The result is widened back, multiplied
# by 2**k and, for MEAN, divided by n, in the caller's dtype (:func:`decompress`). The
# power of two is exact and keeps float16's partial sums in range: inputs within
# float16's range (|x| <= 65504) cannot overflow on the wire. docs/optimizers.md,
# "Compression", says which layouts agree with which.

#: The dtypes a reduction may be compressed to.
COMPRESSION_DTYPES = (torch.bfloat16, torch.float16)
_COMPRESSION_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                      "fp16": torch.float16, "half": torch.float16}


def canonical_compression(compression: Any, argname: str = "compression") -> torch.dtype | None:
    """``compression`` checked: None, ``torch.bfloat16`` or ``torch.float16``; anything else
    is an error naming ``argname`` and the value."""
    if compression is None or (isinstance(compression, torch.dtype) and compression in COMPRESSION_DTYPES):
        return compression
    expected = f"{argname} must be None, torch.bfloat16 or torch.float16 (the dtype gradients cross the wire in)"
    if isinstance(compression, torch.dtype):
        raise ValueError(f"{expected}; got {compression}")
    hint = ""
    if isinstance(compression, str) and compression.lower() in _COMPRESSION_NAMES:
        hint = f"; pass the dtype itself: {argname}={_COMPRESSION_NAMES[compression.lower()]}"
    elif "compression" in type(compression).__name__.lower() or "compressor" in type(compression).__name__.lower():
        hint = (f"; Horovod's hvd.Compression.fp16 is {argname}=torch.float16 (torch.bfloat16 keeps float32's "
                f"range)")
    raise TypeError(f"{expected}; got {type(compression).__name__}: {summarize(compression)}{hint}")


def compresses(dtype: torch.dtype, compression: torch.dtype | None) -> bool:
    """Whether a SUM or MEAN of ``dtype`` is compressed to ``compression``: floating point
    and wider than it (tensors already that narrow, and other dtypes, travel as they are)."""
    return compression is not None and dtype.is_floating_point and dtype.itemsize > compression.itemsize


def compression_scale(n: int) -> float:
    """The power of two ``2**k >= n`` a compressed reduction of ``n`` values divides them by
    (1 for a single value)."""
    return float(1 << (n - 1).bit_length()) if n > 1 else 1.0


def compress(t: torch.Tensor, compression: torch.dtype, scale: float) -> torch.Tensor:
    """``t / scale`` rounded once to ``compression`` (a new tensor; scaled first, in ``t``'s
    dtype, so float16 never sees the unscaled value): one pass, the product rounded to
    ``compression`` as it is stored."""
    if scale == 1.0:
        return t.to(compression)
    return torch.mul(t, 1.0 / scale, out=torch.empty(t.shape, dtype=compression, device=t.device))


def decompress(narrow: torch.Tensor, dtype: torch.dtype, scale: float, divisor: int | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`compress` for a reduced ``narrow`` tensor: widened to ``dtype``,
    times ``scale``, divided by ``divisor`` (a MEAN's count; None for SUM), in that order,
    written into ``out`` when given (else a new tensor). A mean over a power of two, whose
    ``divisor`` is ``scale``, skips both: the same bits wherever ``wide * scale`` is finite."""
    wide = out.copy_(narrow) if out is not None else narrow.to(dtype)
    if divisor is not None and float(divisor) == scale:
        return wide
    if scale != 1.0:
        wide.mul_(scale)
    if divisor is not None:
        wide.div_(divisor)
    return wide
