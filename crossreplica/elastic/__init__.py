"""How a fault-tolerant job keeps, puts back and hands over its training state (``state.py``)."""

from .state import Handler, TrainingState, handler_for

__all__ = ["Handler", "TrainingState", "handler_for"]
