"""OneDeviceStrategy: the replica function runs once, in the calling thread."""

from __future__ import annotations

import logging

import torch

from ..micro_batches import LayoutInvariant, check_layout
from .. import context, settings
from ..devices import canonical_device
from ..engines.threads import ThreadsEngine
from .base import Strategy, StrategyExtended

__all__ = ["OneDeviceStrategy"]

_log = logging.getLogger(__name__)


class OneDeviceStrategy(Strategy):
    """One replica on ``device``; the same code as N replicas, with N = 1.

    Its collectives wait at most ``CROSSREPLICA_TIMEOUT`` seconds (300 by default;
    docs/settings.md), under the same rule as every strategy's timeout. With
    ``layout_invariant=cr.LayoutInvariant(micro_batches=M)`` it runs the ``M``
    micro-batches of each batch in turn (docs/layout_invariance.md).
    """

    def __init__(self, device: str | torch.device = "cpu", *, layout_invariant: LayoutInvariant | None = None):
        dev = canonical_device(device, "device")
        self.extended = StrategyExtended(self, [dev], ThreadsEngine([dev], settings.timeout()))
        self.extended.layout_invariant = check_layout(layout_invariant, 1)
        _log.info("OneDeviceStrategy: 1 replica on %s (threads engine, in the calling thread)", str(dev))


# Outside any scope, crossreplica behaves as one replica on the CPU (tf.distribute's default strategy).
context.register_default_strategy(lambda: OneDeviceStrategy("cpu"))
