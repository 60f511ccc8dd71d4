"""``check_collectives``, the cross-worker agreement check.

Before each collective every worker all-gathers a hash of its local replicas'
calls; only on a mismatch do the full calls travel (``all_gather_object``) and
are compared with the contract's :func:`check_agreement`. Invariant: workers
whose replicas disagree get a CollectiveMismatchError listing every replica's
call, worded as the in-process engines word it, instead of a hang or garbage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError
from ..base import Call, Kind, check_agreement
from ..kinds import SPECS
from .gather import gather_fixed

if TYPE_CHECKING:
    from .engine import TorchDistEngine

__all__ = ["check_signatures"]


def check_signatures(eng: TorchDistEngine, calls: Sequence[Call]) -> None:
    """Compares every worker's calls (hashed; the full calls only on a mismatch)."""
    text = "\n".join(SPECS[c.kind].signature(c) for c in calls)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=eng.comm_device)
    everyone = gather_fixed(eng, mine, None, tuple(range(eng.world_size)))
    if bool((everyone == everyone[0]).all()):
        return
    gathered: list[Any] = [None] * eng.world_size
    dist.all_gather_object(gathered, list(calls))
    all_calls = [c for worker_calls in gathered for c in worker_calls]
    count = eng.watchdog.count
    finished = [c.kind is Kind.FINISHED for c in all_calls]
    if any(finished) and not all(finished):
        # the in-process engines' wording for a replica that returned while others wait
        lines = "\n".join(f"  replica {rid}: {c.describe()}" for rid, c in enumerate(all_calls))
        raise CollectiveMismatchError(
            f"replicas made different collective calls (cross-process call #{count}; found by "
            f"check_collectives): some replicas returned from the replica function while others "
            f"wait:\n{lines}")
    try:
        check_agreement(all_calls, list(range(eng.num_replicas)))
    except CollectiveMismatchError as e:
        raise CollectiveMismatchError(
            f"{e}\n(cross-process call #{count}; found by check_collectives)") from None
