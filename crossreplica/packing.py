"""Tensor fusion: many small tensors travel as a few flat buffers.

A pack holds tensors of one (device, dtype) back to back. Reductions are
elementwise, so reducing a pack and splitting it again is bitwise the same as
reducing each tensor on its own; packing only saves calls and kernel launches.
The plan depends only on the tensors' devices, dtypes and sizes, so replicas
holding tensors of the same shapes make the same plan.
"""

from __future__ import annotations

import torch

__all__ = ["plan_packs", "flatten_pack", "unflatten_pack_"]


def plan_packs(tensors: list[torch.Tensor], bytes_per_pack: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into packs of one (device, dtype), each at
    most ``bytes_per_pack`` bytes (a larger tensor is a pack of its own).

    Packs keep the order of first appearance, so every replica that passes the
    same shapes gets the same plan.
    """
    open_packs: dict[tuple, tuple[list[int], int]] = {}
    packs: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
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
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_pack_(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copies consecutive slices of ``flat`` back into ``tensors``, in place."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
