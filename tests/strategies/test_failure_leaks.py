"""After failures, nothing stays behind: threads, strategies and tensors return to the baseline."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import crossreplica as cr

pytestmark = pytest.mark.reliability


def _settle(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _replica_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("MirroredStrategy-"))


@pytest.fixture
def baseline():
    gc.collect()
    assert _settle(lambda: _replica_threads() == 0 or True)
    return _replica_threads()


def test_failed_run_frees_strategy_threads_and_tensors(baseline):
    tensors: list = []

    def fn():
        t = torch.zeros(1 << 20)  # 4 MiB per replica, referenced only by this frame
        tensors.append(weakref.ref(t))
        if cr.replica_id() == 1:
            raise ValueError("replica 1 fails")
        cr.all_reduce(t)
        return t

    for _ in range(3):
        strategy = cr.MirroredStrategy(4)
        ref = weakref.ref(strategy)
        with pytest.raises(ValueError, match="replica 1 fails") as info:
            strategy.run(fn)
        # While the error is held, the failing replica's tensors are already gone.
        assert _settle(lambda: all(r() is None for r in tensors)), "tensors of the failed run are alive"
        assert info.value.replica_id == 1
        del info, strategy
        assert _settle(lambda ref=ref: ref() is None), "the failed strategy was never freed"
    assert _settle(lambda: _replica_threads() == baseline), threading.enumerate()


def test_error_keeps_file_and_line_but_not_locals():
    strategy = cr.MirroredStrategy(2)

    def fn():
        big = torch.ones(8)  # noqa: F841 - a local the stored failure must not keep
        raise KeyError("lost")

    with pytest.raises(KeyError) as info:
        strategy.run(fn)
    tb = info.value.original.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    mine = [f for f in frames if f.f_code is fn.__code__]
    assert mine and mine[0].f_locals == {} and info.value.original.__traceback__.tb_lineno > 0


def test_abandoned_runs_leave_no_idle_threads(baseline):
    strategy = cr.MirroredStrategy(3, timeout_seconds=0.2)

    def fn(stuck_for):
        if cr.replica_id() == 0:
            raise ValueError("replica 0 fails")
        if cr.replica_id() == 1:
            time.sleep(stuck_for)  # outside any collective: the run abandons it
        return torch.ones(2)

    for _ in range(3):
        with pytest.raises(ValueError, match="replica 0 fails"):
            strategy.run(fn, args=(1.4,))
    out = strategy.run(lambda: cr.all_reduce(torch.ones(2)))  # the strategy still works
    assert torch.equal(out.values[0], torch.full((2,), 3.0))
    # Once the stuck replicas return, only the strategy's own three threads remain.
    assert _settle(lambda: _replica_threads() == baseline + 3), [t.name for t in threading.enumerate()]
    ref = weakref.ref(strategy)
    del strategy, out
    assert _settle(lambda: ref() is None)
    assert _settle(lambda: _replica_threads() == baseline), [t.name for t in threading.enumerate()]
