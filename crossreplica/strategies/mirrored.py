"""MirroredStrategy: N replicas in this process, one thread per replica."""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Sequence

import torch

from ..micro_batches import LayoutInvariant, check_layout
from .. import settings
from ..arguments import check_int
from ..devices import canonical_device
from ..engines.threads import ThreadsEngine
from ..errors import summarize
from ..timeouts import canonical_timeout
from .base import Strategy, StrategyExtended
from .logical_devices import LogicalDevices

__all__ = ["MirroredStrategy"]

_log = logging.getLogger(__name__)


class MirroredStrategy(Strategy):
    """Synchronous replicas as threads of this process, one per device.

    Args:
        num_replicas: how many replicas. Defaults to one per device in
            ``devices``, else one per visible GPU, else 1.
        devices: one device per replica; several replicas may share a device
            (``["cpu"] * 4``). Defaults to the visible GPUs (round-robin when
            there are more replicas than GPUs), else the CPU.
        cross_device_ops: how every cross-device reduction of the strategy is done
            (``strategy.reduce``, ``extended.reduce_to``, ``ReplicaContext.all_reduce``,
            CrossShardOptimizer; default ``AllReduceCrossDeviceOps``); see
            docs/collectives.md.
        timeout_seconds: how long a collective waits for missing replicas
            before raising CollectiveTimeoutError (env CROSSREPLICA_TIMEOUT,
            default 300); a finite number of seconds up to a week.
        logical_devices_per_replica: devices each replica owns (model
            parallelism inside a replica); replica ``i`` gets ``devices[i*k:(i+1)*k]``
            and runs on the first (see :mod:`crossreplica.strategies.logical_devices`).
        layout_invariant: a ``cr.LayoutInvariant(micro_batches=M)`` for training whose
            bits do not depend on the number of replicas (docs/layout_invariance.md).
        steps_per_run: TPUStrategy's steps per dispatch (None: 1), ``extended.steps_per_run``:
            what ``experimental_run_steps`` takes when given no count.
    """

    def __init__(self, num_replicas: int | None = None, devices: Sequence[Any] | None = None,
                 cross_device_ops: Any = None, *, timeout_seconds: float | None = None,
                 logical_devices_per_replica: int = 1, layout_invariant: LayoutInvariant | None = None,
                 steps_per_run: int | None = None):
        k = check_int(logical_devices_per_replica, "logical_devices_per_replica", low=1)
        if steps_per_run is not None:
            check_int(steps_per_run, "steps_per_run", low=1, hint=" (or None: 1)")
        if num_replicas is not None:
            check_int(num_replicas, "num_replicas", low=1, hint=" or None")
        if devices is not None:
            if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence) or not devices:
                raise ValueError(
                    f"devices must be a non-empty list with one device per replica, e.g. ['cpu', 'cpu']; "
                    f"got {summarize(devices)}")
            devs = [canonical_device(d, f"devices[{i}]") for i, d in enumerate(devices)]
            if num_replicas is not None and num_replicas * k != len(devs):
                raise ValueError(
                    f"num_replicas={num_replicas} does not match the {len(devs)} devices given; "
                    f"pass {k} device(s) per replica (logical_devices_per_replica={k}) or leave num_replicas out")
        else:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            n = num_replicas if num_replicas is not None else max(gpus // k, 1)
            devs = ([torch.device("cuda", i % gpus) for i in range(n * k)] if gpus
                    else [torch.device("cpu")] * (n * k))
        logical = LogicalDevices.consecutive(devs, k)
        devs = list(logical.column(0))
        timeout = (settings.timeout() if timeout_seconds is None
                   else canonical_timeout(timeout_seconds, "timeout_seconds"))
        self.extended = StrategyExtended(self, devs, ThreadsEngine(devs, timeout), cross_device_ops)
        self.extended.set_logical_devices(logical.groups)
        self.extended.layout_invariant = check_layout(layout_invariant, len(devs))
        self.extended.steps_per_run = steps_per_run
        _log.info("MirroredStrategy: %d replicas (threads engine, one thread per replica) on %s, timeout %gs",
                  len(devs), [str(d) for d in devs], timeout)
        if k > 1:
            _log.info("MirroredStrategy: %d logical devices per replica: %s", k,
                      [[str(d) for d in g] for g in logical.groups])
