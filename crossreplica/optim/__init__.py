"""The optimizer: :class:`CrossShardOptimizer` (``optimizer.py``), the overlapped
bucketed gradient reduction it can use (``overlap.py``), the sharded (ZeRO
stage 1) update (``sharded.py``) and its part in ``torch.amp.GradScaler``'s
recipe (``amp.py``). User guide: docs/optimizers.md.

Design. The wrapper is a real :class:`torch.optim.Optimizer` that owns no
state of its own: ``param_groups``, ``state``, ``defaults``, ``state_dict``
and friends are the wrapped optimizer's. ``step()`` first reduces every
non-None gradient over the replica group, then steps the wrapped optimizer,
so every replica applies the same update to its own copy of the parameters.

Dense gradients are fused into packs per (device, dtype) (persistent flat
buffers; large gradients travel as themselves), and the whole list goes in ONE
engine call. The reduction is elementwise, so a fused reduction is bitwise
identical to reducing every gradient on its own. Sparse gradients are reduced
by ``cr.all_reduce`` of the sparse tensors (coalesced, bitwise the dense
gradient's reduction). With cross-device ops other than the exact default, the
same packs go through the ops (``routing.py``).

With a closure (``step(closure)``, LBFGS), every evaluation reduces the
gradients and the loss it computed before the wrapped optimizer sees them, so
its control flow is the same on every replica. Hooks, LR schedulers, pickling
and copies behave as for torch's own optimizers. In a group of one replica the
reduction is the identity (no engine call): training is bitwise plain torch.

Uneven batches: with ``reduction="mean"`` pass ``weight=`` (the replica's row
count) to ``step`` or ``synchronize``; the result ``sum_r w_r g_r / sum_r w_r``
is the exact gradient of the mean loss over the concatenated global batch when
each replica's loss is the mean over its own rows.
"""

from .optimizer import DEFAULT_BYTES_PER_PACK, CrossShardOptimizer

__all__ = ["DEFAULT_BYTES_PER_PACK", "CrossShardOptimizer"]
