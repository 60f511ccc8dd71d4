"""The in-process engine; replicas are threads, tensors move by memory copies.

Each collective is one :class:`Rendezvous` round. The leader checks that every
replica made the same call, then either computes every output itself (small
payloads: one barrier, no extra wake-ups) or hands out a plan that every
replica executes on its own share, followed by a completion barrier (large
payloads: the work and the memory traffic are spread over the threads, which
run in parallel because torch kernels release the GIL).

On the small path every replica thread's Python work is serialised by the GIL,
so the leader keeps its torch calls per replica few: a reduction's steps are one
foreach call (``reduction.py``), and from ``settings.shared_rows_members()``
members on the outputs are the rows of one buffer (one fill, no allocation per replica;
each replica's row is its own). Work moved to the replicas themselves costs
more than it saves: each torch call there hands the GIL to another thread.

All-reduce in parallel mode is reduce-scatter then gather in one pass: the
member at position ``j`` of a group reduces the ``j``-th share of every leaf,
in ascending replica id, block by block so the partial sum stays in cache, and
copies the finished block to every member's output. Reductions therefore equal
the sequential sum ``((x0 + x1) + x2) + ...`` exactly, and every replica's
output is a copy of the same bytes.

An in-place all-reduce over every replica started with ``execute_async`` (the
optimizer's buckets during backward) is not a rendezvous round: each replica
deposits its tensors and goes on, and the work is shared out chunk by chunk to
whoever comes by (``async_rounds.py``), with the same bytes.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from .. import settings
from ..groups import Groups
from ..logs import replica_failed
from ..reduce_op import ReduceOp, all_finite, from_wire, mean_scale, to_wire
from .base import (
    BARRIER,
    Call,
    Engine,
    Kind,
    Pending,
    check_agreement,
    check_inplace,
    is_inplace,
    scatter_slice,
)
from .async_rounds import AsyncRounds
from . import cuda_fold, multi_gpu
from .buffer_pool import BufferPool
from .reduction import reduce_into, reduced
from .rendezvous import Rendezvous
from .streams import FencedRounds

__all__ = ["ThreadsEngine"]

_log = logging.getLogger(__name__)

# Payloads at least settings.parallel_bytes() large (bytes per replica; 2 MiB,
# where the parallel path starts to win on 2 cores, benchmarks/allreduce.py) are
# processed by every replica in parallel; smaller ones by the leader alone. The
# test suite lowers it so that small tensors exercise both paths.
# Bytes per block of the parallel all-reduce: each block's running result is
# re-read from cache by the next operand. Measured on the 2-core VM, blocks
# down to 256 KiB bought nothing over 4 MiB ones and cost more kernel launches.
BLOCK_BYTES = 4 * 1024 * 1024
# The dtypes whose MEAN travels in its own dtype and may overflow (reduce_op.mean_scale):
# the leader checks their results for every replica (checks_mean_overflow).
_OWN_WIRE_MEAN = frozenset((torch.float32, torch.float64, torch.complex64, torch.complex128))

_CORES = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


# A small all-reduce's outputs are the rows of one buffer when it holds at most
# this many bytes (every member's copy): a replica that keeps its output keeps
# the whole buffer alive, so large results get an allocation each. With fewer
# than settings.shared_rows_members() members (8) a copy each costs fewer torch
# calls (the test suite lowers it so that both forms run).
SHARED_ROWS_BYTES = 1024 * 1024


def _shares_rows(xs: list[torch.Tensor], min_members: int) -> bool:
    """Whether the outputs of reducing ``xs`` go into rows of one buffer: enough members,
    small enough, and contiguous (as the result of reducing ``xs`` itself would be)."""
    x = xs[0]
    return (len(xs) >= min_members and x.numel() * x.element_size() * len(xs) <= SHARED_ROWS_BYTES
            and x.is_contiguous() and xs[1].is_contiguous())


_NO_PAYLOADS: list[Any] = []  # a finished plan's: never read, never written


def _plan_outputs(plan: "_Plan") -> list[Any]:
    return plan.outputs


class _Plan:
    """What the leader hands out: finished outputs, or work for every replica."""

    __slots__ = ("calls", "finite", "outputs", "parallel", "payloads")

    def __init__(self, outputs: list[Any], parallel: bool = False, calls: Sequence[Call] = (),
                 payloads: list[Any] = _NO_PAYLOADS):
        self.outputs = outputs
        self.parallel = parallel
        self.calls = calls  # parameters agree within a group only: each member uses its own
        self.payloads = payloads
        #: per replica, whether its share of a checked MEAN came out finite (parallel path)
        self.finite = [True] * len(outputs) if parallel else []


class ThreadsEngine(Engine):
    """Collectives between replica threads of one process."""

    # A round costs some 20 us; copying 1 MiB into a bucket about 0.1 ms (the MLP of
    # benchmarks/training_step.py: 1.2 -> 0.7 ms per step in the gradient hooks).
    own_bucket_bytes = 1 << 20
    in_process = True

    def __init__(self, devices: Sequence[torch.device], timeout: float | None = None,
                 rendezvous: Rendezvous | None = None, replica_ids: Sequence[int] | None = None):
        """``timeout`` defaults to ``settings.timeout()`` (CROSSREPLICA_TIMEOUT)."""
        self.devices = tuple(devices)
        self.num_replicas = len(self.devices)
        self.local_replica_ids = tuple(replica_ids) if replica_ids is not None else tuple(range(self.num_replicas))
        self._index = {r: i for i, r in enumerate(self.local_replica_ids)}
        self._members: dict[Groups, list[list[int]]] = {}
        self._pool = BufferPool(max_buffers=4 * self.num_replicas)
        # Every replica on one device (the CPU case): no per-tensor device checks.
        self._one_device = len(set(self.devices)) == 1
        self._on_one_cpu = self._one_device and self.devices[0].type == "cpu"
        # The tuning settings are read once here: the hot path reads attributes.
        self._parallel_bytes = settings.parallel_bytes()
        self._shared_rows_members = settings.shared_rows_members()
        # CUDA kernels run later, on each thread's stream: rounds are fenced (streams.py),
        # and the leader computes every output (spreading the work over threads buys nothing).
        self._cuda = any(d.type == "cuda" for d in self.devices)
        self.rendezvous = rendezvous or Rendezvous(
            self.num_replicas, settings.timeout() if timeout is None else timeout, self.local_replica_ids)
        self._fenced = FencedRounds(self.rendezvous) if self._cuda else None
        # In-place all-reduces started during backward (the optimizer's buckets), on one CPU.
        self._async = (AsyncRounds(self.rendezvous, self.local_replica_ids)
                       if self._on_one_cpu and self.num_replicas > 1 else None)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("threads engine: replicas %s on %s, timeout %gs, slow-collective warning after %gs, "
                       "parallel path from %d bytes on %d cores", list(self.local_replica_ids),
                       [str(d) for d in self.devices], self.timeout, self.rendezvous.slow, self._parallel_bytes,
                       _CORES)

    @property
    def timeout(self) -> float:
        return self.rendezvous.timeout

    # ------------------------------------------------------------ lifecycle

    def begin_run(self) -> None:
        self.rendezvous.begin_run()
        if self._async is not None:
            self._async.reset()

    def finish(self, replica_id: int) -> None:
        self.rendezvous.finish(self._index[replica_id])

    def abort(self, replica_id: int, exc: BaseException) -> None:
        replica_failed(_log, replica_id, exc)
        self.rendezvous.abort(self._index[replica_id], exc)

    # ------------------------------------------------------------ execution

    def execute(self, replica_id: int, call: Call, tensors: list[torch.Tensor],
                timeout: float | None = None) -> list[torch.Tensor]:
        # Nothing here calls into torch: on the small-message path only the leader
        # runs kernels, so the replica threads never fight over the GIL.
        i = self._index[replica_id]
        if self._fenced is not None:
            return self._fenced.exchange(i, call, tensors, self._lead, _plan_outputs, timeout).outputs[i]
        plan = self.rendezvous.exchange(i, call, tensors, self._lead, timeout)
        if not plan.parallel:
            return plan.outputs[i]
        checked = self.checks_mean_overflow(call)
        try:
            out = self._part(plan, i)
            if checked:
                plan.finite[i] = self._all_reduce_share(call, plan, i, check=True)
        except BaseException as e:
            self.rendezvous.abort(i, e)
            raise
        self.rendezvous.exchange(i, BARRIER, None, None, timeout)
        if checked and not all(plan.finite):  # every replica reads the same flags after the barrier
            try:
                self._all_reduce_share(call, plan, i, scaled=True)
            except BaseException as e:
                self.rendezvous.abort(i, e)
                raise
            self.rendezvous.exchange(i, BARRIER, None, None, timeout)
        return out if out is not None else plan.outputs[i]

    def execute_async(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> Pending:
        """An in-place all-reduce over every replica on one CPU is an asynchronous round
        (``async_rounds.py``): the replica deposits its tensors and goes on; any other
        call runs now."""
        if (self._async is not None and call.kind is Kind.ALL_REDUCE and is_inplace(call)
                and len(call.groups) == 1 and len(call.groups[0]) == self.num_replicas):
            check_inplace([tensors])
            return self._async.start(self._index[replica_id], call, tensors, self.timeout)
        return Pending.done(self.execute(replica_id, call, tensors))

    def exchange_objects(self, replica_id: int, call: Call, obj: Any, leader_fn: Any,
                         timeout: float | None = None) -> Any:
        """A rendezvous round on arbitrary payloads (merge_call is built on it)."""
        return self.rendezvous.exchange(self._index[replica_id], call, obj, leader_fn, timeout)

    def _lead(self, calls: list[Call], payloads: list[list[torch.Tensor]]) -> _Plan:
        call = calls[0]
        # The common case needs one C-level comparison; an all_to_all's split sizes are
        # checked against each other even when every replica passed the same ones.
        if calls.count(call) != len(calls) or call.kind is Kind.ALL_TO_ALL:
            check_agreement(calls, self.local_replica_ids)
        parallel = (not self._cuda and self.num_replicas > 1 and call.kind is not Kind.PERMUTE
                    and sum(math.prod(s) * d.itemsize for s, d in zip(call.shapes, call.dtypes)) >= self._parallel_bytes
                    and all(len(g) > 1 for g in call.groups))
        if is_inplace(call):
            check_inplace(payloads)
        elif parallel:
            for xs in payloads:
                for t, x in enumerate(xs):
                    if not x.is_contiguous():
                        xs[t] = x.contiguous()
        # Calls agree within a group only (ops, dims and gather sizes may differ
        # between groups): every replica's outputs follow its own call.
        if call.kind is Kind.ALL_REDUCE:
            return self._lead_all_reduce(calls, payloads, parallel)
        if parallel:
            return _Plan([None] * self.num_replicas, True, calls, payloads)
        outputs = [self._own(calls, payloads, i) for i in range(self.num_replicas)]
        return _Plan(outputs)

    def checks_mean_overflow(self, call: Call) -> bool:
        """True for a plain MEAN all-reduce over one group on one CPU (the calls the
        collectives layer checks after the fact) whose leaves keep their dtype on the wire:
        the leader checks the results once, or each sharer its share on the parallel path,
        and every replica redoes the call scaled when one element is not finite, as each
        would on its own (engines.base)."""
        params = call.params
        return (call.kind is Kind.ALL_REDUCE and params.op is ReduceOp.MEAN and not params.inplace  # type: ignore[union-attr]
                and self._on_one_cpu and len(call.groups) == 1 and len(call.groups[0]) > 1
                and not call.source_dtypes and all(d in _OWN_WIRE_MEAN for d in call.dtypes))

    def _part(self, plan: _Plan, i: int) -> list[torch.Tensor] | None:
        call = plan.calls[i]
        if call.kind is Kind.ALL_REDUCE:
            self._all_reduce_share(call, plan, i)
            return None
        return self._own(plan.calls, plan.payloads, i)

    # ------------------------------------------------------------ all_reduce

    def _sorted_members(self, groups: Groups) -> list[list[int]]:
        """Local indices of each group's members in ascending replica id (cached)."""
        members = self._members.get(groups)
        if members is None:
            members = [[self._index[r] for r in sorted(g)] for g in groups]
            self._members[groups] = members
        return members

    def _lead_all_reduce(self, calls: list[Call], payloads: list, parallel: bool) -> _Plan:
        call = calls[0]
        inplace = is_inplace(call)
        if parallel:
            shares = payloads if inplace else [
                [self._pool.empty(shape, dtype, x.device) for shape, dtype, x in zip(call.shapes, call.dtypes, xs)]
                for xs in payloads]
            return _Plan(shares, True, calls, payloads)
        if inplace:
            for members in self._sorted_members(call.groups):
                if len(members) > 1:
                    op: ReduceOp = calls[members[0]].params.op
                    for t in range(len(call.shapes)):
                        xs = [payloads[m][t] for m in members]
                        if self._cuda and self._one_device:
                            cuda_fold.reduce_in_place(op, xs)
                            continue
                        acc = reduced(op, [x.to(xs[0].device) for x in xs])
                        for x in xs:
                            x.copy_(acc)
            return _Plan(payloads)
        outputs: list[Any] = [None] * len(payloads)
        leaves = range(len(call.shapes))
        for members in self._sorted_members(call.groups):
            op = calls[members[0]].params.op
            if self._one_device:
                columns = [self._reduce_column(op, [payloads[m][t] for m in members]) for t in leaves]
                if (op is ReduceOp.MEAN and self.checks_mean_overflow(calls[members[0]])
                        and not all(all_finite(column[0]) for column in columns)):
                    columns = [self._scaled_mean_column([payloads[m][t] for m in members]) for t in leaves]
                if len(columns) == 1:
                    for m, out in zip(members, columns[0]):
                        outputs[m] = [out]
                else:
                    for j, m in enumerate(members):
                        outputs[m] = [column[j] for column in columns]
                continue
            per_member: list[list[torch.Tensor]] = [[] for _ in members]
            for t in leaves:
                xs = [payloads[m][t] for m in members]
                if all(x.is_cuda for x in xs):  # replicas on several GPUs
                    column = multi_gpu.all_reduce_column(op, xs)
                else:
                    home = xs[0].device
                    acc = reduced(op, [x.to(home) for x in xs])
                    column = [acc if j == 0 else acc.to(x.device, copy=True) for j, x in enumerate(xs)]
                for outs, out in zip(per_member, column):
                    outs.append(out)
            for m, outs in zip(members, per_member):
                outputs[m] = outs
        return _Plan(outputs)

    def _scaled_mean_column(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One leaf's MEAN with the values scaled down by a power of two before the sum and the
        result back up after: the collectives layer's redo of an overflowing MEAN, bit for bit."""
        op, dtype = ReduceOp.MEAN, xs[0].dtype
        scale = mean_scale(op, len(xs), dtype)
        return [from_wire(op, out, dtype, scale)
                for out in self._reduce_column(op, [to_wire(op, x, scale) for x in xs])]

    def _reduce_column(self, op: ReduceOp, xs: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        """One leaf's all-reduce on one device: every member's output, in member order."""
        if self._cuda:
            return cuda_fold.reduce_column(op, xs)
        if _shares_rows(xs, self._shared_rows_members):  # one buffer, one row per member: no allocation per replica
            buf = torch.empty((len(xs), *xs[0].shape), dtype=xs[0].dtype, device=xs[0].device)
            rows = buf.unbind(0)
            reduce_into(op, rows[0], xs)
            buf[1:].copy_(rows[0])
            return rows
        acc = reduced(op, xs)
        return [acc, *[acc.clone() for _ in xs[1:]]]

    def _all_reduce_share(self, call: Call, plan: _Plan, i: int, check: bool = False,
                          scaled: bool = False) -> bool:
        """Member ``j`` of a group reduces the ``j``-th share of every leaf for everyone.
        With ``check``, only says whether its share of the results is finite; with
        ``scaled``, redoes its share as the collectives layer's scaled MEAN, bit for bit
        (values times 1/2**k before the sum, the result times 2**k after)."""
        payloads, outputs = plan.payloads, plan.outputs
        op: ReduceOp = call.params.op
        members = next(ms for ms in self._sorted_members(call.groups) if i in ms)
        # No more sharers than cores: with more threads than cores the phase
        # barrier would wait for whichever sharer the OS has descheduled.
        j, k = members.index(i), min(len(members), _CORES)
        if j >= k:
            return True
        for t, shape in enumerate(call.shapes):
            n = math.prod(shape)
            lo, hi = n * j // k, n * (j + 1) // k
            if hi <= lo:
                continue
            outs = [outputs[m][t].view(-1)[lo:hi] for m in members]
            if check:
                if not all_finite(outs[0]):
                    return False
                continue
            xs = [payloads[m][t].view(-1)[lo:hi] for m in members]
            if scaled:
                scale = mean_scale(op, len(members), call.dtypes[t])
                xs = [to_wire(op, x, scale) for x in xs]
                reduce_into(op, outs[0], xs)
                outs[0].copy_(from_wire(op, outs[0], call.dtypes[t], scale))
                for o in outs[1:]:
                    o.copy_(outs[0])
                continue
            if not self._one_device:
                home = outs[0].device
                reduce_into(op, outs[0], [x.to(home) for x in xs])
                for o in outs[1:]:
                    o.copy_(outs[0])
                continue
            # Block by block, so each block's running result is re-read from cache.
            step = max(1, BLOCK_BYTES // call.dtypes[t].itemsize)
            if hi - lo <= step:
                reduce_into(op, outs[0], xs)
                for o in outs[1:]:
                    o.copy_(outs[0])
                continue
            x_blocks = [x.split(step) for x in xs]
            o_blocks = [o.split(step) for o in outs]
            for b, dst in enumerate(o_blocks[0]):
                reduce_into(op, dst, [xb[b] for xb in x_blocks])
                for ob in o_blocks[1:]:
                    ob[b].copy_(dst)
        return True

    # ------------------------------------------------------------ the rest

    def _own(self, calls: Sequence[Call], payloads: list, i: int) -> list[torch.Tensor]:
        """Replica ``i``'s outputs of a non-all-reduce collective (``calls``: every replica's)."""
        call = calls[i]
        kind, idx = call.kind, self._index
        rid = self.local_replica_ids[i]
        mine = payloads[i]
        if kind is Kind.PERMUTE:
            pairs = call.params.pairs
            for s, t in pairs:
                if t == rid:
                    return [x.to(m.device, copy=True) for x, m in zip(payloads[idx[s]], mine)]
            return [torch.zeros_like(m) for m in mine]
        group = next(g for g in call.groups if rid in g)
        pos = group.index(rid)
        k = len(group)
        members = [idx[r] for r in group]  # group order: gather and scatter positions
        sorted_members = [idx[r] for r in sorted(group)]  # reduction order
        p = call.params
        out = []
        for t, x in enumerate(mine):
            if kind is Kind.ALL_GATHER:
                d = p.dims[t]
                out.append(torch.cat([payloads[m][t].to(x.device) for m in members], d))
            elif kind is Kind.REDUCE_SCATTER:
                d = p.dims[t]
                start, length = scatter_slice(x.shape[d], pos, k, None if p.sizes is None else p.sizes[t])
                xs = [payloads[m][t].narrow(d, start, length).to(x.device) for m in sorted_members]
                out.append(reduce_into(p.op, torch.empty_like(xs[0], memory_format=torch.contiguous_format), xs))
            elif kind is Kind.ALL_TO_ALL:
                sd, cd = p.split_dims[t], p.concat_dims[t]
                pieces = []
                for m in members:  # each sender cuts its own tensor by its own split sizes
                    start, length = scatter_slice(payloads[m][t].shape[sd], pos, k, calls[m].params.input_splits)
                    pieces.append(payloads[m][t].narrow(sd, start, length).to(x.device))
                out.append(torch.cat(pieces, cd))
            elif kind is Kind.BROADCAST:
                src = members[p.source]
                out.append(payloads[src][t].to(x.device, copy=True))
            else:
                raise ValueError(f"unknown collective kind {kind!r}")
        return out
