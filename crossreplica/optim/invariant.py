"""CrossShardOptimizer in the layout-invariant mode (:mod:`crossreplica.micro_batches`).

A step in a micro-batch other than the replica's last only folds the
micro-batch's gradients into the replica's tree sums and clears them; the last
one folds its own, then sums every replica's partial sums by the fixed tree over
micro-batch indices (:func:`crossreplica.collectives.tree.tree_all_sum`),
divides (mean) and steps the wrapped optimizer on the result, the same bits on
one device as on any number of replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

import torch

from .. import torch_private as tp
from ..collectives.tree import tree_all_sum
from ..errors import summarize
from ..micro_batches import MicroBatch, PendingGradients, leaf_value, nothing_like
from ..random_streams import current_stream, entered
from ..reduce_op import ReduceOp
from ..tree_sum import Node, sequential_sum
from .arguments import canonical_weight

if TYPE_CHECKING:
    from .optimizer import CrossShardOptimizer

__all__ = ["check_supported", "invariant_step", "synchronize"]

#: Gradients of these dtypes are summed in float32 (as the engines reduce them), then rounded once.
_WIDENED = (torch.float16, torch.bfloat16)


def check_supported(opt: "CrossShardOptimizer") -> None:
    """What the layout-invariant step does not do, as errors that say what to use instead."""
    if opt._group_assignment is not None:
        raise ValueError(
            f"CrossShardOptimizer(group_assignment={summarize(opt._group_assignment)}) cannot take a "
            f"layout-invariant step: the mode sums over every micro-batch of the global batch; leave "
            f"group_assignment out")


def synchronize(opt: "CrossShardOptimizer", mb: MicroBatch, weight: Any) -> bool:
    """Folds this micro-batch's gradients; in the replica's last micro-batch also combines
    every pending gradient into ``.grad``. Returns whether ``.grad`` now holds the step's."""
    check_supported(opt)
    params = _params(opt)
    w = None if weight is None else float(canonical_weight(weight))
    if w is not None and opt._reduction is not ReduceOp.MEAN:
        raise ValueError(f"weight={summarize(weight)} is only used with reduction='mean'; this optimizer sums "
                         f"(reduction='sum'), so leave weight out")
    pending = mb.pending
    if mb.count == 1 and not pending.runs:
        # One micro-batch per replica and nothing accumulated: the gradients go from .grad
        # straight into the tree sum (the same values a fold would push).
        _combine([_Current(mb, params, w)], params, opt._reduction)
    else:
        pending.fold(mb, params, w)
        if not mb.is_last:
            return False
        _combine(pending.runs, params, opt._reduction)
        pending.clear(params)
    pending.mark_folded(mb, params)
    pending.stepped_run = mb.run
    return True


class _Current:
    """The partial sums of a run whose only micro-batch's gradients are still in ``.grad``
    (a fold's view of them, without the fold)."""

    def __init__(self, mb: MicroBatch, params: list[torch.Tensor], weight: float | None):
        self.first, self.count, self.total = mb.first, 1, mb.total
        self.slots, self.counted = mb.slots, mb.counted
        self.weight = weight if mb.rows else None  # an empty micro-batch contributes nothing
        self.weighted = weight is not None
        self.leaves = ({id(p): leaf_value(p.grad, weight) for p in params if p.grad is not None} if mb.rows
                       else {})

    def nodes(self) -> list[Node]:
        return [(self.first, self.first + 1)]

    def has(self, p: torch.Tensor) -> bool:
        return id(p) in self.leaves

    def grad_node(self, p: torch.Tensor, j: int) -> torch.Tensor | None:
        return self.leaves.get(id(p))

    def weight_node(self, j: int) -> float:
        return self.weight or 0.0


# Each optimizer's hyperparameters at its last deferred step: (run, micro-batch index, values).
_deferred: "weakref.WeakKeyDictionary[Any, tuple[int, int, tuple]]" = weakref.WeakKeyDictionary()


def _hyperparameters(opt: "CrossShardOptimizer") -> tuple:
    """The wrapped optimizer's hyperparameters, comparable without reading a device (a
    tensor's identity and version stand for its value)."""
    return tuple(tuple((k, (id(v), tp.tensor_version(v)) if isinstance(v, torch.Tensor) else v)
                       for k, v in g.items() if k != "params") for g in opt._optimizer.param_groups)


def _check_unchanged_between_micro_batches(opt: "CrossShardOptimizer", mb: MicroBatch) -> None:
    """Raises when the hyperparameters changed since this optimizer's step in an earlier
    micro-batch of the same run: the replica function runs once per micro-batch, so an LR
    scheduler stepped in it would step ceil(M/R) times per step, a number that depends on
    the replica count (a silently different schedule on every layout)."""
    now = _hyperparameters(opt)
    seen = _deferred.get(opt)
    if seen is not None and seen[0] == mb.run and seen[2] != now:
        changed = sorted({k for before, after in zip(seen[2], now) for (k, a), (_, b) in zip(before, after)
                          if a != b} or {"param_groups"})
        raise ValueError(
            f"the optimizer's {', '.join(changed)} changed between micro-batch {seen[1]} and micro-batch "
            f"{mb.index} of one step: in the layout-invariant mode the replica function runs once per "
            f"micro-batch ({mb.count} on this replica, a number that depends on the replica count), so an LR "
            f"scheduler stepped in it would step that many times per optimizer step; step it after "
            f"strategy.run, in cross-replica context (for s in strategy.experimental_local_results(schedulers): "
            f"s.step()), or change the hyperparameters there")
    if mb.is_last:
        _deferred.pop(opt, None)
    else:
        _deferred[opt] = (mb.run, mb.index, now)


def invariant_step(opt: "CrossShardOptimizer", mb: MicroBatch, closure: Callable[[], Any] | None,
                   weight: Any) -> Any:
    """``opt.step()`` in micro-batch ``mb``: folds, and steps in the replica's last one."""
    check_supported(opt)
    _check_unchanged_between_micro_batches(opt, mb)
    if closure is not None:
        return _closure_step(opt, mb, closure, weight)
    if opt._synchronized:
        opt._synchronized = False
    elif not synchronize(opt, mb, weight):
        return None
    if opt._sharded is not None:
        raise ValueError("shard_optimizer_state=True is not supported in the layout-invariant mode; every "
                         "replica steps the whole model (leave shard_optimizer_state out)")
    return opt._optimizer.step()


def _closure_step(opt: "CrossShardOptimizer", mb: MicroBatch, closure: Callable[[], Any], weight: Any) -> Any:
    """``step(closure)``: the closures of the replica's micro-batches are kept until its last one,
    where the wrapped optimizer steps with one closure that evaluates them all, each under its
    micro-batch's random stream, and returns the tree mean (or sum) of their losses with the
    gradients combined as ``step()`` combines them; LBFGS may call it several times."""
    if weight is not None:
        raise ValueError(f"weight={summarize(weight)} cannot be used with a closure in the layout-invariant "
                         f"mode; return the micro-batch's mean loss from the closure")
    if opt._sharded is not None:
        raise ValueError("shard_optimizer_state=True is not supported in the layout-invariant mode; every "
                         "replica steps the whole model (leave shard_optimizer_state out)")
    pending = mb.pending
    if pending.closures and pending.closures[0][0].run != mb.run:
        pending.closures.clear()
    pending.closures.append((mb, closure, current_stream()))
    if not mb.is_last:
        return None
    closures, params = list(pending.closures), _params(opt)
    pending.closures.clear()
    loss_holder = torch.zeros(1, dtype=torch.float64, device=params[0].device if params else "cpu")

    def evaluate() -> Any:
        sums = PendingGradients()
        for mbj, cj, stream in closures:
            with entered(stream) if stream is not None else contextlib.nullcontext(), torch.enable_grad():
                loss = cj()
            loss_holder.grad = torch.as_tensor(loss, dtype=torch.float64).detach().reshape(1).to(
                loss_holder.device)
            sums.fold(dataclasses.replace(mbj, pending=sums), [*params, loss_holder])
        _combine(sums.runs, [*params, loss_holder], opt._reduction)
        opt._edits.forget()  # the closures' backward passes, combined: not an edit
        total = loss_holder.grad
        loss_holder.grad = None
        return None if total is None else total[0].to(torch.get_default_dtype())

    result = opt._optimizer.step(evaluate)
    pending.mark_folded(mb, params)
    pending.stepped_run = mb.run
    return result


def _params(opt: "CrossShardOptimizer") -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in opt._optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _combine(runs: Sequence[Any], params: list[torch.Tensor], reduction: ReduceOp) -> None:
    """Sets ``p.grad`` of every parameter to the tree sum of its pending gradients over
    every replica and pending run (divided as ``reduction`` says). ``runs`` give each
    run's nodes (``nodes()``, ``grad_node(p, j)``, ``weight_node(j)``, ``has(p)``).

    One tree sum (one gather) per dtype: each node is the flat concatenation of the
    parameters' partial sums, and the first float32/float64 group carries, after them,
    the node's weight and a 1 for each parameter this replica has a gradient for (exact
    counts in either dtype), so which parameters got a gradient anywhere and the total
    weight come with the gradients."""
    if not runs:
        for p in params:
            p.grad = None
        return
    weighted = {sums.weighted for sums in runs} - {None}
    if len(weighted) > 1:
        raise ValueError("CrossShardOptimizer.step got weight= in some runs of an accumulation and not in "
                         "others; pass weight= in every step or in none")
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((torch.float32 if p.dtype in _WIDENED else p.dtype, p.device), []).append(p)
    carrier = next((key for key in groups if key[0] in (torch.float32, torch.float64)), None)
    if carrier is not None:  # first: the others need its weights
        groups = {carrier: groups.pop(carrier), **groups}
    meta: list[float] | None = None
    totals: dict[int, torch.Tensor] = {}
    for key, members in groups.items():
        dtype, device = key
        per_run = []
        for sums in runs:
            flats = []
            for j, node in enumerate(sums.nodes()):
                parts = [nothing_like(torch.empty(p.numel(), dtype=dtype, device=device))
                         if (g := sums.grad_node(p, j)) is None else g.reshape(-1) for p in members]
                if key == carrier:
                    parts.append(_node_meta(sums, j, params, dtype, device))
                flats.append((node, torch.cat(parts) if len(parts) > 1 else parts[0]))
            per_run.append(tree_all_sum(flats, sums.slots))
        size = 1 + len(params) if key == carrier else 0
        counts = {sums.counted for sums in runs}
        if reduction is ReduceOp.MEAN and weighted != {True} and len(counts) > 1:
            # runs of different counts of micro-batches with rows: each run's mean, then their sum
            # (a run of no rows holds -0.0 sums: nothing to divide, it adds nothing)
            per_run = [_divided(t, float(sums.counted), size) if sums.counted else t
                       for t, sums in zip(per_run, runs)]
        total = sequential_sum(per_run)
        if size:
            meta, total = total[-size:].tolist(), total[:-size]
        if reduction is ReduceOp.MEAN and (weighted == {True} or len(counts) == 1):
            if meta is None:  # no float32/float64 gradients to carry it
                meta = _meta(params, runs)
            total = total.div_(_divisor(meta, weighted, runs))  # fresh buffers, or sums no one else holds
        offset = 0
        for p in members:
            totals[id(p)] = total[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
    if meta is None:  # no float32/float64 gradients to carry it
        meta = _meta(params, runs)
    for p, m in zip(params, meta[1:]):
        g = totals[id(p)]
        p.grad = (g if g.dtype == p.dtype else g.to(p.dtype)) if m > 0 else None


def _divisor(meta: list[float], weighted: set[bool | None], runs: Sequence[Any]) -> float:
    """What the mean divides by: the summed weights, or the micro-batches with rows (every run
    has as many)."""
    if weighted != {True}:
        return _count(runs[0].counted)
    if meta[0] <= 0:
        raise ValueError(f"the micro-batches' weights sum to {meta[0]}; at least one micro-batch must "
                         f"pass weight > 0 (its row count)")
    return meta[0]


def _count(counted: int) -> float:
    """An unweighted mean's divisor: the micro-batches of the global batch that have rows
    (empty ones contribute nothing and are not counted)."""
    if counted <= 0:
        raise ValueError("CrossShardOptimizer.step in the layout-invariant mode got a global batch of 0 rows: "
                         "there is no gradient to average; skip empty batches")
    return float(counted)


def _divided(total: torch.Tensor, divisor: float, size: int) -> torch.Tensor:
    """``total``'s gradients divided by ``divisor``, its last ``size`` elements (the carried
    weights and presence) as they are."""
    if not size:
        return total / divisor
    return torch.cat([total[:-size] / divisor, total[-size:]])


def _node_meta(sums: Any, j: int, params: list[torch.Tensor], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Node ``j``'s ``[weight, presence...]``: the presence in the replica's first node only."""
    values = [sums.weight_node(j)] + [float(sums.has(p)) if j == 0 else 0.0 for p in params]
    return torch.tensor(values, dtype=dtype, device=device)


def _meta(params: list[torch.Tensor], runs: Sequence[Any]) -> list[float]:
    """``[total weight, presence...]`` by a tree sum of its own (float64), for gradients of no
    float32/float64 dtype."""
    device = params[0].device if params else torch.device("cpu")
    per_run = [tree_all_sum([(node, _node_meta(sums, j, params, torch.float64, device))
                             for j, node in enumerate(sums.nodes())], sums.slots) for sums in runs]
    return sequential_sum(per_run).tolist()
