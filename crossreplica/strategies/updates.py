"""Updates of mirrored copies: ``fn`` once per copy, each on its device and in its update
context (a ``cr.Variable`` used in ``fn`` is its copy ``i``, as in TF's UpdateContext).

``strategy.extended.update`` (a Mirrored or a cr.Variable, copy by copy) and
``update_non_slot`` (non-slot variables colocated on some devices) share it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..arguments import check_call
from ..context import update_context
from ..errors import summarize
from ..values import Mirrored, regroup, select_replica_mirrored

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["check_update", "update_each"]


def check_update(fn: Any, args: Any, kwargs: Any, group: Any, call: str) -> None:
    """Checks an update's arguments; ``call`` shows how ``fn`` is called."""
    check_call(fn, args, kwargs, call)
    if not isinstance(group, bool):
        raise TypeError(f"group must be True or False; got {summarize(group)}")


def update_each(strategy: Strategy, devices: Sequence[torch.device | None], fn: Callable[..., Any], args: Sequence[Any],
                kwargs: dict | None, group: bool, copies: Sequence[Any] | None = None,
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
