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
