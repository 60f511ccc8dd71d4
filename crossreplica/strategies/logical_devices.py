"""Logical devices per replica: a replica that owns several devices (model parallelism inside it).

tf.distribute's TPUStrategy gives each replica ``num_cores_per_replica``
logical devices; crossreplica's strategies take ``logical_devices_per_replica=k``
and give replica ``i`` the ``k`` consecutive devices ``devices[i*k : (i+1)*k]``.
Logical device 0 is the replica's own device (where ``run`` executes it and
where collectives meet); collectives still address replicas, never logical
devices. Inside a replica function:

* ``with strategy.extended.experimental_logical_device(j):`` (or
  ``cr.get_replica_context().experimental_logical_device(j)``, TF's TPU replica
  context's spelling) makes logical device ``j`` the default device for new
  tensors (``torch.device`` as a context; on CUDA also the current device), and
  ``extended.worker_devices`` logical device ``j`` of every replica, so a
  ``cr.Variable`` created there has its copies on it;
* ``strategy.experimental_assign_to_logical_device(t, j)``: ``t`` on logical
  device ``j``;
* ``strategy.experimental_split_to_logical_devices(t, partition_dimensions)``:
  the ``k`` tiles of ``t`` (``partition_dimensions`` splits per dimension,
  whose product is ``k``), tile ``j`` on logical device ``j``, in row-major
  order of the tile grid (the last dimension's index varies fastest);
  :func:`join_logical_tiles` puts them back together;
* ``strategy.experimental_replicate_to_logical_devices(t)``: one copy of ``t``
  per logical device.

In cross-replica context (under ``strategy.scope()``, outside any scope, in a
``merge_fn``) the same block places what is created for every replica, as TF's
does: ``extended.worker_devices`` is logical device ``j`` of every local
replica, so ``cr.Variable`` and ``strategy.mirror`` put their copies there; no
default device is set (each replica's device ``j`` may differ), and the block
yields those devices. A replica function starts on logical device 0 whatever
block its caller is in.

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
from typing import Any
from collections.abc import Iterator, Sequence

import torch

from ..arguments import check_int
from ..errors import summarize

__all__ = ["LogicalDevices", "assign", "join_logical_tiles", "replicate", "split", "made_current", "suspended"]


class LogicalDevices:
    """Which devices each local replica owns: one group per local replica, the same size
    for every replica, the replica's own device first. Immutable."""

    __slots__ = ("groups", "_first")

    def __init__(self, groups: Sequence[Sequence[torch.device]]):
        grouped = tuple(tuple(g) for g in groups)
        if not grouped or any(not g for g in grouped):
            raise ValueError(
                f"logical device groups must be non-empty, one per local replica; got {summarize(grouped)}")
        if len({len(g) for g in grouped}) != 1:
            raise ValueError(f"every replica must own the same number of logical devices; got {summarize(grouped)}")
        self.groups: tuple[tuple[torch.device, ...], ...] = grouped
        self._first = tuple(g[0] for g in grouped)

    @classmethod
    def consecutive(cls, devices: Sequence[torch.device], k: int) -> LogicalDevices:
        """``devices`` cut into consecutive groups of ``k``: one group per replica.

        Raises:
            ValueError: ``len(devices)`` is not a multiple of ``k``.
        """
        if len(devices) % k:
            raise ValueError(
                f"devices holds {len(devices)} devices, which is not a multiple of "
                f"logical_devices_per_replica={k}; give each replica k consecutive devices")
        return cls([devices[i:i + k] for i in range(0, len(devices), k)])

    @property
    def per_replica(self) -> int:
        """How many logical devices each replica owns."""
        return len(self.groups[0])

    def column(self, j: int) -> tuple[torch.device, ...]:
        """Logical device ``j`` of every local replica, in local order."""
        return self._first if j == 0 else tuple(g[j] for g in self.groups)

    def check_id(self, logical_device_id: Any) -> int:
        """``logical_device_id`` as an int in ``[0, per_replica)``, or ValueError naming it."""
        k = self.per_replica
        return check_int(logical_device_id, "logical_device_id", low=0, high=k,
                         hint=f" (this strategy has logical_devices_per_replica={k})")

    def __repr__(self) -> str:
        return f"LogicalDevices({list(map(list, self.groups))})"


class _Current(threading.local):
    """The logical device each thread has made current (a stack; empty means 0), and the
    strategy machinery (``owner``) whose logical device it is."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.owners: list[object] = []


_current = _Current()


def current_id(owner: object | None = None) -> int:
    """The logical device made current in this thread (0 outside any block); with ``owner``,
    0 unless the innermost block is ``owner``'s."""
    if not _current.ids or (owner is not None and _current.owners[-1] is not owner):
        return 0
    return _current.ids[-1]


@contextlib.contextmanager
def made_current(owner: object, logical_device_id: int, device: torch.device | None, result: Any) -> Iterator[Any]:
    """``owner``'s logical device ``logical_device_id`` current in the block of this thread,
    which yields ``result``; ``device`` (a replica's: that logical device) also the default
    device for new tensors and the current CUDA device, None in cross-replica context."""
    _current.ids.append(logical_device_id)
    _current.owners.append(owner)
    try:
        with contextlib.ExitStack() as stack:
            if device is not None:
                stack.enter_context(torch.device(device))
                if device.type == "cuda":
                    stack.enter_context(torch.cuda.device(device))
            yield result
    finally:
        _current.ids.pop()
        _current.owners.pop()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No logical device current in this thread inside the block (a replica function run
    in its caller's thread starts on logical device 0, as one run in a thread of its own)."""
    if not _current.ids:
        yield
        return
    saved = _current.ids, _current.owners
    _current.ids, _current.owners = [], []
    try:
        yield
    finally:
        _current.ids, _current.owners = saved


def assign(tensor: torch.Tensor, device: torch.device, api: str) -> torch.Tensor:
    """``tensor`` on ``device`` (differentiable; no copy when it is there already)."""
    _check_tensor(tensor, api)
    return tensor.to(device)


def replicate(tensor: torch.Tensor, group: Sequence[torch.device]) -> tuple[torch.Tensor, ...]:
    """One copy of ``tensor`` per device of ``group``, in order."""
    _check_tensor(tensor, "experimental_replicate_to_logical_devices")
    return tuple(tensor.to(d) for d in group)


def split(tensor: torch.Tensor, partition_dimensions: Sequence[int],
          group: Sequence[torch.device]) -> tuple[torch.Tensor, ...]:
    """The tiles of ``tensor`` in row-major order of the grid ``partition_dimensions``, tile
    ``j`` on ``group[j]`` (see ``Strategy.experimental_split_to_logical_devices``)."""
    _check_tensor(tensor, "experimental_split_to_logical_devices")
    dims = _check_partition(tensor, partition_dimensions, len(group))
    tiles = [tensor]
    for axis, parts in enumerate(dims):
        if parts > 1:
            tiles = [piece for t in tiles for piece in torch.chunk(t, parts, dim=axis)]
    return tuple(t.to(d) for t, d in zip(tiles, group))


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
