"""Layout-invariant training: a step's result depends on the global batch only.

``cr.LayoutInvariant(micro_batches=M)`` passed as ``layout_invariant=`` to a
strategy turns the mode on (docs/layout_invariance.md):

* every global batch of ``B`` rows is cut into ``M`` micro-batches,
  :func:`micro_batch_sizes` (the first ``B % M`` get one row more);
  ``distribute_dataset`` deals them out contiguously, ``k = ceil(M / R)`` to each of
  the ``R <= M`` replicas (:func:`dealt_sizes`: where ``R`` does not divide ``M`` the
  last replica's share is padded with empty micro-batches, indices ``M .. k·R - 1``),
  and one device runs all ``M``;
* the replica function runs once per micro-batch, drawing random numbers as
  replica ``m`` of a run would (seed ``base + m``, whatever replica runs it);
* an empty micro-batch (no rows: ``B < M``, or the padding) contributes nothing:
  its gradients, weight, buffer changes and results are left out, its summands in
  the trees are ``-0.0`` (:func:`nothing_like`, the exact identity of IEEE addition,
  so the padding leaves the tree over ``[0, M)`` bitwise as it is), and a mean
  divides by the micro-batches that have rows;
* the gradients of each micro-batch enter a per-parameter :class:`TreeStack`
  before any addition, and CrossShardOptimizer combines the replicas' partial sums
  by the fixed tree over micro-batch indices (:mod:`crossreplica.tree_sum`);
* the mirrored modules' buffers (BatchNorm statistics) are, after the run, the
  tree mean over the micro-batches of what each micro-batch left, every
  micro-batch starting from the run's initial buffers.

This module holds the rules and the per-replica state; the loop is
:mod:`crossreplica.strategies.micro_batched` and the optimizer side
:mod:`crossreplica.optim.invariant`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .arguments import check_int
from .errors import summarize
from .tree_sum import Node, TreeStack, tree_nodes

__all__ = ["LayoutInvariant", "MicroBatch", "PendingGradients", "RESULTS", "check_layout", "counted_micro_batches",
           "dealt_sizes", "leaf_value", "micro_batch_sizes", "micro_batches_per_replica", "nothing_like",
           "replica_share"]

#: How a replica's results of its micro-batches become its result of the run.
RESULTS = ("mean", "sum", "concat", "last")


@dataclasses.dataclass(frozen=True)
class LayoutInvariant:
    """The layout-invariant mode: training whose bits do not depend on the replica count.

    Args:
        micro_batches: ``M``, the number of micro-batches each global batch is cut
            into; any number of replicas in sync from 1 to ``M`` gives the same bits
            (a divisor of ``M`` gives every replica as many micro-batches).
        results: how the replica function's results over a replica's micro-batches
            combine into that replica's result of ``run`` (tensor leaves;
            other leaves are the last micro-batch's): ``"mean"`` (default: a
            returned mean loss stays this replica's mean), ``"sum"`` (returned sums
            and counts), ``"concat"`` (per-row outputs, along dim 0) or ``"last"``.
        intra_op_threads: torch's intra-op threads while a run of the strategy is under
            way (``torch.set_num_threads``, restored after): CPU kernels may split a
            reduction by thread, so the bits hold for one value in every layout; 1 as
            torchrun's ``OMP_NUM_THREADS=1`` per process (None: leave torch's setting).
    """

    micro_batches: int
    results: str = "mean"
    intra_op_threads: int | None = 1

    def __post_init__(self) -> None:
        check_int(self.micro_batches, "micro_batches", low=1, hint=" (micro-batches per global batch)")
        if self.intra_op_threads is not None:
            check_int(self.intra_op_threads, "intra_op_threads", low=1, hint=" or None")
        if self.results not in RESULTS:
            raise ValueError(f"results must be one of {', '.join(map(repr, RESULTS))}; got "
                             f"{summarize(self.results)}")


def check_layout(value: Any, num_replicas: int) -> LayoutInvariant | None:
    """``value`` (a strategy's ``layout_invariant=`` argument) checked against the replica count."""
    if value is None:
        return None
    if not isinstance(value, LayoutInvariant):
        raise TypeError(f"layout_invariant must be a cr.LayoutInvariant(micro_batches=M) or None; got "
                        f"{summarize(value)}")
    if num_replicas > value.micro_batches:
        raise ValueError(
            f"layout_invariant=LayoutInvariant(micro_batches={value.micro_batches}) has fewer micro-batches than "
            f"the {num_replicas} replicas in sync: replicas {value.micro_batches}..{num_replicas - 1} would only "
            f"run empty micro-batches; use micro_batches >= {num_replicas} (a multiple of {num_replicas}, e.g. "
            f"micro_batches={num_replicas * value.micro_batches}, gives every replica as many)")
    return value


def micro_batch_sizes(rows: int, micro_batches: int) -> list[int]:
    """The rows of each micro-batch of a global batch of ``rows``: as even as possible,
    the first ``rows % micro_batches`` one row larger."""
    q, r = divmod(rows, micro_batches)
    return [q + (m < r) for m in range(micro_batches)]


def micro_batches_per_replica(micro_batches: int, num_replicas: int) -> int:
    """``ceil(M / R)``: the micro-batch indices each replica holds (the last ones may be empty padding)."""
    return -(-micro_batches // num_replicas)


def dealt_sizes(rows: int, micro_batches: int, num_replicas: int) -> list[int]:
    """The rows of micro-batches ``0 .. k·R - 1`` (``k``: :func:`micro_batches_per_replica`):
    :func:`micro_batch_sizes`, then empty micro-batches that pad the deal. Replica ``r`` holds
    indices ``[r·k, (r + 1)·k)``, so each holds an aligned run of the tree's summands (the fixed
    tree sum over ``k·R`` summands expects that) and the empty ones come last, where their
    ``-0.0`` summands leave the tree over ``[0, M)`` bitwise as it is."""
    k = micro_batches_per_replica(micro_batches, num_replicas)
    return micro_batch_sizes(rows, micro_batches) + [0] * (k * num_replicas - micro_batches)


def replica_share(rows: int, micro_batches: int, num_replicas: int) -> list[int]:
    """The rows of a global batch each replica gets: its micro-batches', contiguously
    (``ceil(M / R)`` micro-batches each, the last replicas' shares the smaller where ``R``
    does not divide ``M``)."""
    sizes = dealt_sizes(rows, micro_batches, num_replicas)
    k = micro_batches_per_replica(micro_batches, num_replicas)
    return [sum(sizes[r * k:(r + 1) * k]) for r in range(num_replicas)]


def counted_micro_batches(rows: int, micro_batches: int) -> int:
    """The micro-batches of a global batch of ``rows`` that have rows (what an unweighted mean
    divides by): ``min(rows, M)``."""
    return min(rows, micro_batches)


def nothing_like(t: torch.Tensor) -> torch.Tensor:
    """What an empty micro-batch adds to a tree sum: ``-0.0`` everywhere (``x + -0.0`` is ``x``
    for every float ``x``, ``-0.0`` included, where ``+0.0`` would turn ``-0.0`` into ``+0.0``);
    0 for integers."""
    if t.is_complex():
        return torch.full_like(t, complex(-0.0, -0.0))
    if t.is_floating_point():
        return torch.full_like(t, -0.0)
    return torch.zeros_like(t)


@dataclasses.dataclass
class MicroBatch:
    """Where a replica is in its run's micro-batch loop (``rctx.micro_batch``).

    ``index`` is the global micro-batch index (``first + j``), ``first`` and
    ``count`` this replica's range, ``total`` the micro-batches per global batch,
    ``slots`` the tree's summands (``total`` and the empty micro-batches that pad the
    deal: ``count`` times the replicas), ``rows`` this micro-batch's rows (0: empty,
    it contributes nothing), ``counted`` the micro-batches of the global batch that
    have rows (an unweighted mean divides by it); ``pending`` the replica's gradient
    sums not yet stepped.
    """

    index: int
    first: int
    count: int
    total: int
    rows: int
    run: int
    pending: "PendingGradients"
    slots: int
    counted: int

    @property
    def is_last(self) -> bool:
        """The replica's last micro-batch of the run (where a step is taken)."""
        return self.index == self.first + self.count - 1


def leaf_value(g: torch.Tensor, weight: float | None) -> torch.Tensor:
    """A micro-batch's gradient as it enters the tree: half floats in float32, times ``weight``;
    a micro-batch of weight 0 adds nothing (:func:`nothing_like`; 0 * nan would be nan)."""
    if g.is_sparse:
        raise ValueError("the layout-invariant mode does not support sparse gradients; use dense embeddings "
                         "(sparse=False)")
    g = g.detach()
    if g.dtype in (torch.float16, torch.bfloat16):
        g = g.float()
    return g if weight is None else (g * weight if weight else nothing_like(g))


class _RunSums:
    """One run's partial sums on one replica: a tree stack per parameter and one of the weights."""

    __slots__ = ("run", "first", "count", "total", "slots", "counted", "grads", "weights", "weighted")

    def __init__(self, mb: MicroBatch):
        self.run, self.first, self.count, self.total = mb.run, mb.first, mb.count, mb.total
        self.slots, self.counted = mb.slots, mb.counted
        self.grads: dict[int, TreeStack] = {}
        self.weights = TreeStack()
        self.weighted: bool | None = None

    def nodes(self) -> list[Node]:
        """This replica's canonical nodes of the run's micro-batches."""
        return tree_nodes(self.first, self.first + self.count)

    def push(self, stack: TreeStack, index: int, value: torch.Tensor) -> None:
        """Pushes ``value`` as micro-batch ``index``; micro-batches skipped since the last push
        (no gradient, or no rows) enter as nothing (-0.0), so every stack covers the same range."""
        nodes = stack.nodes
        for missing in range(nodes[-1][0][1] if nodes else self.first, index):
            stack.push(missing, [nothing_like(value)])
        stack.push(index, [value])

    def has(self, p: torch.Tensor) -> bool:
        """Whether this replica has a gradient of ``p`` in the run."""
        return id(p) in self.grads

    def grad_node(self, p: torch.Tensor, j: int) -> torch.Tensor | None:
        """Node ``j`` of ``p``'s partial sums (None: no gradient in the run)."""
        stack = self.grads.get(id(p))
        return None if stack is None else self.value(stack, j, stack.nodes[0][1][0])

    def weight_node(self, j: int) -> float:
        """Node ``j`` of the weights' partial sums (0 when unweighted)."""
        if not self.weighted:
            return 0.0
        return float(self.value(self.weights, j, torch.zeros((), dtype=torch.float64)))

    def value(self, stack: TreeStack, j: int, like: torch.Tensor) -> torch.Tensor:
        """Node ``j`` of ``stack`` once the run is complete (nothing, -0.0, for the micro-batches left)."""
        stop = self.first + self.count
        nodes = stack.nodes
        if not nodes:
            for i in range(self.first, stop):
                stack.push(i, [nothing_like(like)])
        elif nodes[-1][0][1] < stop:
            self.push(stack, stop - 1, nothing_like(nodes[-1][1][0]))
        return stack.nodes[j][1][0]


class PendingGradients:
    """A replica's per-micro-batch gradients, folded into tree sums until a step takes them.

    Kept across runs: a run whose function only calls ``backward`` (gradient
    accumulation over several runs) leaves its sums here; the step combines every
    pending run, each by its own tree, and adds the runs in order.
    """

    def __init__(self) -> None:
        self.runs: list[_RunSums] = []
        self._folded: dict[int, tuple[int, int]] = {}  # id(param) -> (run, micro-batch) last folded
        self.stepped_run: int | None = None  # the last run in which an optimizer stepped
        #: ``(micro-batch, closure, random stream)`` of the run's ``step(closure)`` calls so far
        self.closures: list[tuple[MicroBatch, Any, Any]] = []

    def _sums(self, mb: MicroBatch) -> _RunSums:
        if not self.runs or self.runs[-1].run != mb.run:
            self.runs.append(_RunSums(mb))
        return self.runs[-1]

    def fold(self, mb: MicroBatch, params: list[torch.Tensor], weight: float | None = None) -> None:
        """Moves the gradients of ``params`` (times ``weight``) into micro-batch ``mb.index``'s
        place of the tree and clears them; parameters already folded for it are skipped.
        Half-precision gradients are summed in float32. An empty micro-batch's gradients
        and weight are dropped: it contributes nothing (its place is filled with -0.0)."""
        sums = self._sums(mb)
        if weight is not None:
            if sums.weighted is False:
                raise ValueError(
                    "CrossShardOptimizer.step got weight= in some micro-batches of a run and not in others; "
                    "pass weight= (the micro-batch's rows) in every step or in none")
            sums.weighted = True
        elif sums.weighted is None and any(p.grad is not None for p in params):
            sums.weighted = False
        key = (mb.run, mb.index)
        for p in params:
            g = p.grad
            if g is None or self._folded.get(id(p)) == key:
                continue
            if not mb.rows:  # an empty micro-batch: what its backward left (zeros, or nan) is not a gradient
                self._folded[id(p)] = key
                p.grad = None
                continue
            # The gradient itself is taken (.grad is cleared below, so the next backward makes a new one).
            value = leaf_value(g, weight)
            stack = sums.grads.get(id(p))
            if stack is None:
                stack = sums.grads[id(p)] = TreeStack()
            sums.push(stack, mb.index, value)
            self._folded[id(p)] = key
            p.grad = None
        if weight is not None and mb.rows:
            nodes = sums.weights.nodes
            if not nodes or nodes[-1][0][1] <= mb.index:
                sums.push(sums.weights, mb.index, torch.tensor(weight, dtype=torch.float64))

    def mark_folded(self, mb: MicroBatch, params: list[torch.Tensor]) -> None:
        """Records ``params`` as folded for ``mb`` (their ``.grad`` is the step's, not the micro-batch's)."""
        for p in params:
            self._folded[id(p)] = (mb.run, mb.index)

    def clear(self, params: list[torch.Tensor] | None = None) -> None:
        """Forgets the pending sums (of ``params``; None: all)."""
        if params is not None:
            for sums in self.runs:
                for p in params:
                    sums.grads.pop(id(p), None)
        if params is None or not any(sums.grads for sums in self.runs):
            self.runs.clear()
