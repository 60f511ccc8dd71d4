"""OneDeviceStrategy: the replica function runs once, in the calling thread.

Layer: strategies (layer 5); see docs/architecture.md.
"""

from __future__ import annotations

import logging

import torch

from .. import context, settings
from ..devices import canonical_device
from ..engines.threads import ThreadsEngine
from .base import Strategy, StrategyExtended

__all__ = ["OneDeviceStrategy"]

_log = logging.getLogger(__name__)


class OneDeviceStrategy(Strategy):
    """One replica on ``device``; the same code as N replicas, with N = 1.

    Its collectives wait at most ``CROSSREPLICA_TIMEOUT`` seconds (300 by default;
    docs/settings.md), under the same rule as every strategy's timeout.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        dev = canonical_device(device, "device")
        self.extended = StrategyExtended(self, [dev], ThreadsEngine([dev], settings.timeout()))
        _log.info("OneDeviceStrategy: 1 replica on %s (threads engine, in the calling thread)", str(dev))


# Outside any scope, crossreplica behaves as one replica on the CPU (tf.distribute's default strategy).
context.register_default_strategy(lambda: OneDeviceStrategy("cpu"))
