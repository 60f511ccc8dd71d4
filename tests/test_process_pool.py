"""The "processes" engine's worker pools (tests/process_pool.py): layouts, reuse,
restart after a failure, exceptions that cannot travel."""

from __future__ import annotations

import os

import pytest
import torch

import crossreplica as cr
import process_pool

pytestmark = pytest.mark.multiprocess


def test_layouts():
    assert [process_pool.layout(n) for n in (1, 2, 3, 4, 6, 8)] == [(1, 1), (2, 1), (3, 1), (2, 2), (2, 3), (2, 4)]


def _where(x):
    return os.getpid(), cr.replica_id(), cr.num_replicas(), os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


def _raise_unpicklable(x):
    if cr.replica_id() == 1:
        raise _Unpicklable("cannot travel")
    return cr.all_reduce(x)


def test_workers_persist_and_restart_after_a_failure():
    run = process_pool.run_pooled
    first = run(_where, 4, [None] * 4)
    assert [r[1:] for r in first] == [(r, 4, "2", "127.0.0.1") for r in range(4)]
    pids = {r[0] for r in first}
    assert len(pids) == 2 and os.getpid() not in pids  # 2 workers x 2 replicas
    assert {r[0] for r in run(_where, 4, [None] * 4)} == pids  # the same workers serve the next job
    with pytest.raises(process_pool.RemoteReplicaError, match=r"(?s)_Unpicklable.*cannot travel"):
        run(_raise_unpicklable, 4, [torch.ones(1)] * 4)
    again = {r[0] for r in run(_where, 4, [None] * 4)}
    assert len(again) == 2 and not again & pids  # a fresh pool after the failure
