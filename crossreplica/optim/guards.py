"""Guards against optimizer habits that train the replicas apart without an error.

Each guard turns a habit brought from single-process or DDP code into a
``ReplicasDivergeWarning`` (or an error) that names the cause and the fix:

* **A plain torch optimizer in a replica** (CrossShardOptimizer forgotten): a
  global ``torch.optim`` step pre-hook sees a step in a replica of several with
  no cross-replica collective since that optimizer's previous step (the
  replica context counts them), so each copy trains on its own shard. TF raises
  for the same mistake on TPUs; a warning leaves room for replicas trained apart
  on purpose. The optimizers a CrossShardOptimizer steps are exempt.
* **Gradients edited before the reduction** (DDP's ``backward; clip_grad_norm_;
  step``): CrossShardOptimizer reduces in ``step()``, so an in-place edit between
  backward and step acts on each replica's own gradients. The end of every
  backward records the first parameter's gradient and its in-place counter
  (``Tensor._version``; ``clip_grad_norm_`` and in-place scaling write every
  gradient, so one tells); ``step()`` or ``synchronize()`` compares. One
  parameter and one autograd callback per backward keep it O(1) per step.
  ``overlap=True`` needs no guard: its gradients are reduced by the end of
  backward, as DDP's.
* **One optimizer stepped by several replicas** (:func:`check_owner`): an error.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import torch_private as tp
from ..context import ReplicaContext, current_replica_context
from ..errors import ReplicasDivergeWarning
from ..groups import group_of

if TYPE_CHECKING:
    from .optimizer import CrossShardOptimizer

__all__ = ["GradientEdits", "check_owner", "exempt"]

#: Optimizers stepped by a CrossShardOptimizer (the wrapped one, ZeRO's shard optimizer).
_EXEMPT: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
#: optimizer -> (the replica context, its collective count) at its last step (a weak reference:
#: an id could name the context of a later run, with the same count)
_LAST: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[weakref.ref, int]] = weakref.WeakKeyDictionary()
_WARNED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def exempt(optimizer: torch.optim.Optimizer) -> None:
    """Marks ``optimizer`` as stepped by a CrossShardOptimizer (after its reduction)."""
    _EXEMPT.add(optimizer)


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook: warns about a plain optimizer in a replica of several
    that no cross-replica reduction fed since its previous step."""
    rctx = current_replica_context()
    if rctx is None or optimizer in _EXEMPT or rctx.num_replicas_in_sync == 1:
        return
    seen = rctx.collectives
    last = _LAST.get(optimizer)
    _LAST[optimizer] = (weakref.ref(rctx), seen)
    if seen != (last[1] if last is not None and last[0]() is rctx else 0) or optimizer in _WARNED:
        return
    _WARNED.add(optimizer)
    name = type(optimizer).__name__
    warnings.warn(
        f"{name}.step() ran in a replica of {rctx.num_replicas_in_sync} with no cross-replica reduction since "
        f"its previous step: each replica steps its own copy on its own shard of the batch, so the mirrored "
        f"copies drift apart (and cr.save keeps replica 0's). Wrap it, cr.CrossShardOptimizer({name}(...)), "
        f"to reduce the gradients in step() (TF requires CrossShardOptimizer on TPUs for this reason), or "
        f"all-reduce them first: cr.all_reduce([p.grad for p in params], 'mean'). Replicas trained apart on "
        f"purpose: warnings.filterwarnings('ignore', category=cr.logs.ReplicasDivergeWarning)",
        ReplicasDivergeWarning, stacklevel=3)


register_optimizer_step_pre_hook(_on_step)


class GradientEdits:
    """Notices a gradient written in place between the end of backward and the reduction."""

    def __init__(self, params: list[torch.Tensor]):
        self._param = params[0] if params else None
        self._seen: tuple[torch.Tensor, int] | None = None  # (the gradient, its _version) at backward's end
        self._queued = False
        self._warned = False
        if self._param is not None:
            handle = self._param.register_post_accumulate_grad_hook(_hook(weakref.ref(self)))
            weakref.finalize(self, handle.remove)

    def on_grad(self) -> None:
        if not self._queued:  # once per backward
            self._queued = True
            tp.queue_autograd_callback(self._record)

    def _record(self) -> None:
        self._queued = False
        g = self._param.grad if self._param is not None else None
        self._seen = (g, tp.tensor_version(g)) if g is not None else None

    def forget(self) -> None:
        """The gradients are reduced or cleared: nothing to compare until the next backward."""
        self._seen = None

    def check(self, api: str, opt: CrossShardOptimizer, rctx: ReplicaContext) -> None:
        """Warns (once) when the gradient recorded at the end of backward was edited since,
        unless this replica reduces alone (a group of one: the edit is plain torch's)."""
        seen, self._seen = self._seen, None
        if seen is None or self._warned or self._param is None:
            return
        g = self._param.grad
        if g is seen[0] and tp.tensor_version(g) == seen[1]:
            return
        if len(group_of(opt._groups(rctx.num_replicas_in_sync), rctx.replica_id_in_sync_group)) == 1:
            return
        self._warned = True
        warnings.warn(
            f"the gradients were changed between backward and {api} (e.g. by clip_grad_norm_, as DDP scripts "
            f"do after backward): CrossShardOptimizer reduces them in {api}, so the change acted on each "
            f"replica's own, unreduced gradients and the replicas may clip or scale differently from one "
            f"device. Call opt.synchronize() after backward and edit the reduced gradients, or build the "
            f"optimizer with overlap=True (reduced by the end of backward, as in DDP)",
            ReplicasDivergeWarning, stacklevel=3)


def _hook(ref: weakref.ref) -> Any:
    # A weak reference: a discarded optimizer's hook does nothing.
    def hook(p: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.on_grad()
    return hook


def check_owner(opt: CrossShardOptimizer, rctx: ReplicaContext) -> None:
    """One optimizer per replica: sharing one would race on the same gradients."""
    owner = (id(rctx.engine), rctx.replica_id_in_sync_group)
    if opt._owner is None or opt._owner[0] != owner[0]:
        opt._owner = owner
    elif opt._owner != owner:
        raise ValueError(
            f"this CrossShardOptimizer is stepped by replica {opt._owner[1]} and replica {owner[1]}; "
            f"every replica needs its own optimizer over its own model copy, e.g. "
            f"opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), "
            f"lr=0.1)), args=(strategy.mirror(model),))")
