"""How a job forms, re-forms and recovers, in one package.

- ``coordinator.py``, ``protocol.py``, ``store.py``: the job's store served apart from the
  workers (``crossreplica coordinator``), every client authenticated with the job secret,
  and a worker's connection to it (a ``torch.distributed.Store``);
- ``job_store.py``: where a job's workers meet in the store (its secret's namespace, each
  start's token, the arrival check, the launchers' places);
- ``launch.py``: ``crossreplica launch``, a host's workers, whose survivors go on;
- ``membership.py``: who is left after a loss, agreed through the store, and fencing;
- ``fault_tolerance.py``: ``cr.FaultTolerance``, a step redone on the survivors;
- ``state.py``: the training state a fault-tolerant job keeps, puts back and hands over.

The names below are imported when first used: the store's modules sit below the
strategies (a worker's set-up reaches its store through them), the rest above.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Handler", "TrainingState", "handler_for"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".state", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
