"""Cross-device ops as TF code calls and subclasses them.

* TF's signatures of the methods a subclass overrides:
  ``reduce_implementation(self, reduce_op, per_replica_value, destinations, options)``
  and ``batch_reduce_implementation(self, reduce_op, value_destination_pairs, options)``.
  crossreplica passes one more argument, the ``reducer``; an override written with
  TF's four arguments is recognised by its signature and called as TF calls it
  (a PerReplica and the destinations given by the caller).
* ``destinations`` (:func:`get_devices_from`); a ``cr.Variable`` names its copies' devices. The variable type lives
  in a layer above; it is recognised by its class attribute ``_cr_variable``.
* The ops reduce in cross-replica context only, as in TF: called in a replica
  function they would reduce that one replica's value.
"""

from __future__ import annotations

import inspect
from typing import Any
from collections.abc import Callable

import torch

from . import context
from .devices import canonical_device
from .errors import ReplicaContextError, summarize
from .values import DistributedValues

__all__ = ["check_same_shapes", "get_devices_from", "require_cross_replica", "takes_reducer", "variable_copies"]

_DEST_HELP = ("a device string ('cpu', 'cuda:0'), a torch.device, a tensor (its device), a "
              "cr.DistributedValues (the device of each value) or a cr.Variable (the device of each copy)")


def _device_of(x: Any) -> torch.device | None:
    if isinstance(x, torch.Tensor):
        return x.device
    if isinstance(x, torch.nn.Module):
        for tensor in x.parameters():
            return tensor.device
        for buffer in x.buffers():
            return buffer.device
        return torch.device("cpu")
    return None


def get_devices_from(destinations: Any, argname: str = "destinations") -> tuple[torch.device, ...]:
    """The devices ``destinations`` names, in order (a non-empty tuple of torch.device: those)."""
    if isinstance(destinations, str):
        if not destinations:
            raise ValueError(f"{argname} must not be empty; pass {_DEST_HELP}")
        return (canonical_device(destinations, argname),)
    if isinstance(destinations, torch.device):
        return (destinations,)
    if isinstance(destinations, tuple) and destinations and all(isinstance(d, torch.device) for d in destinations):
        return destinations
    copies = variable_copies(destinations)
    if copies is not None:  # TF's optimizer pattern: batch_reduce_to(op, [(grad, var)])
        return tuple(c.device for c in copies)
    if isinstance(destinations, DistributedValues):
        devices = []
        for i, v in enumerate(destinations.values):
            d = _device_of(v)
            if d is None:
                raise ValueError(
                    f"{argname} is a {type(destinations).__name__} whose value {i} is "
                    f"{type(v).__name__}, which has no device; its values must be tensors or modules")
            devices.append(d)
        return tuple(devices)
    d = _device_of(destinations)
    if d is not None:
        return (d,)
    raise ValueError(f"{argname} must be {_DEST_HELP}; got {type(destinations).__name__}: {summarize(destinations)}")


_TAKES_REDUCER: dict[tuple[type, str], bool] = {}


def takes_reducer(ops: Any, method: str) -> bool:
    """Whether ``type(ops).<method>`` takes crossreplica's ``reducer`` argument (False: TF's
    signature, without it). Decided once per class from the signature."""
    key = (type(ops), method)
    known = _TAKES_REDUCER.get(key)
    if known is not None:
        return known
    fn: Callable[..., Any] = getattr(type(ops), method)
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]  # without self
    except (TypeError, ValueError):  # no signature to read: the library's own form
        result = True
    else:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        result = (any(p.name == "reducer" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
                  or len(positional) >= (5 if method == "reduce_implementation" else 4))
    _TAKES_REDUCER[key] = result
    return result


def variable_copies(x: Any) -> tuple[Any, ...] | None:
    """The copies of ``x`` when it is a ``cr.Variable``; None otherwise."""
    if getattr(type(x), "_cr_variable", False):
        return tuple(x.values)
    return None


def require_cross_replica(ops: Any, method: str) -> None:
    """Raises ReplicaContextError (a RuntimeError) when called inside a replica function."""
    if context.current_replica_context() is not None:
        raise ReplicaContextError(
            f"{type(ops).__name__}.{method} must be called in cross-replica context, as in TF: outside "
            f"strategy.run, or in a merge_call's merge_fn (cr.get_replica_context().merge_call(lambda s, v: "
            f"ops.{method}(...), args=(v,))); in a replica function it would see this replica's value only. "
            f"To reduce inside a replica function use cr.all_reduce or cr.get_replica_context().all_reduce")


def check_same_shapes(values: list[torch.Tensor], argname: str) -> None:
    """One shape, dtype and layout (dense or sparse COO) on every replica."""
    s0, d0 = values[0].shape, values[0].dtype
    _check_layouts(values, argname)
    for i, v in enumerate(values[1:], start=1):
        if v.shape != s0 or v.dtype != d0:
            raise ValueError(
                f"{argname} must hold tensors of one shape and dtype; value 0 is {list(s0)} {d0}, "
                f"value {i} is {list(v.shape)} {v.dtype}")


def _check_layouts(values: list[torch.Tensor], argname: str) -> None:
    """Dense or sparse COO (reduced by gather, never densified), the same on every replica."""
    for i, v in enumerate(values):
        if v.layout is not torch.strided and v.layout is not torch.sparse_coo:
            raise TypeError(
                f"{argname}.values[{i}] has layout {v.layout}; only strided (dense) and torch.sparse_coo "
                f"tensors can be reduced (convert with x.to_sparse_coo() or x.to_dense())")
        if v.layout is not values[0].layout:
            raise ValueError(
                f"{argname} must hold tensors of one layout; value 0 is {values[0].layout}, value {i} is "
                f"{v.layout} (convert with x.to_dense() or x.to_sparse_coo())")
