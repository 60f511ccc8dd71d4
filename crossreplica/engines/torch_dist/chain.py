"""Engine layer (torch_dist): the ordered all-reduce across hosts, as a chain of hosts.

Why: the ordered all-reduce (``ordered.py``) sends each replica's share to its
chunk's owner separately, so with several workers per host most of its bytes
cross the network, more than a ring's. The ordered sum ``((x0 + x1) + x2) + ...``
is a left fold in replica order, so one host's partial sum cannot be added to
another's; but a fold can be continued. With the workers of each host on
consecutive ranks (hosts in rank order, as torchrun lays them out), every vector
is cut into K slices, K the fewest workers on a host, and the k-th worker of
each host owns slice k:

1. within each host, every worker sends its replicas' part of slice k to the
   host's owner k (the host's own network);
2. owner k of host 0 folds its host's replicas; owner k of host h continues the
   fold host h-1 sent it with its own host's replicas, in replica order, and sends
   it on; the last host's fold is the result (MEAN divides it there), which goes
   back down the chain. Slices travel in pieces (``PIECE_BYTES``), so a host folds
   piece p while piece p+1 is on the wire, and the K owners of a host use the link
   in parallel;
3. within each host, the owners send their reduced slice to the host's other workers.

Each host boundary carries the vector once each way: the cross-host bytes of a
hierarchical ring, two thirds of a flat ring's on 2 hosts x 2 workers.
Invariant: the result is ``reduce_into`` over every replica in ascending id (the
bytes of ``reduction.py``, of the in-process engine and of ``ordered.py``), the
same on every replica. Waits are bounded by the timeout as in ``p2p.exchange``.
"""

from __future__ import annotations

import datetime
import hashlib
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...reduce_op import ReduceOp
from ..reduction import reduce_into
from .gather import gather_fixed
from .p2p import exchange
from .plan import GroupPlan

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["PIECE_BYTES", "chain_all_reduce", "chain_hosts", "host_layout"]

#: the size of the pieces a slice travels in between hosts (pipelining; 0: one piece)
PIECE_BYTES = 1 << 20

Hosts = list[tuple[int, ...]]


def host_layout(eng: TorchDistEngine) -> Hosts:
    """The worker ranks of each host (by host name), ascending, hosts ordered by their
    first rank; learnt once by an all-gather over every worker (collective), then cached."""
    if eng.hosts is None:
        digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
        key = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64,
                           device=eng.comm_device)
        keys = gather_fixed(eng, key, None, tuple(range(eng.world_size))).tolist()
        by_host: dict[int, list[int]] = {}
        for rank, k in enumerate(keys):
            by_host.setdefault(k, []).append(rank)
        eng.hosts = sorted(tuple(ranks) for ranks in by_host.values())
    return eng.hosts


def chain_hosts(eng: TorchDistEngine, workers: tuple[int, ...], entries: list[GroupPlan]) -> Hosts | None:
    """The hosts when an ordered reduction of ``entries`` takes the chain: one group of
    every replica, hosts of consecutive ranks, at least two of them and one holding
    several replicas; else None (the caller takes ``ordered.py``). Every worker of the
    set decides the same way (learning the layout is collective)."""
    if (not eng.chain_reductions or len(entries) != 1 or workers != tuple(range(eng.world_size))
            or len(entries[0].group) != eng.num_replicas):
        return None
    hosts = host_layout(eng)
    if len(hosts) < 2 or eng.num_replicas <= len(hosts):
        return None
    if any(host != tuple(range(host[0], host[0] + len(host))) for host in hosts):
        return None
    return hosts


def chain_all_reduce(eng: TorchDistEngine, hosts: Hosts, entry: GroupPlan, op: ReduceOp, leaves: list[int],
                     payloads: Sequence[list[torch.Tensor]], outs: list[list[Any]]) -> None:
    """Reduces ``leaves`` of the group of every replica (``entry``) into ``outs``, one
    vector per dtype, along the chain of ``hosts``."""
    index, comm = eng.local_index, eng.comm_device
    ref = payloads[index[entry.local[0]]]
    for dtype in sorted({ref[leaf].dtype for leaf in leaves}, key=str):
        of_dtype = [leaf for leaf in leaves if ref[leaf].dtype == dtype]
        vectors = [torch.cat([payloads[index[rid]][leaf].reshape(-1) for leaf in of_dtype]).to(comm)
                   for rid in entry.local]
        full = reduce_vectors(eng, hosts, op, vectors)
        offset = 0
        for leaf in of_dtype:
            numel = ref[leaf].numel()
            eng.hand_out(outs, leaf, entry.local, full[offset:offset + numel].view(ref[leaf].shape),
                         fresh=len(of_dtype) == 1)
            offset += numel


def reduce_vectors(eng: TorchDistEngine, hosts: Hosts, op: ReduceOp, vectors: list[torch.Tensor]) -> torch.Tensor:
    """The reduction over every replica of the 1-D ``vectors`` (this worker's replicas',
    one dtype, the same length everywhere): a new vector on the comm device."""
    h = next(i for i, host in enumerate(hosts) if eng.rank in host)
    host, me, rank = hosts[h], hosts[h].index(eng.rank), eng.rank
    k_slices, numel, dtype = min(len(x) for x in hosts), vectors[0].numel(), vectors[0].dtype
    per_worker = eng.replicas_per_worker

    def bounds(k: int) -> tuple[int, int]:
        return numel * k // k_slices, numel * (k + 1) // k_slices

    # 1. every worker's replicas' part of slice k to the host's owner k
    sends = {host[k]: [v[bounds(k)[0]:bounds(k)[1]] for v in vectors] for k in range(k_slices) if host[k] != rank}
    recvs: dict[int, list[Any]] = {}
    if me < k_slices:
        lo, hi = bounds(me)
        recvs = {w: [((hi - lo,), dtype)] * per_worker for w in host if w != rank}
    inbox = exchange(eng, sends, recvs)
    final: torch.Tensor | None = None
    if me < k_slices:
        lo, hi = bounds(me)
        rows = [row for w in host for row in ([v[lo:hi] for v in vectors] if w == rank else inbox[w])]
        final = _fold_along(eng, hosts, h, me, op, rows, hi - lo)
    # 3. the owners' reduced slices to the host's other workers
    sends = {w: [final] for w in host if w != rank} if final is not None else {}
    recvs = {host[k]: [((bounds(k)[1] - bounds(k)[0],), dtype)] for k in range(k_slices) if host[k] != rank}
    inbox = exchange(eng, sends, recvs)
    parts = [final if host[k] == rank else inbox[host[k]][0] for k in range(k_slices)]
    return torch.cat([part for part in parts if part is not None])


def _pieces(n: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    step = max(PIECE_BYTES // dtype.itemsize, 1) if PIECE_BYTES > 0 else max(n, 1)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _fold_along(eng: TorchDistEngine, hosts: Hosts, h: int, k: int, op: ReduceOp, rows: list[torch.Tensor],
                n: int) -> torch.Tensor:
    """Step 2 for owner ``k`` of host ``h``: continues the fold of the hosts before with
    ``rows`` (this host's replicas' slice, ascending id), passes it on, and returns the
    slice reduced over every replica."""
    prev = hosts[h - 1][k] if h > 0 else None
    nxt = hosts[h + 1][k] if h + 1 < len(hosts) else None
    fold_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    pieces = _pieces(n, rows[0].dtype)
    folded = torch.empty(n, dtype=rows[0].dtype, device=eng.comm_device)
    final = folded if nxt is None else torch.empty_like(folded)
    if not pieces:
        return final
    peers = tuple(p for p in (prev, nxt) if p is not None)
    fwd_in = torch.empty_like(folded) if prev is not None else None
    fwd = [dist.irecv(fwd_in[a:b], prev, tag=p) for p, (a, b) in enumerate(pieces)] if fwd_in is not None else []
    back = [dist.irecv(final[a:b], nxt, tag=p) for p, (a, b) in enumerate(pieces)] if nxt is not None else []
    wait = _waiter(eng, peers)
    sent = []
    for p, (a, b) in enumerate(pieces):
        xs = [row[a:b] for row in rows]
        if fwd_in is not None:
            wait(fwd[p])
            xs.insert(0, fwd_in[a:b])  # the fold of every replica before this host's: a prefix
        reduce_into(fold_op, folded[a:b], xs)
        if nxt is not None:
            sent.append(dist.isend(folded[a:b], nxt, tag=p))
            continue
        if op is ReduceOp.MEAN:
            folded[a:b].div_(eng.num_replicas)
        if prev is not None:
            sent.append(dist.isend(folded[a:b], prev, tag=p))
    for p, (a, b) in enumerate(pieces if nxt is not None else []):
        wait(back[p])
        if prev is not None:
            sent.append(dist.isend(final[a:b], prev, tag=p))
    for work in sent:
        wait(work)
    return final


def _waiter(eng: TorchDistEngine, peers: tuple[int, ...]) -> Any:
    """A wait for this step's works with ``peers``, bounded by the timeout: on gloo once the
    peers have arrived (through the store, abort-aware; see ``p2p.exchange``)."""
    watchdog = eng.watchdog
    ranks = tuple(sorted({*peers, eng.rank}))
    if eng.backend == "nccl" or watchdog.store is None:
        return lambda work: watchdog.wait(work, ranks)
    deadline = watchdog.await_peers(list(peers), ranks)
    return lambda work: work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
