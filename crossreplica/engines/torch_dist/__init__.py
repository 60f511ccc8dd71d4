"""The multi-process engine; replicas in different processes, joined by torch.distributed.

One module per concern (gloo on CPU, NCCL on CUDA):

* ``engine``: :class:`TorchDistEngine`, the per-call record and the dispatch by kind;
* ``plan``: group assignments -> worker sets and cached process subgroups;
* ``all_reduce``: all_reduce and reduce_scatter (local reduce, one backend call per bucket);
* ``ordered``: the floating-point all-reduce in ascending replica id;
* ``gather``: all_gather with uneven sizes along the gather dim;
* ``broadcast``: one byte pack per (worker set, source worker);
* ``p2p``: point-to-point messages, all_to_all and permute;
* ``shared_memory``, ``shm_files``: the same-host all-reduce through mapped files;
* ``staging``: CUDA tensors over a CPU transport (gloo), through page-locked host memory;
* ``signatures``: ``check_collectives``, the hashed cross-worker agreement check;
* ``watchdog``: bounded, abort-aware waits and the errors a failure raises.

Byte packs are ``crossreplica.packing``'s; the reduction order is ``engines/reduction.py``'s.
"""

from .engine import TorchDistEngine
from .watchdog import WorkerFailedError

__all__ = ["TorchDistEngine", "WorkerFailedError"]
