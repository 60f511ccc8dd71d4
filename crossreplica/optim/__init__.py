"""The optimizer layer: :class:`CrossShardOptimizer` (``optimizer.py``) and the
overlapped bucketed gradient reduction it can use (``overlap.py``)."""

from .optimizer import DEFAULT_BYTES_PER_PACK, CrossShardOptimizer

__all__ = ["DEFAULT_BYTES_PER_PACK", "CrossShardOptimizer"]
