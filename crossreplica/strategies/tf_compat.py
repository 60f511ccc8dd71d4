"""The rest of tf.distribute's strategy surface, for code ported from TF.

What TF code calls on a strategy and its ``extended`` beyond ``run`` /
``reduce`` / ``gather``, with TF's meaning, on every strategy, so the same
code runs on one device, on threads and across workers:

* ``strategy.experimental_run_v2``: ``run`` under its TF 2.0/2.1 name.
* The worker vocabulary of ``strategy.extended``: ``worker_rank``,
  ``num_workers``, ``is_chief``, ``should_checkpoint``, ``should_save_summary``,
  ``num_hosts``, ``num_replicas_per_host``, ``experimental_should_init``. A
  *host* is TPUStrategy's input host: a process that feeds its local replicas,
  here one worker; one process is one worker (rank 0 of 1).
* Non-slot updates: ``parameter_devices``, ``non_slot_devices(var_list)`` and
  ``update_non_slot(colocate_with, fn, ...)``, which runs ``fn`` once per device
  in an *update context* (TF's ``UpdateContext``): a ``cr.Variable`` read or
  updated there is its copy of that device only, so ``v.assign_add(1)`` adds 1
  to every copy once.
* ``broadcast_to``: Python numbers pass through unconverted (TF delays their
  dtype, so ``step.assign_add(1)`` fits an int64 counter); tensors become one
  distinct copy per destination value, never shared between replicas.
* ``check_gather_shapes``: ``strategy.gather`` names the shapes that do not fit,
  across workers too.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import context
from ..cross_device_ops import get_devices_from
from ..devices import canonical_device
from ..errors import ReplicaContextError, summarize
from ..values import DistributedValues, Mirrored
from ..variables import Variable
from .updates import check_update, update_each

if TYPE_CHECKING:
    from ..cross_device_ops import CrossDeviceOps
    from .extended import StrategyExtended

__all__ = ["TFCompatExtended", "TFCompatMethods", "broadcast_to", "check_gather_shapes"]


class TFCompatMethods:
    """The strategy side."""

    def experimental_run_v2(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                            kwargs: dict | None = None) -> Any:
        """``run`` under its TF 2.0 / 2.1 name (TF's ``experimental_run_v2``)."""
        return self.run(fn, args, kwargs)  # type: ignore[attr-defined]

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """``distribute_dataset`` under TF's name: each global batch split along dim 0, one
        part per replica. ``options`` (TF's ``tf.distribute.InputOptions``) has no
        counterpart here: only None is accepted."""
        if options is not None:
            raise ValueError(
                f"options has no crossreplica counterpart (TF's tf.distribute.InputOptions); pass None, "
                f"got {summarize(options)}")
        return self.distribute_dataset(dataset)  # type: ignore[attr-defined]


class TFCompatExtended:
    """The ``strategy.extended`` side: TF's names for worker facts, and non-slot updates."""

    if TYPE_CHECKING:  # StrategyExtended's (and LogicalDeviceExtended's) properties
        @property
        def worker_devices(self) -> tuple[torch.device, ...]: ...

        @property
        def num_workers(self) -> int: ...

        @property
        def is_chief(self) -> bool: ...

    # ------------------------------------------------------------ workers

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoints of its own (TF: the chief). ``cr.save``
        is called on every worker and writes on the chief by itself."""
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker writes summaries (TF: the chief)."""
        return self.is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether to run initializers here: always (every worker builds its state)."""
        return True

    @property
    def num_hosts(self) -> int:
        """Input hosts (TPUStrategy's): processes that feed their local replicas, one per worker."""
        return self.num_workers

    @property
    def num_replicas_per_host(self) -> int:
        """Replicas each host (worker process) feeds: its local replicas."""
        return len(self.worker_devices)

    # ------------------------------------------------------------ non-slot variables

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        """The devices variables are placed on: every local replica's device."""
        return tuple(self.worker_devices)

    def non_slot_devices(self, var_list: Any) -> tuple[torch.device, ...]:
        """Where non-slot variables (a step counter, Adam's beta powers) live: mirrored on
        every local replica's device, as in TF's MirroredStrategy; pass the result to
        ``update_non_slot``. ``var_list`` is accepted for TF's signature."""
        if var_list is not None and (isinstance(var_list, (str, bytes)) or not isinstance(var_list, Sequence)):
            raise TypeError(f"var_list must be a list of variables (or None); got {summarize(var_list)}")
        return tuple(self.worker_devices)

    def update_non_slot(self, colocate_with: Any, fn: Callable[..., Any], args: Sequence[Any] = (),
                        kwargs: dict | None = None, group: bool = True) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per device of ``colocate_with`` (from
        ``non_slot_devices``), in cross-replica context, under ``torch.no_grad()``, with
        that device as the default device and in an update context: a ``cr.Variable``
        read or updated in ``fn`` is its copy ``i`` for the ``i``-th device (TF's
        UpdateContext). Mirrored ``args``/``kwargs`` give device ``i`` their ``i``-th value.

        Returns, with ``group``, the results regrouped (Mirrored where they differ; one
        device: the result itself); otherwise a tuple with one result per device.

        Raises:
            ReplicaContextError: called inside a replica function.
            TypeError: ``fn`` is not callable, bad ``args``/``kwargs``, or a PerReplica argument.
            ValueError: ``colocate_with`` names no devices, or a Mirrored argument has
                another number of values.
        """
        if context.current_replica_context() is not None:
            raise ReplicaContextError(
                "strategy.extended.update_non_slot must be called in cross-replica context (outside "
                "strategy.run, or in a merge_call's merge_fn)")
        check_update(fn, args, kwargs, group, "fn(*args, **kwargs)")
        devices = _colocation(colocate_with)
        for name, value in (("args", args), ("kwargs", kwargs)):
            for leaf in _distributed_leaves(value):
                if len(leaf.values) != len(devices):
                    raise ValueError(
                        f"{name} holds a {type(leaf).__name__} of {len(leaf.values)} values, but colocate_with "
                        f"names {len(devices)} devices; give one value per device")
        return update_each(_container(self), devices, fn, args, kwargs, group, default_device=True)


def _container(ext: Any) -> Any:
    return ext._container


def _distributed_leaves(value: Any) -> list[DistributedValues]:
    if isinstance(value, DistributedValues):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _distributed_leaves(v)]
    return []


def _colocation(colocate_with: Any) -> tuple[torch.device, ...]:
    """The devices of ``colocate_with``: a device, a sequence of devices, a DistributedValues
    or a cr.Variable (its copies' devices)."""
    if isinstance(colocate_with, Variable):
        return tuple(c.device for c in colocate_with.values)
    if isinstance(colocate_with, (tuple, list)):
        if not colocate_with:
            raise ValueError("colocate_with must name at least one device; pass "
                             "strategy.extended.non_slot_devices(var_list)")
        return tuple(canonical_device(d, f"colocate_with[{i}]") for i, d in enumerate(colocate_with))
    return get_devices_from(colocate_with, "colocate_with")


def broadcast_to(ops: "CrossDeviceOps", value: Any, destinations: Any) -> Any:
    """``value`` on every destination: a Python number unchanged (as TF, which leaves its dtype
    open), a tensor as a Mirrored with one distinct copy per destination value (per copy of
    a cr.Variable, per device of a list of devices), even where several share a device."""
    if isinstance(value, numbers.Number) and not isinstance(value, torch.Tensor):
        return value
    if isinstance(destinations, Variable):
        destinations = Mirrored(list(destinations.values))
    elif isinstance(destinations, (tuple, list)) and destinations:
        # A device per replica (``extended.worker_devices``): one copy each, shared device or not.
        destinations = Mirrored([torch.empty(0, device=d) for d in _colocation(destinations)])
    return ops.broadcast(value, destinations)


def check_gather_shapes(ext: StrategyExtended, tensors: Sequence[torch.Tensor], axis: int) -> None:
    """Raises ValueError, on every worker alike, when the replicas' values (``tensors``: the
    local ones) differ in rank or in a dimension other than ``axis``; across workers the
    shapes travel first (two small gathers)."""
    local = [tuple(t.shape) for t in tensors]
    if ext.num_workers > 1:
        ranks = ext.gather_values([torch.tensor([len(s)], dtype=torch.int64) for s in local], 0).tolist()
        if len(set(ranks)) == 1:
            rows = ext.gather_values([torch.tensor([s], dtype=torch.int64) for s in local], 0).tolist()
            shapes = [tuple(r) for r in rows]
        else:
            shapes = [(None,) * r for r in ranks]
    else:
        shapes = local
    dims = {len(s) for s in shapes}
    keep = None if len(dims) > 1 else [d for d in range(dims.pop()) if d != axis % max(len(shapes[0]), 1)]
    if keep is not None and len({tuple(s[d] for d in keep) for s in shapes}) == 1:
        return
    by_shape: dict[tuple, list[int]] = {}
    for r, s in enumerate(shapes):
        by_shape.setdefault(s, []).append(r)
    described = "; ".join(
        (f"rank {len(s)}" if None in s else str(list(s))) + f" on replicas {rs}" for s, rs in by_shape.items())
    raise ValueError(
        f"strategy.gather: every replica's value must have the same shape except along axis={axis}; got "
        f"{described}")
