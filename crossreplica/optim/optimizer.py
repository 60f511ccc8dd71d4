"""CrossShardOptimizer: keeps replicas in sync by reducing gradients before each step
(the design is described in the package docstring, :mod:`crossreplica.optim`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any
from collections.abc import Callable, Iterator

import torch

from .. import torch_private as tp
from ..arguments import check_int
from ..context import ReplicaContext, get_strategy, has_strategy, require_replica_context
from ..cross_device_ops import CommunicationOptions
from ..errors import summarize
from ..groups import Groups, group_of, resolve_groups
from ..packing import DEFAULT_BYTES_PER_PACK, PackedBuffers
from ..reduce_op import ReduceOp, canonical_compression
from . import invariant
from .amp import reduce_before_scaler, unscale_or_skip
from .guards import GradientEdits, check_owner, exempt
from .arguments import (
    canonical_name,
    canonical_reduction,
    canonical_weight,
    loss_to_buffer,
    own_state,
    reduced_loss,
)
from .overlap import OverlappedReduction
from .routing import all_reduce_buffers, reduce_sparse_grads
from .sharded import ShardedUpdate

__all__ = ["DEFAULT_BYTES_PER_PACK", "CrossShardOptimizer"]

#: Gradients at least this large are not copied into a pack: they travel as
#: their own buffer in the same engine call (packing pays for small tensors).
ALONE_BYTES = 256 * 1024


class _BackwardPasses:
    """Counts the backward passes since the last reduction, for ``backward_passes_per_step=k``
    (nothing to count for k = 1). With overlapped buckets, a pass before the k-th runs under
    their ``no_sync``, entered at its first gradient and left at its end."""

    def __init__(self, params: list[torch.Tensor], per_step: int):
        self.per_step = per_step
        self.count = 0
        self.overlapped: OverlappedReduction | None = None
        self._in_backward = False
        self._deferring: contextlib.AbstractContextManager[None] | None = None
        if per_step > 1:
            ref = weakref.ref(self)
            handles = [p.register_post_accumulate_grad_hook(_count_pass(ref)) for p in params]
            weakref.finalize(self, lambda: [h.remove() for h in handles])

    def reset(self) -> None:
        """A reduction (or zero_grad): counting starts again. Also ends a pass whose end never
        came (a backward that raised skips its end-of-backward callback)."""
        self.count = 0
        self._end()

    def on_grad(self) -> None:
        if self._in_backward:
            return
        if self.count >= self.per_step:
            raise RuntimeError(
                f"backward pass {self.count + 1} since the last step(): this CrossShardOptimizer was built with "
                f"backward_passes_per_step={self.per_step}, so step() (or synchronize()) comes after every "
                f"{self.per_step} backward passes; call it, or raise backward_passes_per_step (as Horovod)")
        self.count += 1
        self._in_backward = True
        tp.queue_autograd_callback(self._end)
        if self.overlapped is not None and self.count < self.per_step:
            self._deferring = self.overlapped.no_sync()
            self._deferring.__enter__()

    def _end(self) -> None:
        self._in_backward = False
        deferring, self._deferring = self._deferring, None
        if deferring is not None:
            deferring.__exit__(None, None, None)


def _count_pass(ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    # A weak reference: a discarded optimizer's hooks do nothing.
    def hook(p: torch.Tensor) -> None:
        passes = ref()
        if passes is not None:
            passes.on_grad()
    return hook


class CrossShardOptimizer(torch.optim.Optimizer):
    """An optimizer that reduces gradients across replicas, then steps ``optimizer``.

    Args:
        optimizer: the torch optimizer over this replica's parameters.
        reduction: ``"mean"`` (default) or ``"sum"`` of the gradients over the group (or TF's
            ``losses.Reduction.MEAN`` / ``SUM``: "weighted_mean" / "weighted_sum").
        name: a name, as TF's third positional argument (default "CrossShardOptimizer").
        group_assignment: replicas that reduce together (see ``cr.all_reduce``);
            None is every replica in sync.
        bytes_per_pack: the most bytes fused into one flat buffer per
            (device, dtype); gradients larger than this, or than 256 KiB,
            travel as their own buffer (no copy), still in the same engine call.
            With ``overlap=True``: the most bytes of one bucket.
        overlap: reduce buckets of gradients during backward, as soon as every
            gradient of a bucket is final (``overlap.py``); ``step()`` then
            reduces only what is left. Use :meth:`no_sync` to accumulate
            several backward passes. ``step(weight=...)`` is not available
            (the gradients are reduced before it is known).
        shard_optimizer_state: ZeRO stage 1 (``sharded.py``): reduce-scatter the
            gradients, update only this replica's shard of the parameters and
            optimizer state, all-gather the parameters. Elementwise optimizers
            only; no closure, no ``weight``, no sparse gradients. With
            ``overlap=True`` the buckets are all-reduced during backward and
            the update takes this replica's slice of them; between replica
            threads of one process, the shard optimizer then steps views of
            the replica's own parameters and copies the others' slices.
        communication_options: a ``cr.CommunicationOptions``; a non-zero
            ``bytes_per_pack`` replaces the argument of that name; ``timeout_seconds``
            bounds each reduction (through the strategy's cross_device_ops, ``routing.py``).
        compression: None, ``torch.bfloat16`` or ``torch.float16`` (Horovod's ``Compression.fp16``,
            DDP's ``bf16_compress_hook``): floating-point gradients wider than that dtype cross
            the wire in it, each addition of the reduction rounded to it, and come back in
            their own dtype (docs/optimizers.md, "Compression": what it does to the bits).
            The closure's loss, the weights and sparse gradients travel as they are. Or
            ``communication_options.compression``. Not with ``shard_optimizer_state`` nor
            in the layout-invariant mode.
        backward_passes_per_step: Horovod's argument: ``step()`` comes after this many
            backward passes, whose gradients accumulate locally and are reduced once.
            With ``overlap=True`` every backward pass but the k-th since the last
            reduction runs as under :meth:`no_sync`; without overlap nothing is reduced
            before ``step()`` anyway. Either way a backward pass beyond the k-th before
            ``step()``, ``synchronize()`` or ``zero_grad()`` is an error, as in Horovod.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: ``reduction`` is not mean/sum, or ``bytes_per_pack`` or
            ``backward_passes_per_step`` is not a positive int, or ``compression`` is another
            dtype than bfloat16 / float16 (a TypeError when it is no dtype).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, reduction: ReduceOp | str = "mean",
                 name: str | None = None, group_assignment: Any = None,
                 bytes_per_pack: int = DEFAULT_BYTES_PER_PACK, *,
                 overlap: bool = False, shard_optimizer_state: bool = False,
                 communication_options: CommunicationOptions | None = None, backward_passes_per_step: int = 1,
                 compression: torch.dtype | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer (e.g. torch.optim.SGD(model.parameters(), "
                f"lr=0.1)); got {type(optimizer).__name__}: {summarize(optimizer)}")
        if isinstance(optimizer, CrossShardOptimizer):
            raise ValueError(
                "optimizer is already a cr.CrossShardOptimizer; wrapping it again would reduce every "
                "gradient twice")
        if communication_options is not None:
            if not isinstance(communication_options, CommunicationOptions):
                raise TypeError(f"communication_options must be a cr.CommunicationOptions; got "
                                f"{type(communication_options).__name__}: {summarize(communication_options)}")
            bytes_per_pack = communication_options.bytes_per_pack or bytes_per_pack
        compression = canonical_compression(compression)
        if communication_options is not None and communication_options.compression is not None:
            if compression is not None and compression != communication_options.compression:
                raise ValueError(
                    f"compression={compression} and communication_options.compression="
                    f"{communication_options.compression} disagree; pass one of them")
            compression = communication_options.compression
        if compression is not None and shard_optimizer_state:
            raise ValueError(
                f"compression={compression} is not supported with shard_optimizer_state=True (the sharded update "
                f"reduce-scatters the gradients in their own dtype); leave one of them out")
        for flag_name, flag in (("overlap", overlap), ("shard_optimizer_state", shard_optimizer_state)):
            if not isinstance(flag, bool):
                raise TypeError(f"{flag_name} must be True or False; got {summarize(flag)}")
        check_int(bytes_per_pack, "bytes_per_pack", low=1, hint=" (bytes)")
        check_int(backward_passes_per_step, "backward_passes_per_step", low=1,
                  hint=" (the backward passes accumulated locally before each step())")
        self._optimizer = optimizer
        self._reduction = canonical_reduction(reduction)
        self.name = canonical_name(name)  # TF's name (None: "CrossShardOptimizer")
        self._group_assignment = group_assignment
        self._bytes_per_pack = bytes_per_pack
        self._overlap = overlap
        self._communication_options = communication_options
        self._backward_passes_per_step = int(backward_passes_per_step)
        self._compression = compression
        self._sharded = ShardedUpdate(optimizer) if shard_optimizer_state else None
        self._groups_cache: tuple[int, Groups] | None = None
        self._pack_cache: tuple[tuple, PackedBuffers] | None = None
        self._owner: tuple[int, int] | None = None
        self._reset_runtime_state()
        if group_assignment is not None and has_strategy():
            self._groups(get_strategy().num_replicas_in_sync)  # a bad assignment fails here, not at step

    # ------------------------------------------------------------ delegation

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def reduction(self) -> ReduceOp:
        return self._reduction

    @property
    def shards_state(self) -> bool:
        """Whether each replica keeps only its shard of the optimizer state (``shard_optimizer_state``)."""
        return self._sharded is not None

    @property
    def bytes_per_pack(self) -> int:
        return self._bytes_per_pack

    @property
    def compression(self) -> torch.dtype | None:
        """The dtype gradients cross the wire in (None: their own; ``compression=``)."""
        return self._compression

    @property
    def backward_passes_per_step(self) -> int:
        """The backward passes accumulated locally before each ``step()`` (Horovod's argument)."""
        return self._backward_passes_per_step

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (the wrapper's state-dict hooks run around it).
        Sharded, a collective that gathers the full state (the unsharded format)."""
        for pre_hook in tp.optimizer_hooks(self, "state_dict_pre"):
            pre_hook(self)
        if self._sharded is not None:
            rctx = require_replica_context("CrossShardOptimizer.state_dict (shard_optimizer_state=True)")
            state_dict = self._sharded.state_dict(rctx, self._groups(rctx.num_replicas_in_sync))
        else:
            state_dict = self._optimizer.state_dict()
        for post_hook in tp.optimizer_hooks(self, "state_dict_post"):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads into the wrapped optimizer (the wrapper's load hooks run around it). The state
        tensors are copied: torch keeps a loaded tensor of the right dtype and device, so one
        dict loaded into every in-process replica (DDP's resume idiom) would be shared."""
        state_dict = own_state(state_dict)  # a copy, as torch makes: a pre hook may edit it
        for pre_hook in tp.optimizer_hooks(self, "load_state_dict_pre"):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if self._sharded is not None:
            self._sharded.load_state_dict(state_dict)
        else:
            self._optimizer.load_state_dict(state_dict)
        for post_hook in tp.optimizer_hooks(self, "load_state_dict_post"):
            post_hook(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group to the wrapped optimizer."""
        self._optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients (and forgets an earlier :meth:`synchronize`)."""
        self._synchronized = False
        self._sync_called = False
        self._passes.reset()
        self._edits.forget()
        if self._overlapped is not None:
            self._overlapped.reset()
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # What a copy keeps, as torch's optimizers keep only defaults/state/param_groups:
    # hooks (often local functions), caches, the owning replica and an LR scheduler's
    # instance patch of ``step`` stay behind.
    _PICKLED = ("_optimizer", "_reduction", "name", "_group_assignment", "_bytes_per_pack", "_overlap", "_sharded",
                "_communication_options", "_backward_passes_per_step", "_compression")

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in self._PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_overlap", False)
        state.setdefault("_sharded", None)
        state.setdefault("name", canonical_name(None))
        state.setdefault("_communication_options", None)
        state.setdefault("_backward_passes_per_step", 1)
        state.setdefault("_compression", None)
        self.__dict__.update(state)
        self._reset_runtime_state()

    def forget_engine(self) -> None:
        """Drops what this optimizer holds of the engine it last ran on: cached groups
        and packs, its owner, and the overlapped buckets' work and shared buffers. For a
        job that replaced its engine (``cr.FaultTolerance`` after a lost worker)."""
        self._forget_caches()
        self._edits.forget()
        self._passes.reset()
        if self._overlapped is not None:
            self._overlapped.forget_engine()

    def _forget_caches(self) -> None:
        self._groups_cache = None
        self._pack_cache = None
        self._synchronized = False
        self._sync_called = False  # synchronize() ran since the last step() (skip_synchronize's check)
        self._owner = None

    def _reset_runtime_state(self) -> None:
        self._forget_caches()
        self._skipping = False
        for stepped in (self, self._optimizer, self._sharded and self._sharded.inner):
            if stepped:  # the plain-optimizer guard leaves them alone: this wrapper reduces
                exempt(stepped)
        params = list({id(p): p for g in self._optimizer.param_groups for p in g["params"]
                       if p.requires_grad}.values())
        # Before the overlapped buckets' hooks: a backward pass that must not reduce enters
        # no_sync at its first gradient, before the buckets count that gradient.
        self._passes = _BackwardPasses(params, self._backward_passes_per_step)
        self._overlapped: OverlappedReduction | None = None
        if self._overlap:
            self._overlapped = OverlappedReduction(params, self._bytes_per_pack, self._reduction, self._groups,
                                                   self._communication_options, self._compression)
        # Gradients edited before step() reduces them (the DDP clipping idiom) are a warning;
        # with overlap they are reduced by the end of backward.
        self._edits = GradientEdits([] if self._overlap else params)
        self._passes.overlapped = self._overlapped
        # What torch.optim.Optimizer.__init__ sets up for hooks; the parameters
        # themselves stay with the wrapped optimizer.
        tp.init_optimizer_hooks(self)

    def __repr__(self) -> str:
        passes = (f", backward_passes_per_step={self._backward_passes_per_step}"
                  if self._backward_passes_per_step > 1 else "")
        if self._compression is not None:
            passes += f", compression={self._compression}"
        return (f"CrossShardOptimizer({self._optimizer!r}, reduction={self._reduction}, "
                f"group_assignment={self._group_assignment!r}, bytes_per_pack={self._bytes_per_pack}{passes})")

    # ------------------------------------------------------------ stepping

    #: True; torch.amp.GradScaler.step reads it first, and reading it reduces the gradients (amp.py).
    _step_supports_amp_scaling = property(reduce_before_scaler)

    def step(self, closure: Callable[[], Any] | None = None, *, weight: Any = None) -> Any:  # type: ignore[override]
        """Reduces the gradients over the group (unless :meth:`synchronize` already
        did) and steps the wrapped optimizer.

        Args:
            closure: re-evaluates the model on this replica's batch, calls
                ``backward`` and returns the loss. It is passed on to the wrapped
                optimizer, which may call it several times (LBFGS); after every
                call the gradients and the returned loss are reduced over the
                group, so the wrapped optimizer (and the caller) get the global
                loss.
            weight: this replica's weight in the mean, usually its row count;
                see the module docstring. Only with ``reduction="mean"``.

        Returns:
            What the wrapped optimizer's ``step`` returns: with a closure, the
            reduced loss.

        Raises:
            cr.ReplicaContextError: called outside a replica function.
            RuntimeError: inside :meth:`skip_synchronize` without a :meth:`synchronize`
                since the last step.
        """
        rctx = require_replica_context("CrossShardOptimizer.step")
        synchronized_since_step, self._sync_called = self._sync_called, False
        self._passes.reset()
        if self._skipping:
            self._check_skip(synchronized_since_step, closure, weight)
        if not self._synchronized:
            self._edits.check("step()", self, rctx)
        if rctx.micro_batch is not None:
            self._check_invariant()
            return invariant.invariant_step(self, rctx.micro_batch, closure, weight)
        if not unscale_or_skip(self, closure, weight):
            return None  # GradScaler found an inf in the reduced gradients: the whole group skips
        if self._sharded is not None:
            groups = self._groups(rctx.num_replicas_in_sync)
            if closure is not None or weight is not None:
                raise ValueError("shard_optimizer_state=True supports neither a closure nor weight=")
            if len(group_of(groups, rctx.replica_id_in_sync_group)) > 1:
                check_owner(self, rctx)
                overlapped = self._overlapped is not None
                if overlapped and not self._synchronized:  # what the buckets left
                    self._reduce_gradients(None)
                self._sharded.step(rctx, groups, self._reduction, reduced=self._synchronized or overlapped,
                                   in_place=overlapped)
                self._synchronized = False
                return None
        if closure is not None:
            # The closure recomputes the gradients, so an earlier synchronize() is moot.
            self._synchronized = False
            return self._optimizer.step(self._reducing_closure(closure, weight))
        if not self._synchronized:
            self._reduce_gradients(weight)
        self._synchronized = False
        return self._optimizer.step()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's context for a ``step()`` that must not reduce again: ``opt.synchronize();
        (unscale, clip); with opt.skip_synchronize(): opt.step()`` (or ``scaler.step(opt)``).

        A ``step()`` after :meth:`synchronize` never reduces again, with or without this
        context; inside it, a step whose gradients no :meth:`synchronize` reduced since the
        last ``step()`` or ``zero_grad()`` is a RuntimeError (it would step each replica on
        its own gradients), as are ``step(closure)`` and ``step(weight=...)``."""
        saved, self._skipping = self._skipping, True
        try:
            yield
        finally:
            self._skipping = saved

    def _check_skip(self, synchronized: bool, closure: Any = None, weight: Any = None) -> None:
        """Raises when a step inside :meth:`skip_synchronize` would not use reduced gradients."""
        if closure is not None:
            raise ValueError(
                "step(closure) inside opt.skip_synchronize(): the closure computes new gradients, which must "
                "be reduced; call opt.step(closure) outside skip_synchronize()")
        if weight is not None:
            raise ValueError(
                f"step(weight={summarize(weight)}) inside opt.skip_synchronize() comes after the reduction; pass "
                f"the weight to opt.synchronize(weight=...)")
        if not synchronized:
            raise RuntimeError(
                "opt.step() inside opt.skip_synchronize() without opt.synchronize() since the last step() or "
                "zero_grad(): the gradients are this replica's own, unreduced ones, and each replica would step "
                "on its own. Call opt.synchronize() after backward (Horovod's order: synchronize(); unscale_ / "
                "clip; with opt.skip_synchronize(): step()), or step outside skip_synchronize()")

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """A context in which backward passes accumulate gradients without reducing
        them (``overlap=True``; as DDP's ``no_sync``): the first backward after it
        reduces the sums. Without overlap nothing is reduced before ``step()``
        anyway, so it changes nothing."""
        if self._overlapped is None:
            return contextlib.nullcontext()
        return self._overlapped.no_sync()

    def _reducing_closure(self, closure: Callable[[], Any], weight: Any) -> Callable[[], Any]:
        def reduced() -> Any:
            with torch.enable_grad():
                loss = closure()
            self._passes.reset()
            return self._reduce_gradients(weight, loss=loss)
        return reduced

    def synchronize(self, *, weight: Any = None) -> None:
        """Reduces the gradients in place without stepping (clip them after this).

        The next :meth:`step` then steps without reducing again.
        """
        rctx = require_replica_context("CrossShardOptimizer.synchronize")
        self._edits.check("synchronize()", self, rctx)
        self._sync_called = True
        self._passes.reset()
        if rctx.micro_batch is not None:
            self._check_invariant()
            # Folds this micro-batch; the gradients are the step's only in the replica's last one.
            self._synchronized = invariant.synchronize(self, rctx.micro_batch, weight)
            return
        if self._synchronized:
            raise RuntimeError(
                "CrossShardOptimizer.synchronize was called twice without step() or zero_grad() in "
                "between; the gradients are already reduced")
        self._reduce_gradients(weight)
        self._synchronized = True

    def _check_invariant(self) -> None:
        """The layout-invariant mode refuses compression: its fixed tree sums the micro-batches'
        gradients in float32 on every layout, and a narrow wire would round them per layout."""
        if self._compression is not None:
            raise ValueError(
                f"CrossShardOptimizer(compression={self._compression}) cannot take a layout-invariant step: the "
                f"mode promises the same bits on every layout, and a compressed reduction rounds its partial sums "
                f"where each layout adds them; leave compression out (or the strategy's layout_invariant)")

    def _groups(self, num_replicas: int) -> Groups:
        cached = self._groups_cache
        if cached is not None and cached[0] == num_replicas:
            return cached[1]
        groups = resolve_groups(num_replicas, self._group_assignment)
        self._groups_cache = (num_replicas, groups)
        return groups

    def _collect(self) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple]:
        """(dense grads, params with sparse grads, the layout key of the dense grads)."""
        seen: set[int] = set()
        reduced = self._overlapped.reduced if self._overlapped is not None else ()
        dense, sparse, key = [], [], []
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or id(p) in seen or id(p) in reduced:
                    continue
                seen.add(id(p))
                if g.is_sparse:
                    sparse.append(p)
                else:
                    dense.append(g)
                    key.append((id(p), g.shape, g.dtype, g.device))
        return dense, sparse, tuple(key)

    def _packed(self, grads: list[torch.Tensor], key: tuple) -> PackedBuffers:
        cached = self._pack_cache
        if cached is None or cached[0] != key:
            cached = (key, PackedBuffers(grads, self._bytes_per_pack,
                                         min(ALONE_BYTES, self._bytes_per_pack)))
            self._pack_cache = cached
        return cached[1]

    def _reduce_gradients(self, weight: Any, loss: Any = None) -> Any:
        """Reduces the gradients in place; returns ``loss`` reduced the same way.

        A loss that is not a one-element tensor or a real number is returned as is.
        """
        rctx = require_replica_context("CrossShardOptimizer.step")
        check_owner(self, rctx)
        overlapped = self._overlapped
        if overlapped is not None:
            overlapped.finish()  # waits for what is still in flight
            if weight is not None and overlapped.reduced:
                raise ValueError(
                    f"weight={summarize(weight)} cannot apply: with overlap=True the gradients were already "
                    f"reduced during backward; use overlap=False for uneven batches")
        try:
            return self._reduce_rest(rctx, weight, loss)
        finally:
            self._edits.forget()  # reduced in place: not an edit (a closure's backward recorded them)
            if overlapped is not None:
                overlapped.reduced.clear()

    def _reduce_rest(self, rctx: ReplicaContext, weight: Any, loss: Any) -> Any:
        """The fused reduction of every gradient the overlapped buckets did not reduce."""
        rid = rctx.replica_id_in_sync_group
        groups = self._groups(rctx.num_replicas_in_sync)
        group_size = len(group_of(groups, rid))
        weighted = weight is not None
        if weighted:
            if self._reduction is not ReduceOp.MEAN:
                raise ValueError(
                    f"weight={summarize(weight)} is only used with reduction='mean'; this optimizer sums "
                    f"(reduction='sum'), so leave weight out")
            w = canonical_weight(weight)
        if group_size == 1:
            # Reducing over a group of one is the identity: no engine call, and the
            # gradients stay bitwise those of plain torch (no multiply by w, divide by w).
            if weighted and w <= 0:
                raise ValueError(
                    f"the weights of the replicas in this group sum to {w}; at least one replica must "
                    f"pass weight > 0 (its row count)")
            return loss
        grads, sparse, key = self._collect()
        loss_buffer = loss_to_buffer(loss, rctx.device)
        if not grads and not sparse and loss_buffer is None:
            return loss
        total_weight = None
        if grads or weighted or loss_buffer is not None:
            packed = self._packed(grads, key) if grads else None
            buffers = packed.pack(grads) if packed is not None else []
            if loss_buffer is not None:
                buffers.append(loss_buffer)
            if weighted:
                # 0 * nan is nan: a replica without rows contributes exact zeros.
                for i, buf in enumerate(buffers):
                    own = packed is not None and i < len(packed.buffers) and packed.buffers[i] is not None
                    if w > 0:
                        buffers[i] = buf.mul_(w) if own else buf * w
                    else:
                        buffers[i] = buf.zero_() if own else torch.zeros_like(buf)
                buffers.append(torch.tensor([w], dtype=torch.float64, device=rctx.device))
            # An unweighted mean lets the engine divide while each block is hot in cache; that
            # is the same sum-then-divide, so bitwise the result of cr.all_reduce(g, "mean").
            op = ReduceOp.MEAN if self._reduction is ReduceOp.MEAN and not weighted else ReduceOp.SUM
            # In place: the packs and large gradients are this replica's own buffers.
            outs = all_reduce_buffers(rctx, groups, op, buffers, self._communication_options, self._compression,
                                      len(packed.buffers) if packed is not None else 0)
            if weighted:
                total_weight = float(outs[-1].item())
                outs = outs[:-1]
                if total_weight <= 0:
                    raise ValueError(
                        f"the weights of the replicas in this group sum to {total_weight}; at least one "
                        f"replica must pass weight > 0 (its row count)")
                for out in outs:
                    out.div_(total_weight)
            if loss_buffer is not None:
                loss = reduced_loss(loss, outs[-1])
                outs = outs[:-1]
            if packed is not None:
                packed.unpack_(outs, grads)
        if sparse:
            reduce_sparse_grads(groups, sparse, w if weighted else None,
                                total_weight if weighted else
                                (group_size if self._reduction is ReduceOp.MEAN else None))
        return loss
