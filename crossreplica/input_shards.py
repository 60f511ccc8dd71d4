"""Input sharding: a worker reads only its replicas' rows of each global batch.

A ``torch.utils.data.DataLoader`` over a map-style dataset (``len`` and
``__getitem__``) with automatic batching draws each global batch as a list of
indices from its batch sampler before it reads a row. :class:`ShardedLoader`
runs that same batch sampler (same sampler, same seed, same order: the same
global batches as every other worker) and hands the loader only the indices
of this worker's replicas, so each worker reads and collates only its share,
as TF's auto-sharding and torch's ``DistributedSampler`` do. It records each
global batch's row count, so the worker can cut its share into exactly the
per-replica parts the unsharded split would give.

An ``IterableDataset``, a loader without automatic batching (``batch_size=None``)
or with ``in_order=False``, and any other iterable cannot be sharded by index:
every worker then reads every global batch and keeps its rows.
"""

from __future__ import annotations

import collections
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

__all__ = ["split_sizes", "shardable", "distributed_sampler", "ShardedLoader"]

# DataLoader settings a sharded loader copies from the original (those it has).
_LOADER_SETTINGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                    "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                    "pin_memory_device", "in_order")


def split_sizes(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` sizes as evenly as possible, larger ones first."""
    base, extra = divmod(rows, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def shardable(source: Any) -> bool:
    """Whether ``source`` can be sharded by index: a DataLoader over a map-style dataset
    with automatic batching that delivers batches in order."""
    return (isinstance(source, DataLoader) and source.batch_sampler is not None
            and not isinstance(source.dataset, IterableDataset)
            and hasattr(source.dataset, "__len__") and getattr(source, "in_order", True))


def distributed_sampler(source: Any) -> DistributedSampler | None:
    """The ``torch.utils.data.DistributedSampler`` that ``source`` (a DataLoader or a sampler)
    draws its indices from: itself, its ``sampler`` or ``batch_sampler``, or theirs (a
    ``BatchSampler``'s sampler), a few levels down; None if there is none."""
    level = [source]
    for _ in range(4):
        below = []
        for obj in level:
            if isinstance(obj, DistributedSampler):
                return obj
            if isinstance(obj, (DataLoader, Sampler)):
                below += [getattr(obj, name, None) for name in ("batch_sampler", "sampler")]
        level = [obj for obj in below if obj is not None]
    return None


class _ShardSampler:
    """The original batch sampler's global batches, cut to one worker's replicas' indices."""

    def __init__(self, batch_sampler: Any, num_replicas: int, keep: Sequence[int],
                 split: Callable[[int], list[int]] | None = None):
        self.batch_sampler = batch_sampler
        self.num_replicas = num_replicas
        self.keep = list(keep)
        self.split = split or (lambda rows: split_sizes(rows, num_replicas))
        self.rows: collections.deque[int] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        self.rows.clear()  # a new pass: what an abandoned one queued is stale
        for batch in self.batch_sampler:
            indices = list(batch)
            sizes = self.split(len(indices))
            starts = [sum(sizes[:i]) for i in range(self.num_replicas)]
            mine = [j for part in self.keep for j in indices[starts[part]:starts[part] + sizes[part]]]
            self.rows.append(len(indices))
            # A share of no rows still fetches one, cut away later: a loader cannot collate nothing.
            yield mine if mine or not indices else indices[:1]

    def __len__(self) -> int:
        return len(self.batch_sampler)


class ShardedLoader:
    """Iterates ``(local_batch, global_rows)``: this worker's rows of each global batch of
    ``loader``, collated by the loader's own settings, and the global batch's row count.

    Args:
        loader: a DataLoader for which :func:`shardable` holds.
        num_replicas: replicas in sync over all workers.
        keep: this worker's replica ids, in local order.
        split: a global batch's rows -> each replica's rows (default: as even as possible,
            :func:`split_sizes`).
    """

    def __init__(self, loader: DataLoader, num_replicas: int, keep: Sequence[int],
                 split: Callable[[int], list[int]] | None = None):
        if not shardable(loader):
            raise ValueError(f"loader must be a DataLoader over a map-style dataset with automatic batching; "
                             f"got {loader!r}")
        self._sampler = _ShardSampler(loader.batch_sampler, num_replicas, keep, split)
        settings = {k: getattr(loader, k) for k in _LOADER_SETTINGS if hasattr(loader, k)}
        self._loader = DataLoader(loader.dataset, batch_sampler=self._sampler, **settings)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        rows = self._sampler.rows
        for batch in self._loader:
            yield batch, rows.popleft()

    def __len__(self) -> int:
        return len(self._sampler)
