"""The cross-worker agreement checks that run before a collective's data moves.

:func:`precheck`, always: a call of a kind other than all_reduce that goes through the
backend (gloo) first reduces its stamp (``agreement.py``) over every worker in one small
collective (the maximum of ``d`` and of ``-d`` for each digit of the digest), because
gloo aborts a process whose peer sends another size, and mixes ops or dtypes of one size
in silence. all_reduce checks its stamp on its own transport (check elements in front of
gloo's buffer, the shared-memory headers, the gathered rows, the chain's stamp swap). Only when the
stamps differ do the full calls travel, as below. NCCL's calls are not prechecked: the
verdict would cost a host synchronisation per call (CROSSREPLICA_CHECK_COLLECTIVES=1
checks them).

``check_collectives`` (opt-in, CROSSREPLICA_CHECK_COLLECTIVES=1): before each
collective every worker all-gathers a hash of its local replicas' calls, every
parameter included (calls over several groups too); only on a mismatch do the full
calls travel (``all_gather_object``) and are compared with the contract's
:func:`check_agreement`. Invariant: workers whose replicas disagree get a
CollectiveMismatchError listing every replica's call, worded as the in-process engines
word it, instead of a hang or garbage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError
from ...reduce_op import ReduceOp
from ..base import Call, Kind, check_agreement
from ..kinds import SPECS
from .agreement import check_elements, stamp_of, verify_elements
from .gather import gather_fixed

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["check_signatures", "precheck"]


def precheck(eng: TorchDistEngine, calls: Sequence[Call]) -> None:
    """Raises CollectiveMismatchError, listing every replica's call, unless every worker's
    latest call has this worker's stamp (module docstring). A no-op on one worker, under
    NCCL, and where ``check_collectives`` compares the calls anyway."""
    if eng.world_size == 1 or eng.comm_device.type != "cpu" or eng.check_collectives:
        return
    stamp = stamp_of(eng.watchdog.count, calls)
    words = check_elements(stamp, ReduceOp.MAX, torch.int64, eng.world_size, eng.comm_device)
    eng.watchdog.wait(dist.all_reduce(words, op=dist.ReduceOp.MAX, async_op=True), range(eng.world_size))
    try:
        verify_elements(words, stamp, ReduceOp.MAX, eng.world_size, "found before the data moved", eng.rank)
    except CollectiveMismatchError as e:
        if _explain(eng, calls, "found before the data moved"):
            return  # the full rules accept what the stamps told apart
        raise e


def check_signatures(eng: TorchDistEngine, calls: Sequence[Call]) -> None:
    """Compares every worker's calls (hashed; the full calls only on a mismatch)."""
    text = "\n".join(SPECS[c.kind].signature(c) for c in calls)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=eng.comm_device)
    everyone = gather_fixed(eng, mine, None, tuple(range(eng.world_size)))
    if bool((everyone == everyone[0]).all()):
        return
    _explain(eng, calls, "found by check_collectives")


def _explain(eng: TorchDistEngine, calls: Sequence[Call], how: str) -> bool:
    """Every worker's calls travel (every worker is here, having found the mismatch) and the
    CollectiveMismatchError names every replica's; True if they turn out to agree."""
    gathered: list[Any] = [None] * eng.world_size
    dist.all_gather_object(gathered, list(calls))
    all_calls = [c for worker_calls in gathered for c in worker_calls]
    count = eng.watchdog.count
    finished = [c.kind is Kind.FINISHED for c in all_calls]
    if any(finished) and not all(finished):
        # the in-process engines' wording for a replica that returned while others wait
        lines = "\n".join(f"  replica {rid}: {c.describe()}" for rid, c in enumerate(all_calls))
        raise CollectiveMismatchError(
            f"replicas made different collective calls (cross-process call #{count}; {how}): some "
            f"replicas returned from the replica function while others wait:\n{lines}")
    try:
        check_agreement(all_calls, list(range(eng.num_replicas)))
    except CollectiveMismatchError as e:
        raise CollectiveMismatchError(f"{e}\n(cross-process call #{count}; {how})") from None
    return True
