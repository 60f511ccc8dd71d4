"""Layers whose training behaviour spans replicas.

:class:`SyncBatchNorm` is distributed batch norm (the seeds'
``cross_replica_average``): in training, inside a replica function, the batch
statistics are those of the whole group's batch. Each replica contributes
``[sum(x), sum(x*x), count]`` per channel and ONE all-reduce SUM over the
group gives the group's mean and E[x^2], weighted by each replica's row count
so uneven (even empty) per-replica batches are exact. The all-reduce is
differentiable (its backward is the all-reduce SUM of the output gradients),
so ``loss.backward()`` inside the replica function gives the gradients of
one-device batch norm on the concatenated batch.

In eval mode, outside a replica context, or in a group of one replica the
layer is exactly ``torch.nn.BatchNorm{1,2,3}d``.

Precision: the variance is E[x^2] - mean^2 in the input's dtype, as in the
seeds. For float32 inputs whose per-channel mean is much larger than their
spread (|mean| / std > ~100) that loses digits; normalise such inputs first.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import nn as tnn
from torch.nn import init

from .arguments import check_int
from .torch_private import BatchNormBase
from .collectives import all_reduce
from . import context
from .context import current_replica_context
from .groups import Groups, contiguous_groups, group_of, resolve_groups
from .errors import ReplicaContextError, summarize

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "replace_torch_sync_batchnorm", "compute_average_loss",
           "scale_regularization_loss"]


# What convert_sync_batchnorm carries over (absent ones are None: no affine, no running stats).
_BATCH_NORM_PARAMETERS = ("weight", "bias")
_BATCH_NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
# torch's BatchNorm takes ``bias=`` from 2.12 on; before, SyncBatchNorm drops the shift itself.
_TORCH_BATCH_NORM_BIAS = "bias" in inspect.signature(BatchNormBase.__init__).parameters


class SyncBatchNorm(BatchNormBase):
    """Batch norm over the concatenated batch of a replica group, for inputs of
    shape ``(N, C, *)``.

    Args:
        num_features, eps, momentum, affine, track_running_stats, bias: as
            ``torch.nn.BatchNorm2d`` (``bias=False``: a scale without a shift).
        group_assignment: replicas whose batches are normalised together (see
            ``cr.all_reduce``); None is every replica in sync.
        num_shards_per_group: the seeds' spelling: groups of this many
            consecutive replicas (``[[0, 1], [2, 3]]`` for 2 of 4). Exclusive
            with ``group_assignment``; ``distributed_group_size`` is its other seed spelling.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, group_assignment: Any = None,
                 num_shards_per_group: int | None = None, device: Any = None, dtype: Any = None, *,
                 bias: bool = True, distributed_group_size: int | None = None):
        check_int(num_features, "num_features", low=1, hint=" (channels)")
        if distributed_group_size is not None:
            if num_shards_per_group is not None:
                raise ValueError(f"pass either num_shards_per_group or distributed_group_size, not both; got "
                                 f"{summarize(num_shards_per_group)} and {summarize(distributed_group_size)}")
            num_shards_per_group = distributed_group_size
        if group_assignment is not None and num_shards_per_group is not None:
            raise ValueError(
                f"pass either group_assignment or num_shards_per_group, not both; got "
                f"group_assignment={summarize(group_assignment)}, "
                f"num_shards_per_group={summarize(num_shards_per_group)}")
        if num_shards_per_group is not None:
            check_int(num_shards_per_group, "num_shards_per_group", low=1, hint=" or None")
        if _TORCH_BATCH_NORM_BIAS:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                             bias=bias)
        else:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
            if not bias:
                self.register_parameter("bias", None)
        self.group_assignment = group_assignment
        self.num_shards_per_group = num_shards_per_group

    def reset_parameters(self) -> None:
        """As torch's (2.12 on), also where an older torch expects a bias."""
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, *) with at least 2 "
                             f"dimensions; got shape {list(input.shape)}")

    def _groups(self, num_replicas: int) -> Groups:
        if self.num_shards_per_group is not None:
            return contiguous_groups(num_replicas, self.num_shards_per_group)
        return resolve_groups(num_replicas, self.group_assignment)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} "
                             f"channels (shape {list(input.shape)}); dim 1 must be the channels")
        rctx = current_replica_context()
        if not self.training or rctx is None:
            return self._local(input)
        if rctx.micro_batch is not None:
            raise ValueError(
                "cr.nn.SyncBatchNorm cannot train in the layout-invariant mode: its batch statistics span the "
                "micro-batches that run at the same time, which depend on the replica count; use "
                "torch.nn.BatchNorm (statistics per micro-batch, running statistics combined invariantly)")
        groups = self._groups(rctx.num_replicas_in_sync)
        if len(group_of(groups, rctx.replica_id_in_sync_group)) == 1:
            return self._local(input)
        return self._synced(input, groups)

    def _momentum(self) -> float:
        """Counts the batch and returns the running-stats factor (as torch's BatchNorm)."""
        tracked = cast(torch.Tensor, self.num_batches_tracked)  # set whenever stats are tracked
        tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(tracked)
        return self.momentum

    def _local(self, input: torch.Tensor) -> torch.Tensor:
        """Exactly torch.nn.BatchNorm's forward."""
        return super().forward(input)

    def _synced(self, input: torch.Tensor, groups: Groups) -> torch.Tensor:
        c = self.num_features
        dims = [0] + list(range(2, input.dim()))
        count = input.numel() // c
        stats = torch.cat([input.sum(dims), (input * input).sum(dims),
                           torch.full((1,), float(count), dtype=input.dtype, device=input.device)])
        total = all_reduce(stats, "sum", groups)
        n = float(total[-1].detach().item())
        if n <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training across the replica group, got "
                f"{int(n)} (input shape on this replica {list(input.shape)})")
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            factor = self._momentum()
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.detach() * (n / (n - 1)), alpha=factor)
        shape = [1, c] + [1] * (input.dim() - 2)
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        out = (input - mean.view(shape)) * scale.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: tnn.Module, group_assignment: Any = None, *,
                               num_shards_per_group: int | None = None) -> tnn.Module:
        """``module`` with every BatchNorm layer replaced by a SyncBatchNorm, as
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does.

        Recursive; each new layer takes over the old one's parameters and buffers
        (the same tensors, so ``requires_grad``, device and dtype are kept), its
        training flag and ``qconfig``; ``affine=False``, ``bias=False`` and
        ``track_running_stats=False`` layers stay so. ``module`` itself is returned
        (its children replaced) unless it is a BatchNorm layer. Layers that already
        are SyncBatchNorm are kept as they are. ``group_assignment`` /
        ``num_shards_per_group`` go to every new layer (torch's ``process_group``).
        """
        if not isinstance(module, tnn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {summarize(module)}")
        out = module
        if isinstance(module, BatchNormBase) and not isinstance(module, cls):
            out = cls._taking_over(module, group_assignment, num_shards_per_group)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(
                child, group_assignment, num_shards_per_group=num_shards_per_group))
        return out

    @classmethod
    def _taking_over(cls, module: BatchNormBase, group_assignment: Any = None,
                     num_shards_per_group: int | None = None) -> "SyncBatchNorm":
        """A SyncBatchNorm with ``module``'s hyper-parameters, its tensors themselves (as
        torch's conversion keeps them), its training flag and ``qconfig``."""
        out = cls(module.num_features, module.eps, module.momentum, module.affine,
                  module.track_running_stats, group_assignment=group_assignment,
                  num_shards_per_group=num_shards_per_group, bias=module.bias is not None,
                  device="meta")
        for name in _BATCH_NORM_PARAMETERS:
            out.register_parameter(name, getattr(module, name))
        for name in _BATCH_NORM_BUFFERS:
            out.register_buffer(name, getattr(module, name))
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
        return out

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.num_shards_per_group is not None:
            extra += f", num_shards_per_group={self.num_shards_per_group}"
        elif self.group_assignment is not None:
            extra += f", group_assignment={self.group_assignment!r}"
        return extra


def convert_sync_batchnorm(module: tnn.Module, group_assignment: Any = None, *,
                           num_shards_per_group: int | None = None) -> tnn.Module:
    """``SyncBatchNorm.convert_sync_batchnorm``: every BatchNorm layer of ``module`` made a SyncBatchNorm."""
    return SyncBatchNorm.convert_sync_batchnorm(module, group_assignment, num_shards_per_group=num_shards_per_group)


def replace_torch_sync_batchnorm(module: tnn.Module) -> tuple[tnn.Module, list[str]]:
    """``module`` with every ``torch.nn.SyncBatchNorm`` replaced by a :class:`SyncBatchNorm`
    over every replica in sync, and the names of the replaced layers (``""``: ``module``
    itself, which is then the one object not changed in place).

    torch's layer syncs over torch.distributed's ranks, which are processes: on in-process
    replicas it normalises each replica's rows alone (no process group), and across
    processes on CPU it fails. The new layers take over the old ones' tensors and
    hyper-parameters (:meth:`SyncBatchNorm.convert_sync_batchnorm`'s rule), so the state
    dict, the parameters an optimizer holds and the numbers of whole-batch BatchNorm are
    kept; a layer shared by several parents becomes one new layer. Other layers (plain
    BatchNorm, cr's SyncBatchNorm) stay as they are.

    Raises:
        ValueError: a layer syncs over its own ``process_group``: ranks of processes are not
            replica ids, so the group cannot be carried over.
    """
    found = [(name, m) for name, m in module.named_modules(remove_duplicate=True)
             if isinstance(m, tnn.SyncBatchNorm)]
    if not found:
        return module, []
    for name, layer in found:
        if layer.process_group is not None:
            where = f"layer {name!r}" if name else "the module"
            raise ValueError(
                f"{where} is a torch.nn.SyncBatchNorm with process_group={layer.process_group!r}; torch.distributed's "
                f"ranks are processes, not crossreplica's replicas, so that group cannot be carried over. Convert it "
                f"before strategy.mirror with cr.nn.convert_sync_batchnorm(model, group_assignment=...), which "
                f"takes replica ids ([[0, 1], [2, 3]])")
    new = {id(layer): SyncBatchNorm._taking_over(layer) for _, layer in found}
    if id(module) in new:
        return new[id(module)], [""]
    places = [name for name, m in module.named_modules(remove_duplicate=False) if id(m) in new]
    for name in places:  # every place of a shared layer, which named_children would give once
        parent, _, child = name.rpartition(".")
        module.get_submodule(parent).add_module(child, new[id(module.get_submodule(name))])
    return module, [name for name, _ in found]


# ------------------------------------------------------------------ TF's loss scaling (tf.nn)


def _replicas_in_sync(api: str) -> int:
    """``num_replicas_in_sync`` of the replica (or of the default strategy outside any);
    in cross-replica context a ReplicaContextError, as TF's RuntimeError."""
    if context.in_cross_replica_context():
        raise ReplicaContextError(
            f"cr.nn.{api} was called in cross-replica context (strategy.scope() or merge_fn); call it "
            f"inside the replica function that strategy.run runs")
    return context.get_strategy().num_replicas_in_sync


def compute_average_loss(per_example_loss: torch.Tensor, sample_weight: Any = None,
                         global_batch_size: Any = None) -> torch.Tensor:
    """TF's ``tf.nn.compute_average_loss``: ``sum(per_example_loss * sample_weight) /
    global_batch_size``, so that summing every replica's result (what a MEAN-reducing
    optimizer's gradient is) gives the mean over the global batch.

    Args:
        per_example_loss: a floating tensor of rank >= 1, one row per example.
        sample_weight: None, a number or a tensor broadcastable to ``per_example_loss``
            (a trailing or missing size-1 dimension is squeezed or added, as in TF).
        global_batch_size: a positive integer; None is this replica's rows times
            ``num_replicas_in_sync`` (exact only when every replica has as many rows).

    Raises:
        TypeError: ``per_example_loss`` is not a floating tensor.
        ValueError: a rank-0 ``per_example_loss``, shapes that do not broadcast, or a
            ``global_batch_size`` that is not a positive integer.
        ReplicaContextError: called in cross-replica context without ``global_batch_size``.
    """
    if not isinstance(per_example_loss, torch.Tensor) or not per_example_loss.is_floating_point():
        raise TypeError(f"per_example_loss must be a floating-point tensor with one entry per example; got "
                        f"{summarize(per_example_loss)}")
    if per_example_loss.dim() < 1:
        raise ValueError(
            f"per_example_loss must have rank >= 1 (one entry per example); got a scalar "
            f"{summarize(per_example_loss)}: compute the loss with reduction='none'")
    loss = per_example_loss
    if sample_weight is not None:
        loss = loss * _broadcast_weight(sample_weight, loss)
    if global_batch_size is None:
        n = _replicas_in_sync("compute_average_loss")
        rctx = context.current_replica_context()
        if rctx is not None and rctx.micro_batch is not None:
            raise ValueError("cr.nn.compute_average_loss needs global_batch_size in the layout-invariant mode: "
                             "the rows of a micro-batch times the replica count are not the global batch")
        global_batch_size = per_example_loss.shape[0] * n
        if global_batch_size == 0:
            raise ValueError("cr.nn.compute_average_loss got an empty per_example_loss, so the global batch size "
                             "cannot be inferred; pass global_batch_size=")
    size = _check_batch_size(global_batch_size)
    return (loss.sum() / size).to(per_example_loss.dtype)


def _check_batch_size(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_floating_point() or value.is_complex() or value.dtype is torch.bool:
            raise ValueError(f"global_batch_size must be an integer (a scalar integer tensor or an int); got "
                             f"{summarize(value)}")
        if int(value) <= 0:
            raise ValueError(f"global_batch_size must be positive; got {int(value)}")
        return value
    return check_int(value, "global_batch_size", low=1, hint=" (the number of examples in the global batch)")


def _broadcast_weight(sample_weight: Any, loss: torch.Tensor) -> torch.Tensor:
    """``sample_weight`` as a tensor broadcastable to ``loss`` (TF's squeeze_or_expand_dimensions)."""
    w = torch.as_tensor(sample_weight, device=loss.device)
    if not (w.is_floating_point() or w.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise TypeError(f"sample_weight must hold real numbers; got {summarize(sample_weight)}")
    if w.dim() == loss.dim() + 1 and w.shape[-1] == 1:
        w = w.squeeze(-1)
    elif w.dim() == loss.dim() - 1 and w.dim() > 0:
        w = w.unsqueeze(-1)
    try:
        torch.broadcast_shapes(w.shape, loss.shape)
    except RuntimeError:
        raise ValueError(f"sample_weight of shape {list(w.shape)} does not broadcast to per_example_loss of "
                         f"shape {list(loss.shape)}") from None
    return w


def scale_regularization_loss(regularization_loss: Any) -> torch.Tensor:
    """TF's ``tf.nn.scale_regularization_loss``: ``sum(regularization_loss) /
    num_replicas_in_sync``, so the replicas' summed gradients count it once.

    Args:
        regularization_loss: a floating tensor (summed), a number, or a list of them.

    Raises:
        TypeError: anything else. ReplicaContextError: called in cross-replica context.
    """
    if isinstance(regularization_loss, (list, tuple)):
        if not regularization_loss:
            raise ValueError("regularization_loss is an empty list; pass a tensor or a list of tensors")
        parts = [_as_loss(v, f"regularization_loss[{i}]") for i, v in enumerate(regularization_loss)]
        total = torch.stack([p.sum() for p in parts]).sum()
    else:
        total = _as_loss(regularization_loss, "regularization_loss").sum()
    return total / _replicas_in_sync("scale_regularization_loss")


def _as_loss(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    raise TypeError(f"{name} must be a floating-point tensor or a number; got {summarize(value)}")
