"""Mixed precision: ``torch.amp.GradScaler`` driving a CrossShardOptimizer.

GradScaler decides from the gradients it reads whether to skip
``optimizer.step()`` and how to move its scale. Reading a replica's own,
unreduced gradients, one replica may find an inf the others do not: it skips
the step (and the reduction inside it) while the others reduce, and its scale
halves while theirs grows. So the gradients are reduced *before* GradScaler
reads them, and every replica of a group reaches the same verdict on the same,
bitwise identical, gradients. torch gives the optimizer two moments for that:

* ``scaler.step(opt)`` first reads ``opt._step_supports_amp_scaling`` (torch's
  contract for optimizers that unscale themselves). On a CrossShardOptimizer
  that property reduces the gradients (unless ``synchronize()`` did) and
  answers True; GradScaler then checks the reduced gradients and always calls
  ``opt.step()`` with ``opt.grad_scale`` and ``opt.found_inf`` set: step skips
  on every replica together, or unscales with torch's own kernel and steps.
* ``opt.synchronize()`` before ``scaler.unscale_(opt)`` (which asks the
  optimizer nothing): the clipping recipe is ``synchronize``, ``unscale_``,
  clip, ``step``, ``update``. An ``unscale_`` that read unreduced gradients is
  an error at ``scaler.step``, never a silent divergence. Horovod's spelling,
  ``with opt.skip_synchronize(): scaler.step(opt)``, is the same recipe; inside
  that context a ``scaler.step`` with no ``synchronize()`` before it is an error
  rather than a reduction made on the scaler's behalf.

The designs not taken (reducing only inside ``step()``, or at the end of every
backward): docs/optimizers.md, "Mixed precision".
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from .. import torch_private as tp
from ..context import current_replica_context
from ..errors import summarize
from ..groups import group_of

__all__ = ["reduce_before_scaler", "unscale_or_skip"]


def reduce_before_scaler(opt: Any) -> bool:
    """The value of ``CrossShardOptimizer._step_supports_amp_scaling``: reduces the
    gradients (unless ``synchronize()`` already did) and answers True."""
    try:
        opt._amp_late = False
        rctx = current_replica_context()
        if rctx is not None and rctx.micro_batch is not None:
            raise ValueError(
                "torch.amp.GradScaler cannot be used in the layout-invariant mode: its scale would change "
                "between micro-batches, so the loss scaling would depend on the layout; use bfloat16 "
                "autocast without a scaler, or the default mode")
        if rctx is None:
            return True  # step() raises the usual ReplicaContextError
        if opt._skipping:  # Horovod's `with opt.skip_synchronize(): scaler.step(opt)`: synchronize() came first
            opt._check_skip(opt._sync_called)
        if opt._synchronized:
            return True
        groups = opt._groups(rctx.num_replicas_in_sync)
        if len(group_of(groups, rctx.replica_id_in_sync_group)) > 1:
            dense, sparse, _ = opt._collect()
            # Gradients reduced only now: an explicit scaler.unscale_ before read local ones.
            opt._amp_late = bool(dense or sparse)
        opt.synchronize()
        return True
    except AttributeError as e:
        # GradScaler reads the attribute with getattr(opt, name, False), which would swallow
        # an AttributeError and fall back to checking the local gradients.
        raise RuntimeError(f"CrossShardOptimizer could not reduce the gradients for GradScaler: {e}") from e


def unscale_or_skip(opt: Any, closure: Any, weight: Any) -> bool:
    """The start of ``step()``: False to skip it (GradScaler's call found an inf; every
    replica of the group alike), True to go on (after unscaling the reduced gradients)."""
    if "found_inf" not in vars(opt):
        return True  # not GradScaler's call (it sets grad_scale and found_inf for the call)
    late, opt._amp_late = getattr(opt, "_amp_late", False), False
    if closure is not None:
        raise ValueError("a closure cannot be used with torch.amp.GradScaler (torch does not support it); "
                         "call scaler.step(opt) without one")
    if weight is not None:
        raise ValueError(
            f"weight={summarize(weight)} reached step() after GradScaler checked the reduced gradients; pass it "
            f"to opt.synchronize(weight=...) before scaler.step(opt) (or scaler.unscale_(opt))")
    if not opt._synchronized:
        raise RuntimeError(
            "GradScaler called CrossShardOptimizer.step without reading _step_supports_amp_scaling first, so it "
            "checked this replica's unreduced gradients; call opt.synchronize() before scaler.step(opt)")
    grad_scale, found_inf = opt.grad_scale, opt.found_inf
    if grad_scale is None and late:
        raise RuntimeError(
            "scaler.unscale_(opt) read this replica's own gradients before they were reduced, so replicas could "
            "clip different gradients and disagree on skipping the step; call opt.synchronize() before "
            "scaler.unscale_(opt), or build the optimizer with overlap=True")
    if float(found_inf) > 0:
        opt._synchronized = False  # as a step would: the next backward brings new gradients
        return False
    if grad_scale is not None:
        _unscale(opt.param_groups, grad_scale)
    return True


def _unscale(param_groups: list[dict[str, Any]], grad_scale: torch.Tensor) -> None:
    """Divides the gradients by the scale exactly as ``GradScaler.unscale_`` does (the
    same inverse and kernel), so a group of one is bitwise plain torch."""
    inv_scale = (grad_scale.double().reciprocal().float() if grad_scale.device.type != "mps"
                 else grad_scale.reciprocal())
    per_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    seen: set[int] = set()
    with torch.no_grad():
        for group in param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or id(p) in seen:
                    continue
                seen.add(id(p))
                if g.is_sparse:
                    if g.dtype is torch.float16:
                        p.grad = g = g.coalesce()
                    g = tp.sparse_values(g)
                per_device[(g.device, g.dtype)].append(g)
        for (device, _), grads in per_device.items():
            ignored = torch.zeros((), dtype=torch.float32, device=device)  # GradScaler already checked
            tp.amp_foreach_non_finite_check_and_unscale_(grads, ignored, inv_scale.to(device))
