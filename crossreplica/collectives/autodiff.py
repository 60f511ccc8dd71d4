"""A collective's forward (the engine call) and its derivative.

Eagerly, a collective is one engine call (:func:`raw`); when autograd or a
functorch transform (``torch.vmap``) needs to see it, it goes through
:class:`Collective`, whose backward is the dual collective: each kind's
``Spec.dual`` in ``engines/kinds.py``, summed up here:

================================  ==========================================
forward                           backward (the transpose, on the cotangents)
================================  ==========================================
all_reduce sum / mean             the same all_reduce
all_reduce max / min              sum of the cotangents, shared among the
                                  members that hold the extremum
all_reduce prod                   not differentiable (a clear RuntimeError)
all_gather (dim, sizes)           reduce_scatter sum along dim, each member
                                  its own (possibly uneven) part
reduce_scatter sum / mean         all_gather along dim (/ group size)
all_to_all (split, concat,        all_to_all (concat, split,
            in_sizes, out_sizes)              out_sizes, in_sizes)
broadcast from position p         all_reduce sum, kept at p, zero elsewhere
collective_permute(pairs)         collective_permute(inverted pairs)
================================  ==========================================

Every backward is written with the differentiable collectives themselves
(``run``), so a backward taken with ``create_graph=True`` is differentiable
again: gradient penalties and meta-learning get second (and higher) order
gradients, through the same rules. ``torch.compile`` uses the same rules
(``compiled.py``), with the collectives as custom operators.

Invariant: every member of a group runs the same backward collectives (a
backward that returns zeros on some members still calls the collective there),
so a backward never leaves a peer waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..torch_private import are_functorch_transforms_active, view_base
from ..context import ReplicaContext, current_replica_context
from ..engines.base import Call, Kind, is_inplace
from ..engines.kinds import REDUCING, SPECS, Run, gather
from ..engines.wire import execute_on_wire
from ..groups import Groups
from ..reduce_op import ReduceOp, all_finite, from_wire, mean_scale, to_wire

__all__ = ["Collective", "Run", "dual", "execute", "execute_one", "gather", "gather_sizes", "raw"]

_transforms_active = are_functorch_transforms_active


def raw(rctx: ReplicaContext, kind: Kind, groups: Groups, params: Any,
        tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The engine call itself: no autograd, no transforms."""
    # The context of the executing thread, not ``rctx``: a backward pass may run
    # in a later run with the forward's context (fine), while a replica thread
    # abandoned by a failed run still holds its old one (rejected). Autograd's
    # device threads hold none.
    current = current_replica_context()
    if current is not None:
        current.check_current("cr.", kind)
        device = current.device
        for t in tensors:
            if t.device != device:
                _wrong_device(current, kind, tensors, device)
    call = Call.of(kind, groups, params, tensors)
    # A MEAN whose engine checks the results itself, once for every replica, runs plain here.
    if kind in REDUCING and params.op is ReduceOp.MEAN and not rctx.engine.checks_mean_overflow(call):
        scales = [mean_scale(ReduceOp.MEAN, len(groups[0]), t.dtype) for t in tensors]
        if any(s is not None for s in scales):
            if not _mean_checked_after(kind, groups, call, tensors):
                return _scaled_mean(rctx, kind, groups, params, tensors, scales)
            # The plain MEAN first (no extra pass); only a sum past the dtype's range (an inf in
            # the result) takes the scaled path. Every replica holds the same result, so all of
            # them take the same branch and make the same engine calls.
            outs = execute_on_wire(rctx.engine, rctx.replica_id_in_sync_group, call, tensors)
            if all(s is None or all_finite(o) for o, s in zip(outs, scales)):
                return outs
            return _scaled_mean(rctx, kind, groups, params, tensors, scales)
    # float16/bfloat16 sums accumulate in float32; unsigned ints travel as signed ones (wire.py)
    return execute_on_wire(rctx.engine, rctx.replica_id_in_sync_group, call, tensors)


def _mean_checked_after(kind: Kind, groups: Groups, call: Call, tensors: list[torch.Tensor]) -> bool:
    """Whether a MEAN may run plain and be redone scaled only when its sum overflowed: an
    all-reduce over one group (every replica then sees the same result and decides alike)
    on CPU tensors (a CUDA check would synchronize) that leaves its inputs intact."""
    return (kind is Kind.ALL_REDUCE and len(groups) == 1 and not is_inplace(call)
            and all(t.device.type == "cpu" for t in tensors))


def _scaled_mean(rctx: ReplicaContext, kind: Kind, groups: Groups, params: Any, tensors: list[torch.Tensor],
                 scales: list[float | None]) -> list[torch.Tensor]:
    """A MEAN whose values are scaled down by a power of two before the sum and the result back
    up after, in the wire dtype (as the strategies' reductions), so that values above max/n
    do not overflow the sum (``reduce_op.mean_scale``); otherwise bitwise the plain MEAN."""
    op = ReduceOp.MEAN
    wire = [to_wire(op, t, s) for t, s in zip(tensors, scales)]
    call = Call.of(kind, groups, params, wire)
    source = tuple(t.dtype for t in tensors)
    if source != call.dtypes:
        call = call._replace(source_dtypes=source)
    outs = rctx.engine.execute(rctx.replica_id_in_sync_group, call, wire)
    return [from_wire(op, o, t.dtype, s) for o, s, t in zip(outs, scales, tensors)]


def _wrong_device(rctx: ReplicaContext, kind: Kind, tensors: list[torch.Tensor], device: torch.device) -> None:
    """Raises in the replica that passed a tensor on another device than its own."""
    bad = next(i for i, t in enumerate(tensors) if t.device != device)
    raise ValueError(
        f"cr.{kind}: tensor {bad} (shape {list(tensors[bad].shape)}) is on {tensors[bad].device}, but "
        f"replica {rctx.replica_id_in_sync_group} runs on {device}; move it there first, e.g. "
        f"x.to(cr.get_replica_context().device)")


def execute(rctx: ReplicaContext, kind: Kind, groups: Groups, params: Any,
            tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The eager collective: the engine call, through autograd/vmap only when they need it."""
    if _transforms_active() or (torch.is_grad_enabled() and _any_requires_grad(tensors)):
        return list(Collective.apply(rctx, kind, groups, params, *tensors))
    return raw(rctx, kind, groups, params, tensors)


def execute_one(rctx: ReplicaContext, kind: Kind, groups: Groups, params: Any, x: torch.Tensor) -> torch.Tensor:
    """:func:`execute` of a collective with one tensor in and one out (the common call)."""
    if _transforms_active() or (x.requires_grad and torch.is_grad_enabled()):
        return Collective.apply(rctx, kind, groups, params, x)[0]
    return raw(rctx, kind, groups, params, [x])[0]


def _any_requires_grad(tensors: list[torch.Tensor]) -> bool:
    for t in tensors:  # noqa: SIM110 - a plain loop: any() over a generator costs more on the hot path
        if t.requires_grad:
            return True
    return False


def gather_sizes(outs: Sequence[torch.Tensor], k: int) -> tuple[tuple[int, ...], ...]:
    """Per user leaf, every member's size along the gather dim, from the gathered sizes leaf
    (the last output: one row per member, one column per user leaf)."""
    return tuple(tuple(s) for s in outs[-1].view(k, -1).t().tolist())


class Collective(torch.autograd.Function):
    """A collective whose backward is its dual collective (see the module docstring)."""

    @staticmethod
    def forward(rctx, kind, groups, params, *xs):  # type: ignore[override]
        # An engine may return views of one buffer (small all-reduces, packed transfers);
        # autograd forbids modifying in place a view made inside a Function, so those are copied.
        return tuple([o.clone() if view_base(o) is not None else o for o in raw(rctx, kind, groups, params, list(xs))])

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        rctx, kind, groups, params, *xs = inputs
        ctx.rctx, ctx.kind, ctx.groups, ctx.params = rctx, kind, groups, params
        # The gathered sizes are plain ints, read here once (the backward may be traced).
        ctx.sizes = gather_sizes(output, len(groups[0])) if kind is Kind.ALL_GATHER else None
        if SPECS[kind].saves_inputs(params):
            ctx.save_for_backward(*xs, *output)
        ctx.mark_non_differentiable(*[o for o in output if not (o.dtype.is_floating_point or o.dtype.is_complex)])

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        rctx = ctx.rctx

        def run(kind: Kind, groups: Groups, params: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return execute(rctx, kind, groups, params, tensors)

        saved = ctx.saved_tensors if SPECS[ctx.kind].saves_inputs(ctx.params) else ()
        grads_in = dual(ctx.kind, ctx.groups, ctx.params, list(grads), saved, ctx.sizes,
                        rctx.replica_id_in_sync_group, run)
        return (None, None, None, None, *grads_in)

    @staticmethod
    def vmap(info, in_dims, rctx, kind, groups, params, *xs):  # type: ignore[override]
        # A collective acts elementwise on whatever it does not split or gather, so the
        # batched call is the collective of the stacked batch (every replica must map
        # over the same batch size): move each batch dim to the front, shift the dims.
        dims = in_dims[4:]
        batched = [d is not None for d in dims]
        moved = [x if d is None else x.movedim(d, 0) for x, d in zip(xs, dims)]
        def shift(dims: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(d + 1 if b else d for d, b in zip(dims, batched))

        outs = execute(rctx, kind, groups, SPECS[kind].batched(params, shift), moved)
        return tuple(outs), tuple(0 if b else None for b in batched)


def dual(kind: Kind, groups: Groups, params: Any, grads: list[torch.Tensor], saved: Sequence[torch.Tensor],
         sizes: Any, rid: int | torch.Tensor, run: Run) -> Sequence[torch.Tensor | None]:
    """Input cotangents of a collective: the dual collective on the output cotangents
    (the kind's ``Spec.dual``; see the table in the module docstring)."""
    rule = SPECS[kind].dual
    if rule is None:
        raise RuntimeError(f"no gradient for collective '{kind}'")
    return rule(groups, params, grads, saved, sizes, rid, run)
