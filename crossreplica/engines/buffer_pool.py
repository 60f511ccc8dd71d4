"""Reuse of large CPU output buffers between collectives.

Fresh large allocations come straight from the OS and every page is faulted
in on first write, which on virtual machines costs more than the all-reduce's
own memory traffic. The pool hands out views of buffers it keeps, and reuses a
buffer only once nothing else refers to its storage (the caller dropped the
result and every view of it), so results are never overwritten while alive.
"""

from __future__ import annotations

import math

import torch

from .. import torch_private as tp

__all__ = ["BufferPool"]

_storage_refs = tp.storage_refs


class BufferPool:
    """Keeps up to ``max_buffers`` flat buffers; ``empty`` returns a free one or a new one."""

    def __init__(self, max_buffers: int = 8):
        self.max_buffers = max_buffers
        # (numel, dtype, device, base buffer, storage refcount when nothing else holds it)
        self._buffers: list[tuple[int, torch.dtype, torch.device, torch.Tensor, int]] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        if not tp.has_storage_refs() or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        for k, (n, dt, dev, base, idle) in enumerate(self._buffers):
            if n == numel and dt == dtype and dev == device and _storage_refs(base) == idle:
                self._buffers.append(self._buffers.pop(k))  # most recently used last
                return base.view(shape)
        base = torch.empty(numel, dtype=dtype, device=device)
        self._buffers.append((numel, dtype, device, base, _storage_refs(base)))
        if len(self._buffers) > self.max_buffers:
            self._buffers.pop(0)
        return base.view(shape)

    def clear(self) -> None:
        self._buffers.clear()
