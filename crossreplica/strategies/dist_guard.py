"""torch.distributed calls in a replica function: an error where they cannot be right.

torch.distributed's ranks are processes. With one replica per process (what
MultiWorkerMirroredStrategy gives by default) a rank is a replica, and a DDP
habit left in a replica function (``dist.all_reduce(t)``, ``dist.get_rank()``)
is right. With several replicas in one process (``replicas_per_worker`` > 1,
MirroredStrategy's threads) it cannot be: the replica threads of a process call
the same collective on the same process group, the calls pair up by arrival
rather than by replica, and ``get_world_size()`` counts processes where more
replicas are in sync. Such a call raises ReplicaContextError naming the ``cr.``
function to use; calls in cross-replica context (outside ``strategy.run``, in
``merge_fn``) are not affected.

The mechanism. The first ``strategy.run`` with more than one local replica
calls :func:`install`, which replaces the public functions below in the
``torch.distributed`` namespace by thin wrappers, once per process, never
undone. Replacing a module attribute is atomic, so a call in any thread sees
either torch's function or the wrapper, both correct, and nothing is ever put
back under a run that still needs it. Outside a replica function a wrapper
costs one thread-local read (the context stack) before torch's function. Inside
one it reads the caller's module from its frame: crossreplica's own calls pass
at once (the engines move bytes with torch.distributed from the replica
threads); any other passes where the process runs one replica, and so do
torch's own rank queries (torch's logging asks ``get_rank()``); a collective
reached from the user's code, directly or through torch
(``torch.distributed.nn``, torch's SyncBatchNorm), raises. Only calls through the ``torch.distributed`` namespace
are seen: a function imported by name before the first run (``from
torch.distributed import all_reduce``) is not checked, nor are ``isend`` and
``irecv``, which ``P2POp`` recognises by identity (their ``batch_isend_irecv`` is).
"""

from __future__ import annotations

import functools
import sys
from types import FrameType
from typing import Any
from collections.abc import Callable

import torch.distributed as dist

from .. import context
from ..errors import ReplicaContextError

__all__ = ["install", "installed"]

_ALL_REDUCE = 't = cr.all_reduce(t, "sum") (it returns the result, where torch\'s works in place)'
_GATHER = "cr.all_gather(t) (every replica's t, concatenated along dim 0)"
_BROADCAST = "cr.broadcast(t, source=0)"
_POINT_TO_POINT = "cr.collective_permute(t, source_target_pairs)"
_BARRIER = 'nothing: the replicas meet at every cr collective (cr.all_reduce(torch.zeros(()), "sum") waits for all)'

#: torch.distributed's collectives -> the crossreplica call that replaces them in a replica function
COLLECTIVES: dict[str, str] = {
    "all_reduce": _ALL_REDUCE, "reduce": _ALL_REDUCE,
    "all_gather": _GATHER, "all_gather_into_tensor": _GATHER, "all_gather_object": _GATHER,
    "gather": _GATHER, "gather_object": _GATHER,
    "reduce_scatter": 'cr.reduce_scatter(t, "sum")', "reduce_scatter_tensor": 'cr.reduce_scatter(t, "sum")',
    "broadcast": _BROADCAST, "broadcast_object_list": _BROADCAST,
    "scatter": f"{_BROADCAST}[cr.replica_id()]", "scatter_object_list": f"{_BROADCAST}[cr.replica_id()]",
    "all_to_all": "cr.all_to_all(t, split_dim=0, concat_dim=0)",
    "all_to_all_single": "cr.all_to_all(t, split_dim=0, concat_dim=0)",
    # isend and irecv stay torch's: P2POp accepts only them, compared by identity
    "send": _POINT_TO_POINT, "recv": _POINT_TO_POINT, "batch_isend_irecv": _POINT_TO_POINT,
    "send_object_list": _POINT_TO_POINT, "recv_object_list": _POINT_TO_POINT,
    "barrier": _BARRIER, "monitored_barrier": _BARRIER,
}
#: torch.distributed's rank queries -> their crossreplica counterparts in a replica function
QUERIES: dict[str, str] = {
    "get_world_size": "cr.num_replicas() (strategy.num_replicas_in_sync outside a replica function)",
    "get_rank": "cr.replica_id() (cr.get_replica_context().replica_id_in_sync_group)",
}
_MARK = "_crossreplica_guarded"


def installed() -> bool:
    """Whether this process's torch.distributed functions are guarded."""
    return dist.is_available() and bool(getattr(getattr(dist, "all_reduce", None), _MARK, False))


def install() -> None:
    """Guards torch.distributed's collectives and rank queries in replica functions (once
    per process; a function already guarded is kept, so concurrent calls are harmless)."""
    if not dist.is_available() or getattr(getattr(dist, "get_rank", None), _MARK, False):
        return  # installed (get_rank is wrapped last)
    for name in (*COLLECTIVES, *QUERIES):
        current = getattr(dist, name, None)
        if current is not None and not getattr(current, _MARK, False):
            setattr(dist, name, _guarded(name, current))


def _guarded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    query = name in QUERIES

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        rctx = context.current_replica_context()
        if rctx is not None:
            caller = sys._getframe(1)
            if not caller.f_globals.get("__name__", "").startswith("crossreplica."):  # the engines' own calls
                _check(name, query, rctx, caller)
        return function(*args, **kwargs)

    setattr(call, _MARK, True)
    return call


def _module(frame: FrameType | None) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _check(name: str, query: bool, rctx: context.ReplicaContext, caller: FrameType) -> None:
    """Raises for ``torch.distributed.<name>`` called from user code (``caller``: the frame
    that called it) in a replica function of a process with several local replicas."""
    ext = rctx.strategy.extended
    local = len(ext.worker_devices)
    if local == 1:
        return
    frame: FrameType | None = caller
    through = ""
    if query:  # torch's own rank queries (logging) are harmless
        if _within(_module(frame), "torch") or _within(_module(frame), "crossreplica"):
            return
    else:  # a collective reached through torch is the user's as much as a direct one
        while frame is not None and _within(_module(frame), "torch"):
            through = _module(frame)
            frame = frame.f_back
        if _within(_module(frame), "crossreplica"):
            return
    workers, n = ext.num_workers, rctx.num_replicas_in_sync
    if name == "get_world_size":
        effect = f"it counts the processes ({workers}) where {n} replicas are in sync"
    elif name == "get_rank":
        effect = f"it gives each of this process's {local} replicas the process's rank ({ext.worker_rank})"
    else:
        effect = ("the replica threads of a process call it on the same process group, so the calls pair up by "
                  "arrival rather than by replica and combine the wrong replicas")
    via = f" (reached through {through})" if through else ""
    fix = (QUERIES if query else COLLECTIVES)[name]
    raise ReplicaContextError(
        f"torch.distributed.{name} was called in a replica function{via}, but torch.distributed's ranks are "
        f"processes and this process runs {local} of the {n} replicas in sync, over {workers} process(es): {effect}. "
        f"Use {fix} instead; torch.distributed calls are right only with one replica per process, or in "
        f"cross-replica context (outside strategy.run, or in merge_fn)")
