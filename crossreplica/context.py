"""Strategy and replica contexts: a thread-local stack, as in tf.distribute.

This module imports nothing of crossreplica but errors, reduce_op and values (it
tells a distributed value which replica runs: ``values.register_local_index``).
What it needs from a strategy is the typed :class:`StrategyLike` /
:class:`ReplicaHost` interface below, and the default strategy comes from a
factory the strategies layer registers (:func:`register_default_strategy`).

Entering ``strategy.scope()`` pushes a cross-replica frame; each replica thread
of ``strategy.run`` pushes a replica frame holding its :class:`ReplicaContext`;
``merge_call`` pushes a cross-replica frame while ``merge_fn`` runs. The stack
is the only mutable module-level state of crossreplica.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable, Iterator

from . import values
from .errors import ReplicaAborted, ReplicaContextError
from .reduce_op import ReduceOp

if TYPE_CHECKING:
    import torch

    from .engines.base import Engine

__all__ = [
    "ReplicaContext",
    "ReplicaHost",
    "StrategyLike",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "get_replica_context",
    "current_replica_context",
    "register_default_strategy",
    "update_context",
    "current_update",
    "options_or_hints",
]


class ReplicaHost(Protocol):
    """What a replica context needs from its strategy's machinery (``strategy.extended``)."""

    @property
    def worker_devices(self) -> "tuple[torch.device, ...]":
        """The local replicas' devices, in local order."""

    @property
    def logical_devices(self) -> "tuple[tuple[torch.device, ...], ...]":
        """Per local replica, every device it owns (its own device first)."""

    @property
    def run_token(self) -> object:
        """Identifies the run in progress; a new run gets a new token."""

    @property
    def engine(self) -> "Engine":
        """The engine the replicas' collectives run on."""

    def merge_call(self, rctx: "ReplicaContext", merge_fn: Callable[..., Any], args: tuple,
                   kwargs: dict, timeout: float | None = None) -> Any:
        """Runs ``merge_fn`` once for the local replicas (see ReplicaContext.merge_call)."""

    def replica_all_reduce(self, rctx: "ReplicaContext", reduce_op: ReduceOp | str, value: Any,
                           options: Any = None) -> Any:
        """``ReplicaContext.all_reduce``: reduces ``value`` over every replica in sync,
        through the strategy's cross-device ops."""

    def replica_all_gather(self, rctx: "ReplicaContext", value: Any, axis: int) -> Any:
        """``ReplicaContext.all_gather``: concatenates ``value`` over every replica in sync."""

    def experimental_logical_device(self, logical_device_id: int) -> contextlib.AbstractContextManager[Any]:
        """A block on logical device ``logical_device_id`` (``ReplicaContext.experimental_logical_device``)."""


class StrategyLike(Protocol):
    """What the context stack needs from a strategy."""

    @property
    def extended(self) -> ReplicaHost: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]: ...


Frame = tuple[StrategyLike, "ReplicaContext | None"]


class _Stack(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.updates: list[tuple[Any, int]] = []  # update contexts: (strategy, copy index)


_stack = _Stack()
_default_factory: Callable[[], StrategyLike] | None = None
_default_strategy: StrategyLike | None = None
_default_lock = threading.Lock()
_default_replica_context: "ReplicaContext | None" = None


def register_default_strategy(factory: Callable[[], StrategyLike]) -> None:
    """Sets how the strategy used outside any scope is built (once, lazily).

    The strategies layer registers its single-replica strategy here, so this
    module never imports a layer above it."""
    global _default_factory, _default_strategy, _default_replica_context
    with _default_lock:
        _default_factory, _default_strategy, _default_replica_context = factory, None, None


def push(strategy: StrategyLike, replica_context: "ReplicaContext | None") -> None:
    _stack.frames.append((strategy, replica_context))


def pop() -> None:
    _stack.frames.pop()


def top() -> Frame | None:
    frames = _stack.frames
    return frames[-1] if frames else None


@contextlib.contextmanager
def frame(strategy: StrategyLike, replica_context: "ReplicaContext | None") -> Iterator[None]:
    push(strategy, replica_context)
    try:
        yield
    finally:
        pop()


@contextlib.contextmanager
def update_context(strategy: StrategyLike, index: int) -> Iterator[None]:
    """TF's UpdateContext: inside it (cross-replica context) a variable of ``strategy`` is
    its copy ``index``: reads give that copy, updates change that copy only. What
    ``strategy.extended.update_non_slot`` runs ``fn`` in, once per device."""
    _stack.updates.append((strategy, index))
    try:
        yield
    finally:
        _stack.updates.pop()


def current_update() -> "tuple[Any, int] | None":
    """The innermost update context of this thread: (strategy, copy index), or None."""
    updates = _stack.updates
    return updates[-1] if updates else None


def _default() -> StrategyLike:
    global _default_strategy
    if _default_strategy is None:
        with _default_lock:
            if _default_strategy is None:
                if _default_factory is None:
                    raise RuntimeError("no default strategy is registered; import crossreplica first")
                _default_strategy = _default_factory()
    return _default_strategy


def get_strategy() -> Any:
    """The strategy in scope, or a single-replica default strategy when none is."""
    t = top()
    return t[0] if t is not None else _default()


def has_strategy() -> bool:
    """True inside ``strategy.scope()`` or a replica function."""
    return top() is not None


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (or ``merge_fn``) but not in a replica function."""
    t = top()
    return t is not None and t[1] is None


def _local_index() -> "tuple[int, int] | None":
    """(index, count) of the running replica among the local ones, for a distributed value
    used as its copy; in an update context its device's; else None."""
    t = top()
    if t is not None and t[1] is not None and not isinstance(t[1], _DefaultReplicaContext):
        return t[1].local_index, len(t[1]._host.worker_devices)
    update = current_update()
    if update is not None:
        return update[1], len(update[0].extended.worker_devices)
    return None


values.register_local_index(_local_index)


def current_replica_context() -> "ReplicaContext | None":
    """The context of the replica function running in this thread; None outside one (the
    library's own test: the default replica context is not a replica function's)."""
    t = top()
    return t[1] if t is not None else None


def get_replica_context() -> "ReplicaContext | None":
    """The current replica's context, as TF's: inside a replica function its own; in
    cross-replica context (``strategy.scope()``, ``merge_fn``) None; outside any strategy
    the default strategy's single replica (id 0 of 1, ``all_reduce`` the identity)."""
    t = top()
    if t is not None:
        return t[1]
    global _default_replica_context
    if _default_replica_context is None:
        _default_replica_context = _DefaultReplicaContext(_default())
    return _default_replica_context


def require_replica_context(api: str) -> "ReplicaContext":
    """The replica context, or a ReplicaContextError that says how to call ``api``."""
    t = top()
    if t is None or t[1] is None:
        where = "in cross-replica context (strategy.scope() or merge_fn)" if t else "outside any strategy"
        raise ReplicaContextError(
            f"{api} must be called inside a replica function, but was called {where}; "
            f"run it as strategy.run(fn, args=...) where fn calls {api}, or in cross-replica "
            f"context use strategy.reduce / strategy.extended.reduce_to instead")
    return t[1]


class ReplicaContext:
    """What a replica function knows about itself and its peers."""

    __slots__ = ("_strategy", "_host", "_replica_id", "_local_index", "_engine", "_run", "micro_batch", "collectives",
                 "__weakref__")

    def __init__(self, strategy: StrategyLike, replica_id: int, local_index: int, engine: "Engine",
                 run: object = None):
        self._strategy = strategy
        self._host = strategy.extended
        self._replica_id = replica_id
        self._local_index = local_index
        self._engine = engine
        self._run = run  # the run this context belongs to (its host's run_token then)
        #: In the layout-invariant mode, the micro-batch being run (a ``MicroBatch``); else None.
        self.micro_batch: Any = None
        #: collectives and merge_calls this replica has made in the run (optim/guards.py reads it)
        self.collectives = 0

    def check_current(self, prefix: str, name: object = "") -> None:
        """Raises if this replica's run was abandoned (a later run is under way).

        A replica left behind by a failed run must not join the collectives of
        the next run in its seat. ``prefix + name`` names the API; it is joined
        only when raising, since this runs on every collective (and counts it)."""
        self.collectives += 1
        if self._run is not None and self._host.run_token is not self._run:
            raise ReplicaAborted(
                f"{prefix}{name} was called by replica {self._replica_id} of a run that already failed and "
                f"was abandoned; it does not take part in later runs")

    @property
    def strategy(self) -> Any:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._engine.num_replicas

    @property
    def devices(self) -> "tuple[torch.device, ...]":
        """Every device of this replica: its logical devices, its own device first."""
        return tuple(self._host.logical_devices[self._local_index])

    @property
    def device(self) -> "torch.device":
        return self._host.worker_devices[self._local_index]

    @property
    def engine(self) -> "Engine":
        return self._engine

    @property
    def local_index(self) -> int:
        return self._local_index

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None, *,
                   experimental_hints: Any = None) -> Any:
        """All-reduces a nest of tensors over every replica in sync through the strategy's
        ``cross_device_ops`` (``options``: a ``cr.CommunicationOptions``; its
        ``timeout_seconds`` bounds the wait for the other replicas). ``experimental_hints``
        is TF 2.2/2.3's name for ``options`` (a DeprecationWarning, as TF's)."""
        options = options_or_hints(options, experimental_hints, "ReplicaContext.all_reduce")
        return self._host.replica_all_reduce(self, reduce_op, value, options)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's ``value`` along ``axis`` (replica order)."""
        return self._host.replica_all_gather(self, value, axis)

    def experimental_logical_device(self, logical_device_id: int) -> contextlib.AbstractContextManager[Any]:
        """TF's TPU replica context's: ``with rctx.experimental_logical_device(j):`` runs the block
        on this replica's logical device ``j``, as ``strategy.extended.experimental_logical_device(j)``
        (new tensors, and variables created there, go to that device)."""
        return self._host.experimental_logical_device(logical_device_id)

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (),
                   kwargs: dict | None = None) -> Any:
        """Pauses every local replica, runs ``merge_fn(strategy, *regrouped)`` once, resumes.

        Arguments are regrouped across the local replicas (PerReplica where they
        differ); each replica receives its part of the result (select_replica).
        """
        _check_merge_call(merge_fn, args, kwargs)
        return self._host.merge_call(self, merge_fn, tuple(args), kwargs or {})

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


def options_or_hints(options: Any, experimental_hints: Any, api: str) -> Any:
    """``options``, or ``experimental_hints``, TF 2.2/2.3's name for it (TF's
    ``CollectiveHints``, here a ``cr.CommunicationOptions``), with a DeprecationWarning as
    TF gives; both at once is a TypeError."""
    if experimental_hints is None:
        return options
    if options is not None:
        raise TypeError(f"{api} got options={options!r} and experimental_hints={experimental_hints!r}; "
                        f"experimental_hints is TF's old name for options: pass options only")
    warnings.warn(f"{api}(experimental_hints=...) is TF 2.2/2.3's name for options=; pass "
                  f"options=cr.CommunicationOptions(...) (TF's CollectiveHints)", DeprecationWarning, stacklevel=3)
    return experimental_hints


def _check_merge_call(merge_fn: Any, args: Any, kwargs: Any) -> None:
        if not callable(merge_fn):
            raise TypeError(f"merge_fn must be callable; got {merge_fn!r}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of positional arguments; got {args!r}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict or None; got {kwargs!r}")


class _DefaultReplicaContext(ReplicaContext):
    """TF's default replica context: the one replica of the default strategy, outside any
    strategy. Its reductions are the identity (one replica); ``merge_call`` runs
    ``merge_fn`` at once in the default strategy's cross-replica context."""

    __slots__ = ()

    def __init__(self, strategy: StrategyLike):
        super().__init__(strategy, 0, 0, strategy.extended.engine)  # the default strategy's engine

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def check_current(self, prefix: str, name: object = "") -> None:
        """Always current: the default context belongs to no run."""

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None, *,
                   experimental_hints: Any = None) -> Any:
        """``value`` itself: the SUM or MEAN (or MAX, ...) of one replica."""
        options_or_hints(options, experimental_hints, "ReplicaContext.all_reduce")
        ReduceOp.from_any(reduce_op, "reduce_op")
        return value

    def all_gather(self, value: Any, axis: int) -> Any:
        """``value`` itself: the concatenation of one replica's value."""
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"axis must be an int; got {axis!r}")
        return value

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (),
                   kwargs: dict | None = None) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context."""
        _check_merge_call(merge_fn, args, kwargs)
        with frame(self._strategy, None):
            return merge_fn(self._strategy, *args, **(kwargs or {}))
