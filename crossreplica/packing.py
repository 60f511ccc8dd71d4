"""Tensor fusion: many small tensors travel as a few flat buffers.

Two formats, one module. A *typed pack* (``plan_packs``, ``flatten_pack``,
``PackedBuffers``) holds tensors of one (device, dtype) back to back, for
reductions. A *byte pack* (``pack_bytes`` / ``unpack_bytes``) holds tensors of
any dtypes as one uint8 buffer, each segment padded to ``BYTE_ALIGN`` bytes so
that every dtype view of a segment is aligned; the receiver rebuilds views from
the ``(shape, dtype)`` specs it already knows, for messages that are copied,
never reduced (gathers, broadcasts, point-to-point).

A typed pack holds tensors of one (device, dtype) back to back. Reductions are
elementwise, so reducing a pack and splitting it again is bitwise the same as
reducing each tensor on its own; packing only saves calls and kernel launches.
The plan depends only on the tensors' devices, dtypes and sizes, so replicas
holding tensors of the same shapes make the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import torch_private as tp

# one C++ call per pack instead of a Python loop over its tensors (DDP uses them too)
_flatten_dense_tensors = tp.flatten_dense_tensors
_unflatten_dense_tensors = tp.unflatten_dense_tensors

__all__ = ["BYTE_ALIGN", "DEFAULT_BYTES_PER_PACK", "PackedBuffers", "byte_pack_size", "flatten_pack",
           "pack_bytes", "plan_packs", "unflatten_pack_", "unpack_bytes"]

#: Default upper bound on the bytes of one pack (the optimizer's gradient packs,
#: AllReduceCrossDeviceOps.batch_reduce when its options say 0).
DEFAULT_BYTES_PER_PACK = 4 * 1024 * 1024
#: Byte alignment of the segments of a byte pack, so every dtype view is aligned.
BYTE_ALIGN = 16

# Elements per tensor above which making a view of a result beats copying it
# into the persistent buffer (a view costs microseconds, 16K floats about as much).
_VIEWS_OVER_COPY = 16 * 1024


def plan_packs(tensors: list[torch.Tensor], bytes_per_pack: int,
               alone_bytes: int | None = None) -> list[list[int]]:
    """Indices of ``tensors`` grouped into packs of one (device, dtype), each at
    most ``bytes_per_pack`` bytes (a larger tensor is a pack of its own).

    With ``alone_bytes``, tensors at least that large also travel alone: their
    own flat view goes to the engine, which saves copying them into a pack
    (packing pays off for small tensors, whose per-tensor overhead dominates).
    A sparse tensor is a pack of its own.
    Packs keep the order of first appearance, so every replica that passes the
    same shapes gets the same plan.
    """
    open_packs: dict[tuple, tuple[list[int], int]] = {}
    packs: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
        if t.layout is not torch.strided or alone_bytes is not None and nbytes >= alone_bytes:
            # a sparse tensor has no flat buffer to share: it travels alone
            packs.append([i])
            continue
        current = open_packs.get(key)
        if current is not None and current[1] + nbytes <= bytes_per_pack:
            current[0].append(i)
            open_packs[key] = (current[0], current[1] + nbytes)
            continue
        pack = [i]
        packs.append(pack)
        open_packs[key] = (pack, nbytes)
    return packs


def flatten_pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding ``tensors`` back to back (a view when there is one)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return _flatten_dense_tensors(tensors)


def unflatten_pack_(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copies consecutive slices of ``flat`` back into ``tensors``, in place."""
    if len(tensors) == 1:
        tensors[0].copy_(flat.view_as(tensors[0]))
        return
    tp.foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))


class PackedBuffers:
    """Persistent flat buffers for a fixed list of tensor shapes: one per pack,
    with a view per tensor made once, so packing and unpacking a step's
    tensors are one ``_foreach_copy_`` per pack and allocate nothing.

    A pack of a single tensor has no buffer: the tensor's own flat view travels.
    """

    def __init__(self, tensors: list[torch.Tensor], bytes_per_pack: int, alone_bytes: int | None = None):
        self.packs = plan_packs(tensors, bytes_per_pack, alone_bytes)
        self.buffers: list[torch.Tensor | None] = []
        self.views: list[list[torch.Tensor]] = []  # per pack with a buffer; [] for the others
        for pack in self.packs:
            if len(pack) == 1:
                self.buffers.append(None)
                self.views.append([])
                continue
            first = tensors[pack[0]]
            total = sum(tensors[i].numel() for i in pack)
            buf = torch.empty(total, dtype=first.dtype, device=first.device)
            views, offset = [], 0
            for i in pack:
                n = tensors[i].numel()
                views.append(buf[offset:offset + n].view(tensors[i].shape))
                offset += n
            self.buffers.append(buf)
            self.views.append(views)

    def pack(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The flat buffers holding ``tensors`` (same shapes as at construction)."""
        out = []
        for pack, buf, views in zip(self.packs, self.buffers, self.views):
            if buf is None:
                out.append(tensors[pack[0]].reshape(-1))
            else:
                tp.foreach_copy_(views, [tensors[i] for i in pack])
                out.append(buf)
        return out

    def unpack_(self, flats: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Copies each flat result back into ``tensors``, in place."""
        for pack, buf, views, flat in zip(self.packs, self.buffers, self.views, flats):
            if buf is None:
                t = tensors[pack[0]]
                if flat.data_ptr() != t.data_ptr():
                    t.copy_(flat.view_as(t))
            elif flat is buf:
                tp.foreach_copy_([tensors[i] for i in pack], views)
            elif flat.numel() >= len(pack) * _VIEWS_OVER_COPY:
                # Few large tensors: fresh views of the result cost less than copying it into buf.
                members = [tensors[i] for i in pack]
                tp.foreach_copy_(members, _unflatten_dense_tensors(flat, members))
            else:
                buf.copy_(flat)
                tp.foreach_copy_([tensors[i] for i in pack], views)


# --------------------------------------------------------------------------- byte packs

def _segment(nbytes: int) -> int:
    """``nbytes`` rounded up to the segment alignment."""
    return (nbytes + BYTE_ALIGN - 1) // BYTE_ALIGN * BYTE_ALIGN


def byte_pack_size(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of the byte pack of tensors with these ``(shape, dtype)`` specs."""
    return sum(_segment(math.prod(shape) * dtype.itemsize) for shape, dtype in specs)


def pack_bytes(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bytes of ``tensors`` in one uint8 buffer on ``device``, each segment aligned."""
    total = sum(_segment(t.numel() * t.element_size()) for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[offset:offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _segment(n)
    return buf


def unpack_bytes(buf: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
                 offset: int = 0) -> tuple[list[torch.Tensor], int]:
    """Views into ``buf`` for ``(shape, dtype)`` specs laid out by :func:`pack_bytes`,
    starting at byte ``offset``; also returns the offset just past them."""
    out = []
    for shape, dtype in specs:
        n = math.prod(shape) * dtype.itemsize
        out.append(buf[offset:offset + n].view(dtype).view(shape))
        offset += _segment(n)
    return out, offset
