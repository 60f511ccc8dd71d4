"""Engines: the only layer that moves bytes between replicas.

Every engine implements :class:`~crossreplica.engines.base.Engine` and keeps
its invariants; the layers above never know which one runs.
"""

from .base import Call, Engine
from .hierarchical import HierarchicalEngine
from .threads import ThreadsEngine
from .torch_dist import TorchDistEngine

__all__ = ["Call", "Engine", "HierarchicalEngine", "ThreadsEngine", "TorchDistEngine"]
