"""The state walker: a nest of live training objects -> a plain nest of tensors and builtins.

What each leaf of the nest given to ``cr.save`` becomes (the first rule that
matches; :func:`kind` is the one place that decides, and restoring uses it too):

* ``Mirrored``: replica 0's copy, walked (every copy is the same; on the chief
  local replica 0 is global replica 0). Copies that differ are a warning (they
  were trained without a cross-replica reduction): local ones compared here,
  those of other workers by digest with the PerReplica values (:mod:`.per_replica`).
* ``PerReplica``: every local replica's value, walked; then compared across
  all replicas (:mod:`.per_replica`): one value if they are all the same,
  else one value per replica.
* a tensor: a detached copy on the CPU, so a checkpoint loads on any device.
* stateful: anything with ``state_dict()`` and ``load_state_dict()`` (modules,
  optimizers and ``cr.CrossShardOptimizer``, LR schedulers,
  ``torch.amp.GradScaler``, ``cr.Variable``, your own classes): its
  ``state_dict()``, walked.
* a random stream: a ``torch.Generator`` (``torch.default_generator`` is torch's
  CPU stream), anything with ``get_state()`` / ``set_state()`` (numpy's
  ``RandomState``, per-replica streams) or ``getstate()`` / ``setstate()``
  (``random.Random``, the ``random`` module): its state.
* containers (dicts, lists, tuples, dataclasses, ...): walked.
* anything else is kept as it is (numbers, strings, numpy values...).

The walk runs on every worker: a ``cr.Variable`` that aggregates when read
(ON_READ) and the comparison of per-replica values are collectives.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from .. import nest
from ..errors import ReplicaContextError, ReplicasDivergeWarning
from ..values import Mirrored, PerReplica

if TYPE_CHECKING:
    from ..strategies.base import Strategy

__all__ = ["MIRRORED", "PER_REPLICA", "TENSOR", "STATEFUL", "GENERATOR", "GET_STATE", "GETSTATE",
           "Unsettled", "capture", "kind", "local_ids_for", "warn_copies_differ", "where"]

MIRRORED, PER_REPLICA, TENSOR, STATEFUL = "mirrored", "per_replica", "tensor", "stateful"
GENERATOR, GET_STATE, GETSTATE = "generator", "get_state", "getstate"

#: What reads and writes the state of each kind of random stream.
RNG_METHODS = {GENERATOR: ("get_state", "set_state"), GET_STATE: ("get_state", "set_state"),
               GETSTATE: ("getstate", "setstate")}


def _has(obj: Any, *names: str) -> bool:
    return all(callable(getattr(obj, n, None)) for n in names)


def kind(obj: Any) -> str | None:
    """What ``obj`` is to a checkpoint (the kinds in the module docstring), or None for a
    container or a plain value."""
    if isinstance(obj, Mirrored):
        return MIRRORED
    if isinstance(obj, PerReplica):
        return PER_REPLICA
    if isinstance(obj, torch.Tensor):
        return TENSOR
    if isinstance(obj, type):  # a class is never state (its methods are unbound)
        return None
    if _has(obj, "state_dict", "load_state_dict"):
        return STATEFUL
    if isinstance(obj, torch.Generator):
        return GENERATOR
    if _has(obj, "get_state", "set_state"):
        return GET_STATE
    if _has(obj, "getstate", "setstate"):
        return GETSTATE
    return None


def where(root: str, path: tuple) -> str:
    """``state['opt'][0]``: the place in the user's nest a message names."""
    return root + ("" if not path else nest.path_str(path))


class Unsettled:
    """A PerReplica's local values, walked, before they are compared across replicas; or a
    Mirrored's compared part (``local``), only to warn when the workers' copies differ, and
    the copy to save (``mirrored``)."""

    __slots__ = ("where", "local", "mirrored")

    def __init__(self, where: str, local: list[Any], mirrored: Any = None):
        self.where = where
        self.local = local
        self.mirrored = mirrored


def capture(state: Any, strategy: Strategy, unsettled: list[Unsettled], path: tuple = ()) -> Any:
    """``state`` as a plain nest; each PerReplica becomes an :class:`Unsettled` appended to
    ``unsettled`` (settled by :func:`.per_replica.settle`)."""
    k = kind(state)
    if k == MIRRORED:
        first = capture(state.values[0], strategy, unsettled, path)
        trained = _trained(state.values[0], first)
        for i, other in enumerate(state.values[1:], 1):
            if not _same(trained, _trained(other, capture(other, strategy, [], path))):
                warn_copies_differ(where("state", path), f"local copy {i} is not copy 0")
        ext = strategy.extended
        local = len(ext.local_replica_ids)
        if local == ext.num_replicas_in_sync:
            return first
        # Other workers hold copies too: compared by digest with the PerReplica values.
        entry = Unsettled(where("state", path), [trained] * local, mirrored=first)
        unsettled.append(entry)
        return entry
    if k == PER_REPLICA:
        return _per_replica(state, strategy, unsettled, path)
    if k == TENSOR:
        return state.detach().to("cpu", copy=True)
    if k == STATEFUL:
        return capture(state.state_dict(), strategy, unsettled, path)
    if k is not None:  # a random stream
        value = getattr(state, RNG_METHODS[k][0])()
        return capture(value, strategy, unsettled, path)
    if nest.is_container(state):
        keys, items = nest.children(state)
        return nest.rebuild(state, keys, [capture(v, strategy, unsettled, path + (key,))
                                          for key, v in zip(keys, items)])
    return state


def local_ids_for(value: Any, strategy: Strategy, api: str, name: str, hint: str) -> tuple[int, ...]:
    """The strategy's local replica ids, one per value of ``value`` (a DistributedValues);
    a ValueError naming ``name`` when the counts differ (``value`` belongs to another strategy)."""
    local_ids = tuple(strategy.extended.local_replica_ids)
    if len(value.values) != len(local_ids):
        raise ValueError(
            f"{api}: {name} is a {type(value).__name__} of {len(value.values)} values, but the strategy "
            f"{type(strategy).__name__} has {len(local_ids)} local replicas; call {api} under the scope "
            f"of {hint} (or pass strategy=)")
    return local_ids


def _per_replica(value: PerReplica, strategy: Strategy, unsettled: list[Unsettled], path: tuple) -> Unsettled:
    name = where("state", path)
    local_ids_for(value, strategy, "cr.save", name, "the strategy whose run returned it")
    nested: list[Unsettled] = []  # a PerReplica inside a PerReplica is one value per replica already
    try:
        local = [capture(v, strategy, nested, path) for v in value.values]
    except ReplicaContextError:
        # A state_dict that is a collective among the replicas (a CrossShardOptimizer with
        # shard_optimizer_state=True) is taken inside the replicas.
        if not all(kind(v) == STATEFUL for v in value.values):
            raise
        local = [capture(sd, strategy, nested, path) for sd in
                 strategy.experimental_local_results(strategy.run(_state_dict_of, args=(value,)))]
    if nested:
        raise TypeError(f"cr.save: {name} is a PerReplica that holds PerReplica values; give one "
                        f"value per replica")
    entry = Unsettled(name, local)
    unsettled.append(entry)
    return entry


def _same(a: Any, b: Any) -> bool:
    """Whether two captured nests hold the same values (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.eq(a, b).logical_or(a.ne(a) & b.ne(b)).all()))
    if nest.is_container(a) and nest.is_container(b) and type(a) is type(b):
        (ka, va), (kb, vb) = nest.children(a), nest.children(b)
        return list(ka) == list(kb) and all(_same(x, y) for x, y in zip(va, vb))
    try:
        return bool(a == b)
    except Exception:  # values that do not compare (arrays...) count as the same
        return True


def _trained(obj: Any, captured: Any) -> Any:
    """What an optimizer step keeps the same on a Mirrored's copies: a module's state without
    its buffers (``sync_buffers=None`` lets those differ, with an UnsyncedBuffersWarning)."""
    if not isinstance(obj, torch.nn.Module) or not isinstance(captured, dict):
        return captured
    buffers = {name for name, _ in obj.named_buffers()}
    return {k: v for k, v in captured.items() if k not in buffers}


def warn_copies_differ(name: str, which: str) -> None:
    """The warning of a Mirrored whose copies differ (``which`` says which do)."""
    warnings.warn(
        f"cr.save: the copies of the Mirrored at {name} differ ({which}), and the checkpoint keeps replica 0's "
        f"only. Mirrored copies drift apart when they are trained without a cross-replica reduction, e.g. a "
        f"plain torch.optim optimizer stepping each copy on its own shard; wrap it as "
        f"cr.CrossShardOptimizer(torch.optim....) (or all-reduce the gradients) so every copy takes the same "
        f"step", ReplicasDivergeWarning, stacklevel=4)


def _state_dict_of(obj: Any) -> Any:
    return obj.state_dict()
