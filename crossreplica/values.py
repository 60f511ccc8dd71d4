"""Distributed values: one value per local replica, and the regroup/select walk.

``regroup`` turns "one nest per replica" into "one nest of DistributedValues";
``select_replica`` is its inverse for one replica. Both follow tf.distribute:
leaves that are the same object on every replica stay unwrapped, containers
keep their class, and with a single replica regroup is the identity unless
``always_wrap``. What a container is, is :mod:`crossreplica.nest`'s call
(builtins, types registered with torch's pytree, dataclasses); a pytree or
dataclass object that is the same object on every replica is kept as it is,
like a shared leaf.

Layer: bottom (layer 0); see docs/architecture.md.
"""

from __future__ import annotations

from collections import abc
from typing import Any
from collections.abc import Sequence

from . import nest
from .arguments import check_int
from .errors import summarize

__all__ = [
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "regroup",
    "select_replica",
    "select_replica_mirrored",
]


class DistributedValues:
    """Base class: one value per local replica, in local replica order."""

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        if isinstance(values, (str, bytes)) or not isinstance(values, abc.Sequence) or not values:
            raise ValueError(
                f"values must be a non-empty sequence with one value per replica; got {summarize(values)}")
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}({{{body}}})"


class PerReplica(DistributedValues):
    """Values that may differ between replicas (inputs, per-replica results)."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """Values that are identical on every replica (model copies, reduced results)."""

    __slots__ = ()


def regroup(values: Sequence[Any], wrap_class: type[DistributedValues] = PerReplica,
            always_wrap: bool = False) -> Any:
    """Turns a sequence of per-replica nests into one nest of ``wrap_class`` leaves.

    Raises:
        ValueError: the nests differ in structure; the message gives the path.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, abc.Sequence) or len(values) == 0:
        raise ValueError(
            f"values must be a non-empty sequence with one nest per replica; got {summarize(values)}")
    if not (isinstance(wrap_class, type) and issubclass(wrap_class, DistributedValues)):
        raise ValueError(
            f"wrap_class must be a subclass of cr.DistributedValues; got {summarize(wrap_class)}")
    return _regroup(tuple(values), wrap_class, always_wrap, ())


def _regroup(values: tuple, wrap_class: type, always_wrap: bool, path: tuple) -> Any:
    v0 = values[0]
    k = nest.kind(v0)
    if k is not None and k in (nest.PYTREE, nest.DATACLASS) and not always_wrap and all(
            v is v0 for v in values[1:]):
        return v0  # a user object shared by every replica, like a shared leaf
    if k is not None:
        for r, v in enumerate(values[1:], start=1):
            why = nest.node_mismatch(v0, v)
            if why is not None:
                who = (f"replica 0 has {type(v0).__name__}, replica {r} {why}" if why.startswith("has ")
                       else f"replica 0 and replica {r} have {why}")
                raise ValueError(f"regroup: replicas disagree in structure at {nest.path_str(path)}: {who}")
        keys, _ = nest.children(v0)
        columns = zip(*(nest.children_like(v0, v) for v in values))
        items = (_regroup(tuple(column), wrap_class, always_wrap, path + (k,))
                 for k, column in zip(keys, columns))
        return nest.rebuild(v0, keys, items)
    if not always_wrap and all(v is v0 for v in values[1:]):
        return v0
    return wrap_class(values)


def select_replica(replica_id: int, structured: Any) -> Any:
    """The part of ``structured`` that belongs to replica ``replica_id``."""
    def get(x: Any) -> Any:
        if isinstance(x, DistributedValues):
            return _pick(x, replica_id)
        return x
    return nest.map_structure(get, structured)


def select_replica_mirrored(replica_id: int, structured: Any) -> Any:
    """Like :func:`select_replica`, but every distributed leaf must be Mirrored."""
    def get(x: Any) -> Any:
        if isinstance(x, DistributedValues):
            if not isinstance(x, Mirrored):
                raise TypeError(
                    f"select_replica_mirrored expects every distributed leaf to be cr.Mirrored; "
                    f"got {type(x).__name__}: {summarize(x)}")
            return _pick(x, replica_id)
        return x
    return nest.map_structure(get, structured)


def _pick(x: DistributedValues, replica_id: int) -> Any:
    n = len(x.values)
    return x.values[check_int(replica_id, "replica_id", low=0, high=n,
                              hint=f" for {type(x).__name__} with {n} values")]
