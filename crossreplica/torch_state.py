"""The caller's thread-local torch state, carried into replica threads.

torch keeps several switches per thread: a thread started by a strategy sees
torch's defaults, not the state of the thread that called ``strategy.run``.
:func:`capture` records, in the caller's thread, every thread-local switch that
changes what a replica computes; :func:`applied` re-enters it in a replica
thread, so ``with torch.no_grad(): strategy.run(fn)`` runs ``fn`` without grad
on every replica, as it would on one device.

Carried (each is thread-local in torch; see docs/fidelity.md):

* grad mode (``torch.no_grad`` / ``enable_grad`` / ``set_grad_enabled``);
* inference mode (``torch.inference_mode``);
* forward-mode AD enabled (``torch.autograd.forward_ad``'s switch);
* autocast, per device type: enabled, its dtype, and the cache flag;
* the default device of ``with torch.device(...)`` / ``torch.set_default_device``
  (a ``DeviceContext`` on the thread's torch-function mode stack);
* the saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) in force.

Process-wide switches (default dtype, deterministic algorithms, anomaly mode,
matmul precision) are already shared by every thread and are not recorded.

Capturing is on the hot path of every ``run``: the common case (grad on, no
autocast, no mode, no hooks) is a few C calls and returns a shared record, and
:func:`applied` of that record enters nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from . import torch_private as tp
from .torch_private import DeviceContext

__all__ = ["TorchState", "applied", "capture"]

_is_grad_enabled = torch.is_grad_enabled
_is_inference = torch.is_inference_mode_enabled
_is_fwd_grad = tp.is_fwd_grad_enabled
_len_modes = tp.len_torch_function_stack
_top_hooks = tp.top_saved_tensors_default_hooks
_autocast_enabled = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype
_autocast_cache = torch.is_autocast_cache_enabled

# Device types torch has autocast for in this build (checked once).
_AUTOCAST_TYPES: tuple[str, ...] = tuple(
    t for t in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")
    if torch.amp.is_autocast_available(t))


class TorchState(NamedTuple):
    """A frozen record of a thread's torch state (see the module docstring)."""

    grad: bool
    inference: bool
    fwd_grad: bool
    #: ``((device_type, dtype), ...)`` for each device type with autocast enabled
    autocast: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool
    #: the device of the innermost DeviceContext on the mode stack, or None
    device: torch.device | None
    #: the (pack, unpack) saved-tensor hooks in force, or None
    saved_tensor_hooks: tuple[Any, Any] | None


_DEFAULT = TorchState(True, False, True, (), True, None, None)


def capture() -> TorchState:
    """The calling thread's torch state (cheap; call it in the thread that calls ``run``)."""
    grad, inference, fwd = _is_grad_enabled(), _is_inference(), _is_fwd_grad()
    autocast = tuple((t, _autocast_dtype(t)) for t in _AUTOCAST_TYPES if _autocast_enabled(t))
    device = _default_device() if _len_modes() else None
    hooks = _top_hooks(False)
    if grad and not inference and fwd and not autocast and device is None and hooks is None:
        return _DEFAULT
    return TorchState(grad, inference, fwd, autocast, _autocast_cache(), device, hooks)


def _default_device() -> torch.device | None:
    for mode in reversed(tp.get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


_NOTHING = contextlib.nullcontext()


def applied(state: TorchState) -> contextlib.AbstractContextManager[None]:
    """Runs the body under ``state``, entered over the current thread's own state.

    The default record enters nothing: a replica thread starts from torch's defaults
    (every context it enters is left when its body returns), and a replica run in the
    caller's own thread already has the caller's state.
    """
    return _NOTHING if state is _DEFAULT else _applied(state)


@contextlib.contextmanager
def _applied(state: TorchState) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if state.inference:
            stack.enter_context(torch.inference_mode(True))
        elif _is_inference():
            stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.set_grad_enabled(state.grad))
        if state.fwd_grad != _is_fwd_grad():
            stack.enter_context(tp.set_fwd_grad_enabled(state.fwd_grad))
        enabled = dict(state.autocast)
        for t in _AUTOCAST_TYPES:
            if t in enabled:
                stack.enter_context(torch.autocast(t, dtype=enabled[t], cache_enabled=state.autocast_cache))
            elif _autocast_enabled(t):
                stack.enter_context(torch.autocast(t, enabled=False))
        if state.device is not None:
            stack.enter_context(DeviceContext(state.device))
        if state.saved_tensor_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state.saved_tensor_hooks))
        yield
