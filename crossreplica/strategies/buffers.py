"""Mirrored buffers: the copies of a mirrored module's buffers agree after every run.

Parameters of mirrored copies stay identical because every replica applies the
same reduced gradient to the same values. Buffers have no gradient: a
``torch.nn.BatchNorm`` updates its running statistics from its own replica's
batch, so left alone the copies drift apart and ``cr.save`` (which keeps
replica 0's copy) silently drops what the others saw.

``strategy.mirror(module, sync_buffers=...)`` remembers the module's copies
(weakly) with a policy, :data:`POLICIES`:

* ``"broadcast"`` (the default; DDP's choice): replica 0's buffers are copied
  to every replica.
* ``"mean"``: floating-point buffers are averaged over the replicas (the
  engine's all-reduce MEAN, the same bytes on every engine); other buffers
  (``num_batches_tracked``) take replica 0's values.
* ``None``: no sync. A run after which the local copies' buffers differ warns
  once per module (only copies in the same process can be compared).

The sync ends every run, after the replica functions returned, so when ``run``
returns every copy holds the same bytes. With replicas in other processes each
replica syncs inside its body with the engine's collectives (one flat tensor
per device and dtype); with every replica in this process the caller's thread
does the same arithmetic once they all returned, which spares a rendezvous.
A module is synced when its copy has any submodule in training mode after the
replica function returns (decided the same way on every replica); a module in
eval mode, or a ``cr.nn.SyncBatchNorm`` over every replica, costs nothing.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any
from collections.abc import Callable, Sequence

import torch

from .. import collectives, nest
from .. import torch_private as tp
from ..errors import summarize
from ..logs import UnsyncedBuffersWarning
from ..nn import SyncBatchNorm
from ..packing import flatten_pack, unflatten_pack_
from ..reduce_op import ReduceOp
from ..values import Mirrored

__all__ = ["POLICIES", "MirroredBuffers", "RunSync", "check_policy"]

#: ``strategy.extended.reduce_values``: one tensor per local replica -> their reduction.
Reduce = Callable[[ReduceOp, Sequence[torch.Tensor]], torch.Tensor]

#: The accepted values of ``sync_buffers``.
POLICIES = ("broadcast", "mean", None)


def check_policy(value: Any, argname: str = "sync_buffers") -> str | None:
    """``value`` if it is one of :data:`POLICIES`; a ValueError naming it otherwise."""
    if value is None or (isinstance(value, str) and value in POLICIES):
        return value
    raise ValueError(
        f"{argname} must be one of 'broadcast' (replica 0's buffers to every replica), 'mean' "
        f"(average the floating-point buffers) or None (no sync); got {summarize(value)}")


class _Group:
    """One mirrored module: a weak reference to its copy on each local replica."""

    __slots__ = ("copies", "policy", "warned", "versions")

    def __init__(self, modules: Sequence[torch.nn.Module], policy: str | None):
        self.copies = tuple(weakref.ref(m) for m in modules)
        self.policy = policy
        self.warned = False
        self.versions: tuple[int, ...] = ()  # buffer versions when last compared (policy None)

    def modules(self) -> list[torch.nn.Module] | None:
        """Strong references to the copies; None once any copy is gone."""
        mods = [ref() for ref in self.copies]
        return None if any(m is None for m in mods) else mods  # type: ignore[return-value]


class MirroredBuffers:
    """The mirrored modules of one strategy and their buffer policies."""

    def __init__(self) -> None:
        self._groups: list[_Group] = []

    def register(self, mirrored: Mirrored, policy: str | None) -> None:
        """Remembers (weakly) every module of ``mirrored``'s copies, with ``policy``."""
        per_copy = [[leaf for leaf in nest.flatten(c)[0] if isinstance(leaf, torch.nn.Module)]
                    for c in mirrored.values]
        for j in range(len(per_copy[0])):
            self._groups.append(_Group([mods[j] for mods in per_copy], policy))

    def local_modules(self, local_index: int) -> list[torch.nn.Module]:
        """Every mirrored module's copy on local replica ``local_index`` (registration order)."""
        found = []
        for g in self._groups:
            mods = g.modules()
            if mods is not None and local_index < len(mods):
                found.append(mods[local_index])
        return found

    def for_run(self, num_replicas: int, num_local: int) -> RunSync | None:
        """The sync of the coming run (None: nothing to sync), given the replicas in sync
        and how many of them run in this process."""
        live: list[tuple[_Group, list[torch.nn.Module]]] = []
        kept = []
        for g in self._groups:
            mods = g.modules()
            if mods is not None:
                kept.append(g)
                live.append((g, mods))
        self._groups = kept
        synced = [(g.policy, mods) for g, mods in live if g.policy is not None]
        if num_replicas == 1 or not synced:
            return None
        return RunSync(synced, in_process=num_local == num_replicas)

    def after_run(self, run_sync: RunSync | None, reduce_values: Reduce) -> None:
        """In the caller's thread once every local replica returned: finishes the run's
        sync (in one process) and warns about unsynced copies that differ."""
        if run_sync is not None:
            run_sync.finish(reduce_values)
        self.check_unsynced()

    def check_unsynced(self) -> None:
        """Warns (once per module) when the local copies of a module mirrored with
        ``sync_buffers=None`` hold different buffers after a run."""
        for g in self._groups:
            if g.policy is not None or g.warned or len(g.copies) < 2:
                continue
            mods = g.modules()
            if mods is None:
                continue
            bufs = [list(m.buffers()) for m in mods]
            versions = tuple(tp.tensor_version(b) for bs in bufs for b in bs)
            if versions == g.versions:
                continue  # nothing written since the last comparison
            g.versions = versions
            if any(not _same(bufs[0], bs) for bs in bufs[1:]):
                g.warned = True
                warnings.warn(
                    f"the mirrored copies of {type(mods[0]).__name__} hold different buffers after "
                    f"strategy.run (each replica updated them from its own batch; cr.save keeps "
                    f"replica 0's); pass sync_buffers='broadcast' or 'mean' to strategy.mirror to keep "
                    f"them identical", UnsyncedBuffersWarning, stacklevel=5)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y.to(x.device)) for x, y in zip(a, b))


class RunSync:
    """The buffer sync of one run.

    Across processes each local replica calls :meth:`sync` after its replica
    function (collectives over every replica). When every replica runs in this
    process, :meth:`finish` does the same arithmetic in the caller's thread once
    they all returned (every copy is at hand there), which saves the replicas a
    rendezvous; the bytes are the same (the engine's reduction, in replica order).
    """

    __slots__ = ("_synced", "_in_process")

    def __init__(self, synced: list[tuple[str, list[torch.nn.Module]]], in_process: bool):
        self._synced = synced
        self._in_process = in_process

    def _collect(self, local_index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The buffers of replica ``local_index``'s copies to broadcast and to average."""
        to_broadcast: list[torch.Tensor] = []
        to_average: list[torch.Tensor] = []
        seen: set[int] = set()
        for policy, mods in self._synced:
            subs = _submodules(mods[local_index])
            if not any(m.training for m in subs):
                continue
            for sub in subs:
                if _agree_already(sub):
                    continue
                for b in tp.own_buffers(sub):
                    if b is None or id(b) in seen:
                        continue  # unset, or a module mirrored inside another one
                    seen.add(id(b))
                    if policy == "mean" and (b.is_floating_point() or b.is_complex()):
                        to_average.append(b)
                    else:
                        to_broadcast.append(b)
        return to_broadcast, to_average

    def sync(self, local_index: int) -> None:
        """Inside replica ``local_index``, after its replica function: makes its copies'
        buffers agree with every other replica's (collectives over every replica)."""
        if self._in_process:
            return
        to_broadcast, to_average = self._collect(local_index)
        with torch.no_grad():
            if to_average:
                _packed(to_average, lambda flats: collectives.all_reduce(flats, "mean"))
            if to_broadcast:
                _packed(to_broadcast, lambda flats: collectives.broadcast(flats, 0))

    def finish(self, reduce_values: Reduce) -> None:
        """In the caller's thread after the run, when every replica is in this process:
        copy 0's buffers to the others, or the mean (``reduce_values``) to all."""
        if not self._in_process:
            return
        per_copy = [self._collect(i) for i in range(len(self._synced[0][1]))]
        layout = [[(t.shape, t.dtype) for t in ts] for ts in per_copy[0]]
        for i, lists in enumerate(per_copy[1:], 1):
            if [[(t.shape, t.dtype) for t in ts] for ts in lists] != layout:
                raise RuntimeError(
                    f"the mirrored copies of replica 0 and replica {i} changed different buffers in this "
                    f"run (their training modes or structure differ); switch train()/eval() inside the "
                    f"replica function, on every copy alike")
        with torch.no_grad():
            sources = per_copy[0][0]
            for to_broadcast, _ in per_copy[1:]:
                if to_broadcast:
                    tp.foreach_copy_(to_broadcast, sources)  # one call (any devices)
            if not per_copy[0][1]:
                return
            packs: dict[tuple[torch.device, torch.dtype], list[int]] = {}
            for j, t in enumerate(per_copy[0][1]):
                packs.setdefault((t.device, t.dtype), []).append(j)
            for members in packs.values():
                copies = [[avg[j] for j in members] for _, avg in per_copy]
                mean = reduce_values(ReduceOp.MEAN, [flatten_pack(ts) for ts in copies])
                for ts in copies:
                    unflatten_pack_(mean.to(ts[0].device), ts)


def _submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every submodule of ``module`` once, ``module`` first (breadth-first): what
    ``module.modules()`` yields, at half its cost (the sync walks the model every run)."""
    out = [module]
    seen = {id(module)}
    for m in out:  # grows while it is walked
        for c in tp.child_modules(m):
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                out.append(c)
    return out


def _agree_already(module: torch.nn.Module) -> bool:
    """A SyncBatchNorm over every replica: each replica updates its statistics from the
    same all-reduced totals, so its buffers agree without a sync."""
    return (isinstance(module, SyncBatchNorm) and module.group_assignment is None
            and module.num_shards_per_group is None)


def _packed(tensors: list[torch.Tensor], collective: Any) -> None:
    """Runs ``collective`` once on one flat tensor per (device, dtype) of ``tensors``
    and copies the results back into them."""
    packs: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        packs.setdefault((t.device, t.dtype), []).append(t)
    members = list(packs.values())
    outs = collective([flatten_pack(ts) for ts in members])
    for ts, out in zip(members, outs):
        unflatten_pack_(out, ts)
