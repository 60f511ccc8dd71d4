"""The replica side of the layout-invariant mode: one call of the replica function per micro-batch.

The rules are :mod:`crossreplica.micro_batches`. Replica ``r`` of ``R`` runs
micro-batches ``[r * k, (r + 1) * k)`` (``k = ceil(M / R)``; indices from ``M`` on
are empty padding) of each global batch in order. For micro-batch ``m`` it

* cuts the replica's rows of every PerReplica argument (tensors along dim 0,
  per-row lists) to the micro-batch's rows; other arguments reach every call whole;
* restores the mirrored modules' buffers to their values at the start of the run,
  so every micro-batch starts from the same state;
* clears the gradients of the mirrored modules' parameters, draws random numbers
  from a stream seeded with ``base + m`` (replica ``m``'s seed in the default mode),
  and calls the function with ``rctx.micro_batch`` set;
* folds what gradients the function left (no step taken: accumulation) into the
  replica's pending tree sums, and the buffers into a tree stack.

After the last micro-batch the buffers become the tree mean over the micro-batches
with rows (integer buffers: the exact integer sum, floor-divided), identical on every
replica, and the results of the calls with rows combine by ``LayoutInvariant.results``.
An empty micro-batch still runs (the replica function's collectives and the step
must happen on every replica) but contributes nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any
from collections.abc import Callable, Sequence

import torch

from .. import collectives, nest
from ..collectives.tree import tree_all_sum
from ..context import ReplicaContext
from ..micro_batches import (LayoutInvariant, MicroBatch, PendingGradients, counted_micro_batches, dealt_sizes,
                             micro_batches_per_replica, nothing_like)
from ..random_streams import entered
from ..tree_sum import TreeStack
from ..values import DistributedValues, Mirrored, PerReplica

__all__ = ["MicroBatchedRun"]


class MicroBatchedRun:
    """One ``run`` in the layout-invariant mode, for every local replica of this process."""

    def __init__(self, layout: LayoutInvariant, args: tuple, kwargs: dict, num_replicas: int,
                 replica_ids: Sequence[int], modules: Callable[[int], list[torch.nn.Module]],
                 pending: Sequence[PendingGradients], run: int, base: int | None, rows: Sequence[int]):
        self.layout, self.args, self.kwargs = layout, args, kwargs
        self.num_replicas, self.replica_ids = num_replicas, tuple(replica_ids)
        self.modules, self.pending, self.run, self.base = modules, pending, run, base
        self.k = micro_batches_per_replica(layout.micro_batches, num_replicas)
        self.slots = self.k * num_replicas  # the micro-batches and the empty ones padding the deal
        self.rows = list(rows)
        # Every replica local: the global batch's rows are known here; otherwise an all-reduce finds them.
        self.global_rows = sum(rows) if len(replica_ids) == num_replicas else None

    @classmethod
    def of(cls, layout: LayoutInvariant, args: tuple, kwargs: dict, num_replicas: int, replica_ids: Sequence[int],
           modules: Callable[[int], list[torch.nn.Module]], pending: Sequence[PendingGradients], run: int,
           base: int | None) -> "MicroBatchedRun | None":
        """The micro-batched run of ``args``/``kwargs``; None when they hold no per-replica rows
        (a run that creates optimizers, say), which runs once per replica as usual."""
        rows = [_rows(i, (args, kwargs)) for i in range(len(replica_ids))]
        if any(r is None for r in rows):
            return None
        return cls(layout, args, kwargs, num_replicas, replica_ids, modules, pending, run, base,
                   rows)  # type: ignore[arg-type]

    def __call__(self, fn: Callable[..., Any], i: int, rctx: ReplicaContext) -> Any:
        rid, k = self.replica_ids[i], self.k
        first = rid * k
        rows = self.rows[i]
        total_rows = self.global_rows
        if total_rows is None:
            total_rows = int(collectives.all_reduce(torch.tensor(rows, dtype=torch.int64), "sum").item())
        sizes = dealt_sizes(total_rows, self.layout.micro_batches, self.num_replicas)[first:first + k]
        if sum(sizes) != rows:
            raise ValueError(
                f"replica {rid} got {rows} rows of a global batch of {total_rows}, but the layout-invariant "
                f"split into {self.layout.micro_batches} micro-batches gives it {sum(sizes)} (micro-batches "
                f"{first}..{first + k - 1}); feed run with strategy.distribute_dataset (or "
                f"cr.replica_share for your own split)")
        counted = counted_micro_batches(total_rows, self.layout.micro_batches)
        modules = [m for m in self.modules(i) if any(mod.training for mod in m.modules())]
        params = _unique(p for m in self.modules(i) for p in m.parameters() if p.requires_grad)
        buffers = _unique(b for m in modules for b in m.buffers())
        start = [_widen(b) for b in buffers]  # exact copies (half floats and integers widened)
        stack = TreeStack()
        pending = self.pending[i]
        outs: list[tuple[int, Any]] = []
        lo = 0
        for j, n in enumerate(sizes):
            m = first + j
            if j:
                for b, w in zip(buffers, start):
                    b.copy_(w)
            for p in params:
                p.grad = None
            a, kw = _cut(self.args, self.kwargs, i, lo, n, rows)
            lo += n
            mb = MicroBatch(index=m, first=first, count=k, total=self.layout.micro_batches, rows=n,
                            run=self.run, pending=pending, slots=self.slots, counted=counted)
            rctx.micro_batch = mb
            try:
                with entered(self.base + m) if self.base is not None else contextlib.nullcontext():
                    outs.append((n, fn(*a, **kw)))
            finally:
                rctx.micro_batch = None
            pending.fold(mb, params)
            if buffers:  # what the micro-batch changed: a buffer it left alone adds exact zeros, an empty one nothing
                stack.push(m, [_widen(b) - w if n else nothing_like(w) for b, w in zip(buffers, start)])
        if pending.stepped_run == self.run:
            pending.clear()  # what no optimizer stepped is dropped, as zero_grad would
        if buffers:
            self._combine_buffers(buffers, start, stack, counted)
        return _results(outs, self.layout.results)

    def _combine_buffers(self, buffers: list[torch.Tensor], start: list[torch.Tensor], stack: TreeStack,
                         counted: int) -> None:
        """Every buffer := its value at the start of the run + the tree mean over the ``counted``
        micro-batches with rows of what each changed (the same on every replica; a buffer no
        micro-batch changed keeps its bytes)."""
        flats: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for idx, w in enumerate(start):
            flats.setdefault((w.dtype, w.device), []).append(idx)
        nodes = stack.nodes
        for (dtype, _), members in flats.items():
            parts = [(node, torch.cat([value[idx].reshape(-1) for idx in members])) for node, value in nodes]
            total = tree_all_sum(parts, self.slots)
            offset = 0
            for idx in members:
                b = buffers[idx]
                piece = total[offset:offset + b.numel()].view(b.shape)
                offset += b.numel()
                with torch.no_grad():
                    if not counted:  # a global batch of no rows: nothing changed
                        b.copy_(start[idx])
                        continue
                    mean = (piece / counted if dtype.is_floating_point or dtype.is_complex
                            else torch.div(piece, counted, rounding_mode="floor"))
                    b.copy_(start[idx] + mean)


def _widen(b: torch.Tensor) -> torch.Tensor:
    """A buffer as summed: float32 for half floats, int64 for integers and bools, a copy."""
    if b.dtype in (torch.float16, torch.bfloat16):
        return b.detach().float()
    if not (b.dtype.is_floating_point or b.dtype.is_complex):
        return b.detach().to(torch.int64, copy=True)
    return b.detach().clone()


def _unique(items: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in items:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _split_leaf(x: Any) -> bool:
    return isinstance(x, PerReplica) and not isinstance(x, Mirrored)


def _rows(i: int, args: Any) -> int | None:
    """The rows of replica ``i``'s share: dim 0 of its PerReplica tensors (they must agree);
    None when there are none."""
    found: set[int] = set()
    for leaf in nest.flatten(args)[0]:
        if _split_leaf(leaf):
            for t in nest.flatten(leaf.values[i])[0]:
                if isinstance(t, torch.Tensor) and t.dim() >= 1:
                    found.add(t.shape[0])
    if len(found) > 1:
        raise ValueError(f"the per-replica tensors of run's arguments have different row counts {sorted(found)}; "
                         f"the layout-invariant mode cuts them into micro-batches along dim 0, so they must agree")
    return found.pop() if found else None


def _cut(args: tuple, kwargs: dict, i: int, lo: int, n: int, rows: int) -> tuple[tuple, dict]:
    """Replica ``i``'s arguments with its PerReplica values cut to rows ``[lo, lo + n)``."""
    def one(x: Any) -> Any:
        if isinstance(x, DistributedValues):
            value = x.values[i]
            if not _split_leaf(x):
                return value
            return nest.map_structure(lambda t: _narrow(t, lo, n, rows), value)
        return x
    return nest.map_structure(one, args), nest.map_structure(one, kwargs)


def _narrow(x: Any, lo: int, n: int, rows: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == rows:
        return x.narrow(0, lo, n)
    if isinstance(x, (list, tuple)) and len(x) == rows:
        return nest.rebuild(x, range(n), x[lo:lo + n])
    if hasattr(x, "shape") and hasattr(x, "__getitem__") and getattr(x, "shape", ())[:1] == (rows,):
        return x[lo:lo + n]
    return x


def _results(calls: list[tuple[int, Any]], how: str) -> Any:
    """A replica's result of the run from its micro-batches' ``(rows, result)`` (``LayoutInvariant.results``):
    those of the micro-batches with rows (an empty one's mean loss is nan); a replica whose
    micro-batches are all empty returns theirs."""
    outs = [out for rows, out in calls if rows] or [out for _, out in calls]
    if len(outs) == 1 or how == "last":
        return outs[-1]
    leaves = [nest.flatten(o)[0] for o in outs]
    _, spec = nest.flatten(outs[-1])

    def combine(values: list[Any]) -> Any:
        if not all(isinstance(v, torch.Tensor) for v in values):
            return values[-1]
        if how == "concat":
            return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values])
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total if how == "sum" else total / len(values)

    return nest.unflatten(spec, [combine([leaf[j] for leaf in leaves]) for j in range(len(leaves[0]))])
