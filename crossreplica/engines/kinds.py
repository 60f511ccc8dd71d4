"""The collective kinds: one typed parameter record and one :class:`Spec` per kind.

A kind's rules live in its block below, as a JAX primitive registers its rules
in one place: what ``Call.describe`` shows, when two replicas' calls agree, the
output shapes (torch.compile's fake kernels), the batched parameters (vmap) and
the dual collective (the backward, stated beside the forward). Adding a kind is
one block here plus its transport in each engine. The layers above use these
rules through generic code (``collectives/autodiff.py``, ``collectives/compiled.py``,
``base.check_agreement``) and never branch on a kind's parameters themselves.

Parameter records are NamedTuples: cheap to build, hashed and compared as the
tuples they are, and picklable (the torch_dist engine ships calls between workers).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..groups import Groups, group_of
from ..reduce_op import ReduceOp

if TYPE_CHECKING:
    from .base import Call

__all__ = ["REDUCING", "SPECS", "AllGatherParams", "AllReduceParams", "AllToAllParams", "BroadcastParams",
           "Kind", "PermuteParams", "ReduceScatterParams", "Run", "Spec", "gather", "scatter_slice"]


class Kind(enum.Enum):
    """What a :class:`~crossreplica.engines.base.Call` asks the engine to do; ``str(kind)``
    is the name messages show. ``SPECS[kind]`` holds its rules and its parameter record."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    PERMUTE = "permute"
    MERGE_CALL = "merge_call"
    BARRIER = "barrier"
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


#: ``run(kind, groups, params, tensors) -> outputs``: a differentiable collective call.
Run = Callable[[Kind, Groups, Any, list[torch.Tensor]], list[torch.Tensor]]
#: A dual (backward) rule: ``(groups, params, grads, saved, sizes, rid, run) -> input cotangents``;
#: ``sizes`` are an all_gather's per-leaf member sizes (None: equal parts), ``rid`` this replica's
#: id, an int or (traced under torch.compile) a 0-d tensor.
Dual = Callable[[Groups, Any, list[torch.Tensor], Sequence[torch.Tensor], Any, "int | torch.Tensor", Run],
                Sequence["torch.Tensor | None"]]
Shift = Callable[[tuple[int, ...]], tuple[int, ...]]


def _same_shapes(a: Call, b: Call) -> bool:
    return a.shapes == b.shapes


def _never(params: Any) -> bool:
    return False


def _unchanged(params: Any, shift: Shift) -> Any:
    return params


@dataclass(frozen=True, slots=True)
class Spec:
    """Every rule of one kind; the defaults serve a kind that keeps shapes and has no parameters."""

    kind: Kind
    #: the parameter record (None: the kind carries ``()``)
    record: type | None = None
    #: ``(label, field)`` pairs ``Call.describe`` shows, in order
    shown: tuple[tuple[str, str], ...] = ()
    #: a fixed description instead of ``kind(params, groups, shapes, dtypes)``
    text: str | None = None
    #: carries no tensors: replicas agree on it by kind alone
    meeting: bool = False
    #: replicas agree within each group (False: among all of them, and describe omits the groups)
    grouped: bool = True
    #: reduces with ``params.op`` (wire dtypes accumulate; a MEAN may be scaled against overflow)
    reducing: bool = False
    #: the members' parameters agree (``a``, ``b``: two members' records)
    params_agree: Callable[[Any, Any], bool] = operator.eq
    #: the members' shapes agree
    shapes_agree: Callable[[Call, Call], bool] = _same_shapes
    #: the group as a whole agrees (``calls``: per member in group order, None for another worker's)
    group_agree: Callable[[tuple[int, ...], Sequence["Call | None"]], bool] | None = None
    #: ``(params, leaf, input shape, group size) -> output shape`` (None: the input's shape and strides)
    out_shape: Callable[[Any, int, list[int], int], list[int]] | None = None
    #: the parameters for leaves that gained a leading batch dim (``shift`` moves a dims tuple)
    batched: Callable[[Any, Shift], Any] = _unchanged
    #: the backward needs the forward's inputs and outputs
    saves_inputs: Callable[[Any], bool] = _never
    #: the backward (None: not differentiable)
    dual: Dual | None = None
    #: per leaf, the dim along which the members' sizes may differ (None: none): masked in
    #: the signature the workers compare (:meth:`signature`)
    varying_dims: Callable[[Any], tuple[int, ...]] | None = None

    def describe_params(self, params: Any) -> list[str]:
        return [f"{label}={_fmt(getattr(params, field))}" for label, field in self.shown]

    def signature(self, call: Call) -> str:
        """What every worker's call must match: ``call.describe()`` with the sizes along
        ``varying_dims`` masked."""
        if self.varying_dims is None:
            return call.describe()
        shapes = tuple(tuple(-1 if i == dim else size for i, size in enumerate(shape))
                       for dim, shape in zip(self.varying_dims(call.params), call.shapes))
        return call._replace(shapes=shapes).describe()

    @property
    def compared_locally(self) -> bool:
        """Whether an engine of several replicas per worker may check its local members'
        calls within their part of each group. Not for meetings, calls whose groups are
        every replica (permute: the pairs say who meets whom), or whose group agrees as a
        whole (all_to_all's split sizes, by position in the whole group)."""
        return not self.meeting and self.grouped and self.group_agree is None


def _fmt(v: Any) -> str:
    return str(v) if not isinstance(v, tuple) else str([list(p) if isinstance(p, tuple) else p for p in v])


def _shapes_agree_except(dims: Sequence[int], a: Call, b: Call) -> bool:
    """Shapes agree except along ``dims`` (one per leaf): an all_gather's uneven parts."""
    if len(a.shapes) != len(b.shapes):
        return False
    for d, sa, sb in zip(dims, a.shapes, b.shapes):
        if len(sa) != len(sb) or sa[:d] + sa[d + 1:] != sb[:d] + sb[d + 1:]:
            return False
    return True


def scatter_slice(extent: int, pos: int, k: int, sizes: Sequence[int] | None) -> tuple[int, int]:
    """``(start, length)`` along the scattered dim for the member at ``pos`` of ``k``:
    equal chunks, or the per-member ``sizes`` (an uneven all_gather's backward, an uneven
    all_to_all's split sizes)."""
    if sizes is None:
        chunk = extent // k
        return pos * chunk, chunk
    return sum(sizes[:pos]), sizes[pos]


# --------------------------------------------------------------------------- all_reduce

class AllReduceParams(NamedTuple):
    op: ReduceOp
    #: writes the results into the input tensors, which must be contiguous, and returns them
    #: (for callers that own their buffers, such as the optimizer's gradient packs)
    inplace: bool = False


def _all_reduce_saves(p: AllReduceParams) -> bool:
    return p.op in (ReduceOp.MAX, ReduceOp.MIN)


def _all_reduce_dual(groups: Groups, p: AllReduceParams, grads: list[torch.Tensor], saved: Sequence[torch.Tensor],
                     sizes: Any, rid: int | torch.Tensor, run: Run) -> Sequence[torch.Tensor | None]:
    """sum / mean: the same all_reduce; max / min: the sum of the cotangents, shared among the
    members that hold the extremum; prod: not differentiable."""
    if p.op in (ReduceOp.SUM, ReduceOp.MEAN):
        return run(Kind.ALL_REDUCE, groups, AllReduceParams(p.op), grads)
    if p.op in (ReduceOp.MAX, ReduceOp.MIN):
        xs, outs = saved[:len(grads)], saved[len(grads):]
        masks = [(x == o).to(g.dtype) for x, o, g in zip(xs, outs, grads)]
        summed = run(Kind.ALL_REDUCE, groups, AllReduceParams(ReduceOp.SUM), grads + masks)
        total, count = summed[:len(grads)], summed[len(grads):]
        return [t * m / c for t, m, c in zip(total, masks, count)]
    raise RuntimeError(
        f"the gradient of all_reduce with op={p.op} is not implemented; use op='sum', 'mean', "
        f"'max' or 'min' for differentiable reductions")


ALL_REDUCE = Spec(Kind.ALL_REDUCE, AllReduceParams, shown=(("op", "op"),), reducing=True,
                  saves_inputs=_all_reduce_saves, dual=_all_reduce_dual)


# --------------------------------------------------------------------------- all_gather

class AllGatherParams(NamedTuple):
    #: per leaf, the dim gathered along (sizes along it may differ between members)
    dims: tuple[int, ...]


def _all_gather_shapes(a: Call, b: Call) -> bool:
    return _shapes_agree_except(a.params.dims, a, b)


def _all_gather_out(p: AllGatherParams, leaf: int, shape: list[int], k: int) -> list[int]:
    shape[p.dims[leaf]] *= k
    return shape


def _all_gather_dual(groups: Groups, p: AllGatherParams, grads: list[torch.Tensor], saved: Sequence[torch.Tensor],
                     sizes: Any, rid: int | torch.Tensor, run: Run) -> Sequence[torch.Tensor | None]:
    """reduce_scatter sum along the dim, each member its own (possibly uneven) part; the last
    leaf carried the sizes (:func:`gather`)."""
    out = run(Kind.REDUCE_SCATTER, groups, ReduceScatterParams(ReduceOp.SUM, p.dims[:-1], sizes), grads[:-1])
    return [*out, None]


def gather(run: Run, groups: Groups, dims: tuple[int, ...], tensors: list[torch.Tensor],
           device: torch.device | None = None) -> list[torch.Tensor]:
    """all_gather of ``tensors`` along ``dims`` (sizes may differ): the sizes along the gather
    dims travel as one more leaf, so that a backward can scatter uneven parts. The leaf sits
    on the tensors' device (``device``, the replica's, when there are none): engines check
    that every leaf sits where the replica runs."""
    device = tensors[0].device if tensors else device
    sizes = torch.tensor([t.shape[d] for t, d in zip(tensors, dims)], dtype=torch.int64, device=device)
    return run(Kind.ALL_GATHER, groups, AllGatherParams(dims + (0,)), [*tensors, sizes])[:-1]


ALL_GATHER = Spec(Kind.ALL_GATHER, AllGatherParams, shown=(("dim", "dims"),), shapes_agree=_all_gather_shapes,
                  out_shape=_all_gather_out, batched=lambda p, shift: AllGatherParams(shift(p.dims)),
                  dual=_all_gather_dual, varying_dims=lambda p: p.dims)


# --------------------------------------------------------------------------- reduce_scatter

class ReduceScatterParams(NamedTuple):
    op: ReduceOp
    #: per leaf, the dim scattered along
    dims: tuple[int, ...]
    #: per leaf, every member's part along the dim (an uneven all_gather's backward); None: equal
    sizes: tuple[tuple[int, ...], ...] | None = None


def _reduce_scatter_out(p: ReduceScatterParams, leaf: int, shape: list[int], k: int) -> list[int]:
    shape[p.dims[leaf]] //= k
    return shape


def _reduce_scatter_dual(groups: Groups, p: ReduceScatterParams, grads: list[torch.Tensor],
                         saved: Sequence[torch.Tensor], sizes: Any, rid: int | torch.Tensor,
                         run: Run) -> Sequence[torch.Tensor | None]:
    """sum / mean: all_gather along the dim (/ group size)."""
    if p.op not in (ReduceOp.SUM, ReduceOp.MEAN):
        raise RuntimeError(
            f"the gradient of reduce_scatter with op={p.op} is not implemented; use op='sum' or 'mean'")
    out = gather(run, groups, p.dims, grads)
    if p.op is ReduceOp.MEAN:
        k = len(groups[0])
        out = [o / k for o in out]
    return out


REDUCE_SCATTER = Spec(Kind.REDUCE_SCATTER, ReduceScatterParams, shown=(("op", "op"), ("dim", "dims")),
                      reducing=True, out_shape=_reduce_scatter_out,
                      batched=lambda p, shift: p._replace(dims=shift(p.dims)), dual=_reduce_scatter_dual)


# --------------------------------------------------------------------------- all_to_all

class AllToAllParams(NamedTuple):
    split_dims: tuple[int, ...]
    concat_dims: tuple[int, ...]
    #: rows sent to each member, the same for every leaf (None: equal chunks); they may differ
    #: between the members of a group, and need split_dims == concat_dims
    input_splits: tuple[int, ...] | None = None
    #: rows received from each member (None: equal chunks)
    output_splits: tuple[int, ...] | None = None


def _all_to_all_params(a: AllToAllParams, b: AllToAllParams) -> bool:
    # split sizes are per member: _all_to_all_splits compares them
    return a.split_dims == b.split_dims and a.concat_dims == b.concat_dims


def _all_to_all_shapes(a: Call, b: Call) -> bool:
    """Exact, except along the split dims of an uneven all_to_all."""
    pa, pb = a.params, b.params
    if (pa.input_splits is None and pa.output_splits is None and pb.input_splits is None
            and pb.output_splits is None):
        return a.shapes == b.shapes
    return _shapes_agree_except(pa.split_dims, a, b)


def _all_to_all_splits(group: tuple[int, ...], calls: Sequence[Call | None]) -> bool:
    """Member ``i`` sends member ``j`` as many rows as ``j`` expects from ``i``, on every leaf."""
    k = len(group)

    def sizes(call: Call, given: Sequence[int] | None, leaf: int) -> Sequence[int]:
        if given is not None:
            return given
        extent = call.shapes[leaf][call.params.split_dims[leaf]]
        return [extent // k] * k

    for leaf in range(len(next(c for c in calls if c is not None).shapes)):
        for i, sender in enumerate(calls):
            for j, receiver in enumerate(calls):
                if sender is None or receiver is None:
                    continue
                if (sizes(sender, sender.params.input_splits, leaf)[j]
                        != sizes(receiver, receiver.params.output_splits, leaf)[i]):
                    return False
    return True


def _all_to_all_out(p: AllToAllParams, leaf: int, shape: list[int], k: int) -> list[int]:
    sd, cd = p.split_dims[leaf], p.concat_dims[leaf]
    if p.output_splits is not None:
        shape[sd] = sum(p.output_splits)  # uneven: split_dim == concat_dim
    else:
        shape[sd] = shape[sd] // k
        shape[cd] = shape[cd] * k
    return shape


def _all_to_all_dual(groups: Groups, p: AllToAllParams, grads: list[torch.Tensor], saved: Sequence[torch.Tensor],
                     sizes: Any, rid: int | torch.Tensor, run: Run) -> Sequence[torch.Tensor | None]:
    """all_to_all with split and concat dims, and input and output sizes, swapped."""
    return run(Kind.ALL_TO_ALL, groups, AllToAllParams(p.concat_dims, p.split_dims, p.output_splits, p.input_splits),
               grads)


ALL_TO_ALL = Spec(Kind.ALL_TO_ALL, AllToAllParams,
                  shown=(("split_dim", "split_dims"), ("concat_dim", "concat_dims"),
                         ("input_split_sizes", "input_splits"), ("output_split_sizes", "output_splits")),
                  params_agree=_all_to_all_params, shapes_agree=_all_to_all_shapes, group_agree=_all_to_all_splits,
                  out_shape=_all_to_all_out,
                  batched=lambda p, shift: p._replace(split_dims=shift(p.split_dims), concat_dims=shift(p.concat_dims)),
                  dual=_all_to_all_dual)


# --------------------------------------------------------------------------- broadcast

class BroadcastParams(NamedTuple):
    #: the position in the group of the member whose value everyone gets
    source: int


def _broadcast_dual(groups: Groups, p: BroadcastParams, grads: list[torch.Tensor], saved: Sequence[torch.Tensor],
                    sizes: Any, rid: int | torch.Tensor, run: Run) -> Sequence[torch.Tensor | None]:
    """all_reduce sum, kept at the source, zero elsewhere."""
    total = run(Kind.ALL_REDUCE, groups, AllReduceParams(ReduceOp.SUM), grads)
    if isinstance(rid, torch.Tensor):
        sources = torch.tensor([g[p.source] for g in groups], dtype=rid.dtype, device=rid.device)
        at_source = (sources == rid).any()
        return [torch.where(at_source, t, t.new_zeros(())) for t in total]
    if group_of(groups, rid).index(rid) == p.source:
        return total
    # a zero that stays on the graph, so a second backward meets the peers here too
    return [t * 0 if t.requires_grad else torch.zeros_like(t) for t in total]


BROADCAST = Spec(Kind.BROADCAST, BroadcastParams, shown=(("source", "source"),), dual=_broadcast_dual)


# --------------------------------------------------------------------------- permute

class PermuteParams(NamedTuple):
    #: sorted ``(source, target)`` replica ids; replicas that are no target receive zeros
    pairs: tuple[tuple[int, int], ...]


def _permute_dual(groups: Groups, p: PermuteParams, grads: list[torch.Tensor], saved: Sequence[torch.Tensor],
                  sizes: Any, rid: int | torch.Tensor, run: Run) -> Sequence[torch.Tensor | None]:
    """The inverse permutation."""
    return run(Kind.PERMUTE, groups, PermuteParams(tuple(sorted((t, s) for s, t in p.pairs))), grads)


# Its groups are every replica (the pairs say who meets whom): describe leaves them out.
PERMUTE = Spec(Kind.PERMUTE, PermuteParams, shown=(("pairs", "pairs"),), grouped=False, dual=_permute_dual)


# --------------------------------------------------------------------------- meetings (no tensors, params ())

MERGE_CALL = Spec(Kind.MERGE_CALL, text="merge_call()", meeting=True)
BARRIER = Spec(Kind.BARRIER, meeting=True)
#: what a replica that returned from its function "calls" where others may still wait
FINISHED = Spec(Kind.FINISHED, text="<returned from the replica function>", meeting=True)


SPECS: dict[Kind, Spec] = {s.kind: s for s in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST,
                                                PERMUTE, MERGE_CALL, BARRIER, FINISHED)}
#: the kinds that reduce (a tuple: membership by identity is the cheapest test on the hot path)
REDUCING: tuple[Kind, ...] = tuple(k for k, s in SPECS.items() if s.reducing)
