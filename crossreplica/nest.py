"""The one nest walker of the library.

A nest is a leaf or a container of nests. Containers are tuples (namedtuples
keep their class, built with ``_make`` so a custom ``__new__`` is not re-run),
lists, and any ``collections.abc.Mapping`` (rebuilt as its own class; keys in
the order of the first nest). Everything else, DistributedValues included, is
a leaf. Every part of crossreplica that walks user structures goes through
:func:`children` and :func:`rebuild`, so they all agree on what a nest is.
"""

from __future__ import annotations

import collections
from collections import abc
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = ["is_container", "is_namedtuple", "children", "rebuild", "flatten", "unflatten", "map_structure", "path_str"]


def is_container(x: Any) -> bool:
    return isinstance(x, (tuple, list, abc.Mapping))


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields") and hasattr(x, "_make")


_is_namedtuple = is_namedtuple


def children(x: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Returns ``(keys, items)`` of a container: indices for sequences, keys for mappings."""
    if isinstance(x, abc.Mapping):
        keys = tuple(x.keys())
        return keys, tuple(x[k] for k in keys)
    return tuple(range(len(x))), tuple(x)


def rebuild(template: Any, keys: Sequence[Any], items: Iterable[Any]) -> Any:
    """A container of ``template``'s kind holding ``items`` (under ``keys`` for mappings)."""
    items = list(items)
    if isinstance(template, abc.Mapping):
        pairs = dict(zip(keys, items))
        if isinstance(template, collections.defaultdict):
            return type(template)(template.default_factory, pairs)
        return type(template)(pairs)
    if _is_namedtuple(template):
        return template._make(items)
    if isinstance(template, tuple):
        if type(template) is tuple:
            return tuple(items)
        try:
            return type(template)(items)
        except TypeError:
            return tuple(items)
    return items


def path_str(path: Sequence[Any]) -> str:
    return "".join(f"[{k!r}]" for k in path) or "<root>"


class _Spec:
    """Structure of a flattened nest: a leaf marker or a container with child specs."""

    __slots__ = ("template", "keys", "kids", "num_leaves")

    def __init__(self, template: Any, keys: tuple, kids: tuple["_Spec", ...] | None):
        self.template = template
        self.keys = keys
        self.kids = kids
        self.num_leaves = 1 if kids is None else sum(k.num_leaves for k in kids)


_LEAF = _Spec(None, (), None)


def flatten(nest: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], _Spec]:
    """Leaves of ``nest`` in a fixed order, and the spec :func:`unflatten` needs."""
    leaves: list[Any] = []
    spec = _walk(nest, leaves, is_leaf)
    return leaves, spec


def _walk(x: Any, leaves: list[Any], is_leaf: Callable[[Any], bool] | None) -> _Spec:
    if not is_container(x) or (is_leaf is not None and is_leaf(x)):
        leaves.append(x)
        return _LEAF
    keys, items = children(x)
    return _Spec(x, keys, tuple([_walk(i, leaves, is_leaf) for i in items]))


def unflatten(spec: _Spec, leaves: Sequence[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    return _build(spec, iter(leaves))


def _build(spec: _Spec, it: Iterator[Any]) -> Any:
    # A module-level function: a recursive closure would form a reference cycle
    # that keeps every leaf (often large tensors) alive until the cyclic GC runs.
    if spec.kids is None:
        return next(it)
    return rebuild(spec.template, spec.keys, [_build(k, it) for k in spec.kids])


def map_structure(fn: Callable[..., Any], nest: Any) -> Any:
    """``fn`` applied to every leaf, structure kept."""
    if not is_container(nest):
        return fn(nest)
    keys, items = children(nest)
    return rebuild(nest, keys, (map_structure(fn, i) for i in items))
