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

import hashlib
import socket
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...errors import CollectiveTimeoutError
from ...reduce_op import ReduceOp
from ..base import Pending
from ..reduction import reduce_into
from .agreement import Stamp, mismatch
from .gather import gather_fixed
from .plan import GroupPlan
from .watchdog import Transfers

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["PIECE_BYTES", "chain_all_reduce", "chain_hosts", "drain", "host_layout", "start_chain"]

#: the size of the pieces a slice travels in between hosts (pipelining; 0: one piece)
PIECE_BYTES = 256 << 10

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
    every replica on gloo (messages matched by tag; NCCL matches them in posting order),
    hosts of consecutive ranks, at least two of them and one holding several replicas;
    else None (the caller takes ``ordered.py``). Every worker of the
    set decides the same way (learning the layout is collective)."""
    if (not eng.chain_reductions or eng.backend != "gloo" or len(entries) != 1
            or workers != tuple(range(eng.world_size)) or len(entries[0].group) != eng.num_replicas):
        return None
    hosts = host_layout(eng)
    if len(hosts) < 2 or eng.num_replicas <= len(hosts):
        return None
    if any(host != tuple(range(host[0], host[0] + len(host))) for host in hosts):
        return None
    return hosts


def chain_all_reduce(eng: TorchDistEngine, hosts: Hosts, entry: GroupPlan, op: ReduceOp, leaves: list[int],
                     payloads: Sequence[list[torch.Tensor]], outs: list[list[Any]], stamp: Stamp) -> None:
    """Reduces ``leaves`` of the group of every replica (``entry``) into ``outs``, one
    vector per dtype, along the chain of ``hosts``; ``stamp``: the call's (the first
    vector's messages start with it, :func:`reduce_vectors`)."""
    index, comm = eng.local_index, eng.comm_device
    ref = payloads[index[entry.local[0]]]
    for number, dtype in enumerate(sorted({ref[leaf].dtype for leaf in leaves}, key=str)):
        of_dtype = [leaf for leaf in leaves if ref[leaf].dtype == dtype]
        vectors = [torch.cat([payloads[index[rid]][leaf].reshape(-1) for leaf in of_dtype]).to(comm)
                   for rid in entry.local]
        full = reduce_vectors(eng, hosts, op, vectors, stamp if number == 0 else None)
        offset = 0
        for leaf in of_dtype:
            numel = ref[leaf].numel()
            eng.hand_out(outs, leaf, entry.local, full[offset:offset + numel].view(ref[leaf].shape),
                         fresh=len(of_dtype) == 1)
            offset += numel


def reduce_vectors(eng: TorchDistEngine, hosts: Hosts, op: ReduceOp, vectors: list[torch.Tensor],
                   stamp: Stamp | None) -> torch.Tensor:
    """The reduction over every replica of the 1-D ``vectors`` (this worker's replicas',
    one dtype, the same length everywhere): a new vector on the comm device. Every
    message is posted at once, piece by piece, so the three steps overlap. With
    ``stamp`` (the call's, ``agreement.py``), each worker first swaps it with every peer
    it will exchange data with (:func:`_agree_with_peers`)."""
    h = next(i for i, host in enumerate(hosts) if eng.rank in host)
    host, rank, per_worker = hosts[h], eng.rank, eng.replicas_per_worker
    k_slices, numel, dtype = min(len(x) for x in hosts), vectors[0].numel(), vectors[0].dtype
    out = torch.empty(numel, dtype=dtype, device=eng.comm_device)
    if not numel:
        return out
    starts = [numel * k // k_slices for k in range(k_slices + 1)]
    pieces = [_pieces(starts[k + 1] - starts[k], dtype) for k in range(k_slices)]
    me = host.index(rank)
    owner = me < k_slices
    prev = hosts[h - 1][me] if owner and h > 0 else None
    nxt = hosts[h + 1][me] if owner and h + 1 < len(hosts) else None
    linked = {host[k] for k in range(k_slices)} | (set(host) if owner else set())
    peers = tuple(sorted((linked | {p for p in (prev, nxt) if p is not None}) - {rank}))
    wait = eng.watchdog.transfers(peers)
    if stamp is not None:
        _agree_with_peers(eng, peers, stamp, wait)
    sent, finals = [], []
    for k in range(k_slices):
        if host[k] == rank:
            continue
        lo = starts[k]
        for p, (a, b) in enumerate(pieces[k]):  # 3. the reduced slices of the other owners of this host
            finals.append(dist.irecv(out[lo + a:lo + b], host[k], tag=_FINAL + p))
            for r, v in enumerate(vectors):  # 1. this worker's replicas' part of slice k, to its owner
                sent.append(dist.isend(v[lo + a:lo + b], host[k], tag=p * per_worker + r))
    if owner:
        sent += _own_slice(eng, host, prev, nxt, op, vectors, out[starts[me]:starts[me + 1]], starts[me],
                           pieces[me], wait)
    wait.expect(finals + sent)
    for work in finals + sent:
        wait(work)
    return out


_FINAL = 1 << 24  # the tags of reduced pieces (below: a piece's contributions, and the chain's prefixes)
_STAMP = 1 << 25  # the tag of a call's stamp, swapped before its data


def _agree_with_peers(eng: TorchDistEngine, peers: tuple[int, ...], stamp: Stamp, wait: Transfers) -> None:
    """Swaps the call's stamp (its number and digest: two words, the same size whatever the
    call) with each peer, before any data message, and raises CollectiveMismatchError
    naming the first peer whose call differs (announced, so that the workers waiting
    elsewhere in the chain are released). The workers and their chain links form one
    connected graph, so peers that agree pairwise agree all: one round trip to the
    neighbours in place of a collective over every worker (``signatures.precheck``), and
    on the chain's own thread, in the order of its messages."""
    mine = torch.tensor([stamp.seq, stamp.digest], dtype=torch.int64)
    theirs = {peer: torch.empty(2, dtype=torch.int64) for peer in peers}
    recvs = [dist.irecv(theirs[peer], peer, tag=_STAMP) for peer in peers]
    sends = [dist.isend(mine, peer, tag=_STAMP) for peer in peers]
    wait.expect(recvs + sends)
    for peer, work in zip(peers, recvs):
        wait(work)
        seq, digest = theirs[peer].tolist()
        if seq != stamp.seq or digest != stamp.digest:
            error = mismatch(eng.rank, "found by the chain of hosts before the data moved", stamp.seq, stamp.call,
                             peer, seq)
            eng.watchdog.announce(str(error))  # only this worker's neighbours see it: release the rest
            raise error
    for work in sends:
        wait(work)


def _own_slice(eng: TorchDistEngine, host: tuple[int, ...], prev: int | None, nxt: int | None, op: ReduceOp,
               vectors: list[torch.Tensor], mine: torch.Tensor, lo: int, pieces: list[tuple[int, int]],
               wait: Transfers) -> list[Any]:
    """Step 2 for this worker's slice (``mine``, at ``lo`` in the vector): continues the
    fold of the hosts before with this host's replicas (ascending id) piece by piece,
    passes it on, and sends the reduced pieces to the host's other workers and back down
    the chain; returns the sends still under way."""
    rank, per_worker = eng.rank, eng.replicas_per_worker
    fold_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    inbox = {w: [torch.empty_like(mine) for _ in range(per_worker)] for w in host if w != rank}
    received = {w: [[dist.irecv(inbox[w][r][a:b], w, tag=p * per_worker + r) for r in range(per_worker)]
                    for p, (a, b) in enumerate(pieces)] for w in inbox}
    prefix = torch.empty_like(mine) if prev is not None else None
    ahead = [dist.irecv(prefix[a:b], prev, tag=p) for p, (a, b) in enumerate(pieces)] if prefix is not None else []
    back = [dist.irecv(mine[a:b], nxt, tag=_FINAL + p) for p, (a, b) in enumerate(pieces)] if nxt is not None else []
    folded = torch.empty_like(mine) if nxt is not None else mine
    sent = []
    # The transfer thread waits in the order this loop does: each piece's prefix and
    # contributions, then the reduced pieces coming back down the chain.
    wait.expect([work for p in range(len(pieces)) for work in [
        *ahead[p:p + 1], *(work for w in host if w != rank for work in received[w][p])]] + back)

    def hand_on(a: int, b: int, p: int) -> None:
        for w in [*inbox, *([prev] if prev is not None else [])]:
            sent.append(dist.isend(mine[a:b], w, tag=_FINAL + p))
    for p, (a, b) in enumerate(pieces):
        xs = []
        if prefix is not None:
            wait(ahead[p])
            xs.append(prefix[a:b])  # the fold of every replica before this host's: a prefix
        for w in host:
            if w == rank:
                xs.extend(v[lo + a:lo + b] for v in vectors)
                continue
            for work in received[w][p]:
                wait(work)
            xs.extend(x[a:b] for x in inbox[w])
        reduce_into(fold_op, folded[a:b], xs)
        if nxt is not None:
            sent.append(dist.isend(folded[a:b], nxt, tag=p))
            continue
        if op is ReduceOp.MEAN:
            mine[a:b].div_(eng.num_replicas)
        hand_on(a, b, p)
    for p, (a, b) in enumerate(pieces if nxt is not None else []):
        wait(back[p])
        hand_on(a, b, p)
    return sent


def _pieces(n: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    step = max(PIECE_BYTES // dtype.itemsize, 1) if PIECE_BYTES > 0 else max(n, 1)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def start_chain(eng: TorchDistEngine, hosts: Hosts, op: ReduceOp, tensors: list[torch.Tensor],
                stamp: Stamp) -> Pending:
    """Starts the in-place all-reduce of ``tensors`` (one dtype, contiguous, on the comm
    device) along the chain on the engine's chain thread, so backward goes on while
    its pieces travel (CrossShardOptimizer(overlap=True)'s buckets). Chains run one at
    a time in the order started, and the engine drains them (:func:`drain`) before any
    other cross-process call, so every worker's messages keep one order."""
    flat = tensors[0].view(-1) if len(tensors) == 1 else torch.cat([t.view(-1) for t in tensors])
    if eng.chain_pool is None:
        eng.chain_pool = ThreadPoolExecutor(1, thread_name_prefix="crossreplica-chain")
    future = eng.chain_pool.submit(reduce_vectors, eng, hosts, op, [flat], stamp)
    eng.chains.append(future)

    def finish() -> list[torch.Tensor]:
        out, offset = _result(eng, future), 0
        for t in tensors:
            t.view(-1).copy_(out[offset:offset + t.numel()])
            offset += t.numel()
        return list(tensors)
    return Pending(finish)


def drain(eng: TorchDistEngine) -> None:
    """Waits for every chain under way (their failures break the engine, as at their own wait)."""
    while eng.chains:
        _result(eng, eng.chains[0])


def _result(eng: TorchDistEngine, future: Future) -> torch.Tensor:
    """The chain's result; bounded: each chain ahead of it, and it, by the timeout."""
    ahead = eng.chains.index(future) + 1 if future in eng.chains else 1
    try:
        return eng.settle(lambda: _bounded(future, ahead * eng.watchdog.timeout + 10))
    finally:
        if future.done() and future in eng.chains:
            eng.chains.remove(future)


def _bounded(future: Future, seconds: float) -> torch.Tensor:
    try:
        return future.result(timeout=seconds)
    except FutureTimeout:
        raise CollectiveTimeoutError(f"an all-reduce along the chain of hosts did not finish in {seconds:g}s") from None
