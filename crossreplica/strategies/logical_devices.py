"""Logical devices per replica: a replica that owns several devices (model parallelism inside it).

tf.distribute's TPUStrategy gives each replica ``num_cores_per_replica``
logical devices; crossreplica's strategies take ``logical_devices_per_replica=k``
and give replica ``i`` the ``k`` consecutive devices ``devices[i*k : (i+1)*k]``.
Logical device 0 is the replica's own device (where ``run`` executes it and
where collectives meet); collectives still address replicas, never logical
devices. Inside a replica function:

* ``with strategy.extended.experimental_logical_device(j):`` makes logical
  device ``j`` the default device for new tensors (``torch.device`` as a
  context; on CUDA also the current device);
* ``strategy.experimental_assign_to_logical_device(t, j)``: ``t`` on logical
  device ``j``;
* ``strategy.experimental_split_to_logical_devices(t, partition_dimensions)``:
  the ``k`` tiles of ``t`` (``partition_dimensions`` splits per dimension,
  whose product is ``k``), tile ``j`` on logical device ``j``, in row-major
  order of the tile grid (the last dimension's index varies fastest);
  :func:`join_logical_tiles` puts them back together;
* ``strategy.experimental_replicate_to_logical_devices(t)``: one copy of ``t``
  per logical device.

TF annotates one tensor for its SPMD compiler; eager PyTorch has no such pass,
so the split and replicate calls return the pieces themselves, each on its
device. Every move is a ``Tensor.to`` / ``chunk``, so gradients flow
back to ``t``. On the CPU every logical device is the CPU and only the
bookkeeping differs.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator, Sequence

import torch

from .. import context
from ..arguments import check_int
from ..errors import ReplicaContextError, summarize

if TYPE_CHECKING:
    from .extended import StrategyExtended

__all__ = ["LogicalDeviceExtended", "LogicalDeviceMethods", "group_devices", "join_logical_tiles"]


def group_devices(devices: Sequence[torch.device], k: int) -> tuple[tuple[torch.device, ...], ...]:
    """``devices`` cut into consecutive groups of ``k``: one group per replica.

    Raises:
        ValueError: ``len(devices)`` is not a multiple of ``k``.
    """
    if len(devices) % k:
        raise ValueError(
            f"devices holds {len(devices)} devices, which is not a multiple of "
            f"logical_devices_per_replica={k}; give each replica k consecutive devices")
    return tuple(tuple(devices[i:i + k]) for i in range(0, len(devices), k))


class _Current(threading.local):
    """The logical device each thread has made current (a stack; empty means 0), and the
    strategy machinery (``extended``) whose logical device it is."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.owners: list[object] = []


_current = _Current()


class LogicalDeviceExtended:
    """The ``strategy.extended`` side: which devices each local replica owns."""

    _worker_devices: tuple[torch.device, ...]
    _logical_groups: tuple[tuple[torch.device, ...], ...] | None = None

    @property
    def worker_devices(self) -> tuple[torch.device, ...]:
        """The local replicas' devices, in local order: logical device 0 of each, or, inside
        ``experimental_logical_device(j)`` (in this thread), logical device ``j`` of each (as TF)."""
        j = _current.ids[-1] if _current.ids else 0
        if j == 0 or self._logical_groups is None or _current.owners[-1] is not self:
            return self._worker_devices
        return tuple(g[j] for g in self._logical_groups)

    def set_logical_devices(self, groups: Sequence[Sequence[torch.device]]) -> None:
        """Records the devices of each local replica (first = the replica's device)."""
        grouped = tuple(tuple(g) for g in groups)
        if len(grouped) != len(self._worker_devices) or any(
                not g or g[0] != d for g, d in zip(grouped, self._worker_devices)):
            raise ValueError(
                f"logical device groups {summarize(grouped)} must hold one group per local replica, "
                f"starting with that replica's device {summarize(self._worker_devices)}")
        if len({len(g) for g in grouped}) != 1:
            raise ValueError(f"every replica must own the same number of logical devices; got {summarize(grouped)}")
        self._logical_groups = grouped

    @property
    def logical_devices_per_replica(self) -> int:
        """How many logical devices each replica owns (1 unless the strategy was given more)."""
        return 1 if self._logical_groups is None else len(self._logical_groups[0])

    @property
    def logical_devices(self) -> tuple[tuple[torch.device, ...], ...]:
        """Per local replica, its logical devices in order (logical device 0 is its own device)."""
        if self._logical_groups is None:
            return tuple((d,) for d in self._worker_devices)
        return self._logical_groups

    def logical_device(self, logical_device_id: int) -> torch.device:
        """The current replica's logical device ``logical_device_id``."""
        k = self.logical_devices_per_replica
        j = check_int(logical_device_id, "logical_device_id", low=0, high=k,
                      hint=f" (this strategy has logical_devices_per_replica={k})")
        rctx = context.require_replica_context("logical devices")
        if rctx.strategy.extended is not self:
            raise ReplicaContextError("the replica function running belongs to another strategy; use the "
                                      "logical devices of the strategy that runs it")
        return self.logical_devices[rctx.local_index][j]

    @property
    def current_logical_device_id(self) -> int:
        """The logical device made current by ``experimental_logical_device`` in this thread (0 outside)."""
        return _current.ids[-1] if _current.ids else 0

    @contextlib.contextmanager
    def experimental_logical_device(self, logical_device_id: int) -> Iterator[torch.device]:
        """Inside a replica function: makes logical device ``logical_device_id`` of this
        replica the default device (for new tensors, and the current CUDA device) in the block.

        Raises:
            ValueError: ``logical_device_id`` is not in ``[0, logical_devices_per_replica)``.
            ReplicaContextError: called outside a replica function.
        """
        device = self.logical_device(logical_device_id)
        _current.ids.append(int(logical_device_id))
        _current.owners.append(self)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.device(device))
                if device.type == "cuda":
                    stack.enter_context(torch.cuda.device(device))
                yield device
        finally:
            _current.ids.pop()
            _current.owners.pop()


class LogicalDeviceMethods:
    """The strategy side: placing tensors on a replica's logical devices."""

    extended: StrategyExtended

    def experimental_assign_to_logical_device(self, tensor: torch.Tensor, logical_device_id: int) -> torch.Tensor:
        """``tensor`` on logical device ``logical_device_id`` of the current replica
        (differentiable; no copy when it is there already)."""
        _check_tensor(tensor, "experimental_assign_to_logical_device")
        return tensor.to(self.extended.logical_device(logical_device_id))

    def experimental_replicate_to_logical_devices(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One copy of ``tensor`` per logical device of the current replica, in order."""
        _check_tensor(tensor, "experimental_replicate_to_logical_devices")
        return tuple(tensor.to(self.extended.logical_device(j))
                     for j in range(self.extended.logical_devices_per_replica))

    def experimental_split_to_logical_devices(self, tensor: torch.Tensor,
                                              partition_dimensions: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The tiles of ``tensor``, tile ``j`` on logical device ``j`` of the current replica.

        ``partition_dimensions`` holds one split count per dimension of ``tensor``; their
        product must be ``logical_devices_per_replica`` and each must divide its dimension
        (as in TF). Tiles come in row-major order of the grid; :func:`join_logical_tiles`
        reassembles them.

        Raises:
            TypeError: ``tensor`` is not a tensor, or ``partition_dimensions`` is not a list of ints.
            ValueError: the counts do not match the tensor's rank, are below 1, do not divide
                their dimension, or multiply to something other than the logical device count.
        """
        _check_tensor(tensor, "experimental_split_to_logical_devices")
        dims = _check_partition(tensor, partition_dimensions, self.extended.logical_devices_per_replica)
        tiles = [tensor]
        for axis, parts in enumerate(dims):
            if parts > 1:
                tiles = [piece for t in tiles for piece in torch.chunk(t, parts, dim=axis)]
        return tuple(t.to(self.extended.logical_device(j)) for j, t in enumerate(tiles))


def join_logical_tiles(tiles: Sequence[torch.Tensor], partition_dimensions: Sequence[int],
                       device: Any = None) -> torch.Tensor:
    """The inverse of ``experimental_split_to_logical_devices``: the whole tensor, on
    ``device`` (default: the first tile's)."""
    dims = [check_int(d, f"partition_dimensions[{i}]", low=1) for i, d in enumerate(partition_dimensions)]
    if len(tiles) != math.prod(dims):
        raise ValueError(f"tiles holds {len(tiles)} tensors, but partition_dimensions={dims} makes "
                         f"{math.prod(dims)} tiles")
    target = tiles[0].device if device is None else torch.device(device)
    parts = [t.to(target) for t in tiles]
    for axis in reversed(range(len(dims))):
        n = dims[axis]
        parts = [torch.cat(parts[i:i + n], dim=axis) for i in range(0, len(parts), n)]
    return parts[0]


def _check_tensor(tensor: Any, api: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{api}: tensor must be a torch.Tensor; got {summarize(tensor)}")


def _check_partition(tensor: torch.Tensor, partition_dimensions: Any, k: int) -> list[int]:
    if isinstance(partition_dimensions, (str, bytes)) or not isinstance(partition_dimensions, Sequence):
        raise TypeError(f"partition_dimensions must be a list with one int per dimension of the tensor; "
                        f"got {summarize(partition_dimensions)}")
    if len(partition_dimensions) != tensor.dim():
        raise ValueError(
            f"partition_dimensions={summarize(partition_dimensions)} has {len(partition_dimensions)} entries, "
            f"but the tensor has {tensor.dim()} dimensions (shape {list(tensor.shape)}); give one split "
            f"count per dimension")
    dims = [check_int(d, f"partition_dimensions[{i}]", low=1) for i, d in enumerate(partition_dimensions)]
    for axis, (parts, size) in enumerate(zip(dims, tensor.shape)):
        if size % parts:
            raise ValueError(f"partition_dimensions[{axis}]={parts} does not divide dimension {axis} of the "
                             f"tensor (size {size}); each dimension must split evenly")
    if math.prod(dims) != k:
        raise ValueError(f"partition_dimensions={dims} makes {math.prod(dims)} tiles, but each replica has "
                         f"logical_devices_per_replica={k}; their product must equal it")
    return dims
