"""The engines: the only code that moves bytes between replicas.

Every engine implements :class:`~crossreplica.engines.base.Engine` and keeps
its invariants; the layers above never know which one runs. ``base`` (the
contract: Call, Kind, the agreement check) and ``reduction`` (the shared
reduction order) are what engines import from each other; ``threads``,
``torch_dist`` (a package) and ``hierarchical`` are the engines.
"""

from .base import Call, Engine
from .hierarchical import HierarchicalEngine
from .threads import ThreadsEngine
from .torch_dist import TorchDistEngine

__all__ = ["Call", "Engine", "HierarchicalEngine", "ThreadsEngine", "TorchDistEngine"]
