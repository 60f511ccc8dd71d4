"""A summation whose bits depend only on the list of summands, never on who adds them.

The layout-invariant mode (:mod:`crossreplica.micro_batches`) sums
per-micro-batch gradients this way, so one device, 2, 3, 4 or 8 replicas,
threads or processes give the same bits.

The sum of ``n`` summands (indices ``0 .. n-1``, one tensor each) is defined as a
fixed binary tree over the indices: the tree over ``[lo, lo + size)`` with
``size`` a power of two is ``tree(left half) + tree(right half)``, a half that
starts at or past ``n`` is absent and a node with an absent right half is its
left half. The root spans the smallest power of two ``>= n``. IEEE addition is
commutative and deterministic, so the result is a function of the summands
alone.

A worker that holds the contiguous indices ``[start, stop)`` reduces them to
their *canonical nodes*: the aligned dyadic intervals (``lo`` a multiple of the
size) that cover ``[start, stop)`` with the fewest pieces, each summed by the
same tree. Every node of the tree that a worker computes is thus a node of the
global tree, and the global sum is assembled from the workers' nodes
(:func:`tree_combine`) with the same additions in the same places as one worker
that holds every index. A contiguous range of ``m`` indices has at most
``2 * ceil(log2(m + 1))`` canonical nodes; a range that is itself an aligned
power of two (``m`` replicas of ``n = m * 2**j``) has one.

Error bound (pairwise summation): with ``d = ceil(log2 n)`` levels, the computed
sum ``s`` of ``x_0 .. x_{n-1}`` in a format with unit roundoff ``u`` satisfies
``|s - sum x_i| <= d * u * sum |x_i|`` to first order (``n - 1`` in place of ``d``
for a left-to-right sum). Why a tree and not an exact accumulator:
docs/layout_invariance.md, "Why a tree, and its error bound".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["Node", "TreeStack", "tree_combine", "tree_nodes"]

#: ``(lo, hi)``: the aligned interval of summand indices a partial sum covers.
Node = tuple[int, int]


def _root_size(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tree_nodes(start: int, stop: int) -> list[Node]:
    """The canonical nodes of ``[start, stop)``, in index order: aligned dyadic intervals
    (``lo % (hi - lo) == 0``, sizes powers of two), as few as possible."""
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop; got start={start}, stop={stop}")
    nodes: list[Node] = []
    lo = start
    while lo < stop:
        size = lo & -lo if lo else _root_size(stop)
        while lo + size > stop:
            size //= 2
        nodes.append((lo, lo + size))
        lo += size
    return nodes


class TreeStack:
    """The partial sums of a worker's contiguous summands, pushed in index order.

    ``push(i, value)`` adds summand ``i`` (the next index after the last one pushed);
    two nodes that are the halves of an aligned interval merge at once, left + right,
    so at any time :attr:`nodes` are the canonical nodes of the indices pushed so far
    and at most ``log2`` of them are held. Values are lists of tensors (one per
    parameter or per flat buffer), added elementwise.
    """

    __slots__ = ("_stack",)

    def __init__(self) -> None:
        self._stack: list[tuple[Node, list[torch.Tensor]]] = []

    def push(self, index: int, value: list[torch.Tensor]) -> None:
        if self._stack and self._stack[-1][0][1] != index:
            raise ValueError(f"summand {index} pushed after {self._stack[-1][0][1] - 1}; push in index order")
        node, acc = (index, index + 1), value
        while self._stack:
            (lo, hi), left = self._stack[-1]
            size = hi - lo
            if node[1] - node[0] != size or lo % (2 * size):
                break
            self._stack.pop()
            for a, b in zip(left, acc):  # left + right, in place in the left half's buffers
                a.add_(b)
            node, acc = (lo, node[1]), left
        self._stack.append((node, acc))

    @property
    def nodes(self) -> list[tuple[Node, list[torch.Tensor]]]:
        """``[(interval, partial sums)]`` in index order."""
        return list(self._stack)

    def __len__(self) -> int:
        return len(self._stack)


def tree_combine(nodes: Mapping[Node, torch.Tensor], n: int) -> torch.Tensor:
    """The tree sum of summands ``0 .. n-1`` from partial sums that cover them.

    ``nodes`` maps intervals to their partial sums; they must be nodes of the tree
    (aligned, as :func:`tree_nodes` gives them) and cover ``[0, n)`` without
    overlap. The same additions happen in the same order whoever computed the nodes.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 summand; got {n}")

    def total(lo: int, size: int) -> torch.Tensor | None:
        if lo >= n:
            return None
        found = nodes.get((lo, lo + size))
        if found is not None:
            return found
        if size == 1:
            raise ValueError(f"summand {lo} of {n} is in none of the partial sums {sorted(nodes)}")
        left = total(lo, size // 2)  # lo < n: never absent
        right = total(lo + size // 2, size // 2)
        return left if right is None else left + right  # type: ignore[operator]

    return total(0, _root_size(n))  # type: ignore[return-value]


def sequential_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``values[0] + values[1] + ...`` left to right (several trees, in a fixed order)."""
    out = values[0]
    for v in values[1:]:
        out = out + v
    return out
