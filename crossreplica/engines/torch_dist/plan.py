"""How one call maps onto workers and process subgroups.

A group assignment becomes, per replica group, the set of workers that own a
member (a *worker set*). Worker sets with more than one worker get a process
subgroup, created for every distinct set of an assignment together, in the
same order on every worker, the first time the assignment is seen, and cached.

Invariant: every worker creates the same subgroups in the same order (SPMD),
and :func:`by_worker_set` serves worker sets in one canonical order, so
blocking collectives on overlapping subgroups cannot deadlock.
"""

from __future__ import annotations

import ctypes
import datetime
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ...groups import Groups
from ..base import Call

__all__ = ["GroupPlan", "Planner", "Step", "by_worker_set", "keep_for_good"]


class GroupPlan(NamedTuple):
    """One replica group as this worker sees it."""

    group: tuple[int, ...]  #: the replica ids, in group order
    workers: tuple[int, ...]  #: the worker set: ranks owning a member, ascending
    subgroup: Any  #: its process group (None: the default group, or a single worker)
    local: list[int]  #: this worker's members, in ascending replica id (empty: not ours)


class Step(NamedTuple):
    """One collective as this worker runs it, for all its local replicas at once."""

    call: Call  #: the first local replica's call (kind and groups agree on every replica)
    params: dict[int, Any]  #: replica id -> its call's parameter record (they agree within a group only)
    payloads: Sequence[list[torch.Tensor]]  #: per local replica, in local order
    inplace: bool  #: an in-place all-reduce: results are written into the payloads


class Planner:
    """Caches the plan of each group assignment and the subgroups it needs."""

    def __init__(self, rank: int, world_size: int, replicas_per_worker: int, timeout: float):
        self.rank = rank
        self.world_size = world_size
        self.replicas_per_worker = replicas_per_worker
        self.timeout = timeout
        self._subgroups: dict[tuple[int, ...], Any] = {}
        self._plans: dict[Groups, list[GroupPlan]] = {}

    def plan(self, groups: Groups) -> list[GroupPlan]:
        """One :class:`GroupPlan` per replica group of ``groups`` (cached)."""
        plan = self._plans.get(groups)
        if plan is not None:
            return plan
        per_worker = self.replicas_per_worker
        worker_sets = [tuple(sorted({rid // per_worker for rid in group})) for group in groups]
        for workers in worker_sets:  # every worker creates every subgroup, in the same order
            if len(workers) > 1 and workers not in self._subgroups:
                if len(workers) == self.world_size:
                    self._subgroups[workers] = None  # the default group
                else:
                    self._subgroups[workers] = dist.new_group(
                        list(workers), timeout=datetime.timedelta(seconds=self.timeout))
        plan = []
        for group, workers in zip(groups, worker_sets):
            local = [rid for rid in sorted(group) if rid // per_worker == self.rank]
            plan.append(GroupPlan(group, workers, self._subgroups.get(workers), local))
        self._plans[groups] = plan
        return plan

    def close(self, abandon: bool = False) -> None:
        """Destroys the subgroups this planner created; ``abandon`` (their peers may be lost):
        aborts them and keeps them for good instead (:func:`keep_for_good`)."""
        for pg in self._subgroups.values():
            if pg is None:
                continue
            try:
                if abandon:
                    pg.abort()  # type: ignore[attr-defined]
                    keep_for_good(pg)
                else:
                    dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001, S110 - best effort at shutdown
                pass
        self._subgroups.clear()
        self._plans.clear()


def keep_for_good(group: Any) -> None:
    """Holds one more reference to the retired process group ``group`` that nothing ever
    drops, not even the interpreter's exit: its destructor (and torch's destroy) joins the
    group's threads, and one of them may wait in a receive from a frozen peer (gloo cannot
    abort it) until the group's timeout, minutes after the survivors are done."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def by_worker_set(plan: list[GroupPlan]) -> dict[tuple[int, ...], list[GroupPlan]]:
    """The groups this worker takes part in, keyed by worker set, in canonical order."""
    out: dict[tuple[int, ...], list[GroupPlan]] = {}
    for entry in plan:
        if entry.local:
            out.setdefault(entry.workers, []).append(entry)
    return out
