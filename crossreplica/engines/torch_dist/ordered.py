"""The ordered all-reduce of floating-point groups.

A reduce-scatter then all-gather, like the backends' ring, but ordered: worker
``j`` of a worker set receives the ``j``-th chunk of every member's tensor
(point to point), reduces the chunks sequentially in ascending replica id
(``reduction.py``), and the reduced chunks are all-gathered.

Invariant: the result is ``((x0 + x1) + x2) + ...`` exactly, the bytes the
in-process engine computes, the same on every replica, for the traffic of a
ring all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ...packing import byte_pack_size, pack_bytes, unpack_bytes
from ...reduce_op import ReduceOp
from ..reduction import reduce_into
from .agreement import STAMP_DIGITS, Stamp, check_rows, stamp_digits
from .gather import gather_fixed
from .p2p import Spec, exchange
from .plan import GroupPlan

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["ordered_all_reduce"]


class _Unit(NamedTuple):
    """One group's leaves of one dtype, flattened end to end: what travels as one vector."""

    entry: int  #: the group's position in the worker set's entries
    dtype: torch.dtype
    leaves: list[int]
    numel: int


def ordered_all_reduce(eng: TorchDistEngine, workers: tuple[int, ...], entries: list[GroupPlan],
                       ops: list[ReduceOp], leaves: list[int], payloads: Sequence[list[torch.Tensor]],
                       outs: list[list[Any]], stamp: Stamp) -> None:
    """Reduces ``leaves`` of the groups in ``entries`` (one worker set) into ``outs``. The
    gathered rows start with each worker's ``stamp`` (``agreement.py``): workers whose calls
    differ raise before they use a result."""
    index, per_worker, comm = eng.local_index, eng.replicas_per_worker, eng.comm_device
    n_workers, me = len(workers), workers.index(eng.rank)
    units = []
    for number, entry in enumerate(entries):
        ref = payloads[index[entry.local[0]]]
        for dtype in sorted({ref[leaf].dtype for leaf in leaves}, key=str):
            of_dtype = [leaf for leaf in leaves if ref[leaf].dtype == dtype]
            units.append(_Unit(number, dtype, of_dtype, sum(ref[leaf].numel() for leaf in of_dtype)))

    def bounds(numel: int, j: int) -> tuple[int, int]:
        """The element range of chunk ``j`` (reduced by worker ``workers[j]``)."""
        return numel * j // n_workers, numel * (j + 1) // n_workers

    vectors = {(u, rid): torch.cat([payloads[index[rid]][leaf].reshape(-1) for leaf in unit.leaves]).to(comm)
               for u, unit in enumerate(units) for rid in entries[unit.entry].local}
    sends: dict[int, list[torch.Tensor]] = {}
    recvs: dict[int, list[Spec]] = {}
    order: dict[int, list[tuple[int, int]]] = {}  # peer worker -> (unit, sender) of its messages
    for j, worker in enumerate(workers):
        if worker == eng.rank:
            continue
        for u, unit in enumerate(units):
            lo, hi = bounds(unit.numel, j)
            sends.setdefault(worker, []).extend(vectors[(u, rid)][lo:hi] for rid in entries[unit.entry].local)
            my_lo, my_hi = bounds(unit.numel, me)
            for rid in sorted(entries[unit.entry].group):
                if rid // per_worker == worker:
                    recvs.setdefault(worker, []).append(((my_hi - my_lo,), unit.dtype))
                    order.setdefault(worker, []).append((u, rid))
    inbox = exchange(eng, sends, recvs)
    chunks = {key: x for worker, keys in order.items() for key, x in zip(keys, inbox[worker])}
    mine = []
    for u, unit in enumerate(units):
        lo, hi = bounds(unit.numel, me)
        xs = [vectors[(u, rid)][lo:hi] if rid // per_worker == eng.rank else chunks[(u, rid)]
              for rid in sorted(entries[unit.entry].group)]
        mine.append(reduce_into(ops[unit.entry], torch.empty(hi - lo, dtype=unit.dtype, device=comm), xs))
    specs = [[((bounds(unit.numel, j)[1] - bounds(unit.numel, j)[0],), unit.dtype) for unit in units]
             for j in range(n_workers)]
    width = max(byte_pack_size(row) for row in specs) + STAMP_DIGITS
    pieces: list[list[torch.Tensor]] = [[] for _ in units]
    send = torch.cat([stamp_digits(stamp, torch.uint8, comm), pack_bytes(mine, comm)])
    if send.numel() < width:
        send = torch.cat([send, send.new_zeros(width - send.numel())])
    recv = gather_fixed(eng, send, entries[0].subgroup, workers).view(n_workers, width)
    check_rows(recv[:, :STAMP_DIGITS], stamp, workers, eng.rank, "the ordered all-reduce")
    for j in range(n_workers):
        row = mine if j == me else unpack_bytes(recv[j, STAMP_DIGITS:], specs[j])[0]
        for u, x in enumerate(row):
            pieces[u].append(x)
    for u, unit in enumerate(units):
        full = torch.cat(pieces[u]) if pieces[u] else torch.empty(0, dtype=unit.dtype, device=comm)
        local = entries[unit.entry].local
        ref = payloads[index[local[0]]]
        offset = 0
        for leaf in unit.leaves:
            numel = ref[leaf].numel()
            eng.hand_out(outs, leaf, local, full[offset:offset + numel].view(ref[leaf].shape),
                         fresh=len(unit.leaves) == 1)
            offset += numel
