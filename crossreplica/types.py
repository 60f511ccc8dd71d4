"""Public names for the shapes that recur in crossreplica's signatures.

Use them to annotate code that passes values through the library:
``def step(batch: cr.types.Nest) -> cr.types.Nest``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["Nest", "TensorNest", "GroupAssignment", "Axes", "DeviceLike"]

#: A leaf or a container of nests: tuples, lists, namedtuples, mappings, dataclasses and
#: types registered with torch's pytree (see docs/nests.md). Leaves are anything else.
Nest = Any

#: A nest whose leaves are tensors (or None), as the collectives take and return.
TensorNest = torch.Tensor | Sequence[Any] | Mapping[Any, Any] | None

#: Replica groups: equal-size lists of replica ids covering every replica once
#: (``[[0, 1], [2, 3]]``), the flat form mapping each replica to a group index
#: (``[0, 0, 1, 1]``), or None for one group of every replica.
GroupAssignment = Sequence[Sequence[int]] | Sequence[int] | None

#: Named mesh axes: one name or a sequence of names (integers index the mesh's axes).
Axes = str | int | Sequence[str | int] | None

#: What a device argument accepts: ``"cpu"``, ``"cuda:0"``, a torch.device or an index.
DeviceLike = str | int | torch.device
