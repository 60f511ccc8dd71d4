"""Distributed input: global batches split into per-replica batches.

``strategy.distribute_dataset(iterable)`` takes any iterable of global batches
(a ``torch.utils.data.DataLoader``, a list, a generator function's result) and
yields, per step, a nest of :class:`~crossreplica.values.PerReplica` values:
every tensor leaf of the batch is split along dim 0 into one part per replica
in sync, and each local replica gets its part on its own device. A list or
tuple of plain values (strings, numbers: no tensors, no nested containers)
whose length equals the batch's rows is per-row data, such as labels or file
names, and is split with the tensors, each part keeping its type; a numpy
array whose first dimension equals the rows is split likewise. Any other
non-tensor leaf reaches every replica unchanged.

A batch that does not divide evenly is split as evenly as possible: the first
``rows % num_replicas`` replicas get one row more, and replicas may get zero
rows. To keep a MEAN gradient the exact global mean, pass each replica's row
count (``x.shape[0]``) as ``weight=`` to ``CrossShardOptimizer.step``; the
reduction is then weighted by rows (see :mod:`crossreplica.optim`).

Across processes every worker iterates the same global batches (same data,
same order, same seed) and keeps the parts of its own replicas.
``distribute_datasets_from_function`` instead calls ``fn(InputContext)`` once
per input pipeline (one per worker; one in-process), and splits each batch it
yields among that pipeline's local replicas.

Layer: strategies (layer 5); see docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable, Iterator

import torch

from . import nest
from .arguments import check_int
from .errors import summarize
from .values import DistributedValues, PerReplica

if TYPE_CHECKING:
    from .strategies.base import Strategy

__all__ = ["InputContext", "DistributedDataset", "split_sizes", "split_batch", "distribute_batch"]


class InputContext:
    """What an input function needs to know about the replicas it feeds.

    Args:
        num_input_pipelines: how many input pipelines (workers) run.
        input_pipeline_id: this pipeline's id in ``[0, num_input_pipelines)``.
        num_replicas_in_sync: replicas in sync over all pipelines.
    """

    __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        check_int(num_input_pipelines, "num_input_pipelines", low=1)
        check_int(input_pipeline_id, "input_pipeline_id", low=0)
        check_int(num_replicas_in_sync, "num_replicas_in_sync", low=1)
        if input_pipeline_id >= num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id must be in [0, num_input_pipelines={num_input_pipelines}); "
                f"got {input_pipeline_id}")
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size of each replica for ``global_batch_size``.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``num_replicas_in_sync``.
        """
        check_int(global_batch_size, "global_batch_size", low=0)
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(
                f"The `global_batch_size` {summarize(global_batch_size)} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync!r}")
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
                f"input_pipeline_id={self._input_pipeline_id}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


def split_sizes(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` sizes as evenly as possible, larger ones first."""
    base, extra = divmod(rows, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def split_batch(batch: Any, num_parts: int, keep: Iterable[int] | None = None,
                devices: Any = None) -> list[Any]:
    """Splits every tensor leaf of ``batch`` along dim 0 into ``num_parts`` parts.

    Args:
        batch: a tensor or a nest with tensor leaves of one size along dim 0.
        num_parts: how many parts (replicas in sync).
        keep: which parts to return (default: all), in this order.
        devices: one device per returned part, or None to leave them in place.

    Returns:
        One nest per kept part, each of ``batch``'s structure.

    Raises:
        ValueError: no tensor leaf, a 0-d tensor, or leaves of different sizes.
    """
    spec, cuts = _cut_leaves(batch, num_parts, keep, devices)
    return [nest.unflatten(spec, [pieces[j] for pieces in cuts]) for j in range(len(cuts[0]))]


def distribute_batch(batch: Any, num_parts: int, keep: Iterable[int] | None = None,
                     devices: Any = None) -> Any:
    """:func:`split_batch` as one nest whose split leaves are PerReplica values (one
    piece per kept part); leaves that are not split stay plain. Per-row sequences of
    uneven parts differ in length, so they are leaves here, never regrouped."""
    spec, cuts = _cut_leaves(batch, num_parts, keep, devices)
    if len(cuts[0]) == 1:
        return nest.unflatten(spec, [pieces[0] for pieces in cuts])
    return nest.unflatten(spec, [pieces[0] if pieces[0] is pieces[-1] else PerReplica(pieces)
                                 for pieces in cuts])


def _cut_leaves(batch: Any, num_parts: int, keep: Iterable[int] | None,
                devices: Any) -> tuple[Any, list[list[Any]]]:
    """The batch's spec, and for each of its leaves one piece per kept part (the leaf
    itself, for a leaf that is not split). Per-row sequences are leaves here."""
    # One walk: a list of plain values is a leaf whether or not it is per-row data (walked
    # further, its items would reach every replica unchanged, as the list itself does).
    leaves, spec = nest.flatten(batch, is_leaf=_is_plain_sequence)
    rows = _rows(leaves, batch)
    sizes = split_sizes(rows, num_parts)
    starts = [sum(sizes[:i]) for i in range(num_parts)]
    parts = list(range(num_parts)) if keep is None else list(keep)
    targets = [None] * len(parts) if devices is None else list(devices)

    def cut(x: Any, part: int, device: Any) -> Any:
        lo, n = starts[part], sizes[part]
        if isinstance(x, torch.Tensor):
            piece = x.narrow(0, lo, n)
            return piece if device is None else piece.to(device, non_blocking=True)
        if _is_row_sequence(x, rows):
            return nest.rebuild(x, range(n), x[lo:lo + n])
        if _is_row_array(x, rows):
            return x[lo:lo + n]
        return x

    return spec, [[cut(x, part, device) for part, device in zip(parts, targets)] for x in leaves]


def _is_plain_sequence(x: Any) -> bool:
    """A list or tuple (not a namedtuple) of plain values: no tensors, no containers."""
    return (isinstance(x, (list, tuple)) and not nest.is_namedtuple(x)
            and not any(isinstance(v, torch.Tensor) or nest.is_container(v) for v in x))


def _is_row_sequence(x: Any, rows: int) -> bool:
    """A list or tuple of ``rows`` plain values (per-row data that splits with the batch)."""
    return _is_plain_sequence(x) and len(x) == rows


def _is_row_array(x: Any, rows: int) -> bool:
    """A numpy array with ``rows`` entries along its first dimension."""
    shape = getattr(x, "shape", None)
    return type(x).__module__ == "numpy" and shape is not None and len(shape) > 0 and shape[0] == rows


def _rows(leaves: list[Any], batch: Any) -> int:
    """The rows of a global batch (whose leaves are ``leaves``): the common size of its
    tensors along dim 0."""
    rows = None
    for p, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedValues):
            raise ValueError(
                f"batch leaf {p} is already a {type(leaf).__name__}; distribute_dataset expects "
                f"global batches of plain tensors")
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    f"batch leaf {p} is a 0-d tensor ({summarize(leaf)}); every tensor in a global batch needs a "
                    f"batch dimension 0 to split along")
            if rows is None:
                rows = leaf.shape[0]
            elif leaf.shape[0] != rows:
                raise ValueError(
                    f"every tensor of a global batch must have the same size along dim 0; leaf 0 has "
                    f"{rows} rows, leaf {p} has {leaf.shape[0]} (shape {list(leaf.shape)})")
    if rows is None:
        raise ValueError(
            f"a global batch must hold at least one tensor to split along dim 0; got "
            f"{type(batch).__name__}: {summarize(batch)}")
    return rows


class DistributedDataset:
    """Iterates per-step nests of PerReplica values (one part per local replica).

    Re-iterable when the underlying source is (a DataLoader, a list): each
    ``iter()`` starts a new pass. ``len()`` is the source's length when it has one.
    """

    def __init__(self, strategy: "Strategy", source: Any, from_function: bool = False):
        self._strategy = strategy
        self._source = source
        self._from_function = from_function

    def __iter__(self) -> Iterator[Any]:
        ext = self._strategy.extended
        devices = list(ext.worker_devices)
        if self._from_function:
            parts, keep = len(devices), None
        else:
            parts, keep = ext.num_replicas_in_sync, list(ext.local_replica_ids)
        for batch in self._source:
            yield distribute_batch(batch, parts, keep, devices)

    def __len__(self) -> int:
        try:
            return len(self._source)
        except TypeError:
            raise TypeError(f"the source {type(self._source).__name__} of this dataset has no len()") from None

    def __repr__(self) -> str:
        return f"DistributedDataset({self._source!r}, strategy={self._strategy!r})"


def distribute_dataset(strategy: "Strategy", iterable: Any) -> DistributedDataset:
    """The implementation of ``Strategy.distribute_dataset``."""
    if isinstance(iterable, (str, bytes)) or not hasattr(iterable, "__iter__"):
        raise ValueError(
            f"dataset must be an iterable of global batches (a DataLoader, a list of tensors or "
            f"nests); got {type(iterable).__name__}: {summarize(iterable)}")
    return DistributedDataset(strategy, iterable)


def input_context(strategy: "Strategy") -> InputContext:
    """The InputContext of this process's input pipeline for ``strategy``."""
    ext = strategy.extended
    return InputContext(ext.num_input_pipelines, ext.input_pipeline_id, ext.num_replicas_in_sync)


def distribute_datasets_from_function(strategy: "Strategy",
                                      dataset_fn: Callable[[InputContext], Any]) -> DistributedDataset:
    """The implementation of ``Strategy.distribute_datasets_from_function``."""
    if not callable(dataset_fn):
        raise ValueError(f"dataset_fn must be callable as dataset_fn(input_context); got {summarize(dataset_fn)}")
    source = dataset_fn(input_context(strategy))
    if isinstance(source, (str, bytes)) or not hasattr(source, "__iter__"):
        raise ValueError(
            f"dataset_fn must return an iterable of batches for this input pipeline; it returned "
            f"{type(source).__name__}: {summarize(source)}")
    return DistributedDataset(strategy, source, from_function=True)

