"""CrossShardOptimizer in the layout-invariant mode (:mod:`crossreplica.micro_batches`).

Layer: strategies (layer 5). A step in a micro-batch other than the replica's
last only folds the micro-batch's gradients into the replica's tree sums and
clears them; the last one folds its own, then sums every replica's partial sums
by the fixed tree over micro-batch indices (:func:`crossreplica.collectives.tree.tree_all_sum`),
divides (mean) and steps the wrapped optimizer on the result, the same bits on
one device as on any number of replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import torch

from ..collectives.tree import tree_all_sum
from ..errors import summarize
from ..micro_batches import MicroBatch, PendingGradients
from ..reduce_op import ReduceOp
from ..tree_sum import sequential_sum
from .arguments import canonical_weight

if TYPE_CHECKING:
    from .optimizer import CrossShardOptimizer

__all__ = ["check_supported", "invariant_step", "synchronize"]

#: Gradients of these dtypes are summed in float32 (as the engines reduce them), then rounded once.
_WIDENED = (torch.float16, torch.bfloat16)


def check_supported(opt: "CrossShardOptimizer", closure: Callable[[], Any] | None) -> None:
    """What the layout-invariant step does not do, as errors that say what to use instead."""
    if opt._group_assignment is not None:
        raise ValueError(
            f"CrossShardOptimizer(group_assignment={summarize(opt._group_assignment)}) cannot take a "
            f"layout-invariant step: the mode sums over every micro-batch of the global batch; leave "
            f"group_assignment out")
    if closure is not None:
        raise ValueError(
            "CrossShardOptimizer.step(closure) is not supported in the layout-invariant mode (the closure "
            "would re-evaluate only the last micro-batch); call loss.backward() and opt.step() without one")


def synchronize(opt: "CrossShardOptimizer", mb: MicroBatch, weight: Any) -> bool:
    """Folds this micro-batch's gradients; in the replica's last micro-batch also combines
    every pending gradient into ``.grad``. Returns whether ``.grad`` now holds the step's."""
    check_supported(opt, None)
    params = _params(opt)
    w = None if weight is None else float(canonical_weight(weight))
    if w is not None and opt._reduction is not ReduceOp.MEAN:
        raise ValueError(f"weight={summarize(weight)} is only used with reduction='mean'; this optimizer sums "
                         f"(reduction='sum'), so leave weight out")
    mb.pending.fold(mb, params, w)
    if not mb.is_last:
        return False
    _combine(mb.pending, params, opt._reduction)
    mb.pending.stepped_run = mb.run
    return True


def invariant_step(opt: "CrossShardOptimizer", mb: MicroBatch, closure: Callable[[], Any] | None,
                   weight: Any) -> Any:
    """``opt.step()`` in micro-batch ``mb``: folds, and steps in the replica's last one."""
    check_supported(opt, closure)
    if opt._synchronized:
        opt._synchronized = False
    elif not synchronize(opt, mb, weight):
        return None
    if opt._sharded is not None:
        raise ValueError("shard_optimizer_state=True is not supported in the layout-invariant mode; every "
                         "replica steps the whole model (leave shard_optimizer_state out)")
    return opt._optimizer.step()


def _params(opt: "CrossShardOptimizer") -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in opt._optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _combine(pending: PendingGradients, params: list[torch.Tensor], reduction: ReduceOp) -> None:
    """Sets ``p.grad`` of every parameter to the tree sum of its pending gradients over
    every replica and pending run (divided as ``reduction`` says); forgets them."""
    runs = pending.runs
    if not runs:
        for p in params:
            p.grad = None
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        dtype = torch.float32 if p.dtype in _WIDENED else p.dtype
        groups.setdefault((dtype, p.device), []).append(p)
    totals: dict[int, torch.Tensor] = {}
    for (dtype, device), members in groups.items():
        per_run = []
        for sums in runs:
            nodes = sums.nodes()
            flats = []
            for j, node in enumerate(nodes):
                parts = []
                for p in members:
                    stack = sums.grads.get(id(p))
                    if stack is None:
                        parts.append(torch.zeros(p.numel(), dtype=dtype, device=device))
                    else:
                        parts.append(pending.node_value(sums, stack, j).reshape(-1).to(dtype))
                flats.append((node, torch.cat(parts) if len(parts) > 1 else parts[0]))
            per_run.append(tree_all_sum(flats, sums.total))
        total = sequential_sum(per_run)
        offset = 0
        for p in members:
            totals[id(p)] = total[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
    present, weight = _meta(pending, params, runs)
    if reduction is ReduceOp.MEAN:
        if weight is None:
            divisor = float(runs[0].total)
        else:
            divisor = weight
            if divisor <= 0:
                raise ValueError(f"the micro-batches' weights sum to {divisor}; at least one micro-batch must "
                                 f"pass weight > 0 (its row count)")
    for p, here in zip(params, present):
        if not here:
            p.grad = None
            continue
        g = totals[id(p)]
        if reduction is ReduceOp.MEAN:
            g = g / divisor
        p.grad = g.to(p.dtype)
    pending.clear(params)


def _meta(pending: PendingGradients, params: list[torch.Tensor], runs: list[Any]) -> tuple[list[bool], float | None]:
    """Whether any replica has a gradient for each parameter, and the summed weights (None: unweighted),
    from one more tree sum of a small float64 vector per node: [weight, presence...]."""
    weighted = {sums.weighted for sums in runs} - {None}
    if len(weighted) > 1:
        raise ValueError("CrossShardOptimizer.step got weight= in some runs of an accumulation and not in "
                         "others; pass weight= in every step or in none")
    device = params[0].device if params else torch.device("cpu")
    per_run = []
    for sums in runs:
        flats = []
        for j, node in enumerate(sums.nodes()):
            v = torch.zeros(1 + len(params), dtype=torch.float64, device=device)
            if sums.weighted:
                v[0] = pending.weight_value(sums, j)
            if j == 0:
                v[1:] = torch.tensor([float(id(p) in sums.grads) for p in params], dtype=torch.float64)
            flats.append((node, v))
        per_run.append(tree_all_sum(flats, sums.total))
    meta = sequential_sum(per_run).tolist()
    return [m > 0 for m in meta[1:]], (meta[0] if weighted == {True} else None)

