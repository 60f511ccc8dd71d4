"""Engines: the only layer that moves bytes between replicas.

Every engine implements :class:`~crossreplica.engines.base.Engine` and keeps
its invariants; the layers above never know which one runs.
"""

from .base import Call, Engine
from .threads import ThreadsEngine

__all__ = ["Call", "Engine", "ThreadsEngine"]
