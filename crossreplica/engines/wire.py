"""Engine calls made in wire dtypes (see ``reduce_op.wire_dtype``).

float16 / bfloat16 / float8 reductions accumulate in float32 and round once;
unsigned ints travel as signed ones. Every caller that hands tensors to an
engine directly (the collectives, CrossShardOptimizer's packs, its overlapped
buckets and its sharded update) goes through here, so every path computes the
same bytes on every engine. A call with no such dtype is passed through as is.

A compressed call (:func:`execute_compressed`, :func:`start_compressed`: the
optimizer's ``compression=``) is the exception: its narrow tensors cross the wire
as they are, without the widening (``reduce_op.compress``).
"""

from __future__ import annotations

import torch

from ..groups import group_of
from ..reduce_op import WIRE_DTYPES, ReduceOp, compress, compresses, compression_scale, decompress, from_wire, to_wire
from .base import Call, Engine, Pending, is_inplace
from .kinds import REDUCING, AllReduceParams, Kind

__all__ = ["execute_compressed", "execute_on_wire", "start_compressed", "start_on_wire"]


def _needs_wire(tensors: list[torch.Tensor]) -> bool:
    for t in tensors:  # noqa: SIM110 - a plain loop: any() over a generator costs more on the hot path
        if t.dtype in WIRE_DTYPES:
            return True
    return False


def _to_wire(call: Call, tensors: list[torch.Tensor]) -> tuple[ReduceOp | None, Call, list[torch.Tensor]]:
    op = call.params.op if call.kind in REDUCING else None
    wire = [to_wire(op, t) for t in tensors]
    return op, call._replace(dtypes=tuple(w.dtype for w in wire), source_dtypes=call.dtypes), wire


def _from_wire(op: ReduceOp | None, call: Call, tensors: list[torch.Tensor],
               outs: list[torch.Tensor]) -> list[torch.Tensor]:
    results = [from_wire(op, o, t.dtype) for o, t in zip(outs, tensors)]
    if not is_inplace(call):
        return results
    for t, r in zip(tensors, results):  # an in-place call's results are its inputs
        if r is not t:
            t.copy_(r)
    return list(tensors)


def execute_on_wire(engine: Engine, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``engine.execute`` with every tensor in its wire dtype; results in the callers' dtypes."""
    if not _needs_wire(tensors):
        return engine.execute(replica_id, call, tensors)
    op, wire_call, wire = _to_wire(call, tensors)
    return _from_wire(op, call, tensors, engine.execute(replica_id, wire_call, wire))


def start_on_wire(engine: Engine, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> Pending:
    """``engine.execute_async`` with every tensor in its wire dtype (see :func:`execute_on_wire`)."""
    if not _needs_wire(tensors):
        return engine.execute_async(replica_id, call, tensors)
    op, wire_call, wire = _to_wire(call, tensors)
    pending = engine.execute_async(replica_id, wire_call, wire)
    return Pending(lambda: _from_wire(op, call, tensors, pending.wait()))


# --------------------------------------------------------------------------- compressed calls

class _Compressed:
    """One replica's compressed in-place SUM/MEAN all-reduce: what goes to the engine and how
    each result comes back into the caller's tensor."""

    __slots__ = ("call", "divisor", "narrow", "scale", "tensors", "wire")

    def __init__(self, replica_id: int, call: Call, tensors: list[torch.Tensor], compression: torch.dtype,
                 limit: int):
        if call.kind is not Kind.ALL_REDUCE or not is_inplace(call) or call.params.op not in (ReduceOp.SUM,
                                                                                             ReduceOp.MEAN):
            raise ValueError(f"a compressed call is an in-place SUM or MEAN all_reduce; got {call.describe()}")
        n = len(group_of(call.groups, replica_id))
        self.tensors = tensors
        self.scale = compression_scale(n)
        self.divisor = n if call.params.op is ReduceOp.MEAN else None
        # The first ``limit`` tensors that compress go narrow; every other one takes the wire
        # as a plain SUM would (bfloat16 widened), and MEAN divides after it, as the engine does.
        self.narrow = [i < limit and compresses(t.dtype, compression) for i, t in enumerate(tensors)]
        self.wire = [compress(t, compression, self.scale) if narrow else to_wire(ReduceOp.SUM, t)
                     for t, narrow in zip(tensors, self.narrow)]
        dtypes = tuple(w.dtype for w in self.wire)
        widened = any(w.dtype != t.dtype and not narrow for w, t, narrow in zip(self.wire, tensors, self.narrow))
        # The narrow dtype is the call's dtype (compared across replicas: a replica that does
        # not compress disagrees); a leaf widened as usual keeps its own as its source dtype.
        self.call = call._replace(params=AllReduceParams(ReduceOp.SUM, inplace=True), dtypes=dtypes,
                                  source_dtypes=tuple(w.dtype if narrow else t.dtype for w, t, narrow in
                                                      zip(self.wire, tensors, self.narrow)) if widened else ())

    def finish(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        for t, out, narrow in zip(self.tensors, outs, self.narrow):
            if narrow:
                decompress(out, t.dtype, self.scale, self.divisor, out=t)
                continue
            if self.divisor is not None:
                out.div_(self.divisor)
            if out is not t:
                t.copy_(from_wire(ReduceOp.SUM, out, t.dtype))
        return list(self.tensors)


def execute_compressed(engine: Engine, replica_id: int, call: Call, tensors: list[torch.Tensor],
                       compression: torch.dtype, limit: int | None = None) -> list[torch.Tensor]:
    """An in-place SUM or MEAN all-reduce (``call``) whose first ``limit`` tensors (None:
    all) cross the wire in ``compression`` where they are wider floating point
    (``reduce_op.compress``): on the wire a SUM of the narrow tensors, each addition
    rounded to ``compression``; widened back into ``tensors``, which it returns."""
    compressed = _Compressed(replica_id, call, tensors, compression, len(tensors) if limit is None else limit)
    return compressed.finish(engine.execute(replica_id, compressed.call, compressed.wire))


def start_compressed(engine: Engine, replica_id: int, call: Call, tensors: list[torch.Tensor],
                     compression: torch.dtype, limit: int | None = None) -> Pending:
    """:func:`execute_compressed` started with ``engine.execute_async``."""
    compressed = _Compressed(replica_id, call, tensors, compression, len(tensors) if limit is None else limit)
    pending = engine.execute_async(replica_id, compressed.call, compressed.wire)
    return Pending(lambda: compressed.finish(pending.wait()))
