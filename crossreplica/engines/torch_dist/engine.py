"""The multi-process engine: replicas in different processes, joined by torch.distributed.

Each process (a *worker*) drives ``replicas_per_worker`` local replicas; the
global replica id is ``worker_rank * replicas_per_worker + local_index``. This
module does the cross-process half of every collective for all local replicas
of a worker at once (:meth:`TorchDistEngine.process`); with one replica per
worker that is the whole engine, with several the hierarchical engine
(``hierarchical.py``) first meets the local replicas in-process.

How each kind maps onto torch.distributed (gloo on CPU, NCCL on CUDA):

* a group assignment becomes, per replica group, the set of workers that own a
  member (a *worker set*). Worker sets with more than one worker get a process
  subgroup, created for every distinct set of an assignment together, in the
  same order on every worker, the first time the assignment is seen, and cached.
  Worker sets are then served in canonical order, so blocking collectives on
  overlapping subgroups cannot deadlock.
* all_reduce: local members reduce in-process (ascending replica id), the
  partials of every group of a worker set are packed into one buffer per dtype
  and all-reduced once. MEAN is a SUM divided by the group size; bool is
  reduced as uint8 with MAX (sum/max = or) or MIN (prod/min = and), never
  through float. Complex PROD (unsupported by the backends) gathers and
  multiplies in worker order.
* reduce_scatter: the all_reduce above, then each member keeps its chunk.
* all_gather: shapes may differ along the gather dim, so the sizes travel
  first (a small int64 all-gather), then one padded byte buffer per worker.
* broadcast: one byte buffer per (worker set, source worker), dist.broadcast.
* all_to_all and permute: point-to-point, one packed message per peer worker,
  through batch_isend_irecv; receivers know the sizes from their own shapes
  (shapes agree within a group).

Invariants kept (see ``engines/base.py``): every replica of a group gets the
same bytes (the backends' all-reduce results are replicated, and everything
else is a copy); every wait is bounded by the timeout. On CPU (gloo) waits are
sliced: between slices the worker checks a store key that a failing worker sets
(``abort``), so a raising worker releases the others within a fraction of a
second, and on timeout the store's progress keys tell which ranks never
arrived. With ``check_collectives`` each collective is preceded by a hashed
signature exchange; a mismatch gathers every replica's call and raises
CollectiveMismatchError listing them.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, CrossReplicaError, ReplicaAborted
from ..groups import Groups
from ..reduce_op import ReduceOp
from .base import FINISHED, Call, Engine, Kind, check_agreement, check_inplace, is_inplace, scatter_slice
from .buffer_pool import BufferPool
from .reduction import reduce_into

__all__ = ["TorchDistEngine", "WorkerFailedError"]

_ALIGN = 16  # byte alignment of packed segments, so every dtype view is aligned
_SLICE = 0.25  # seconds between abort-key checks while a collective waits


class WorkerFailedError(CollectiveTimeoutError):
    """The connection to another worker broke during a collective: it died, so its
    replicas will never arrive (``missing`` holds their ids, when known)."""


def _dist_op(op: ReduceOp, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return dist.ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else dist.ReduceOp.MIN
    return {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.SUM,
            ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.PROD: dist.ReduceOp.PRODUCT}[op]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point or dtype.is_complex
                else torch.iinfo(dtype).bits // 8 if dtype != torch.bool else 1)


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bytes of ``tensors`` in one uint8 buffer, each segment 16-byte aligned."""
    total = sum(_padded(t.numel() * t.element_size()) for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        off += _padded(n)
    return buf


def _unpack(buf: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
            offset: int = 0) -> tuple[list[torch.Tensor], int]:
    """Views into ``buf`` for ``(shape, dtype)`` specs laid out by :func:`_pack`."""
    out = []
    for shape, dtype in specs:
        n = _nbytes(shape, dtype)
        out.append(buf[offset:offset + n].view(dtype).view(shape))
        offset += _padded(n)
    return out, offset


class TorchDistEngine(Engine):
    """Collectives between processes through torch.distributed, one replica per worker
    (or, as the base of the hierarchical engine, all local replicas of a worker at once)."""

    def __init__(self, devices: Sequence[torch.device], timeout: float,
                 check_collectives: bool = False, comm_device: torch.device | None = None,
                 ordered_reductions: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistEngine needs an initialised torch.distributed process group; use "
                "cr.MultiWorkerMirroredStrategy, which initialises it from the torchrun environment")
        self.devices = tuple(devices)
        self.replicas_per_worker = len(self.devices)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.num_replicas = self.world_size * self.replicas_per_worker
        self.local_replica_ids = tuple(self.rank * self.replicas_per_worker + i
                                       for i in range(self.replicas_per_worker))
        self._index = {r: i for i, r in enumerate(self.local_replica_ids)}
        self.backend = str(dist.get_backend())
        if comm_device is None:
            comm_device = (torch.device("cuda", torch.cuda.current_device())
                           if self.backend == "nccl" else torch.device("cpu"))
        self.comm_device = comm_device
        self._timeout = float(timeout)
        self.check_collectives = bool(check_collectives)
        self._store = self._default_store()
        # Keys of this engine in the store. Every worker creates its engines in the same
        # order (SPMD), so its own count of engines names the same engine everywhere.
        serial = 0
        if self._store is not None:
            serial = self._store.add(f"crossreplica/engines-of-rank{self.rank}", 1)
        self._prefix = f"crossreplica/engine{serial}"
        self._subgroups: dict[tuple[int, ...], Any] = {}
        self._plans: dict[Groups, list] = {}
        self._count = 0  # cross-process collectives so far (same on every worker: SPMD)
        self._run = 0
        self._broken: BaseException | None = None
        self._current: tuple[Any, int] = ("no collective yet", 0)
        self._params: dict[int, tuple] = {}
        #: reduce floating point in ascending replica id (exactly the in-process results) rather
        #: than with the backend's ring; matters only for groups of three replicas or more
        self.ordered_reductions = ordered_reductions
        # The one-local-replica all-reduce works in place on its own copy of the
        # input: reused buffers spare the page faults of a fresh one each call.
        self._pool = BufferPool(max_buffers=8)
        self._inplace = False
        self._exchanges: dict[int, int] = {}  # peer worker -> point-to-point exchanges with it so far

    @staticmethod
    def _default_store() -> Any:
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - private API: without it, no prompt abort
            return None

    @property
    def timeout(self) -> float:
        return self._timeout

    # ------------------------------------------------------------ Engine API

    def begin_run(self) -> None:
        self._run += 1

    def execute(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.process([call], [tensors])[0]

    def finish(self, replica_id: int) -> None:
        if self.check_collectives and self._broken is None:
            self.process([FINISHED], [[]])

    def abort(self, replica_id: int, exc: BaseException) -> None:
        """Tells every other worker (through the store) that this one failed."""
        if isinstance(exc, (ReplicaAborted, CollectiveTimeoutError, CollectiveMismatchError)):
            return  # a consequence of another failure, already known everywhere
        self._announce(f"worker rank {self.rank} (replicas {list(self.local_replica_ids)}): replica "
                       f"{replica_id} raised {type(exc).__name__}: {exc}")

    def _announce(self, message: str) -> None:
        """Sets the store's abort key (the other workers stop waiting) and breaks this engine."""
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/abort", message)
            except Exception:  # noqa: BLE001 - best effort; the timeout still bounds the wait
                pass
        self._broken = ReplicaAborted(f"this worker failed earlier: {message}")

    def close(self) -> None:
        for pg in self._subgroups.values():
            if pg is not None:
                try:
                    dist.destroy_process_group(pg)
                except Exception:  # noqa: BLE001
                    pass
        self._subgroups.clear()
        self._plans.clear()

    # ------------------------------------------------------------ the worker-level call

    def process(self, calls: Sequence[Call], payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Runs one collective for every local replica (``calls``/``payloads`` in local order)."""
        if self._broken is not None:
            raise self._broken_error()
        self._count += 1
        call = calls[0]
        self._current = (call, self._count)  # described only if something goes wrong
        try:
            if self.check_collectives:
                self._check_signatures(calls)
            if call.kind is Kind.FINISHED:
                return [[]]
            self._inplace = inplace = is_inplace(call)
            if inplace:
                check_inplace(payloads)
            else:
                payloads = [[t if t.is_contiguous() else t.contiguous() for t in p] for p in payloads]
            # Parameters agree within a group but may differ between groups (an uneven
            # all_gather's sizes, a group-dependent broadcast source): look them up per group.
            self._params = {r: c.params for r, c in zip(self.local_replica_ids, calls)}
            kind = call.kind
            if kind is Kind.ALL_REDUCE:
                outs = self._all_reduce(call.groups, payloads)
                if inplace:  # results that are not already the inputs are copied into them
                    for xs, os_ in zip(payloads, outs):
                        for t, (x, o) in enumerate(zip(xs, os_)):
                            if o.data_ptr() != x.data_ptr():
                                x.copy_(o)
                            os_[t] = x
                return outs
            if kind is Kind.REDUCE_SCATTER:
                return self._reduce_scatter(call, payloads)
            if kind is Kind.ALL_GATHER:
                return self._all_gather(call, payloads)
            if kind is Kind.BROADCAST:
                return self._broadcast(call, payloads)
            if kind is Kind.ALL_TO_ALL:
                return self._all_to_all(call, payloads)
            if kind is Kind.PERMUTE:
                return self._permute(call, payloads)
            raise ValueError(f"unknown collective kind {kind!r}")
        except (CollectiveMismatchError, CollectiveTimeoutError, ReplicaAborted) as e:
            self._broken = e
            raise
        except RuntimeError as e:
            if not _is_peer_loss(e):
                raise
            err = self._lost(e)  # the process group can no longer be trusted
            self._broken = err
            raise err from e

    def barrier(self, what: str = "barrier") -> None:
        """Waits (bounded) until every worker reaches the same barrier."""
        if self._broken is not None:
            raise self._broken_error()
        self._count += 1
        self._current = (what, self._count)
        try:
            self._wait(dist.all_reduce(torch.zeros(1, device=self.comm_device), async_op=True),
                       range(self.world_size))
        except RuntimeError as e:
            if isinstance(e, CrossReplicaError) or not _is_peer_loss(e):
                raise
            raise self._lost(e) from e

    @property
    def _where(self) -> str:
        what, count = self._current
        what = what.describe() if isinstance(what, Call) else what
        return f"{what} (cross-process call #{count})"

    def _broken_error(self) -> BaseException:
        b = self._broken
        return type(b)(f"a previous collective failed, so the process group is out of step; "
                       f"restart the workers (torchrun --max-restarts) and resume from a "
                       f"checkpoint. The failure was: {b}") if not isinstance(b, ReplicaAborted) else b

    # ------------------------------------------------------------ groups

    def _plan(self, groups: Groups) -> list:
        """Per replica group: (group, worker set, subgroup, local members in ascending id)."""
        plan = self._plans.get(groups)
        if plan is not None:
            return plan
        R = self.replicas_per_worker
        sets = [tuple(sorted({r // R for r in g})) for g in groups]
        for ws in sets:  # every worker creates every subgroup, in the same order
            if len(ws) > 1 and ws not in self._subgroups:
                if len(ws) == self.world_size:
                    self._subgroups[ws] = None  # the default group
                else:
                    self._subgroups[ws] = dist.new_group(
                        list(ws), timeout=datetime.timedelta(seconds=self._timeout))
        plan = []
        for g, ws in zip(groups, sets):
            local = [r for r in sorted(g) if r // R == self.rank]
            plan.append((g, ws, self._subgroups.get(ws), local))
        self._plans[groups] = plan
        return plan

    @staticmethod
    def _by_worker_set(plan: list) -> dict[tuple[int, ...], list]:
        """Entries of groups this worker takes part in, keyed by worker set, in canonical order."""
        out: dict[tuple[int, ...], list] = {}
        for entry in plan:
            if entry[3]:
                out.setdefault(entry[1], []).append(entry)
        return out

    # ------------------------------------------------------------ all_reduce

    def _all_reduce(self, groups: Groups, payloads: Sequence[list[torch.Tensor]]
                    ) -> list[list[torch.Tensor]]:
        """All-reduce (the op is ``params[0]`` of each group's call, as for reduce_scatter)."""
        idx = self._index
        n_leaves = len(payloads[0])
        outs: list[list[Any]] = [[None] * n_leaves for _ in payloads]
        for ws, entries in self._by_worker_set(self._plan(groups)).items():
            if len(ws) == 1:
                for g, _, _, local in entries:
                    op = self._params[local[0]][0]
                    for t in range(n_leaves):
                        xs = [payloads[idx[r]][t] for r in local]
                        acc = reduce_into(op, torch.empty_like(xs[0], memory_format=torch.contiguous_format),
                                          [x.to(xs[0].device) for x in xs])
                        self._hand_out(outs, t, local, acc)
                continue
            pg = entries[0][2]
            ops = [self._params[entry[3][0]][0] for entry in entries]
            ref = payloads[idx[entries[0][3][0]]]
            ordered = [t for t in range(n_leaves) if self.ordered_reductions and len(groups[0]) > 2
                       and (ref[t].dtype.is_floating_point or ref[t].dtype.is_complex)]
            if ordered:
                self._ordered_all_reduce(ws, entries, ops, ordered, payloads, outs)
            # partial[(entry, leaf)] reduced over the local members, on the comm device
            partials: dict[tuple[int, int], torch.Tensor] = {}
            for e, (g, _, _, local) in enumerate(entries):
                local_op = ReduceOp.SUM if ops[e] is ReduceOp.MEAN else ops[e]
                for t in range(n_leaves):
                    if t in ordered:
                        continue
                    xs = [payloads[idx[r]][t] for r in local]
                    if len(xs) == 1 and self._inplace and xs[0].device == self.comm_device:
                        p = xs[0]  # the caller's own buffer: reduced where it lies, no copy
                    elif len(xs) == 1:  # our own copy: the collective works in place
                        p = self._pool.empty(tuple(xs[0].shape), xs[0].dtype, self.comm_device).copy_(xs[0])
                    else:
                        xs = [x.to(self.comm_device) for x in xs]
                        p = reduce_into(local_op, torch.empty_like(xs[0], memory_format=torch.contiguous_format), xs)
                    partials[(e, t)] = p
            buckets: dict[tuple[torch.dtype, ReduceOp], list[tuple[int, int]]] = {}
            for key, p in partials.items():
                buckets.setdefault((p.dtype, ops[key[0]]), []).append(key)
            for (dtype, op), keys in buckets.items():
                reduced = self._all_reduce_buffer([partials[k] for k in keys], op, dtype, pg, ws)
                for (e, t), r in zip(keys, reduced):
                    g, _, _, local = entries[e]
                    if op is ReduceOp.MEAN:
                        r.div_(len(g))
                    self._hand_out(outs, t, local, r)
        return outs

    def _ordered_all_reduce(self, ws: tuple[int, ...], entries: list, ops: list[ReduceOp],
                            leaves: list[int], payloads: Sequence[list[torch.Tensor]],
                            outs: list[list[Any]]) -> None:
        """Floating-point reductions in ascending replica id, as the in-process engine does.

        A reduce-scatter then all-gather, like the backends' ring, but ordered: worker ``j``
        of the worker set receives the ``j``-th chunk of every member's tensor (point to
        point), reduces the chunks sequentially in ascending replica id, and the reduced
        chunks are all-gathered. The result is ``((x0 + x1) + x2) + ...`` exactly, the same
        bytes on every replica, for the traffic of a ring all-reduce."""
        idx, R = self._index, self.replicas_per_worker
        n_w, me = len(ws), ws.index(self.rank)
        comm = self.comm_device
        # one unit per (group, dtype): that group's leaves of that dtype, flattened end to end
        units = []
        for e, (g, _, _, local) in enumerate(entries):
            rp = payloads[idx[local[0]]]
            for d in sorted({rp[t].dtype for t in leaves}, key=str):
                ts = [t for t in leaves if rp[t].dtype == d]
                units.append((e, d, ts, sum(rp[t].numel() for t in ts)))

        def bounds(n: int, j: int) -> tuple[int, int]:
            return n * j // n_w, n * (j + 1) // n_w

        vec = {(u, r): torch.cat([payloads[idx[r]][t].reshape(-1) for t in ts]).to(comm)
               for u, (e, d, ts, n) in enumerate(units) for r in entries[e][3]}
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list] = {}
        order: dict[int, list[tuple[int, int]]] = {}
        for j, w in enumerate(ws):
            if w == self.rank:
                continue
            for u, (e, d, ts, n) in enumerate(units):
                lo, hi = bounds(n, j)
                sends.setdefault(w, []).extend(vec[(u, r)][lo:hi] for r in entries[e][3])
                mlo, mhi = bounds(n, me)
                for r in sorted(entries[e][0]):
                    if r // R == w:
                        recvs.setdefault(w, []).append(((mhi - mlo,), d))
                        order.setdefault(w, []).append((u, r))
        inbox = self._exchange(sends, recvs)
        chunks = {key: x for w, keys in order.items() for key, x in zip(keys, inbox[w])}
        reduced = []
        for u, (e, d, ts, n) in enumerate(units):
            lo, hi = bounds(n, me)
            xs = [vec[(u, r)][lo:hi] if r // R == self.rank else chunks[(u, r)] for r in sorted(entries[e][0])]
            reduced.append(reduce_into(ops[e], torch.empty(hi - lo, dtype=d, device=comm), xs))
        specs = [[((bounds(n, j)[1] - bounds(n, j)[0],), d) for (e, d, ts, n) in units] for j in range(n_w)]
        width = max(sum(_padded(_nbytes(s, d)) for s, d in row) for row in specs)
        pieces: list[list[torch.Tensor]] = [[] for _ in units]
        if width:
            send = _pack(reduced, comm)
            if send.numel() < width:
                send = torch.cat([send, send.new_zeros(width - send.numel())])
            recv = self._gather_fixed(send, entries[0][2], ws).view(n_w, width)
            for j in range(n_w):
                row = reduced if j == me else _unpack(recv[j], specs[j])[0]
                for u, x in enumerate(row):
                    pieces[u].append(x)
        for u, (e, d, ts, n) in enumerate(units):
            full = torch.cat(pieces[u]) if pieces[u] else torch.empty(0, dtype=d, device=comm)
            local = entries[e][3]
            rp = payloads[idx[local[0]]]
            off = 0
            for t in ts:
                k = rp[t].numel()
                self._hand_out(outs, t, local, full[off:off + k].view(rp[t].shape), fresh=len(ts) == 1)
                off += k

    def _all_reduce_buffer(self, parts: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype, pg: Any,
                           ws: tuple[int, ...]) -> list[torch.Tensor]:
        """All-reduces ``parts`` (same dtype) over the workers of ``pg`` in one collective."""
        if dtype.is_complex and op is ReduceOp.PROD:
            return self._prod_by_gather(parts, pg, ws)
        if len(parts) == 1:  # already a fresh buffer (see _all_reduce)
            flat = parts[0].reshape(-1)
            views = [parts[0]]
        else:
            flat = torch.cat([p.reshape(-1) for p in parts])
            views, off = [], 0
            for p in parts:
                views.append(flat[off:off + p.numel()].view(p.shape))
                off += p.numel()
        if flat.numel():
            wire = flat.view(torch.uint8) if dtype == torch.bool else flat
            self._wait(dist.all_reduce(wire, op=_dist_op(op, dtype), group=pg, async_op=True), ws)
        return views

    def _prod_by_gather(self, parts: list[torch.Tensor], pg: Any, ws: tuple[int, ...]) -> list[torch.Tensor]:
        flat = torch.cat([p.reshape(-1) for p in parts])
        gathered = torch.empty(len(ws) * flat.numel(), dtype=flat.dtype, device=flat.device)
        self._wait(dist.all_gather_into_tensor(gathered, flat, group=pg, async_op=True), ws)
        rows = gathered.view(len(ws), -1)
        acc = rows[0].clone()
        for row in rows[1:]:
            acc.mul_(row)
        views, off = [], 0
        for p in parts:
            views.append(acc[off:off + p.numel()].view(p.shape))
            off += p.numel()
        return views

    def _hand_out(self, outs: list[list[Any]], t: int, local: list[int], value: torch.Tensor,
                  fresh: bool = True) -> None:
        """Gives each local member of a group its own copy of ``value`` on its device
        (the first may keep ``value`` itself when it is a ``fresh`` buffer of ours)."""
        for k, r in enumerate(local):
            i = self._index[r]
            outs[i][t] = value.to(self.devices[i], copy=not (fresh and k == 0))

    # ------------------------------------------------------------ reduce_scatter

    def _reduce_scatter(self, call: Call, payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        full = self._all_reduce(call.groups, payloads)
        outs: list[list[torch.Tensor]] = []
        for i, rid in enumerate(self.local_replica_ids):
            _, dims, sizes = self._params[rid]
            group = next(g for g in call.groups if rid in g)
            pos, k = group.index(rid), len(group)
            row = []
            for t, x in enumerate(full[i]):
                d = dims[t]
                start, length = scatter_slice(x.shape[d], pos, k, None if sizes is None else sizes[t])
                row.append(x.narrow(d, start, length).clone(memory_format=torch.contiguous_format))
            outs.append(row)
        return outs

    # ------------------------------------------------------------ all_gather

    def _all_gather(self, call: Call, payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        idx, R = self._index, self.replicas_per_worker
        n_leaves = len(payloads[0])
        parts: dict[int, list[torch.Tensor]] = {}  # replica id -> its leaves, for every member we learn of
        for r in self.local_replica_ids:
            parts[r] = payloads[idx[r]]
        for ws, entries in self._by_worker_set(self._plan(call.groups)).items():
            if len(ws) > 1:
                gdims = {r: self._params[entry[3][0]][0] for entry in entries for r in entry[0]}
                parts.update(self._gather_bucket(ws, entries, parts, gdims, n_leaves))
        outs: list[list[torch.Tensor]] = []
        for i, rid in enumerate(self.local_replica_ids):
            group = next(g for g in call.groups if rid in g)
            dev, dims = self.devices[i], self._params[rid][0]
            outs.append([torch.cat([parts[r][t].to(dev) for r in group], dims[t]) for t in range(n_leaves)])
        return outs

    def _gather_bucket(self, ws: tuple[int, ...], entries: list, mine: dict[int, list[torch.Tensor]],
                       gdims: dict[int, tuple], n_leaves: int) -> dict[int, list[torch.Tensor]]:
        """Every member's leaves for the groups of one worker set, given this worker's members'
        leaves in ``mine``; sizes along each group's gather dims (``gdims``) may differ."""
        R = self.replicas_per_worker
        pg = entries[0][2]
        # what each worker of ws contributes: its members of every group, in group order
        owned = {w: [r for g, *_ in entries for r in g if r // R == w] for w in ws}
        refs = {r: mine[entry[3][0]] for entry in entries for r in entry[0]}
        own = owned[self.rank]
        meta_len = max(len(v) for v in owned.values()) * n_leaves
        meta = torch.zeros(meta_len, dtype=torch.int64)
        meta[:len(own) * n_leaves] = torch.tensor(
            [mine[r][t].shape[gdims[r][t]] for r in own for t in range(n_leaves)], dtype=torch.int64)
        metas = self._gather_fixed(meta.to(self.comm_device), pg, ws).cpu().view(len(ws), -1)
        specs: dict[int, list] = {}
        for wi, w in enumerate(ws):
            if w == self.rank:
                continue
            sizes = metas[wi].tolist()
            for j, r in enumerate(owned[w]):
                row = []
                for t in range(n_leaves):
                    ref = refs[r][t]
                    shape = list(ref.shape)
                    shape[gdims[r][t]] = sizes[j * n_leaves + t]
                    row.append((tuple(shape), ref.dtype))
                specs[r] = row
        send = _pack([x for r in own for x in mine[r]], self.comm_device)
        lengths = {w: sum(_padded(_nbytes(s, d)) for r in owned[w] for s, d in specs[r])
                   for w in ws if w != self.rank}
        lengths[self.rank] = send.numel()
        width = max(lengths.values())
        got: dict[int, list[torch.Tensor]] = {}
        if not width:
            for r, row in specs.items():
                got[r] = [torch.empty(s, dtype=d, device=self.comm_device) for s, d in row]
            return got
        if send.numel() < width:
            send = torch.cat([send, send.new_zeros(width - send.numel())])
        recv = self._gather_fixed(send, pg, ws).view(len(ws), width)
        for wi, w in enumerate(ws):
            if w == self.rank:
                continue
            off = 0
            for r in owned[w]:
                got[r], off = _unpack(recv[wi], specs[r], off)
        return got

    def _gather_fixed(self, x: torch.Tensor, pg: Any, ws: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(len(ws) * x.numel(), dtype=x.dtype, device=x.device)
        chunks = list(out.chunk(len(ws))) if x.numel() else [out[:0]] * len(ws)
        self._wait(dist.all_gather(chunks, x, group=pg, async_op=True), ws)
        return out

    # ------------------------------------------------------------ broadcast

    def _broadcast(self, call: Call, payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        idx, R = self._index, self.replicas_per_worker
        n_leaves = len(payloads[0])
        outs: list[list[Any]] = [[None] * n_leaves for _ in payloads]
        for g, ws, pg, local in self._plan(call.groups):
            if not local:
                continue
            src = g[self._params[local[0]][0]]
            if src // R == self.rank:
                for t in range(n_leaves):
                    self._hand_out(outs, t, local, payloads[idx[src]][t], fresh=False)
        # every worker of a worker set walks the same (worker set, source worker) keys in order
        keys: dict[tuple[tuple[int, ...], int], list] = {}
        for g, ws, pg, local in self._plan(call.groups):
            if local and len(ws) > 1:
                src = g[self._params[local[0]][0]]
                keys.setdefault((ws, src // R), []).append((g, pg, local, src))
        for (ws, src_worker), entries in keys.items():
            pg = entries[0][1]
            specs = [(tuple(x.shape), x.dtype) for _, _, local, _ in entries for x in payloads[idx[local[0]]]]
            if src_worker == self.rank:
                buf = _pack([x for _, _, _, src in entries for x in payloads[idx[src]]], self.comm_device)
            else:
                buf = torch.empty(sum(_padded(_nbytes(s, d)) for s, d in specs), dtype=torch.uint8,
                                  device=self.comm_device)
            if buf.numel():
                self._wait(dist.broadcast(buf, src=src_worker, group=pg, async_op=True), ws)
            if src_worker == self.rank:
                continue
            values, _ = _unpack(buf, specs)
            k = 0
            for g, _, local, _ in entries:
                for t in range(n_leaves):
                    self._hand_out(outs, t, local, values[k], fresh=False)
                    k += 1
        return outs

    # ------------------------------------------------------------ point to point

    def _exchange(self, sends: dict[int, list[torch.Tensor]],
                  recvs: dict[int, list[tuple[tuple[int, ...], torch.dtype]]]) -> dict[int, list[torch.Tensor]]:
        """Sends one packed message per peer worker and receives one from each expected peer."""
        ops, inbox = [], {}
        for w in sorted(set(sends) | set(recvs)):
            if w in recvs:
                n = sum(_padded(_nbytes(s, d)) for s, d in recvs[w])
                buf = torch.empty(n, dtype=torch.uint8, device=self.comm_device)
                inbox[w] = buf
                if n:
                    ops.append(dist.P2POp(dist.irecv, buf, w))
            if w in sends:
                buf = _pack(sends[w], self.comm_device)
                if buf.numel():
                    ops.append(dist.P2POp(dist.isend, buf, w))
        if ops:
            peers = tuple(sorted(set(sends) | set(recvs) | {self.rank}))
            works = dist.batch_isend_irecv(ops)
            if self.backend == "nccl" or self._store is None:
                for work in works:
                    self._wait(work, peers)
            else:
                # gloo's send/recv works cannot be waited on in slices: a timed-out wait
                # completes the work with an error (the recv is lost). So wait for the peers
                # to arrive through the store (sliced, abort-aware), then for the transfer.
                deadline = self._await_peers([w for w in peers if w != self.rank], peers)
                for work in works:
                    work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        return {w: _unpack(inbox[w], recvs[w])[0] for w in recvs}

    def _all_to_all(self, call: Call, payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        idx, R = self._index, self.replicas_per_worker
        n_leaves = len(payloads[0])

        def chunk(x: torch.Tensor, split_dim: int, j: int, k: int) -> torch.Tensor:
            c = x.shape[split_dim] // k
            return x.narrow(split_dim, j * c, c)

        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list] = {}
        order: dict[int, list[tuple[int, int]]] = {}  # peer worker -> (sender, receiver) pairs
        for g, ws, pg, local in self._plan(call.groups):
            if not local:
                continue
            k = len(g)
            ref = payloads[idx[local[0]]]
            sds = self._params[local[0]][0]
            for s in g:
                for q in g:
                    sw, qw = s // R, q // R
                    if sw == self.rank and qw != self.rank:
                        sends.setdefault(qw, []).extend(
                            chunk(payloads[idx[s]][t], sds[t], g.index(q), k) for t in range(n_leaves))
                    elif qw == self.rank and sw != self.rank:
                        recvs.setdefault(sw, []).extend(
                            (tuple(chunk(ref[t], sds[t], 0, k).shape), ref[t].dtype) for t in range(n_leaves))
                        order.setdefault(sw, []).append((s, q))
        inbox = self._exchange(sends, recvs)
        received: dict[tuple[int, int], list[torch.Tensor]] = {}
        for w, pairs in order.items():
            for n, pair in enumerate(pairs):
                received[pair] = inbox[w][n * n_leaves:(n + 1) * n_leaves]
        outs = []
        for i, q in enumerate(self.local_replica_ids):
            g = next(g for g in call.groups if q in g)
            k, dev = len(g), self.devices[i]
            sds, cds = self._params[q]
            row = []
            for t in range(n_leaves):
                pieces = []
                for s in g:
                    if s // R == self.rank:
                        pieces.append(chunk(payloads[idx[s]][t], sds[t], g.index(q), k).to(dev))
                    else:
                        pieces.append(received[(s, q)][t].to(dev))
                row.append(torch.cat(pieces, cds[t]))
            outs.append(row)
        return outs

    def _permute(self, call: Call, payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        pairs = call.params[0]
        idx, R = self._index, self.replicas_per_worker
        ref = payloads[0]
        specs = [(tuple(x.shape), x.dtype) for x in ref]
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list] = {}
        order: dict[int, list[int]] = {}
        for s, t in pairs:
            sw, tw = s // R, t // R
            if sw == self.rank and tw != self.rank:
                sends.setdefault(tw, []).extend(payloads[idx[s]])
            elif tw == self.rank and sw != self.rank:
                recvs.setdefault(sw, []).extend(specs)
                order.setdefault(sw, []).append(t)
        inbox = self._exchange(sends, recvs)
        outs: list[list[torch.Tensor]] = [[torch.zeros_like(x) for x in p] for p in payloads]
        n = len(ref)
        for w, targets in order.items():
            for k, t in enumerate(targets):
                i = idx[t]
                outs[i] = [v.to(self.devices[i], copy=True) for v in inbox[w][k * n:(k + 1) * n]]
        for s, t in pairs:
            if s // R == self.rank and t // R == self.rank:
                i = idx[t]
                outs[i] = [x.to(self.devices[i], copy=True) for x in payloads[idx[s]]]
        return outs

    # ------------------------------------------------------------ checking

    def _check_signatures(self, calls: Sequence[Call]) -> None:
        """Compares every worker's calls (hashed; the full calls only on a mismatch)."""
        text = "\n".join(_normalised(c) for c in calls)
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
        mine = torch.tensor([digest], dtype=torch.int64, device=self.comm_device)
        everyone = self._gather_fixed(mine, None, tuple(range(self.world_size)))
        if bool((everyone == everyone[0]).all()):
            return
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, list(calls))
        all_calls = [c for worker_calls in gathered for c in worker_calls]
        finished = [c.kind is Kind.FINISHED for c in all_calls]
        if any(finished) and not all(finished):
            # the in-process engines' wording for a replica that returned while others wait
            lines = "\n".join(f"  replica {r}: {c.describe()}" for r, c in enumerate(all_calls))
            raise CollectiveMismatchError(
                f"replicas made different collective calls (cross-process call #{self._count}; found by "
                f"check_collectives): some replicas returned from the replica function while others "
                f"wait:\n{lines}")
        try:
            check_agreement(all_calls, list(range(self.num_replicas)))
        except CollectiveMismatchError as e:
            raise CollectiveMismatchError(
                f"{e}\n(cross-process call #{self._count}; found by check_collectives)") from None

    # ------------------------------------------------------------ waiting and failures

    def _wait(self, work: Any, ranks: Sequence[int]) -> None:
        """Waits for ``work`` in slices, checking the abort key; bounded by the timeout."""
        if self.backend == "nccl":
            work.wait()  # the NCCL watchdog enforces the process-group timeout
            return
        deadline = time.monotonic() + self._timeout
        posted = False
        while True:
            left = deadline - time.monotonic()
            try:
                work.wait(datetime.timedelta(seconds=max(min(_SLICE, left), 0.001)))
                return
            except RuntimeError as e:
                # Work.wait's own "Operation timed out!" ends a slice; the work goes on. Anything
                # else (or a finished work) is the backend reporting a real failure.
                if "Operation timed out" not in str(e) or work.is_completed():
                    raise
            if not posted:
                self._post_progress()
                posted = True
            self._raise_if_aborted_or_late(deadline, ranks, lambda: self._missing(ranks))

    def _await_peers(self, peers: Sequence[int], ranks: Sequence[int]) -> float:
        """Posts this worker's arrival at its next exchange with each of ``peers`` and waits
        (abort-aware, bounded by the timeout) until each has posted its arrival at the same
        exchange; returns the deadline. Both sides of a pair walk their exchanges in the
        same order, so a per-pair count names the same exchange on both."""
        deadline = time.monotonic() + self._timeout
        want = {}
        for w in peers:
            want[w] = self._exchanges.get(w, 0) + 1
            self._exchanges[w] = want[w]
            self._store.add(f"{self._prefix}/p2p/{self.rank}->{w}", 1)
        pause, posted = 0.0005, False
        while True:
            waiting = [w for w in peers if self._store.add(f"{self._prefix}/p2p/{w}->{self.rank}", 0) < want[w]]
            if not waiting:
                return deadline
            if not posted and pause >= 0.01:
                self._post_progress()
                posted = True
            self._raise_if_aborted_or_late(deadline, ranks, lambda: waiting)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _raise_if_aborted_or_late(self, deadline: float, ranks: Sequence[int],
                                  missing: Any) -> None:
        """Raises if another worker announced a failure, or ``deadline`` has passed
        (naming the worker ranks ``missing()`` returns and their replicas)."""
        aborted = self._abort_message()
        if aborted is not None:
            raise ReplicaAborted(f"{aborted}; this worker was released from {self._where}")
        if time.monotonic() >= deadline:
            late = list(missing())
            R = self.replicas_per_worker
            replicas = tuple(r for w in late for r in range(w * R, (w + 1) * R))
            raise CollectiveTimeoutError(
                f"collective {self._where} timed out after {self._timeout:g}s on worker rank "
                f"{self.rank}: worker ranks {late} (replicas {list(replicas)}) never "
                f"arrived (ranks taking part: {list(ranks)})", replicas)

    def _post_progress(self) -> None:
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/progress/{self.rank}", str(self._count))
            except Exception:  # noqa: BLE001
                pass

    def _abort_message(self) -> str | None:
        if self._store is None:
            return None
        key = f"{self._prefix}/abort"
        try:
            if self._store.check([key]):
                return self._store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - a dead store host shows up as a lost peer instead
            return None
        return None

    def _missing(self, ranks: Sequence[int], grace: float = 0.0) -> list[int]:
        """Ranks among ``ranks`` that have not posted progress at this call (store based)."""
        if self._store is None:
            return [r for r in ranks if r != self.rank]
        end = time.monotonic() + grace
        while True:
            missing = []
            for r in ranks:
                if r == self.rank:
                    continue
                key = f"{self._prefix}/progress/{r}"
                try:
                    seen = int(self._store.get(key)) if self._store.check([key]) else -1
                except Exception:  # noqa: BLE001
                    seen = -1
                if seen < self._count:
                    missing.append(r)
            if not missing or time.monotonic() >= end:
                return missing
            time.sleep(0.1)

    def _lost(self, e: BaseException) -> CrossReplicaError:
        """Turns a backend error (a peer closed its connection) into our error type."""
        aborted = self._abort_message()
        if aborted is not None:
            return ReplicaAborted(f"{aborted}; this worker was released from {self._where}")
        self._post_progress()
        missing = self._missing(range(self.world_size), grace=1.0)
        aborted = self._abort_message()
        if aborted is not None:
            return ReplicaAborted(f"{aborted}; this worker was released from {self._where}")
        R = self.replicas_per_worker
        replicas = tuple(r for w in missing for r in range(w * R, (w + 1) * R))
        who = (f"worker ranks {missing} (replicas {list(replicas)}) did not reach it and are presumed "
               f"dead" if missing else "the failing worker is unknown")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(". ")[0]  # the backend's advice that follows is not ours to give
        return WorkerFailedError(
            f"collective {self._where} failed on worker rank {self.rank}: the connection to another "
            f"worker broke ({first}); {who}", replicas)


_PEER_LOSS = ("connection", "closed", "reset by peer", "broken pipe", "read error", "write error",
              "timed out", "timeout", "socket", "unreachable", "gloo", "nccl")


def _is_peer_loss(e: BaseException) -> bool:
    """Whether a backend error means a peer is gone (rather than a bug in the call)."""
    text = str(e).lower()
    return any(word in text for word in _PEER_LOSS)


def _normalised(call: Call) -> str:
    """``call.describe()`` with all-gather sizes along the gather dim masked (they may differ)."""
    if call.kind is not Kind.ALL_GATHER:
        return call.describe()
    shapes = tuple(tuple(-1 if i == d else s for i, s in enumerate(shape))
                   for d, shape in zip(call.params[0], call.shapes))
    return call._replace(shapes=shapes).describe()
