"""Overlapped gradient reduction: buckets reduced during backward, as DDP does.

The parameters (each once, in registration order) are cut into buckets in
*reverse* order, since backward produces the last layers' gradients first; a
bucket holds one (device, dtype) and at most ``bucket_bytes``; a parameter
larger than that, or than the engine's ``own_bucket_bytes``, is a bucket of its
own (the layout is cut again for the engine at the first backward, before any
bucket starts). A ``register_post_accumulate_grad_hook`` on every parameter counts the
final gradients of its bucket; when the bucket is complete, and every bucket
before it has started (so every replica starts the same calls in the same
order), the gradients are copied into the bucket's persistent flat buffer (the
engine's ``shared_buffer`` where it has one) and an in-place all-reduce of it
starts through ``Engine.execute_async``. At the end of the backward pass (an
autograd-engine callback queued by the first hook) every started bucket is
waited for and each ``.grad`` becomes its view of the bucket's buffer (no copy
back: a later backward accumulates onto it in place, ``zero_grad`` drops it);
those parameters are marked reduced, and the optimizer's ``step()`` reduces
only the rest with the ordinary fused path.

The reduction is the same elementwise in-place all-reduce of a flat buffer as
the fused path's packs, so the gradients are bitwise the same. Gradient
accumulation: inside :meth:`no_sync` the hooks do nothing and the next backward
outside it reduces the accumulated sums (as DDP's ``no_sync``); without it,
every backward reduces, which is still the mean of the sums, up to rounding.

What overlaps is the engine's ``execute_async`` (async backend work across
processes, a shared-memory round between workers of one host, one async
all-gather per worker for the hierarchical engine, deposited rounds for
in-process replicas: ``engines/async_rounds.py``); none needs a communication
thread (BENCHMARKS.md, "Training step: 2 in-process replicas vs one process").

With ``compression``, a bucket's buffer (or its one gradient) goes to the engine
as a narrow copy (``wire.start_compressed``), and the wait writes the widened
result back into it: the fused path's compressed bytes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .. import torch_private as tp
from ..context import current_replica_context
from ..engines.base import AllReduceParams, Call, Engine, Kind, Pending
from ..engines.wire import start_compressed, start_on_wire
from ..groups import Groups, group_of
from ..reduce_op import ReduceOp
from .routing import on_engine

if TYPE_CHECKING:
    from ..cross_device_ops import CommunicationOptions

__all__ = ["OverlappedReduction"]


class _Bucket:
    __slots__ = ("flat", "index", "params", "pending", "ready", "shared", "unusable")

    def __init__(self, index: int, params: list[torch.Tensor]):
        self.index = index
        self.params = params
        self.ready = 0
        self.unusable = False  # a sparse gradient: left to step()
        self.pending: Pending | None = None
        self.shared: bool | None = None  # flat is the engine's shared buffer (asked at the first start)
        n = sum(p.numel() for p in params)
        # A parameter alone in its bucket is reduced in its own .grad (no copies).
        self.flat = torch.empty(n if len(params) > 1 else 0, dtype=params[0].dtype, device=params[0].device)


class OverlappedReduction:
    """The buckets and hooks of one CrossShardOptimizer; see the module docstring."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int, op: ReduceOp,
                 groups_of: Any, options: CommunicationOptions | None = None,
                 compression: torch.dtype | None = None):
        self.op = ReduceOp.MEAN if op is ReduceOp.MEAN else ReduceOp.SUM
        self.compression = compression  # the dtype the buckets cross the wire in (None: their own)
        self._groups_of = groups_of  # num_replicas -> Groups (the optimizer's cache)
        self._options = options  # the optimizer's CommunicationOptions (routing.py)
        self.enabled = True
        #: ids of the parameters whose gradient was reduced since the optimizer last reduced
        self.reduced: set[int] = set()
        self._buckets: list[_Bucket] = []
        self._next = 0  # the first bucket not started in this backward
        self._queued = False
        self._handles = []
        self._params = params
        self._bucket_bytes = bucket_bytes
        self._bucket_of: dict[int, int] = {}  # id(parameter) -> its bucket
        self._own_bytes: int | None = None  # the own_bucket_bytes the layout was cut for
        self._layout(None)
        ref = weakref.ref(self)
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(_hook(ref)))

    def _layout(self, own_bytes: int | None) -> None:
        """Cuts the parameters into buckets, in reverse order; a parameter of ``own_bytes``
        or more (the engine's ``own_bucket_bytes``) is a bucket of its own."""
        bucket_bytes = self._bucket_bytes
        alone_from = min(bucket_bytes, own_bytes) if own_bytes is not None else None
        self._buckets = []
        current: list[torch.Tensor] = []
        size = 0
        for p in reversed(self._params):
            nbytes = p.numel() * p.element_size()
            alone = alone_from is not None and nbytes >= alone_from
            if current and (alone or p.dtype != current[0].dtype or p.device != current[0].device
                            or size + nbytes > bucket_bytes):
                self._buckets.append(_Bucket(len(self._buckets), current))
                current, size = [], 0
            current.append(p)
            size += nbytes
            if alone:
                self._buckets.append(_Bucket(len(self._buckets), current))
                current, size = [], 0
        if current:
            self._buckets.append(_Bucket(len(self._buckets), current))
        self._bucket_of = {id(p): bucket.index for bucket in self._buckets for p in bucket.params}
        self._own_bytes = own_bytes

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def remove(self) -> None:
        """Unregisters the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate without reducing."""
        saved, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = saved

    # ------------------------------------------------------------ during backward

    def on_grad(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        rctx = current_replica_context()
        if rctx is None or rctx.micro_batch is not None:
            return  # the layout-invariant mode reduces at the step, by its fixed tree
        if not self._queued:  # the first gradient of this backward: no bucket has started
            own = rctx.engine.own_bucket_bytes
            if own != self._own_bytes:
                self._layout(own)
        index = self._bucket_of[id(p)]
        groups: Groups = self._groups_of(rctx.num_replicas_in_sync)
        rid = rctx.replica_id_in_sync_group
        if len(group_of(groups, rid)) == 1:
            return  # the identity: nothing to reduce
        if not self._queued:
            if not on_engine(rctx, groups, self._options):
                return  # through the strategy's cross_device_ops, at step() (routing.py)
            self._queued = True
            tp.queue_autograd_callback(self.finish)
        bucket = self._buckets[index]
        bucket.ready += 1
        if p.grad is None or p.grad.is_sparse:
            bucket.unusable = True
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if b.unusable or b.ready < len(b.params):
                return
            self._start(b, rctx.engine, rid, groups)
            self._next += 1

    def _start(self, bucket: _Bucket, engine: Engine, rid: int, groups: Groups) -> None:
        if bucket.shared is None:  # every replica asks in the same order: bucket order
            first = bucket.params[0]
            # A compressed bucket's wire copy is narrow: an engine buffer of its dtype would go unused.
            buf = (None if self.compression is not None else
                   engine.shared_buffer(sum(p.numel() for p in bucket.params), first.dtype, first.device))
            bucket.shared = buf is not None
            if buf is not None:
                bucket.flat = buf
        grad = bucket.params[0].grad
        if len(bucket.params) == 1 and not bucket.shared and grad is not None and grad.is_contiguous():
            call = Call(Kind.ALL_REDUCE, groups, AllReduceParams(self.op, inplace=True), (tuple(grad.shape),),
                        (grad.dtype,))
            bucket.pending = self._start_call(engine, rid, call, grad)
            return
        flat, offset = bucket.flat, 0
        if flat.numel() == 0:
            flat = bucket.flat = torch.empty(grad.numel() if grad is not None else 0, dtype=bucket.params[0].dtype,
                                             device=bucket.params[0].device)
        for p in bucket.params:
            n = p.numel()
            flat[offset:offset + n].view_as(p).copy_(p.grad)  # type: ignore[arg-type]
            offset += n
        call = Call(Kind.ALL_REDUCE, groups, AllReduceParams(self.op, inplace=True), ((flat.numel(),),), (flat.dtype,))
        bucket.pending = self._start_call(engine, rid, call, flat)

    def _start_call(self, engine: Engine, rid: int, call: Call, t: torch.Tensor) -> Pending:
        if self.compression is not None:
            return start_compressed(engine, rid, call, [t], self.compression)
        return start_on_wire(engine, rid, call, [t])

    # ------------------------------------------------------------ after backward

    def finish(self) -> None:
        """Waits for every started bucket and copies the results into ``.grad``
        (the end-of-backward callback; step() calls it too, for what is left)."""
        self._queued = False
        self._next = 0
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.unusable = False
            pending, bucket.pending = bucket.pending, None
            if pending is None:
                continue
            (flat,) = pending.wait()
            if len(bucket.params) == 1 and flat is bucket.params[0].grad:
                self.reduced.add(id(bucket.params[0]))
                continue
            offset = 0
            for p in bucket.params:
                n = p.numel()
                # The gradient becomes its view of the bucket (no copy back): zero_grad
                # drops it, and an accumulating backward adds into the bucket in place.
                p.grad = flat[offset:offset + n].view_as(p)
                offset += n
                self.reduced.add(id(p))

    def reset(self) -> None:
        """Forgets an unfinished backward (zero_grad)."""
        for bucket in self._buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
        self._forget_rounds()

    def forget_engine(self) -> None:
        """Drops what the buckets hold of the engine they last ran on (a fault-tolerant job
        regrouped after a loss): its unfinished work, unwaited, and its shared buffers."""
        for bucket in self._buckets:
            if bucket.shared:
                bucket.flat = torch.empty_like(bucket.flat)
            bucket.shared = None
        self._forget_rounds()

    def _forget_rounds(self) -> None:
        for bucket in self._buckets:
            bucket.pending = None
            bucket.ready = 0
            bucket.unusable = False
        self._next = 0
        self._queued = False
        self.reduced.clear()


def _hook(ref: weakref.ref) -> Any:
    # A weak reference: a discarded optimizer's hooks do nothing.
    def hook(p: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.on_grad(p)
    return hook
