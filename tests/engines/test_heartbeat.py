"""The peers' heartbeats: a counter that stops moving names its peer, after the window asked for."""

from __future__ import annotations

import time

from crossreplica.engines.torch_dist.heartbeat import Pulses


def test_a_still_counter_names_its_peer_after_the_window_asked_for():
    counters = {1: 5, 2: 7}
    pulses = Pulses("p", rank=0, world_size=3, stopped_after=0.4)

    def read(call):
        return [str(counters[1]).encode(), str(counters[2]).encode()]

    assert pulses.lost(read) == []  # first read: the clock of each counter starts now
    time.sleep(0.25)
    counters[1] += 1  # peer 1 beats, peer 2 is still
    assert pulses.lost(read) == [] and pulses.lost(read, after=0.2) == [2]  # half the window: a broken link's
    time.sleep(0.2)
    assert pulses.lost(read) == [2]  # the whole window
    assert pulses.lost(lambda call: None) == []  # a store that does not answer proves nothing
