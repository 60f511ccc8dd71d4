"""Every cross-process call's agreement, checked always, before or with its data.

Workers that make different collective calls (a chief's extra ``strategy.reduce``, a
sum on one worker and a max on another, other shapes or dtypes) must get a
CollectiveMismatchError at once, never a mix of their data nor a wait until the
timeout. Each call of a worker gets a *stamp* (:func:`stamp_of`): its number in this
engine and a 63-bit digest of what every worker's call must match: the kind and the
group assignment and, where the call is one group of every replica (the common case),
the whole signature (``SPECS[kind].signature``: op, dtypes, shapes with a kind's
varying sizes masked). Calls over several groups may differ between groups in their
parameters, so only their kind and groups are stamped (CROSSREPLICA_CHECK_COLLECTIVES=1
compares the rest). The digest is computed once per distinct call; a stamp afterwards
costs a dict lookup. Where the stamps are compared:

* **same-host shared memory** (the default path of one host's workers): the call's
  number and a cheap code of it (:func:`shared_code`) in two words of each worker's
  header, written with every deposit and compared by every worker that reduces the
  round (``shared_memory.py``): no extra message;
* **the backend** (gloo: every other path): before the data moves, one small all-reduce
  of check elements (:func:`check_elements`, the maximum of ``d`` and of ``-d`` per digit
  of the digest), since gloo aborts a process whose peer sends another size
  (``signatures.precheck``); in front of an all-reduce's buffer, the elements ride with
  the data instead;
* **the chain of hosts** (``chain.py``, its synchronous calls and the overlapped buckets
  alike): each worker swaps the stamp with the peers it exchanges data with, on the
  chain's thread, before any data message: one round trip to the neighbours;
* **a wait that stalls**: each worker posts its latest call's number and digest with its
  progress; a peer that waits at a call of the same number with another digest is a
  mismatch (``watchdog.raise_if_calls_differ``), which catches the calls that meet on
  different transports (one worker in a shared-memory round, the other in the backend).

NCCL's calls are not prechecked: reading the verdict would cost a host synchronisation
per call. Figures: BENCHMARKS.md, "Agreement, checked always".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ...errors import CollectiveMismatchError
from ...reduce_op import ReduceOp
from ..base import Call
from ..kinds import SPECS

__all__ = ["STAMP_DIGITS", "Stamp", "check_elements", "check_rows", "mismatch", "shared_code", "stamp_digits",
           "stamp_of", "verify_elements"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads the sequence number over the digest's bits
_digests: dict[object, int] = {}
_MAX_CACHED = 4096


class Stamp(NamedTuple):
    """One worker's call: its sequence number and the digest of what must agree."""

    seq: int
    digest: int  #: 63 bits, non-negative (fits an int64 word)
    call: Call


def stamp_of(seq: int, calls: Sequence[Call]) -> Stamp:
    """The stamp of this worker's call number ``seq`` (``calls``: its local replicas')."""
    call = calls[0]
    spec = SPECS[call.kind]
    # Parameters agree across the whole call only where it is one group and the kind does not
    # compare its members by position (all_to_all's split sizes differ from sender to sender).
    whole = len(call.groups) == 1 and spec.group_agree is None
    key: object = call if whole else (call.kind, call.groups)
    digest = _digests.get(key)
    if digest is None:
        text = spec.signature(call) if whole else f"{call.kind.value} groups={call.groups}"
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        if len(_digests) >= _MAX_CACHED:
            _digests.clear()
        _digests[key] = digest
    return Stamp(seq, ((digest ^ (seq * _GOLDEN)) & _MASK) >> 1, call)


def shared_code(count: int, call: Call | str) -> tuple[int, int]:
    """The stamp the same-host path writes with every deposit, cheaper than :func:`stamp_of`
    (a few hundred nanoseconds there would be a measurable share of a 4 KiB call): the
    call's number, and a hash of its op and shapes (integers only, so the same in every
    process). Its kind is all_reduce and its group every replica there; a dtype of its own
    has a buffer of its own, so workers that differ in it wait on different buffers (and
    the stalled wait compares full stamps: ``watchdog.raise_if_calls_differ``)."""
    if not isinstance(call, Call):  # a host-side meeting
        return count, 0
    op = getattr(call.params, "op", None)  # a meeting's call has no op
    return count, hash((-1 if op is None else _OP_CODES[op], call.shapes)) & _WORD


_OP_CODES = {op: code for code, op in enumerate(ReduceOp)}
_WORD = (1 << 62) - 1


def mismatch(eng_rank: int, where: str, count: int, call: Call | str, rank: int,
             theirs: int) -> CollectiveMismatchError:
    """The error for worker ``rank``, at its call number ``theirs``, whose call differs from
    this worker's call number ``count``, ``call``."""
    described = call.describe() if isinstance(call, Call) else call
    if theirs != count:
        what = (f"worker rank {rank} is at its cross-process call #{theirs} where this worker (rank "
                f"{eng_rank}) is at #{count}: one worker made a collective call the other did not (a call "
                f"made on one worker only, such as strategy.reduce under `if rank == 0`)")
    else:
        what = (f"worker rank {rank}'s call #{theirs} differs from this worker's (rank {eng_rank}) in its "
                f"kind, op, dtypes, shapes or group assignment")
    return CollectiveMismatchError(
        f"replicas made different collective calls ({where}): {what}. This worker's call: {described}. "
        f"Every replica must make the same collective calls in the same order, with the same op, dtypes and "
        f"shapes; CROSSREPLICA_CHECK_COLLECTIVES=1 lists every replica's call")


# ---------------------------------------------------------------------- reduced check elements

#: the bucket dtypes whose reductions carry check elements exactly (integers below 2**24)
CHECKED_DTYPES = frozenset((torch.float32, torch.float64, torch.int32, torch.int64))
CHECKED_OPS = frozenset((ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN))
_DIGITS = 4  # check elements come in pairs, one pair per digit: 8 elements whatever the op and dtype


def _digits(stamp: Stamp, op: ReduceOp, workers: int) -> tuple[list[int], bool]:
    """The digits of the stamp's digest that the elements carry, and whether they are
    squared (SUM, MEAN's partial sums): each digit ``d`` (1 <= d <= 2**b) keeps
    ``workers * d**2`` exact in float32; under MAX and MIN, digits of 16 bits (the whole
    digest). Always ``_DIGITS`` pairs, so that the buffers of workers whose ops differ
    still have one size."""
    squared = op is ReduceOp.SUM or op is ReduceOp.MEAN
    b = max(1, min(8, (24 - math.ceil(math.log2(max(2, workers)))) // 2)) if squared else 16
    return [((stamp.digest >> (i * b)) & ((1 << b) - 1)) + 1 for i in range(_DIGITS)], squared


def check_elements(stamp: Stamp, op: ReduceOp, dtype: torch.dtype, workers: int, device: torch.device) -> torch.Tensor:
    """The elements this worker puts in front of its buffer of ``dtype`` reduced by ``op``
    (SUM for MEAN's partial sums) over ``workers``."""
    digits, squared = _digits(stamp, op, workers)
    values = [v for d in digits for v in ((d, d * d) if squared else (d, -d))]
    return torch.tensor(values, dtype=dtype, device=device)


def verify_elements(reduced: torch.Tensor, stamp: Stamp, op: ReduceOp, workers: int, where: str,
                    rank: int) -> None:
    """Raises unless ``reduced`` (the check elements after the reduction) are what every
    worker holding this stamp gives: ``workers`` times (d, d**2) for SUM (equal sums of d and
    of d**2 mean equal digits), (d, -d) for MAX and MIN."""
    digits, squared = _digits(stamp, op, workers)
    want = [v for d in digits for v in ((workers * d, workers * d * d) if squared else (d, -d))]
    got = reduced.tolist()
    if got != want:
        raise CollectiveMismatchError(
            f"replicas made different collective calls ({where}): the workers' reductions carried other calls "
            f"than this worker's (rank {rank}) call #{stamp.seq} {stamp.call.describe()} (their kind, op, dtypes, "
            f"shapes, group assignment or number of calls differ). Every replica must make the same collective "
            f"calls in the same order; CROSSREPLICA_CHECK_COLLECTIVES=1 lists every replica's call")


#: the digits of :func:`stamp_digits`: the call's number (8), then the digest (8)
STAMP_DIGITS = 16


def stamp_digits(stamp: Stamp, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The stamp as ``STAMP_DIGITS`` byte-sized digits (the call's number, then the digest,
    low byte first), exact in any floating dtype and in uint8: for rows of data that travel
    whole (16 bytes keep a byte row's data 8-byte aligned after them)."""
    seq = [(stamp.seq >> (8 * i)) & 0xFF for i in range(8)]
    digest = [(stamp.digest >> (8 * i)) & 0xFF for i in range(8)]
    return torch.tensor(seq + digest, dtype=dtype, device=device)


def check_rows(digits: torch.Tensor, stamp: Stamp, workers: Sequence[int], rank: int, where: str) -> None:
    """Raises unless every worker's gathered stamp digits (``digits``: one row of
    ``STAMP_DIGITS`` per worker of ``workers``) are this worker's."""
    mine = stamp_digits(stamp, digits.dtype, digits.device)
    for worker, theirs in zip(workers, digits):
        if not torch.equal(theirs, mine):
            seq = sum(int(v) << (8 * i) for i, v in enumerate(theirs[:8].tolist()))
            raise mismatch(rank, where, stamp.seq, stamp.call, worker, seq)
