"""Device arguments: validated once, turned into torch.device."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["canonical_device"]


def canonical_device(device: Any, argname: str) -> torch.device:
    """``device`` as a torch.device; a clear ValueError for anything torch rejects or lacks."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{argname} must be a device such as 'cpu', 'cuda:0' or a torch.device; got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{argname}={device!r} names a CUDA device, but CUDA is not available here")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{argname}={device!r} names CUDA device {index}, but only "
                f"{torch.cuda.device_count()} are visible")
        dev = torch.device("cuda", index)
    return dev
