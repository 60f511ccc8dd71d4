"""Distributed values: one value per local replica, and the regroup/select walk.

``regroup`` turns "one nest per replica" into "one nest of DistributedValues";
``select_replica`` is its inverse for one replica. Both follow tf.distribute:
leaves that are the same object on every replica stay unwrapped, containers
keep their class, and with a single replica regroup is the identity unless
``always_wrap``. What a container is, is :mod:`crossreplica.nest`'s call
(builtins, types registered with torch's pytree, dataclasses); a pytree or
dataclass object that is the same object on every replica is kept as it is,
like a shared leaf.
"""

from __future__ import annotations

from collections import abc
from typing import Any
from collections.abc import Callable, Sequence

import torch

from . import nest
from .arguments import check_int
from .errors import ReplicaContextError, summarize

__all__ = [
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "regroup",
    "select_replica",
    "select_replica_mirrored",
    "register_local_index",
]

# Where the running replica sits among the local replicas: ``() -> (index, local count)``,
# or None in cross-replica context. The context layer registers it (values sits below it).
def _no_replica() -> "tuple[int, int] | None":
    return None


_local_index: Callable[[], "tuple[int, int] | None"] = _no_replica


def register_local_index(fn: Callable[[], "tuple[int, int] | None"]) -> None:
    """Sets how a distributed value finds the running replica's copy (the context layer's)."""
    global _local_index
    _local_index = fn


class LocalValueError(ReplicaContextError, AttributeError):
    """A distributed value was used as its replica's copy outside a replica function. Also an
    AttributeError, so ``getattr(value, name, default)`` and ``hasattr`` keep working."""


class DistributedValues:
    """Base class: one value per local replica, in local replica order.

    Inside a replica function it acts as the running replica's value, as TF's do: calling
    it, and reading or setting a public attribute, go to that value (:meth:`local_value`).

    In cross-replica context there is no running replica, with one exception: values that
    are all ``torch.nn.Module`` switch mode together. ``train(mode=True)`` and ``eval()``
    set the mode of every local copy and return this value (as torch's return the module);
    ``training`` reads the copies' common mode. These draw nothing from any random stream,
    where ``strategy.run(lambda m: m.eval(), args=(model,))`` draws the run's base from the
    caller's generator and so shifts every later dropout mask."""

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

    def local_value(self) -> Any:
        """The running replica's copy: inside ``strategy.run`` (or an update context) the value
        of this replica; elsewhere a LocalValueError (a ReplicaContextError) saying what to do."""
        where = _local_index()
        what = f"{type(self).__name__} of {type(self._values[0]).__name__}"
        if where is None:
            raise LocalValueError(
                f"this {what} stands for one copy per replica, so it has no single value in cross-replica "
                f"context (outside strategy.run); use it inside the replica function that strategy.run "
                f"runs, or pick a copy with strategy.experimental_local_results(value)[i]")
        index, count = where
        if count != len(self._values):
            raise ValueError(
                f"this {what} holds {len(self._values)} values, but the running strategy has {count} local "
                f"replicas; use it with the strategy that made it")
        return self._values[index]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the running replica's copy (a mirrored model: its forward)."""
        return self.local_value()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only public names: the running replica's copy's (``model.parameters``, ``opt.step``).
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name in _MODE_NAMES and _local_index() is None and all(
                isinstance(v, torch.nn.Module) for v in self._values):
            return _every_copy(self, name)
        return getattr(self.local_value(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A public name sets the running replica's copy's attribute (``model.training = False``).
        if name in DistributedValues.__slots__ or name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.local_value(), name, value)

    def __repr__(self) -> str:
        body = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}({{{body}}})"


#: What a DistributedValues of modules does on every local copy in cross-replica context.
_MODE_NAMES = frozenset({"train", "eval", "training"})


def _every_copy(value: DistributedValues, name: str) -> Any:
    """``train`` / ``eval`` applied to every module of ``value``, or their common ``training``."""
    modules = value.values
    if name == "training":
        modes = [m.training for m in modules]
        if any(mode != modes[0] for mode in modes):
            raise LocalValueError(
                f"the copies of this {type(value).__name__} of {type(modules[0]).__name__} are in different "
                f"modes (training: {modes}), so it has no single mode; call value.train() or value.eval() in "
                f"cross-replica context to set every copy")
        return modes[0]

    def switch(*args: Any, **kwargs: Any) -> DistributedValues:
        for m in modules:
            getattr(m, name)(*args, **kwargs)
        return value

    switch.__name__ = name
    switch.__doc__ = f"``{name}`` on every local copy (torch.nn.Module.{name}); returns this value."
    return switch


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
    # The common case, on every run for every replica: ``args`` (a tuple) and ``kwargs`` (a
    # dict) whose items are leaves or distributed values, picked without walking the nest.
    t = type(structured)
    if t is dict and not structured:
        return {}
    if t is tuple and type(replica_id) is int:
        picked = []
        for x in structured:
            if isinstance(x, DistributedValues):
                values = x.values
                if not 0 <= replica_id < len(values):
                    return _select(replica_id, structured)  # the error names the count
                picked.append(values[replica_id])
            elif nest.kind(x) is None:
                picked.append(x)
            else:
                return _select(replica_id, structured)
        return tuple(picked)
    return _select(replica_id, structured)


def _select(replica_id: int, structured: Any) -> Any:
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
