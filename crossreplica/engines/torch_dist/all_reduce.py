"""``all_reduce`` and ``reduce_scatter`` across workers.

Local members reduce in-process (ascending replica id, ``reduction.py``), then
the partials of every group of a worker set are bucketed per (dtype, op) and
all-reduced once per bucket. MEAN is a SUM divided by the group size; bool is
reduced as uint8 with MAX (sum/max = or) or MIN (prod/min = and), never through
float. Complex PROD (unsupported by the backends) gathers and multiplies in
worker order. Floating-point groups of three replicas or more go through the
ordered all-reduce (``ordered.py``) unless the engine says otherwise; a group of
every replica on several hosts, along a chain of hosts (``chain.py``).
reduce_scatter is this all-reduce, then each member keeps its chunk.

On workers of one host (one replica each, a group of every replica, floating
point SUM/MEAN/MAX/MIN on the CPU) the call goes through the shared-memory
arena instead of the backend (``shared_memory.py``): the same bytes, without
loopback TCP.

CUDA tensors on a CPU transport (gloo) are staged (``staging.py``): where CPU
tensors would take the same-host arena, they are copied straight into it on a
side stream; otherwise into pinned host memory, where the path CPU tensors take
runs in place on the copies; the results go back on the side stream. The same
bytes as CPU tensors, in both the synchronous and the asynchronous form.

Invariant: every replica of a group gets the same bytes (the backends'
all-reduce results are replicated, and everything else is a copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...reduce_op import ReduceOp
from ..base import Call, Kind, Pending, is_inplace, scatter_slice
from ..reduction import reduce_into
from .agreement import (CHECKED_DTYPES, CHECKED_OPS, STAMP_DIGITS, Stamp, check_elements, check_rows, shared_code,
                        stamp_digits, stamp_of, verify_elements)
from .chain import Hosts, chain_all_reduce, chain_hosts, drain, start_chain
from .ordered import ordered_all_reduce
from .plan import GroupPlan, Step, by_worker_set
from .staging import stageable

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["all_reduce", "reduce_scatter", "start_all_reduce", "start_gathered_all_reduce"]


# One part up to this size is copied behind the check elements (less than a collective of
# their own costs); a larger one is reduced where it lies.
_RIDING_COPY_BYTES = 256 << 10


def _dist_op(op: ReduceOp, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return dist.ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else dist.ReduceOp.MIN
    return {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.SUM,
            ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.PROD: dist.ReduceOp.PRODUCT}[op]


def all_reduce(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    """All-reduce; in place, the results that are not already the inputs are copied into them."""
    if stageable((t for row in step.payloads for t in row), eng.comm_device):
        staged = _staged(eng, step)
        if staged is not None:
            return staged
    return _all_reduce(eng, step)


def _all_reduce(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    shared = _through_shared_memory(eng, step)
    if shared is not None:
        return [shared]
    outs = _reduced(eng, step)
    if step.inplace:
        for xs, row in zip(step.payloads, outs):
            for leaf, (x, out) in enumerate(zip(xs, row)):
                if out.data_ptr() != x.data_ptr():
                    x.copy_(out)
                row[leaf] = x
    return outs


_SHARED_OPS = (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN)


def _shared_op(eng: TorchDistEngine, step: Step) -> ReduceOp | None:
    """The op when the call's layout and op suit the shared-memory arena (workers of one
    host, one replica each, a group of every replica), else None."""
    reducer, call = eng.shared_memory, step.call
    if reducer is None or len(call.groups) != 1 or len(call.groups[0]) != eng.num_replicas or not step.payloads[0]:
        return None
    op = step.params[eng.local_replica_ids[0]].op
    return op if op in _SHARED_OPS else None


def _through_shared_memory(eng: TorchDistEngine, step: Step) -> list[torch.Tensor] | None:
    """The call on workers of one host, one replica each, over every replica: through
    the shared-memory arena (``shared_memory.py``), with the backend path's bytes; None
    when the path does not take it."""
    op = _shared_op(eng, step)
    tensors = step.payloads[0]
    if op is None or eng.shared_memory is None or any(t.device.type != "cpu" for t in tensors):
        return None
    return eng.shared_memory.all_reduce(tensors, op, step.inplace)


def _staged(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]] | None:
    """The call on CUDA tensors over a CPU transport (``staging.py``): straight into the
    same-host arena where CPU tensors would take it, else through pinned host copies, on
    which the path CPU tensors take runs in place (the bytes of either form); the results
    go back to the tensors (in place) or to new ones on the replicas' devices. None when
    the host memory is not there (the caller takes the unstaged path)."""
    op = _shared_op(eng, step)
    if op is not None and eng.shared_memory is not None:
        pending = eng.shared_memory.stage(step.payloads[0], op, eng.staging, None if step.inplace else eng.devices[0])
        if pending is not None:
            return [pending.wait()]
    staging = eng.staging
    copy = staging.to_host(step.payloads)
    if copy is None:
        return None
    try:
        staging.wait_for(copy.ready)
        with eng.results_on_host():
            _all_reduce(eng, step._replace(payloads=copy.rows, inplace=True))
    except BaseException:
        staging.release(copy)
        raise
    dests = step.payloads if step.inplace else [[torch.empty_like(t, device=eng.devices[i]) for t in row]
                                                 for i, row in enumerate(step.payloads)]
    staging.from_host(copy, dests)
    return [list(row) for row in dests]


def start_all_reduce(eng: TorchDistEngine, call: Call, tensors: list[torch.Tensor]) -> Pending | None:
    """Starts an in-place SUM/MEAN all-reduce of floating-point tensors on the comm
    device as async backend work (one replica per worker); None when the call is
    not of that form (the caller runs it synchronously). The arithmetic is the
    synchronous path's: the backend's SUM, then MEAN divides by the group size.
    Buffers from :meth:`TorchDistEngine.shared_buffer` reduced over every worker take
    the same-host path instead (``shared_memory.py``), with the same bytes; ordered
    reductions across hosts go along the chain of hosts, on its thread (``chain.py``).
    CUDA tensors on a CPU comm device are staged (:func:`_start_staged`)."""
    if call.kind is not Kind.ALL_REDUCE or not is_inplace(call) or call.params.op not in (ReduceOp.SUM, ReduceOp.MEAN):
        return None
    staged = stageable(tensors, eng.comm_device)
    if not all(t.dtype.is_floating_point and (staged or (t.is_contiguous() and t.device == eng.comm_device))
               for t in tensors):
        return None
    entries = [entry for entry in eng.planner.plan(call.groups) if entry.local]
    if len(entries) != 1 or len(entries[0].workers) < 2:
        return None
    if staged:
        return _start_staged(eng, call, tensors, entries)
    if eng.staging.pending:
        eng.staging.flush()  # the staged calls started before this one launch first, on every worker
    entry = entries[0]
    hosts = None
    if eng.ordered_reductions and len(entry.group) > 2:
        hosts = chain_hosts(eng, entry.workers, entries)
        if hosts is None:
            return None
    return _start_on_host(eng, call, tensors, entry, hosts)


def _start_on_host(eng: TorchDistEngine, call: Call, tensors: list[torch.Tensor], entry: GroupPlan,
                   hosts: Hosts | None) -> Pending:
    """Starts the call on host tensors: along the chain of ``hosts``, through the same-host
    path's buffers, or as async backend work (see :func:`start_all_reduce`)."""
    if hosts is not None:
        # Checked by the chain itself, on its thread: a collective of this thread's beside
        # the chains still sending would meet the workers in different orders.
        eng.begin([call])
        return start_chain(eng, hosts, call.params.op, tensors, stamp_of(eng.watchdog.count, [call]))
    drain(eng)
    eng.begin([call])
    if eng.shared_memory is not None and len(entry.workers) == eng.world_size:
        pending = eng.shared_memory.start(tensors, call.params.op)
        if pending is not None:
            return Pending(lambda: eng.settle(pending.wait))
    # The caller's buffers (the optimizer's overlapped buckets, always a SUM in call order) are
    # reduced where they lie and carry no stamp: a check of their own costs a round trip per
    # bucket (0.5-0.9 ms a step on the demo model, BENCHMARKS.md); another size makes gloo
    # abort the peer, which its survivors name (watchdog.lost), and a stall compares stamps.
    works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=entry.subgroup, async_op=True) for t in tensors]
    divisor = len(entry.group) if call.params.op is ReduceOp.MEAN else 0

    def finish() -> list[torch.Tensor]:
        for work in works:
            eng.settle(lambda work=work: eng.watchdog.wait(work, entry.workers))
        if divisor:
            for t in tensors:
                t.div_(divisor)
        return list(tensors)
    return Pending(finish)


def _start_staged(eng: TorchDistEngine, call: Call, tensors: list[torch.Tensor],
                  entries: list[GroupPlan]) -> Pending | None:
    """:func:`start_all_reduce` of CUDA tensors on a CPU comm device (``staging.py``): their
    copies to the host start now, on a side stream, and the transport CPU tensors would
    take starts once they are done, in call order (at a later start, or at the latest at
    the wait or at the next other cross-process call); the wait copies the results back.
    Over every worker of one host, the copies go straight into the same-host arena, each
    chunk a round of its own; else into pinned memory, then the chain or async backend
    work. None where CPU tensors would run synchronously (the caller runs the call)."""
    staging, entry, op = eng.staging, entries[0], call.params.op
    reducer = eng.shared_memory
    if reducer is not None and len(entry.workers) == eng.world_size:
        shared = reducer.stage(tensors, op, staging, None, shared_code(eng.watchdog.count + 1, call))
        if shared is not None:
            eng.begin([call])
            staging.poll()
            reducer.progress()  # the slices of earlier rounds that have become ready
            return Pending(lambda: eng.settle(shared.wait))
    hosts = None
    if eng.ordered_reductions and len(entry.group) > 2:
        if eng.hosts is None and staging.pending:
            staging.flush()  # learning the hosts is a collective: after the calls queued before it
        hosts = chain_hosts(eng, entry.workers, entries)
        if hosts is None:
            return None
    copy = staging.to_host([tensors])
    if copy is None:
        return None
    started: list[Pending] = []
    deferred = staging.defer([(copy.ready, lambda: started.append(_start_on_host(eng, call, copy.rows[0], entry,
                                                                                  hosts)))])
    staging.poll()

    def finish() -> list[torch.Tensor]:
        try:
            staging.flush(deferred)
            started[0].wait()
        except BaseException:
            staging.release(copy)
            raise
        staging.from_host(copy, [tensors])
        return list(tensors)
    return Pending(lambda: eng.settle(finish))


def start_gathered_all_reduce(eng: TorchDistEngine, call: Call,
                              payloads: list[list[torch.Tensor]]) -> Pending | None:
    """Starts an in-place SUM/MEAN all-reduce of every local replica's floating-point
    tensors over every replica as one async all-gather (several local replicas per
    worker, ordered reductions); the wait reduces the gathered rows in ascending
    replica id, the ordered path's bytes, and copies the result into every local
    replica's tensors. None when the call is not of that form, or goes along a chain of
    hosts (``chain.py``): the caller runs it synchronously."""
    if (call.kind is not Kind.ALL_REDUCE or not is_inplace(call) or call.params.op not in (ReduceOp.SUM, ReduceOp.MEAN)
            or not eng.ordered_reductions or eng.world_size < 2 or eng.check_collectives
            or len(call.groups) != 1 or len(call.groups[0]) != eng.num_replicas):
        return None
    leaves = [t for row in payloads for t in row]
    if not leaves or not leaves[0].dtype.is_floating_point:
        return None
    dtype = leaves[0].dtype
    if not all(t.device == eng.comm_device and t.dtype == dtype and t.is_contiguous() for t in leaves):
        return None
    if chain_hosts(eng, tuple(range(eng.world_size)), eng.planner.plan(call.groups)) is not None:
        return None  # across hosts the chain's traffic (run now) beats sending every replica's tensors
    eng.begin([call])
    # Each row ends with the call's stamp (agreement.py) as byte-sized digits, exact in any
    # floating dtype: workers whose calls differ raise at the wait, before a result is used.
    stamp = stamp_of(eng.watchdog.count, [call])
    digits = stamp_digits(stamp, dtype, eng.comm_device)
    local = torch.stack([torch.cat([*[t.view(-1) for t in row], digits]) for row in payloads])  # [local, n + k]
    rows = [torch.empty_like(local) for _ in range(eng.world_size)]
    work = dist.all_gather(rows, local, async_op=True)
    op: ReduceOp = call.params.op
    k = STAMP_DIGITS
    workers = range(eng.world_size)

    def finish() -> list[torch.Tensor]:
        eng.settle(lambda: eng.watchdog.wait(work, workers))
        eng.settle(lambda: check_rows(torch.stack([block[0, -k:] for block in rows]), stamp, workers, eng.rank,
                                      "the gathered all-reduce"))
        every = [row[:-k] for block in rows for row in block.unbind(0)]  # ascending replica id
        out = torch.empty_like(every[0])
        reduce_into(op, out, every)
        for row in payloads:
            offset = 0
            for t in row:
                t.view(-1).copy_(out[offset:offset + t.numel()])
                offset += t.numel()
        return [t for row in payloads for t in row]
    return Pending(finish)


def reduce_scatter(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    full = _reduced(eng, step)
    outs: list[list[torch.Tensor]] = []
    for i, rid in enumerate(eng.local_replica_ids):
        dims, sizes = step.params[rid].dims, step.params[rid].sizes
        group = next(group for group in step.call.groups if rid in group)
        position, k = group.index(rid), len(group)
        row = []
        for leaf, x in enumerate(full[i]):
            dim = dims[leaf]
            start, length = scatter_slice(x.shape[dim], position, k, None if sizes is None else sizes[leaf])
            row.append(x.narrow(dim, start, length).clone(memory_format=torch.contiguous_format))
        outs.append(row)
    return outs


def _reduced(eng: TorchDistEngine, step: Step) -> list[list[torch.Tensor]]:
    """Every local replica's reduced leaves (the op is ``params.op`` of each group's call)."""
    index, payloads, groups = eng.local_index, step.payloads, step.call.groups
    n_leaves = len(payloads[0])
    outs: list[list[Any]] = [[None] * n_leaves for _ in payloads]
    # this worker's calls and their stamp (agreement.py): the same for every worker set
    calls = [step.call._replace(params=step.params[rid]) for rid in eng.local_replica_ids]
    stamp = stamp_of(eng.watchdog.count, calls)
    for workers, entries in by_worker_set(eng.planner.plan(groups)).items():
        if len(workers) == 1:
            for entry in entries:
                op = step.params[entry.local[0]].op
                for leaf in range(n_leaves):
                    xs = [payloads[index[rid]][leaf] for rid in entry.local]
                    acc = reduce_into(op, torch.empty_like(xs[0], memory_format=torch.contiguous_format),
                                      [x.to(xs[0].device) for x in xs])
                    eng.hand_out(outs, leaf, entry.local, acc)
            continue
        ops = [step.params[entry.local[0]].op for entry in entries]
        ref = payloads[index[entries[0].local[0]]]
        ordered = [leaf for leaf in range(n_leaves) if eng.ordered_reductions and len(groups[0]) > 2
                   and (ref[leaf].dtype.is_floating_point or ref[leaf].dtype.is_complex)]
        if ordered:
            hosts = chain_hosts(eng, workers, entries)
            if hosts is not None:
                chain_all_reduce(eng, hosts, entries[0], ops[0], ordered, payloads, outs, stamp)
            else:
                ordered_all_reduce(eng, workers, entries, ops, ordered, payloads, outs, stamp)
        # partials[(entry number, leaf)]: reduced over the local members, on the comm device
        partials: dict[tuple[int, int], torch.Tensor] = {}
        for number, entry in enumerate(entries):
            local_op = ReduceOp.SUM if ops[number] is ReduceOp.MEAN else ops[number]
            for leaf in range(n_leaves):
                if leaf in ordered:
                    continue
                xs = [payloads[index[rid]][leaf] for rid in entry.local]
                if len(xs) == 1 and step.inplace and xs[0].device == eng.comm_device:
                    partial = xs[0]  # the caller's own buffer: reduced where it lies, no copy
                elif len(xs) == 1:  # our own copy: the collective works in place
                    partial = eng.pool.empty(tuple(xs[0].shape), xs[0].dtype, eng.comm_device).copy_(xs[0])
                else:
                    xs = [x.to(eng.comm_device) for x in xs]
                    partial = reduce_into(local_op, torch.empty_like(xs[0], memory_format=torch.contiguous_format),
                                          xs)
                partials[(number, leaf)] = partial
        buckets: dict[tuple[torch.dtype, ReduceOp], list[tuple[int, int]]] = {}
        for key, partial in partials.items():
            buckets.setdefault((partial.dtype, ops[key[0]]), []).append(key)
        for (dtype, op), keys in buckets.items():
            results = _all_reduce_buffer(eng, [partials[key] for key in keys], op, dtype, entries[0].subgroup,
                                         workers, stamp)
            for (number, leaf), result in zip(keys, results):
                entry = entries[number]
                if op is ReduceOp.MEAN:
                    result.div_(len(entry.group))
                eng.hand_out(outs, leaf, entry.local, result)
    return outs


def _all_reduce_buffer(eng: TorchDistEngine, parts: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype,
                       pg: Any, workers: tuple[int, ...], stamp: Stamp) -> list[torch.Tensor]:
    """All-reduces ``parts`` (same dtype) over the workers of ``pg`` in one collective, the
    call's check elements in front (``agreement.py``); where they cannot ride (another dtype
    or op, or one large part reduced where it lies) they travel in a small int64 collective
    of their own, queued behind the data (gloo; NCCL's are not checked)."""
    if dtype.is_complex and op is ReduceOp.PROD:
        return _prod_by_gather(eng, parts, pg, workers)
    n, device = len(workers), parts[0].device
    cpu = device.type == "cpu"
    riding = (cpu and dtype in CHECKED_DTYPES and op in CHECKED_OPS
              and (len(parts) > 1 or parts[0].numel() * parts[0].element_size() <= _RIDING_COPY_BYTES))
    check = check_elements(stamp, op, dtype, n, device) if riding else None
    if check is None and len(parts) == 1:  # already a fresh buffer (see _reduced)
        flat = parts[0].reshape(-1)
        views = [parts[0]]
    else:
        front = [] if check is None else [check]
        flat = torch.cat([*front, *[part.reshape(-1) for part in parts]])
        views, offset = [], 0 if check is None else check.numel()
        for part in parts:
            views.append(flat[offset:offset + part.numel()].view(part.shape))
            offset += part.numel()
    works = []
    if flat.numel():
        wire = flat.view(torch.uint8) if dtype == torch.bool else flat
        works.append(dist.all_reduce(wire, op=_dist_op(op, dtype), group=pg, async_op=True))
    own = None
    if check is None and cpu:
        own = check_elements(stamp, ReduceOp.MAX, torch.int64, n, device)
        works.append(dist.all_reduce(own, op=dist.ReduceOp.MAX, group=pg, async_op=True))
    for work in works:
        eng.watchdog.wait(work, workers)
    if check is not None:
        verify_elements(flat[:check.numel()], stamp, op, n, "the backend's all-reduce", eng.rank)
    elif own is not None:
        verify_elements(own, stamp, ReduceOp.MAX, n, "the backend's all-reduce", eng.rank)
    return views


def _prod_by_gather(eng: TorchDistEngine, parts: list[torch.Tensor], pg: Any,
                    workers: tuple[int, ...]) -> list[torch.Tensor]:
    flat = torch.cat([part.reshape(-1) for part in parts])
    gathered = torch.empty(len(workers) * flat.numel(), dtype=flat.dtype, device=flat.device)
    eng.watchdog.wait(dist.all_gather_into_tensor(gathered, flat, group=pg, async_op=True), workers)
    rows = gathered.view(len(workers), -1)
    acc = rows[0].clone()
    for row in rows[1:]:
        acc.mul_(row)
    views, offset = [], 0
    for part in parts:
        views.append(acc[offset:offset + part.numel()].view(part.shape))
        offset += part.numel()
    return views
