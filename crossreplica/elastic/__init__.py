"""How a job forms, re-forms and recovers: its coordinator (``coordinator.py``: the job's store,
served apart from the workers, every client authenticated with the job secret over
``protocol.py``; ``store.py``: a worker's connection to it) and the training state a
fault-tolerant job keeps, puts back and hands over (``state.py``).

``state.py`` is imported when one of its names is first used: the coordinator's
modules sit below the strategies (a worker's set-up reaches its store through
them), the training state above them.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Handler", "TrainingState", "handler_for"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".state", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
