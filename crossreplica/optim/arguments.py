"""Argument checks and loss conversions of CrossShardOptimizer."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..arguments import check_number
from ..errors import summarize
from ..reduce_op import ReduceOp

__all__ = ["DEFAULT_NAME", "canonical_name", "canonical_reduction", "canonical_weight", "loss_to_buffer", "own_state",
           "reduced_loss"]

_VALID_REDUCTIONS = (ReduceOp.MEAN, ReduceOp.SUM)
#: TF's ``tf.compat.v1.losses.Reduction`` values that TF's CrossShardOptimizer accepts.
_TF_REDUCTIONS = {"weighted_mean": ReduceOp.MEAN, "weighted_sum": ReduceOp.SUM}
DEFAULT_NAME = "CrossShardOptimizer"


def canonical_reduction(reduction: Any) -> ReduceOp:
    """``reduction`` as MEAN or SUM: a cr.ReduceOp, "mean" / "sum" in any case, or TF's
    ``tf.compat.v1.losses.Reduction.MEAN`` / ``.SUM`` ("weighted_mean" / "weighted_sum"),
    the two TF's CrossShardOptimizer accepts."""
    op = None
    if isinstance(reduction, ReduceOp):
        op = reduction
    elif isinstance(reduction, str):
        op = ReduceOp.__members__.get(reduction.upper()) or _TF_REDUCTIONS.get(reduction.lower())
    if op not in _VALID_REDUCTIONS:
        raise ValueError(
            f"reduction must be one of 'mean', 'sum' (or cr.ReduceOp.MEAN / SUM, or TF's "
            f"tf.compat.v1.losses.Reduction.MEAN / SUM: 'weighted_mean' / 'weighted_sum'); got "
            f"{summarize(reduction)}")
    return op


def canonical_name(name: Any) -> str:
    """TF's third positional argument, the name (None: "CrossShardOptimizer")."""
    if name is None:
        return DEFAULT_NAME
    if not isinstance(name, str):
        raise TypeError(
            f"name must be a str or None (TF's order: CrossShardOptimizer(opt, reduction, name, "
            f"group_assignment)); got {summarize(name)}; pass a group assignment by keyword: "
            f"group_assignment={summarize(name)}")
    return name


def canonical_weight(weight: Any) -> float:
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(f"weight must be a number (the replica's row count); got a tensor of "
                             f"shape {list(weight.shape)}")
        weight = weight.item()
    return check_number(weight, "weight", hint=" (usually the replica's row count, x.shape[0])")


def loss_to_buffer(loss: Any, device: torch.device) -> torch.Tensor | None:
    """The closure's loss as a float64 buffer on the replica's ``device`` for the reduction,
    or None if it is no number."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.is_sparse:
            return None
        # A copy: the engine reduces this buffer in place, and the caller's loss stays as it was.
        return loss.detach().reshape(1).to(device, torch.float64, copy=True)
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return torch.tensor([float(loss)], dtype=torch.float64, device=device)
    return None


def reduced_loss(loss: Any, reduced: torch.Tensor) -> Any:
    """The reduced value in the form the closure returned: a tensor (detached) or a float."""
    if isinstance(loss, torch.Tensor):
        return reduced.to(loss.device, loss.dtype).reshape(loss.shape)
    return float(reduced.item())


def own_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of an optimizer state dict whose per-parameter state tensors are copies."""
    state_dict = state_dict.copy()
    if isinstance(state_dict.get("state"), dict):
        state_dict["state"] = {
            key: ({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
                  if isinstance(value, dict) else value)
            for key, value in state_dict["state"].items()}
    return state_dict
