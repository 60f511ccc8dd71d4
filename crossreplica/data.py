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
reduction is then weighted by rows (see :mod:`crossreplica.optim`). The first
such batch of a distributed dataset is logged at INFO (code that weights by rows
is correct, so this is no warning).

Across processes every worker sees the same global batches (same data, same
order, same seed) and keeps the parts of its own replicas. A ``DataLoader``
over a map-style dataset is sharded by index: each worker reads and collates
only its replicas' rows of each global batch (:mod:`crossreplica.input_shards`);
any other iterable is read whole by every worker.

Two habits of other systems would split a batch that is already split, and are
caught where they are cheap to see. A loader that draws its indices from a
``torch.utils.data.DistributedSampler`` (DDP's per-rank loader) yields one
worker's share of each batch, so ``distribute_dataset`` refuses it (a
ValueError naming both fixes) rather than train on a fraction of the data; and
the first global batch of a dataset whose tensors all look like JAX pmap's
stacked ``(replicas, per_replica_batch, ...)`` (one row per replica, a common
size along dim 1, features after it) gets a ``cr.logs.PortingWarning``.

``distribute_datasets_from_function`` instead calls ``fn(InputContext)`` once
per input pipeline (one per worker; one in-process); the pipeline yields
per-replica batches, and its local replicas take whole elements in turn, as
TF does (a last step with fewer elements than replicas gives the others empty
batches): a per-worker loader, a DDP one included, belongs here (its
``DistributedSampler`` must then be the pipeline's: ``num_replicas`` and ``rank``
are ``ctx.num_input_pipelines`` and ``ctx.input_pipeline_id``, else a ValueError).
``experimental_distribute_values_from_function`` calls
``fn(ValueContext)`` once per local replica.

TF 1.x's spellings are thin layers over these: ``make_input_fn_iterator(input_fn,
InputReplicationMode.PER_WORKER)`` is an :class:`InputFunctionIterator` over
``distribute_datasets_from_function(input_fn)``, and
``experimental_make_numpy_dataset(arrays)`` a :class:`NumpyDataset` of their
rows, to batch with a DataLoader and pass to ``distribute_dataset``.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import Dataset

from . import nest
from .arguments import NamedEnum, check_int
from .errors import summarize
from .input_shards import ShardedLoader, distributed_sampler, shardable, split_sizes
from .logs import PortingWarning
from .values import DistributedValues, PerReplica, regroup

if TYPE_CHECKING:
    from .strategies.base import Strategy

_log = logging.getLogger(__name__)

__all__ = ["InputContext", "ValueContext", "DistributedDataset", "split_sizes", "split_batch",
           "distribute_batch", "InputReplicationMode", "InputFunctionIterator", "NumpyDataset"]


class InputReplicationMode(NamedEnum):
    """How an input function is replicated (TF's ``tf.distribute.InputReplicationMode``):
    ``PER_WORKER`` calls it once per worker, whose pipeline feeds the worker's replicas
    in turn; ``PER_REPLICA`` (TF 2.4's) once per replica, which ``make_input_fn_iterator``
    does not take, as in TF."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"

    def __str__(self) -> str:
        return f"cr.InputReplicationMode.{self.name}"


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


class ValueContext:
    """What a value function needs to know about the replica it makes a value for.

    Args:
        replica_id_in_sync_group: the replica's id in ``[0, num_replicas_in_sync)``.
        num_replicas_in_sync: replicas in sync over all workers.
    """

    __slots__ = ("_replica_id_in_sync_group", "_num_replicas_in_sync")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        check_int(replica_id_in_sync_group, "replica_id_in_sync_group", low=0)
        check_int(num_replicas_in_sync, "num_replicas_in_sync", low=1)
        if replica_id_in_sync_group >= num_replicas_in_sync:
            raise ValueError(
                f"replica_id_in_sync_group must be in [0, num_replicas_in_sync={num_replicas_in_sync}); "
                f"got {replica_id_in_sync_group}")
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


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
                     devices: Any = None, sizes: Sequence[int] | None = None, wrap: bool = False) -> Any:
    """:func:`split_batch` as one nest whose split leaves are PerReplica values (one
    piece per kept part); leaves that are not split stay plain. Per-row sequences of
    uneven parts differ in length, so they are leaves here, never regrouped. With
    ``sizes`` (one row count per part, at most the batch's rows in all) the parts
    are those sizes instead of an even split. ``wrap`` makes split leaves PerReplica
    values even with one part (the layout-invariant mode finds the rows to cut that way)."""
    spec, cuts = _cut_leaves(batch, num_parts, keep, devices, sizes)
    if len(cuts[0]) == 1 and not wrap:
        return nest.unflatten(spec, [pieces[0] for pieces in cuts])
    return nest.unflatten(spec, [PerReplica(pieces) if pieces[0] is not pieces[-1]
                                 or (wrap and isinstance(pieces[0], torch.Tensor)) else pieces[0]
                                 for pieces in cuts])


def _cut_leaves(batch: Any, num_parts: int, keep: Iterable[int] | None,
                devices: Any, sizes: Sequence[int] | None = None) -> tuple[Any, list[list[Any]]]:
    """The batch's spec, and for each of its leaves one piece per kept part (the leaf
    itself, for a leaf that is not split). Per-row sequences are leaves here."""
    # One walk: a list of plain values is a leaf whether or not it is per-row data (walked
    # further, its items would reach every replica unchanged, as the list itself does).
    leaves, spec = nest.flatten(batch, is_leaf=_is_plain_sequence)
    rows = _rows(leaves, batch)
    if sizes is None:
        sizes = split_sizes(rows, num_parts)
    elif len(sizes) != num_parts or sum(sizes) > rows:
        raise ValueError(f"sizes must give {num_parts} row counts of at most {rows} rows in all; got {list(sizes)}")
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
    ``iter()`` starts a new pass. ``len()`` is the number of steps when the
    source has a length.
    """

    def __init__(self, strategy: "Strategy", source: Any, from_function: bool = False):
        self._strategy = strategy
        self._source = source
        self._from_function = from_function
        ext = strategy.extended
        self._sharded = (ShardedLoader(source, ext.num_replicas_in_sync, ext.local_replica_ids, ext.batch_split)
                         if not from_function and ext.num_input_pipelines > 1 and shardable(source) else None)
        self._uneven_seen = False
        self._stacked_checked = from_function or ext.num_replicas_in_sync == 1

    @property
    def sharded(self) -> bool:
        """Whether this worker reads only its replicas' rows of each global batch."""
        return self._sharded is not None

    def __iter__(self) -> Iterator[Any]:
        ext = self._strategy.extended
        devices = list(ext.worker_devices)
        if self._from_function:
            yield from _take_in_turn(iter(self._source), devices)
        elif self._sharded is not None:
            keep = list(ext.local_replica_ids)
            for batch, rows in self._sharded:
                sizes = ext.batch_split(rows)
                if not self._stacked_checked:
                    self._check_stacked(nest.flatten(batch, is_leaf=_is_plain_sequence)[0], sizes)
                if rows % len(sizes) and not self._uneven_seen:
                    self._log_uneven(rows, sizes)
                yield distribute_batch(batch, len(keep), None, devices, [sizes[p] for p in keep],
                                       wrap=ext.layout_invariant is not None)
        else:
            parts, keep = ext.num_replicas_in_sync, list(ext.local_replica_ids)
            invariant = ext.layout_invariant is not None
            for batch in self._source:
                sizes = None
                first = not self._stacked_checked
                if invariant or first or (not self._uneven_seen and _log.isEnabledFor(logging.INFO)):
                    leaves = nest.flatten(batch, is_leaf=_is_plain_sequence)[0]
                    rows = _rows(leaves, batch)
                    sizes = ext.batch_split(rows)
                    if first:
                        self._check_stacked(leaves, sizes)
                    if rows % parts and not self._uneven_seen and _log.isEnabledFor(logging.INFO):
                        self._log_uneven(rows, sizes)
                yield distribute_batch(batch, parts, keep, devices, sizes if invariant else None, wrap=invariant)

    def _check_stacked(self, leaves: list[Any], sizes: list[int]) -> None:
        """A PortingWarning when the dataset's first global batch (``leaves``, split into
        ``sizes`` rows per replica) looks like a pmap-style stacked batch."""
        self._stacked_checked = True
        shapes = _stacked_shapes(leaves, sizes)
        if shapes is None:
            return
        n = len(sizes)
        warnings.warn(
            f"strategy.distribute_dataset got a global batch of {n} rows for {n} replicas in sync, so each "
            f"replica gets a batch of one row (tensor shapes {shapes}): this looks like a JAX pmap-style stacked "
            f"batch (replicas, per_replica_batch, ...). distribute_dataset splits a global batch along dim 0, its "
            f"rows: pass the rows themselves (x.flatten(0, 1), a global batch of {n * shapes[0][1]} rows), or hand "
            f"each replica its slice with strategy.experimental_distribute_values_from_function(lambda ctx: "
            f"x[ctx.replica_id_in_sync_group]). If a global batch of {n} rows is what you mean, silence this with "
            f"warnings.filterwarnings(\"ignore\", category=cr.logs.PortingWarning)", PortingWarning, stacklevel=3)

    def _log_uneven(self, rows: int, sizes: list[int]) -> None:
        self._uneven_seen = True
        _log.info("a global batch of %d rows splits unevenly over %d replicas (parts of %s rows): weight means "
                  "by rows (CrossShardOptimizer.step(weight=x.shape[0])) for the exact global mean. Logged once "
                  "per dataset", rows, len(sizes), sizes)

    def __len__(self) -> int:
        try:
            n = len(self._source)
        except TypeError:
            raise TypeError(f"the source {type(self._source).__name__} of this dataset has no len()") from None
        if self._from_function:
            local = len(self._strategy.extended.worker_devices)
            return -(-n // local)
        return n

    def __repr__(self) -> str:
        return f"DistributedDataset({self._source!r}, strategy={self._strategy!r})"


def _stacked_shapes(leaves: list[Any], sizes: list[int]) -> list[list[int]] | None:
    """The global shapes of a batch's tensors (``leaves``, split into ``sizes`` rows per
    replica) when it looks like JAX pmap's stacked ``(replicas, per_replica_batch, ...)``:
    one row per replica, and every tensor with a per-replica batch dimension 1 of one
    size above 1 (so labels of shape ``(rows,)`` and a grayscale channel rule it out), one
    with features after it; else None."""
    if len(sizes) < 2 or any(n != 1 for n in sizes):
        return None
    shapes = [[len(sizes), *leaf.shape[1:]] for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not shapes or any(len(s) < 2 for s in shapes) or max(len(s) for s in shapes) < 3:
        return None
    per_replica = {s[1] for s in shapes}
    return shapes if len(per_replica) == 1 and per_replica.pop() > 1 else None


def _take_in_turn(it: Iterator[Any], devices: list[Any]) -> Iterator[Any]:
    """Per step, one whole element of ``it`` per local replica, in turn, each on its
    replica's device; a last step short of elements gives the others empty batches."""
    for step in itertools.count():
        elements = list(itertools.islice(it, len(devices)))
        if not elements:
            return
        if len(elements) < len(devices):
            elements += [_empty_like(elements[0], step)] * (len(devices) - len(elements))
        placed = [nest.map_structure(lambda x, d=d: x.to(d, non_blocking=True) if isinstance(x, torch.Tensor)
                                     else x, e) for e, d in zip(elements, devices)]
        yield placed[0] if len(placed) == 1 else _group(placed, step)


def _group(elements: list[Any], step: int) -> Any:
    """One nest whose leaves differ per replica are PerReplica values (plain sequences
    are leaves: per-row lists of different lengths are not regrouped)."""
    flat = [nest.flatten(e, is_leaf=_is_plain_sequence) for e in elements]
    spec = flat[0][1]
    for r, (_, s) in enumerate(flat[1:], start=1):
        if not _same_spec(spec, s):
            raise ValueError(
                f"the input pipeline's elements must share one structure; at step {step} replica 0's "
                f"element is {summarize(elements[0])} and replica {r}'s is {summarize(elements[r])}")
    columns = zip(*(leaves for leaves, _ in flat))
    return nest.unflatten(spec, [c[0] if all(v is c[0] for v in c[1:]) else PerReplica(tuple(c))
                                 for c in columns])


def _same_spec(a: Any, b: Any) -> bool:
    if a.kids is None or b.kids is None:
        return a.kids is None and b.kids is None
    return (type(a.template) is type(b.template) and a.keys == b.keys and len(a.kids) == len(b.kids)
            and all(_same_spec(x, y) for x, y in zip(a.kids, b.kids)))


def _empty_like(element: Any, step: int) -> Any:
    """``element`` with no rows: every tensor, per-row sequence and per-row array cut to
    0 rows (other leaves kept), for a replica that gets no element at the last step."""
    leaves, spec = nest.flatten(element, is_leaf=_is_plain_sequence)
    try:
        rows = _rows(leaves, element)
    except ValueError as e:
        raise ValueError(
            f"step {step} has fewer elements than local replicas, and the others get an empty batch "
            f"cut from the first element, which needs a batch dimension: {e}") from None

    def empty(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.narrow(0, 0, 0)
        if _is_row_sequence(x, rows):
            return nest.rebuild(x, range(0), [])
        if _is_row_array(x, rows):
            return x[:0]
        return x
    return nest.unflatten(spec, [empty(x) for x in leaves])


def distribute_dataset(strategy: "Strategy", iterable: Any) -> DistributedDataset:
    """The implementation of ``Strategy.distribute_dataset``."""
    if isinstance(iterable, (str, bytes)) or not hasattr(iterable, "__iter__"):
        raise ValueError(
            f"dataset must be an iterable of global batches (a DataLoader, a list of tensors or "
            f"nests); got {type(iterable).__name__}: {summarize(iterable)}")
    _check_global_loader(strategy, iterable)
    return DistributedDataset(strategy, iterable)


def _check_global_loader(strategy: "Strategy", source: Any) -> None:
    """Refuses a loader of one worker's share (a DistributedSampler over several ranks, DDP's
    per-rank loader): split again over the replicas it would train on a fraction of the data."""
    ext = strategy.extended
    sampler = distributed_sampler(source)
    if sampler is None or sampler.num_replicas == 1 or ext.num_replicas_in_sync == 1:
        return
    shares = sampler.num_replicas
    batch = getattr(source, "batch_size", None) or getattr(getattr(source, "batch_sampler", None), "batch_size", None)
    whole = (f"batch_size={batch * shares}" if isinstance(batch, int) and not isinstance(batch, bool)
             else "batch_size=<the global batch>")
    if ext.num_input_pipelines > 1:
        own = (f"num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id: {ext.num_input_pipelines} and "
               f"{ext.input_pipeline_id} here, DistributedSampler's defaults under torchrun")
    else:
        own = "one input pipeline here: drop the sampler, or give it num_replicas=1"
    raise ValueError(
        f"strategy.distribute_dataset takes a loader of global batches, but this {type(source).__name__} draws its "
        f"indices from a torch.utils.data.DistributedSampler (num_replicas={shares}, rank={sampler.rank}): each of "
        f"its batches is already one of {shares} shares (DDP's per-rank loader), and splitting it again over the "
        f"{ext.num_replicas_in_sync} replicas in sync would train on 1/{shares} of the data. Either pass a loader "
        f"of the whole dataset without the sampler, DataLoader(dataset, {whole}, shuffle=...), whose global batches "
        f"distribute_dataset splits over the replicas (across workers each worker reads only its replicas' rows); "
        f"or keep the per-worker loader and pass it as strategy.distribute_datasets_from_function(lambda ctx: "
        f"loader): each of its batches is then one replica's, and its sampler must be the pipeline's "
        f"({own})")


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
            f"dataset_fn must return an iterable of per-replica batches for this input pipeline; it "
            f"returned {type(source).__name__}: {summarize(source)}")
    _check_pipeline_sampler(input_context(strategy), source)
    return DistributedDataset(strategy, source, from_function=True)


def _check_pipeline_sampler(ctx: InputContext, source: Any) -> None:
    """Refuses an input pipeline whose DistributedSampler is not this pipeline's share: the
    pipelines together would not read the dataset once per epoch."""
    sampler = distributed_sampler(source)
    if sampler is None or (sampler.num_replicas, sampler.rank) == (ctx.num_input_pipelines, ctx.input_pipeline_id):
        return
    raise ValueError(
        f"dataset_fn returned a {type(source).__name__} whose torch.utils.data.DistributedSampler has "
        f"num_replicas={sampler.num_replicas}, rank={sampler.rank}, but it feeds input pipeline "
        f"{ctx.input_pipeline_id} of {ctx.num_input_pipelines} (one per worker process; its local replicas take "
        f"its batches in turn), so the pipelines together would not read the dataset once per epoch. Build the "
        f"sampler from the context: DistributedSampler(dataset, num_replicas=ctx.num_input_pipelines, "
        f"rank=ctx.input_pipeline_id)")


class InputFunctionIterator:
    """TF 1.x's iterator of ``make_input_fn_iterator``: per step, the local replicas' parts
    of a distributed dataset (PerReplica leaves, as iterating the dataset gives them).

    ``get_next()`` is ``next(iterator)`` (StopIteration at the end, where TF raised
    OutOfRangeError); ``initialize()`` starts a new pass over the dataset and returns
    ``[]`` (TF 1.x returned the initializer ops to run: there are none here).
    """

    def __init__(self, dataset: DistributedDataset):
        self._dataset = dataset
        self._iterator: Iterator[Any] = iter(dataset)

    def __iter__(self) -> "InputFunctionIterator":
        return self

    def __next__(self) -> Any:
        return next(self._iterator)

    def get_next(self) -> Any:
        """The next step's per-replica inputs."""
        return next(self._iterator)

    def initialize(self) -> list[Any]:
        """Starts a new pass over the dataset; ``[]``: no initializer ops to run."""
        self._iterator = iter(self._dataset)
        return []

    def __repr__(self) -> str:
        return f"InputFunctionIterator({self._dataset!r})"


class NumpyDataset(Dataset):
    """The rows of NumPy arrays (or tensors, or a nest of them), TF's
    ``experimental_make_numpy_dataset``: item ``i`` is the nest with row ``i`` of every
    array, as tensors on the CPU. A list of arrays is stacked into one array, as
    ``tf.data.Dataset.from_tensor_slices`` does; a tuple or dict is a nest. Batch it with
    a ``DataLoader`` and pass that to ``strategy.distribute_dataset``.

    Raises:
        ValueError: a leaf that is not an array, tensor or number list, a 0-d leaf, or
            leaves with different numbers of rows.
    """

    def __init__(self, numpy_input: Any):
        leaves, self._spec = nest.flatten(numpy_input, is_leaf=lambda x: isinstance(x, list))
        if not leaves:
            raise ValueError(f"numpy_input must hold at least one array; got {summarize(numpy_input)}")
        self._tensors = [_as_rows(leaf, p) for p, leaf in enumerate(leaves)]
        rows = {t.shape[0] for t in self._tensors}
        if len(rows) != 1:
            raise ValueError(f"every array of numpy_input must have the same number of rows (its first dimension); "
                             f"got {[t.shape[0] for t in self._tensors]} rows")
        self._rows = rows.pop()

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> Any:
        return nest.unflatten(self._spec, [t[index] for t in self._tensors])

    def __repr__(self) -> str:
        return f"NumpyDataset(rows={self._rows}, shapes={[list(t.shape) for t in self._tensors]})"


def _as_rows(leaf: Any, position: int) -> torch.Tensor:
    """A leaf of a numpy input as a CPU tensor with at least one dimension (its rows)."""
    try:
        value = _stacked(leaf)
        t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.tensor(value)  # a copy, as TF's
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"numpy_input leaf {position} must be a NumPy array, a tensor or a list of equal-shape "
                         f"arrays or numbers; got {summarize(leaf)} ({e})") from None
    if t.dim() == 0:
        raise ValueError(f"numpy_input leaf {position} is a scalar ({summarize(leaf)}); a dataset's arrays need a "
                         f"first dimension of rows")
    return t


def _stacked(leaf: Any) -> Any:
    """A list of NumPy arrays or of tensors as one stacked array (tf.data's rule); anything
    else as it is."""
    if isinstance(leaf, list) and leaf and all(isinstance(x, torch.Tensor) for x in leaf):
        return torch.stack([x.detach().cpu() for x in leaf])
    if isinstance(leaf, list) and leaf and all(type(x).__module__ == "numpy" for x in leaf):
        import numpy

        return numpy.stack(leaf)
    return leaf


def distribute_values_from_function(strategy: "Strategy", value_fn: Callable[[ValueContext], Any]) -> Any:
    """The implementation of ``Strategy.experimental_distribute_values_from_function``:
    ``value_fn(ValueContext)`` once per local replica (under its CUDA device), its
    tensors moved to that replica's device, regrouped into PerReplica values."""
    if not callable(value_fn):
        raise ValueError(f"value_fn must be callable as value_fn(value_context); got {summarize(value_fn)}")
    ext = strategy.extended
    values = []
    for rid, device in zip(ext.local_replica_ids, ext.worker_devices):
        ctx = ValueContext(rid, ext.num_replicas_in_sync)
        if device.type == "cuda":
            with torch.cuda.device(device):
                value = value_fn(ctx)
        else:
            value = value_fn(ctx)
        values.append(nest.map_structure(
            lambda x, d=device: x.to(d) if isinstance(x, torch.Tensor) else x, value))
    return regroup(values, always_wrap=True)
