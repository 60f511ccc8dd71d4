"""Deadline: the bounds the rendezvous, the asynchronous rounds and the watchdog share."""

from __future__ import annotations

import math

import pytest

from crossreplica.engines import deadline as deadline_module
from crossreplica.engines.deadline import Deadline


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(deadline_module.time, "monotonic", c)
    return c


def test_blocks_until_the_slow_mark_then_until_the_end(clock):
    wait = Deadline(10.0, slow=2.0)
    assert wait.next_block() == 2.0 and wait.next_block(cap=0.5) == 0.5
    assert not wait.turned_slow() and not wait.expired() and not wait.warned
    clock.now += 2.5
    assert wait.waited == 2.5
    assert wait.turned_slow() and wait.warned
    assert not wait.turned_slow()  # once
    assert wait.next_block() == 7.5
    clock.now += 7.5
    assert wait.expired() and wait.next_block() == 1e-3  # never a zero or negative block


def test_a_slow_mark_past_the_end_never_warns(clock):
    wait = Deadline(1.0, slow=1.0)
    assert wait.next_block() == 1.0
    clock.now += 5
    assert wait.expired() and not wait.turned_slow() and not wait.warned


def test_the_default_slow_mark_follows_the_settings(clock, monkeypatch):
    monkeypatch.setattr(deadline_module, "slow_seconds", lambda timeout: timeout / 4)
    wait = Deadline(8.0)
    assert wait.next_block() == 2.0 and wait.end == 108.0 and wait.timeout == 8.0
    assert math.isclose(wait.started, 100.0)


@pytest.fixture
def sleeps(clock, monkeypatch):
    """The pauses slept (each advances the fake clock) and the yields, in order."""
    slept: list[float | str] = []

    def sleep(seconds: float) -> None:
        assert seconds >= 0
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(deadline_module.time, "sleep", sleep)
    monkeypatch.setattr(deadline_module.os, "sched_yield", lambda: slept.append("yield"))
    return slept


def _doubling(first: float, most: float, timeout: float) -> list[float]:
    """The pauses a plain doubling loop capped at ``most`` sleeps until ``timeout``, the last cut at it."""
    out, pause, t = [], first, 0.0
    while t < timeout:
        out.append(min(pause, timeout - t))
        t += out[-1]
        pause = min(2 * pause, most)
    return out


def test_back_off_doubles_up_to_the_cap_and_never_sleeps_past_the_deadline(clock, sleeps):
    wait = Deadline(1.0, slow=math.inf)
    while not wait.expired():
        wait.back_off(0.05, 0.3)
    assert sleeps == pytest.approx(_doubling(0.05, 0.3, 1.0))
    assert max(sleeps) == 0.3 and sum(sleeps) == pytest.approx(1.0)  # capped; ends on the deadline
    wait.back_off(0.05, 0.3)
    assert sleeps[-1] == 0.0  # past the deadline: no pause at all


def test_back_off_yields_during_the_spin_then_sleeps_from_the_first_pause(clock, sleeps):
    wait = Deadline(10.0, slow=math.inf)
    wait.back_off(0.01, 0.04, spin=0.5)
    clock.now += 0.2
    wait.back_off(0.01, 0.04, spin=0.5)
    clock.now += 0.3  # the spin is over
    for _ in range(4):
        wait.back_off(0.01, 0.04, spin=0.5)
    assert sleeps[:2] == ["yield", "yield"]
    assert sleeps[2:] == pytest.approx(_doubling(0.01, 0.04, 0.01 + 0.02 + 0.04 + 0.04))  # from the first pause


def test_the_pauses_go_on_across_waits_sharing_a_deadline(clock, sleeps):
    wait = Deadline(10.0, slow=math.inf)
    wait.back_off(0.01, 1.0)
    wait.back_off(0.01, 1.0)
    wait.back_off(0.01, 1.0)
    assert sleeps == pytest.approx([0.01, 0.02, 0.04])
    Deadline(10.0, slow=math.inf).back_off(0.01, 1.0)  # another wait starts from its first pause
    assert sleeps[-1] == 0.01


def test_sleep_and_left_stop_at_the_deadline(clock, sleeps):
    wait = Deadline(1.0, slow=math.inf)
    assert wait.left == 1.0
    wait.sleep(0.4)
    assert wait.left == pytest.approx(0.6) and not wait.expired()
    wait.sleep(5.0)  # cut at the deadline
    assert sleeps == pytest.approx([0.4, 0.6]) and wait.expired() and wait.left == 0.0
    clock.now += 3
    assert wait.left == 0.0  # never negative
    wait.sleep(1.0)
    assert sleeps[-1] == 0.0
