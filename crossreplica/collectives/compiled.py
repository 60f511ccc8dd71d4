"""The collectives as ``torch.library`` custom operators, for torch.compile.

Under ``torch.compile`` a collective is a call of ``torch.ops.crossreplica.<kind>``
(``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``,
``permute``), one operator per kind with one schema::

    (Tensor[] xs, int[] groups, int group_size, str params) -> Tensor[]

``groups`` is the canonical group assignment flattened (``group_size`` members per
group) and ``params`` the call's parameters, encoded by :func:`encode`. A fake
implementation gives the output shapes, so Dynamo and AOTAutograd trace through
without a graph break; the real one runs the engine in the calling replica
thread, exactly as the eager path does, so compiled and eager results are the
same bytes. Each kind's rules come from its spec (``engines/kinds.py``): the fake
kernel from ``Spec.out_shape``, the backward from ``Spec.dual`` (on these
operators), so compiled training steps, and their second derivatives,
differentiate through the collectives.

Restriction: shapes must be known when tracing, so under torch.compile every
member of an all_gather group must pass the same size along the gather dim (an
uneven gather raises a ValueError at run time, naming the sizes; it works
eagerly), and the uneven parts of a gather's backward are not traced.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import torch

from .. import torch_private as tp
from ..context import require_replica_context
from ..engines.kinds import SPECS, Kind
from ..groups import Groups
from ..reduce_op import ReduceOp
from .autodiff import dual, raw

__all__ = ["encode", "execute"]

_KINDS = tuple(kind for kind, spec in SPECS.items() if not spec.meeting)
_SCHEMA = "(Tensor[] xs, int[] groups, int group_size, str params) -> Tensor[]"
_LIB = torch.library.Library("crossreplica", "DEF")


# --------------------------------------------------------------------------- parameters

def encode(params: tuple) -> str:
    """``params`` (a parameter record: ints, bools, None, ReduceOps and tuples of them) as the
    operator's string argument."""
    return ";".join(_encode_one(p) for p in params)


def _encode_one(p: object) -> str:
    if p is None:
        return "N"
    if isinstance(p, bool):
        return "T" if p else "F"
    if isinstance(p, ReduceOp):
        return p.name
    if isinstance(p, tuple):
        return "(" + ",".join(_encode_one(q) for q in p) + ")"
    return str(p)


def decode(text: str) -> tuple:
    """The inverse of :func:`encode` (the record's fields, in order)."""
    tokens = re.findall(r"[(),;]|[^(),;]+", text)
    pos = 0

    def item() -> object:
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token != "(":
            return _CONSTANTS[token] if token in _CONSTANTS else ReduceOp[token] if token in ReduceOp.__members__ \
                else int(token)
        items: list = []
        while tokens[pos] != ")":
            items.append(item())
            if tokens[pos] == ",":
                pos += 1
        pos += 1
        return tuple(items)

    out = []
    while pos < len(tokens):
        out.append(item())
        pos += 1  # the ";" between parameters
    return tuple(out)


_CONSTANTS = {"N": None, "T": True, "F": False}


@functools.lru_cache(maxsize=1024)
def _params(kind: Kind, text: str) -> tuple:
    """The kind's parameter record from the operator's string argument (a compiled graph
    passes the same few strings on every call: decoded once each)."""
    return SPECS[kind].record(*decode(text))  # type: ignore[misc]


@functools.lru_cache(maxsize=1024)
def _canonical(flat: tuple[int, ...], size: int) -> Groups:
    return tuple(tuple(flat[i:i + size]) for i in range(0, len(flat), size))


def _groups(flat: Sequence[int], size: int) -> Groups:
    return _canonical(tuple(flat), size)


# --------------------------------------------------------------------------- the operators

def execute(kind: Kind, groups: Groups, params: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The collective as a call of its custom operator (what torch.compile traces)."""
    op = getattr(torch.ops.crossreplica, kind.value)
    flat = [r for g in groups for r in g]
    return list(op(tensors, flat, len(groups[0]), encode(params)))


def _impl(kind: Kind):
    def impl(xs: list[torch.Tensor], groups: list[int], group_size: int, params: str) -> list[torch.Tensor]:
        rctx = require_replica_context(f"cr.{kind.value}")
        canonical = _groups(groups, group_size)
        if len(groups) != rctx.num_replicas_in_sync:
            raise ValueError(
                f"a collective compiled for {len(groups)} replicas ran with {rctx.num_replicas_in_sync} in "
                f"sync; compile the replica step once per strategy (torch.compile(fn) inside it)")
        outs = raw(rctx, kind, canonical, _params(kind, params), list(xs))
        if kind is Kind.ALL_GATHER:
            sizes = outs[-1].view(group_size, -1)
            if not bool((sizes == sizes[0]).all()):
                raise ValueError(
                    f"cr.all_gather under torch.compile needs the same size along the gather dim on every "
                    f"member of a group; got sizes {sizes.t().tolist()} (one row per leaf, one column per "
                    f"member); call it eagerly for uneven parts")
        # A custom op's outputs may alias neither its inputs nor each other: an engine may
        # hand out views of one packed buffer (torch_dist's fused all-reduce) or, on some
        # paths, a buffer it was given; those are copied.
        return _fresh(xs, outs)
    return impl


def _fresh(xs: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outs``, with every output that is a view (or starts inside its storage) or shares
    storage with an input or an earlier output replaced by a copy."""
    taken = {x.untyped_storage().data_ptr() for x in xs}
    fresh = []
    for out in outs:
        # (a view made in inference mode has no _base; compiled code expects aligned outputs)
        if tp.view_base(out) is not None or out.storage_offset() or out.untyped_storage().data_ptr() in taken:
            out = out.clone()
        taken.add(out.untyped_storage().data_ptr())
        fresh.append(out)
    return fresh


def _fake(kind: Kind):
    out_shape = SPECS[kind].out_shape

    def fake(xs: list[torch.Tensor], groups: list[int], group_size: int, params: str) -> list[torch.Tensor]:
        if out_shape is None:
            return [torch.empty_like(x) for x in xs]
        p = _params(kind, params)
        return [x.new_empty(out_shape(p, leaf, list(x.shape), group_size)) for leaf, x in enumerate(xs)]
    return fake


def _setup_of(kind: Kind):
    def setup(ctx, inputs, output) -> None:
        xs, groups, group_size, params = inputs
        ctx.groups, ctx.params = _groups(groups, group_size), _params(kind, params)
        ctx.n = len(xs)
        ctx.save_for_backward(*xs, *output)
    return setup


def _backward(kind: Kind):
    def backward(ctx, grads):
        saved = ctx.saved_tensors
        grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, saved[ctx.n:])]
        rid = torch.ops.crossreplica.replica_id()
        grads_in = dual(kind, ctx.groups, ctx.params, grads, saved, None, rid, execute)
        return grads_in, None, None, None
    return backward


for _kind in _KINDS:
    _LIB.define(_kind.value + _SCHEMA)
    _LIB.impl(_kind.value, _impl(_kind), "CompositeExplicitAutograd")
    torch.library.register_fake(f"crossreplica::{_kind.value}", _fake(_kind), lib=_LIB)
    torch.library.register_autograd(f"crossreplica::{_kind.value}", _backward(_kind), setup_context=_setup_of(_kind),
                                    lib=_LIB)


def _replica_id() -> torch.Tensor:
    return torch.tensor(require_replica_context("cr.replica_id").replica_id_in_sync_group)


_LIB.define("replica_id() -> Tensor")
_LIB.impl("replica_id", _replica_id, "CompositeExplicitAutograd")
torch.library.register_fake("crossreplica::replica_id", lambda: torch.empty((), dtype=torch.int64), lib=_LIB)
