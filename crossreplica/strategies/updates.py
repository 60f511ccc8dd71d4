"""Mirrored copies device by device: updates, and broadcasts to destinations.

``strategy.extended.update`` (a Mirrored or a cr.Variable, copy by copy) and
``update_non_slot`` (non-slot variables colocated on some devices) run ``fn``
once per copy, each on its device and in its update context (a ``cr.Variable``
used in ``fn`` is its copy ``i``, as in TF's UpdateContext).
``broadcast_to`` makes one distinct copy per destination.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..arguments import check_call
from ..context import update_context
from ..cross_device_ops import get_devices_from
from ..devices import canonical_device
from ..errors import summarize
from ..values import DistributedValues, Mirrored, regroup, select_replica_mirrored
from ..variables import Variable

if TYPE_CHECKING:
    from ..cross_device_ops import CrossDeviceOps
    from .base import Strategy

__all__ = ["broadcast_to", "update", "update_non_slot"]


def update(strategy: Strategy, var: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict | None,
           group: bool) -> Any:
    """``strategy.extended.update``: ``fn(v, *args, **kwargs)`` on every copy ``v`` of ``var``."""
    _check_update(fn, args, kwargs, group, "fn(var, *args, **kwargs)")
    copies = var.values if isinstance(var, (DistributedValues, Variable)) else (var,)
    return _update_each(strategy, [getattr(v, "device", None) for v in copies], fn, args, kwargs, group,
                        copies=copies)


def update_non_slot(strategy: Strategy, colocate_with: Any, fn: Callable[..., Any], args: Sequence[Any],
                    kwargs: dict | None, group: bool) -> Any:
    """``strategy.extended.update_non_slot``: ``fn(*args, **kwargs)`` once per device of
    ``colocate_with``, each the default device in its turn."""
    _check_update(fn, args, kwargs, group, "fn(*args, **kwargs)")
    devices = _colocation(colocate_with)
    for name, value in (("args", args), ("kwargs", kwargs)):
        for leaf in _distributed_leaves(value):
            if len(leaf.values) != len(devices):
                raise ValueError(
                    f"{name} holds a {type(leaf).__name__} of {len(leaf.values)} values, but colocate_with "
                    f"names {len(devices)} devices; give one value per device")
    return _update_each(strategy, devices, fn, args, kwargs, group, default_device=True)


def broadcast_to(ops: CrossDeviceOps, value: Any, destinations: Any) -> Any:
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


def _check_update(fn: Any, args: Any, kwargs: Any, group: Any, call: str) -> None:
    """Checks an update's arguments; ``call`` shows how ``fn`` is called."""
    check_call(fn, args, kwargs, call)
    if not isinstance(group, bool):
        raise TypeError(f"group must be True or False; got {summarize(group)}")


def _update_each(strategy: Strategy, devices: Sequence[torch.device | None], fn: Callable[..., Any],
                 args: Sequence[Any], kwargs: dict | None, group: bool, copies: Sequence[Any] | None = None,
                 default_device: bool = False) -> Any:
    """``fn(*lead, *args_i, **kwargs_i)`` for each device ``i`` (``lead``: ``copies[i]``, or
    nothing), in the strategy's scope, under ``torch.no_grad()``, in update context ``i``,
    on device ``i`` (with ``default_device``, also the default device for new tensors);
    Mirrored arguments give their ``i``-th value. The results regrouped (Mirrored where
    they differ) with ``group``, else a tuple."""
    results = []
    with strategy.scope(), torch.no_grad():
        for i, device in enumerate(devices):
            a = select_replica_mirrored(i, tuple(args))
            kw = select_replica_mirrored(i, kwargs or {})
            lead = () if copies is None else (copies[i],)
            with contextlib.ExitStack() as stack:
                stack.enter_context(update_context(strategy, i))
                if default_device and device is not None:
                    stack.enter_context(torch.device(device))
                if device is not None and device.type == "cuda":
                    stack.enter_context(torch.cuda.device(device))
                results.append(fn(*lead, *a, **kw))
    return regroup(results, Mirrored) if group else tuple(results)


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
