"""The one nest walker of the library.

A nest is a leaf or a container of nests. Containers are:

* tuples (namedtuples keep their class, built with ``_make`` so a custom
  ``__new__`` is not re-run), lists, and any ``collections.abc.Mapping``
  (rebuilt as its own class; keys in the order of the first nest);
* every other type registered with torch's pytree
  (``torch.utils._pytree.register_pytree_node`` / ``register_dataclass``;
  ``collections.deque`` is one), taken apart and rebuilt by torch's registry
  with the flatten/unflatten functions registered for it;
* dataclass instances that are not registered: their fields are the children
  and a rebuilt instance is a shallow copy with the fields replaced (neither
  ``__init__`` nor ``__post_init__`` runs again, as a leaf may now be a
  ``PerReplica``); a rebuild whose fields are all the same objects returns
  the instance itself, so a dataclass without distributed leaves inside keeps
  its identity through ``select_replica`` and ``regroup``.

Everything else, DistributedValues included, is a leaf. Every part of
crossreplica that walks user structures goes through :func:`children` and
:func:`rebuild` (or :func:`flatten`, :func:`unflatten`, :func:`map_structure`
built on them), so they all agree on what a nest is.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections import abc
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from .torch_private import pytree

__all__ = ["is_container", "is_namedtuple", "children", "rebuild", "flatten", "unflatten", "map_structure",
           "path_str", "node_mismatch", "children_like"]

#: The kinds of container (what :func:`kind` returns for a non-leaf).
MAPPING, SEQUENCE, PYTREE, DATACLASS = "mapping", "sequence", "pytree", "dataclass"


def kind(x: Any) -> str | None:
    """The kind of container ``x`` is, or None for a leaf."""
    if isinstance(x, torch.Tensor):  # the usual leaf, first
        return None
    if isinstance(x, (tuple, list)):
        return SEQUENCE
    if isinstance(x, abc.Mapping):
        return MAPPING
    t = type(x)
    if t in pytree.SUPPORTED_NODES:
        return PYTREE
    if dataclasses.is_dataclass(t) and not isinstance(x, type):
        return DATACLASS
    return None


def is_container(x: Any) -> bool:
    return kind(x) is not None


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields") and hasattr(x, "_make")


_is_namedtuple = is_namedtuple


def _pytree_node(x: Any) -> tuple[list[Any], Any, tuple[Any, ...]]:
    """``(children, context, keys)`` of a pytree-registered ``x`` through torch's registry."""
    node = pytree.SUPPORTED_NODES[type(x)]
    items, context = node.flatten_fn(x)  # the context unflatten_fn expects
    items = list(items)
    if node.flatten_with_keys_fn is not None:  # only for the keys (its context may differ)
        pairs, _ = node.flatten_with_keys_fn(x)
        return items, context, tuple(k for k, _ in pairs)
    return items, context, tuple(range(len(items)))


def _dataclass_fields(x: Any) -> tuple[str, ...]:
    # A field declared init=False and never set is absent: not a child.
    return tuple(f.name for f in dataclasses.fields(x) if hasattr(x, f.name))


def children(x: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Returns ``(keys, items)`` of a container: indices for sequences, keys for mappings,
    ``pytree.GetAttrKey`` for dataclass fields, torch's key entries for pytree nodes."""
    k = kind(x)
    if k == MAPPING:
        keys = tuple(x.keys())
        return keys, tuple(x[key] for key in keys)
    if k == PYTREE:
        items, _, keys = _pytree_node(x)
        return keys, tuple(items)
    if k == DATACLASS:
        names = _dataclass_fields(x)
        return tuple(pytree.GetAttrKey(n) for n in names), tuple(getattr(x, n) for n in names)
    return tuple(range(len(x))), tuple(x)


def rebuild(template: Any, keys: Sequence[Any], items: Iterable[Any]) -> Any:
    """A container of ``template``'s kind holding ``items`` (under ``keys`` for mappings)."""
    items = list(items)
    k = kind(template)
    if k == MAPPING:
        pairs = dict(zip(keys, items))
        if isinstance(template, collections.defaultdict):
            return type(template)(template.default_factory, pairs)
        return type(template)(pairs)
    if k == PYTREE:
        old, context, _ = _pytree_node(template)
        if len(old) == len(items) and all(a is b for a, b in zip(old, items)):
            return template
        return pytree.SUPPORTED_NODES[type(template)].unflatten_fn(items, context)
    if k == DATACLASS:
        if all(getattr(template, key.name) is v for key, v in zip(keys, items)):
            return template
        out = copy.copy(template)
        for key, v in zip(keys, items):
            object.__setattr__(out, key.name, v)  # also for frozen dataclasses
        return out
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


def node_mismatch(a: Any, b: Any) -> str | None:
    """None if ``b`` is a container of the same structure as container ``a`` (one level);
    else what differs, e.g. ``"has list"`` or ``"length 2 vs 3"``."""
    ka = kind(a)
    if ka == MAPPING:
        if not isinstance(b, abc.Mapping):
            return f"has {type(b).__name__}"
        if set(b.keys()) != set(a.keys()):
            return f"keys {sorted(map(repr, a.keys()))} vs {sorted(map(repr, b.keys()))}"
        return None
    if ka == SEQUENCE:
        base = tuple if isinstance(a, tuple) else list
        # namedtuples are records: a different class is a different structure
        if not isinstance(b, base) or (base is tuple and type(b) is not type(a) and (
                _is_namedtuple(a) or _is_namedtuple(b))):
            return f"has {type(b).__name__}"
        return None if len(a) == len(b) else f"length {len(a)} vs {len(b)}"
    if type(b) is not type(a):
        return f"has {type(b).__name__}"
    if ka == PYTREE:
        a_items, a_context, _ = _pytree_node(a)
        b_items, b_context, _ = _pytree_node(b)
        if len(a_items) != len(b_items):
            return f"{len(a_items)} vs {len(b_items)} children"
        if not _same_context(a_context, b_context):
            return f"pytree context {a_context!r} vs {b_context!r}"
        return None
    a_fields, b_fields = _dataclass_fields(a), _dataclass_fields(b)
    return None if a_fields == b_fields else f"fields {list(a_fields)} vs {list(b_fields)}"


def _same_context(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # e.g. tensors in it (ambiguous ==): by identity
        return a is b


def children_like(template: Any, x: Any) -> tuple[Any, ...]:
    """The items of ``x`` in the order of ``template``'s keys (``x`` has its structure)."""
    if isinstance(template, abc.Mapping):
        return tuple(x[key] for key in template)
    return children(x)[1]


def path_str(path: Sequence[Any]) -> str:
    """``path`` as an index expression: ``['a'][1].field``; ``<root>`` when empty."""
    return "".join(_key_str(k) for k in path) or "<root>"


def _key_str(key: Any) -> str:
    if isinstance(key, pytree.GetAttrKey):
        return f".{key.name}"
    if isinstance(key, pytree.SequenceKey):
        return f"[{key.idx!r}]"
    if isinstance(key, pytree.MappingKey):
        return f"[{key.key!r}]"
    return f"[{key!r}]"


class _Spec:
    """Structure of a flattened nest: a leaf marker or a container with child specs."""

    __slots__ = ("template", "keys", "kids", "num_leaves")

    def __init__(self, template: Any, keys: tuple, kids: tuple["_Spec", ...] | None):
        self.template = template
        self.keys = keys
        self.kids = kids
        self.num_leaves: int = 1 if kids is None else sum(k.num_leaves for k in kids)


_LEAF = _Spec(None, (), None)


def flatten(nest: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], _Spec]:
    """Leaves of ``nest`` in a fixed order, and the spec :func:`unflatten` needs."""
    leaves: list[Any] = []
    spec = _walk(nest, leaves, is_leaf)
    return leaves, spec


def _walk(x: Any, leaves: list[Any], is_leaf: Callable[[Any], bool] | None) -> _Spec:
    if kind(x) is None or (is_leaf is not None and is_leaf(x)):
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
    if kind(nest) is None:
        return fn(nest)
    keys, items = children(nest)
    return rebuild(nest, keys, (map_structure(fn, i) for i in items))
