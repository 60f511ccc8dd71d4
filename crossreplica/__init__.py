"""crossreplica: tf.distribute-style synchronous data-parallel training for PyTorch.

Write a replica function once; run it on one device, on N in-process replicas,
on N processes or on many hosts, with the same numbers.
"""

from . import torch_private  # noqa: F401 - first: a torch lacking a private symbol fails here, naming it
from . import errors, logs, settings, types
from .checkpoint import load, save
from .collectives import (all_gather, all_reduce, all_to_all, broadcast, collective_permute,
                          cross_replica_average, cross_replica_mean, cross_replica_sum, num_replicas,
                          reduce_scatter, replica_id)
from .context import (ReplicaContext, get_replica_context, get_strategy, has_strategy,
                      in_cross_replica_context)
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, ReplicaContextError,
                     ReplicaError, WorkerFailedError)
from .groups import Mesh, canonical_groups, contiguous_groups, strided_groups
from .random_streams import checkpoint_context_fn, replica_generator
from .reduce_op import ReduceOp
from .strategies import (MirroredStrategy, MultiStepContext, MultiWorkerMirroredStrategy, OneDeviceStrategy,
                         Strategy)
from .values import (DistributedValues, Mirrored, PerReplica, regroup, select_replica,
                     select_replica_mirrored)
from .cross_device_ops import (AllReduceCrossDeviceOps, CommunicationOptions, CrossDeviceOps,
                               ReductionToOneDevice)
from .data import InputContext, InputReplicationMode, ValueContext
from .micro_batches import LayoutInvariant, replica_share
from .optim import CrossShardOptimizer
from .elastic.fault_tolerance import FaultTolerance, FencedOutError
from .variables import Variable, VariableAggregation, VariableSynchronization
from . import nn
from .version import __version__


__all__ = [
    "__version__",
    "errors", "logs", "settings", "types",
    "save", "load",
    "ReduceOp",
    "DistributedValues", "PerReplica", "Mirrored", "regroup", "select_replica", "select_replica_mirrored",
    "Mesh", "canonical_groups", "contiguous_groups", "strided_groups",
    "ReplicaContext", "get_strategy", "has_strategy", "in_cross_replica_context", "get_replica_context",
    "ReplicaContextError", "CollectiveMismatchError", "CollectiveTimeoutError", "ReplicaError",
    "Strategy", "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy",
    "LayoutInvariant", "replica_share",
    "all_reduce", "cross_replica_sum", "cross_replica_mean", "cross_replica_average", "all_gather",
    "reduce_scatter", "all_to_all", "broadcast", "collective_permute", "replica_id", "num_replicas",
    "CrossDeviceOps", "ReductionToOneDevice", "AllReduceCrossDeviceOps", "CommunicationOptions",
    "InputContext", "InputReplicationMode", "ValueContext", "MultiStepContext", "CrossShardOptimizer", "nn",
    "FaultTolerance", "FencedOutError", "WorkerFailedError",
    "Variable", "VariableSynchronization", "VariableAggregation",
    "replica_generator", "checkpoint_context_fn",
]
