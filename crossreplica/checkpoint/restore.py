"""Restoring a loaded checkpoint into live objects: ``cr.load(path, into=state)``.

``into`` is a nest of the same shape as the state that was saved (usually the
very dict given to ``cr.save``). Each leaf is restored in place from the entry
at the same place in the checkpoint, by the kind :func:`.state.kind` gives it:
``load_state_dict`` for stateful objects, ``set_state`` / ``setstate`` for
random streams, ``copy_`` for tensors; every copy of a ``Mirrored`` and every
local value of a ``PerReplica`` gets the saved state (its own replica's entry
when the state was saved per replica; see :mod:`.per_replica`). Plain values
(numbers, strings, None) are left alone: read them from the nest ``cr.load``
returns. Each target gets its own copy of the saved tensors, so replicas never
share optimizer state.

Errors name the place in ``into``: an entry the checkpoint lacks, a leaf that
cannot be restored in place, or a ``load_state_dict`` that refuses the saved
state (a CheckpointError carrying the object's own message).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import nest
from ..errors import CheckpointError, summarize
from ..values import DistributedValues, Mirrored
from .per_replica import is_record, pick
from .state import GENERATOR, MIRRORED, PER_REPLICA, RNG_METHODS, STATEFUL, TENSOR, kind, local_ids_for, where

if TYPE_CHECKING:
    from ..strategies.base import Strategy

__all__ = ["restore"]

_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def _fresh(value: Any) -> Any:
    """``value`` with every tensor cloned, so two targets never share one."""
    return nest.map_structure(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


def restore(target: Any, saved: Any, strategy: Strategy, path: tuple = ()) -> None:
    """Restores ``target`` (a nest of live objects) from ``saved`` in place."""
    k = kind(target)
    name = where("into", path)
    if k is None and not nest.is_container(target):
        if isinstance(target, _PLAIN) or _is_numpy(target):
            return  # a plain value: read it from the nest cr.load returns
        raise TypeError(
            f"cr.load: {name} is a {type(target).__name__}, which cannot be restored in place: it has no "
            f"load_state_dict(), set_state() or setstate(). Give it state_dict()/load_state_dict(), or "
            f"leave it out of into= and read its value from the nest cr.load returns")
    if k in (MIRRORED, PER_REPLICA):
        _distributed(target, saved, strategy, path)
        return
    if is_record(saved):  # saved per replica, restored into one object: this worker's only replica
        ext = strategy.extended
        local_ids = tuple(ext.local_replica_ids)
        if len(local_ids) != 1:
            raise CheckpointError(
                f"cr.load: {name} is one {type(target).__name__}, but the checkpoint holds one state per "
                f"replica there; pass a PerReplica of {len(local_ids)} objects (one per local replica)")
        saved = pick(saved, local_ids[0], int(ext.num_replicas_in_sync), name)
    if k == TENSOR:
        _tensor(target, saved, name)
    elif k == STATEFUL:
        _call(target, "load_state_dict", _fresh(saved), name)
    elif k is not None:  # a random stream
        if k == GENERATOR and isinstance(saved, torch.Tensor):
            saved = saved.cpu()  # generators take their state as a CPU byte tensor
        _call(target, RNG_METHODS[k][1], _fresh(saved), name)
    else:  # a container
        keys, items = nest.children(target)
        for key, item in zip(keys, items):
            if kind(item) is None and not nest.is_container(item):
                restore(item, None, strategy, path + (key,))  # nothing to restore (or a TypeError)
                continue
            restore(item, _child(saved, key, path), strategy, path + (key,))


def _is_numpy(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "numpy"


def _distributed(target: DistributedValues, saved: Any, strategy: Strategy, path: tuple) -> None:
    ext = strategy.extended
    name = where("into", path)
    local_ids = local_ids_for(target, strategy, "cr.load", name, "the strategy it belongs to")
    if isinstance(target, Mirrored) and is_record(saved):
        raise CheckpointError(f"cr.load: {name} is a Mirrored (identical copies), but the checkpoint holds a "
                              f"different state per replica there; restore it into a PerReplica")
    n = int(ext.num_replicas_in_sync)
    for value, g in zip(target.values, local_ids):
        if isinstance(value, DistributedValues):
            raise TypeError(f"cr.load: {name} is a {type(target).__name__} that holds "
                            f"{type(value).__name__} values; give one object per replica")
        restore(value, pick(saved, g, n, name), strategy, path)


def _tensor(target: torch.Tensor, saved: Any, name: str) -> None:
    if not isinstance(saved, torch.Tensor):
        raise CheckpointError(f"cr.load: {name} is a tensor, but the checkpoint holds "
                              f"{summarize(saved)} there")
    if saved.shape != target.shape:
        raise CheckpointError(f"cr.load: {name} has shape {list(target.shape)}, but the checkpoint's "
                              f"tensor there has shape {list(saved.shape)}")
    with torch.no_grad():
        target.copy_(saved)


def _call(target: Any, method: str, saved: Any, name: str) -> None:
    try:
        getattr(target, method)(saved)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"cr.load: cannot restore {name} (a {type(target).__name__}) from the "
                              f"checkpoint: {type(e).__name__}: {e}") from e


def _child(saved: Any, key: Any, path: tuple) -> Any:
    """The entry of ``saved`` under ``key`` (a key of the target container at ``path``)."""
    name = where("into", path)
    if not nest.is_container(saved):
        raise CheckpointError(f"cr.load: {name} is a container, but the checkpoint holds "
                              f"{summarize(saved)} there")
    keys, items = nest.children(saved)
    found = dict(zip(keys, items))
    if key not in found:
        shown = [k.name if hasattr(k, "name") else k for k in keys]
        raise CheckpointError(f"cr.load: the checkpoint has no entry for {where('into', path + (key,))} "
                              f"(its keys there: {summarize(shown)}); was it saved from another state?")
    return found[key]
