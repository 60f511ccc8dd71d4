"""The optimizer layer: :class:`CrossShardOptimizer` (``optimizer.py``), the
overlapped bucketed gradient reduction it can use (``overlap.py``), the
sharded (ZeRO stage 1) update (``sharded.py``) and its part in
``torch.amp.GradScaler``'s recipe (``amp.py``).

Design. The wrapper is a real :class:`torch.optim.Optimizer` that owns no
state of its own: ``param_groups``, ``state``, ``defaults``, ``state_dict``
and friends are the wrapped optimizer's. ``step()`` first reduces every
non-None gradient over the replica group, then steps the wrapped optimizer,
so every replica applies the same update to its own copy of the parameters.

Dense gradients are fused into packs per (device, dtype): each pack is one
flat buffer (persistent, reused every step), large gradients travel as
themselves, and the whole list of buffers goes in ONE engine call (one
rendezvous of the replicas). The reduction is elementwise, so a fused
reduction is bitwise identical to reducing every gradient on its own.
Sparse gradients (``nn.Embedding(sparse=True)``) are reduced by ``cr.all_reduce``
of the sparse tensors (one gather of every replica's indices and values): the
result is coalesced, and bitwise the dense gradient's reduction (see
docs/collectives.md, "Sparse values").

Those packs are the engine's all-reduce when the strategy's cross_device_ops
is the default ``AllReduceCrossDeviceOps`` (and no ``timeout_seconds`` is
set); with other ops (``ReductionToOneDevice(accumulation_fn=f)``, a subclass)
the same packs go through ``cross_device_ops.replica_all_reduce`` at ``step()``
(``routing.py``), with the same numbers for ops that reduce in replica order.

With a closure (``step(closure)``, required by LBFGS), the closure is handed
to the wrapped optimizer wrapped so that every evaluation reduces the
gradients it computed, and the loss it returned, before the optimizer sees
them: the wrapped optimizer only ever sees global (reduced) values, so its
control flow (LBFGS's line search and stopping tests) is the same on every
replica and every replica evaluates the closure the same number of times.

Everything else is torch's: hooks registered on the wrapper
(``register_step_pre_hook``, ``register_state_dict_pre_hook``, ...) fire with
the wrapper as the optimizer, LR schedulers (ReduceLROnPlateau included)
drive it, and pickling or deep-copying keeps what torch's own optimizers keep
(the wrapped optimizer and the wrapper's settings; not hooks, caches, or a
scheduler's patch of ``step``). Global step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) see two steps,
the wrapper's and the wrapped optimizer's, as with any optimizer that steps
another (torch's ZeroRedundancyOptimizer does the same); hooks registered on
either optimizer fire once.

In a group of one replica (OneDeviceStrategy) the reduction is the identity
and no engine call is made, so training is bitwise that of plain torch.

Uneven batches. With ``reduction="mean"`` every replica's gradient counts
equally, which is the global mean when every replica saw as many rows. When
they did not (the last batch of an epoch split by ``distribute_dataset``),
pass ``weight=`` (the replica's row count, ``x.shape[0]``) to ``step`` or
``synchronize``: the result is ``sum_r w_r g_r / sum_r w_r``, which is the
exact gradient of the mean loss over the concatenated global batch when each
replica's loss is the mean over its own rows.
"""

from .optimizer import DEFAULT_BYTES_PER_PACK, CrossShardOptimizer

__all__ = ["DEFAULT_BYTES_PER_PACK", "CrossShardOptimizer"]
