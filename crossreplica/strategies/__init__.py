"""Distribution strategies: where replicas run and how they talk."""

from .base import Strategy, StrategyExtended
from .mirrored import MirroredStrategy
from .multi_worker import MultiWorkerMirroredStrategy
from .one_device import OneDeviceStrategy
from .steps import MultiStepContext

__all__ = ["Strategy", "StrategyExtended", "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy",
           "MultiStepContext"]
