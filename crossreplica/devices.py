"""Device arguments: validated once, turned into torch.device."""

from __future__ import annotations

from typing import Any

import torch

from .errors import summarize

__all__ = ["canonical_device"]


def canonical_device(device: Any, argname: str) -> torch.device:
    """``device`` as a torch.device; a clear ValueError for anything torch rejects or lacks."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{argname} must be a device such as 'cpu', 'cuda:0' or a torch.device; got {summarize(device)}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{argname}={summarize(device)} names a CUDA device, but CUDA is not available here")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{argname}={summarize(device)} names CUDA device {index}, but only "
                f"{torch.cuda.device_count()} are visible")
        dev = torch.device("cuda", index)
    elif dev.type == "meta":
        raise ValueError(
            f"{argname}={summarize(device)} is the meta device, whose tensors hold no data, so a replica "
            f"cannot compute on it; use 'cpu' or a CUDA device")
    elif dev.type != "cpu":
        try:
            torch.empty(1, device=dev)
        except Exception:  # noqa: BLE001 - any failure means replicas cannot use it
            raise ValueError(
                f"{argname}={summarize(device)} names a {dev.type} device that is not usable here; use "
                f"'cpu' or a CUDA device") from None
    return dev
