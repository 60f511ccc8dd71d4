"""Engine calls made in wire dtypes (see ``reduce_op.wire_dtype``).

float16 / bfloat16 / float8 reductions accumulate in float32 and round once;
unsigned ints travel as signed ones. Every caller that hands tensors to an
engine directly (the collectives, CrossShardOptimizer's packs, its overlapped
buckets and its sharded update) goes through here, so every path computes the
same bytes on every engine. A call with no such dtype is passed through as is.
"""

from __future__ import annotations

import torch

from ..reduce_op import WIRE_DTYPES, ReduceOp, from_wire, to_wire
from .base import Call, Engine, Pending, is_inplace
from .kinds import REDUCING

__all__ = ["execute_on_wire", "start_on_wire"]



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
