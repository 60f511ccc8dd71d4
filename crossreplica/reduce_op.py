"""The reduction operators every reducing API accepts."""

from __future__ import annotations

import enum
from typing import Any

import torch
from .errors import summarize

__all__ = ["ReduceOp"]


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
        raise ValueError(
            f"{argname} must be a cr.ReduceOp or one of {valid} (any case); got {summarize(op)}")

    def __str__(self) -> str:
        return self.name.lower()


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


def reduce_non_distributed_value(op: ReduceOp, value: Any, num_replicas: int) -> Any:
    """The reduction of a value that is the same object on every replica.

    MEAN of identical values is the value; any other op is only defined when a
    single replica holds it (tf.distribute's reduce_non_distributed_value).
    """
    if op is ReduceOp.MEAN or op is ReduceOp.MAX or op is ReduceOp.MIN or num_replicas == 1:
        return value
    raise ValueError(
        f"a non-distributed value {summarize(value)} cannot be reduced with op={op} over {num_replicas} "
        f"replicas; pass a cr.PerReplica (one value per replica), or use op='mean'")
