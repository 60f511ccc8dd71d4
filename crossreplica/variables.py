"""Variables kept in sync across replicas: ``cr.Variable`` with TF's synchronization and aggregation.

A ``cr.Variable`` created under ``strategy.scope()`` holds one copy per local
replica, on that replica's device (across processes every worker starts from
the chief's initial value). What an update does depends on where it happens,
as for tf.distribute's MirroredVariable and SyncOnReadVariable:

* ``ON_WRITE`` (and ``AUTO``): every copy stays the same. In a replica
  function ``assign`` / ``assign_add`` / ``assign_sub`` pause the replicas
  (``merge_call``) and combine what each replica passed with the
  ``aggregation``: ``SUM`` / ``MEAN`` reduce it over every replica in sync
  (every worker), ``ONLY_FIRST_REPLICA`` takes replica 0's, ``NONE`` requires
  every replica to pass the same value (a ValueError otherwise); then every
  copy gets the result. In cross-replica context an update applies to every
  copy. Reading gives the replica's own copy (replica 0's in cross-replica
  context).
* ``ON_READ`` (metrics, counters): updates in a replica function change the
  replica's own copy only; reading in cross-replica context aggregates the
  copies (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``; a collective across
  workers, so every worker reads). ``assign`` in cross-replica context sets
  each copy so that the aggregate is the value: for ``SUM`` a floating-point
  value is divided by the number of replicas (as TF does); an integer one goes
  to replica 0 and zeros to the others, so the read is exact. ``assign_add``
  with ``SUM`` in cross-replica context is a ValueError, as in TF.

A variable acts as a tensor (its value where it is read): torch functions
and operators take it, ``value()`` is the copy itself (gradients reach it),
``read_value()`` a snapshot, ``numpy()`` a NumPy array. ``state_dict`` /
``load_state_dict`` carry the value read in cross-replica context, which
``cr.save`` / ``cr.load`` round-trip.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import torch

from . import context, nest
from .arguments import NamedEnum
from .errors import ReplicaContextError, summarize
from .reduce_op import ReduceOp, check_dtype
from .values import DistributedValues, Mirrored, PerReplica, select_replica

if TYPE_CHECKING:
    from .strategies.base import Strategy  # type-only: strategies sit one sub-layer above

__all__ = ["Variable", "VariableAggregation", "VariableSynchronization"]


class VariableSynchronization(NamedEnum):
    """When a variable's copies are brought together: on every write, or when read."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(NamedEnum):
    """How the values the replicas write (ON_WRITE) or hold (ON_READ) are combined."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3

    @property
    def _cr_reduce_op(self) -> ReduceOp | None:
        """The ReduceOp this aggregation reduces with (SUM, MEAN), None for the others: what
        ``cr.ReduceOp.from_any`` (a layer below) reads, so every API that takes an op takes
        SUM and MEAN as TF 1.x's reduce and batch_reduce took them."""
        return _OPS.get(self)


_OPS = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}
_KINDS = ("assign", "assign_add", "assign_sub")


def _apply(copy: torch.Tensor, kind: str, value: torch.Tensor) -> None:
    with torch.no_grad():
        if kind == "assign":
            copy.copy_(value)
        elif kind == "assign_add":
            copy.add_(value)
        else:
            copy.sub_(value)


def _unwrap(x: Any) -> Any:
    return nest.map_structure(lambda v: v.value() if isinstance(v, Variable) else v, x)


class Variable:
    """A tensor with one copy per replica, kept in sync as ``synchronization`` and
    ``aggregation`` say (tf.distribute's MirroredVariable / SyncOnReadVariable).

    Args:
        initial_value: a tensor, number, nested list, or a callable returning one.
        trainable: whether the copies require gradients (floating-point variables
            only); default True, False for ON_READ (which must not be trainable).
        name: a name for messages and ``repr``.
        dtype: the dtype (default: the initial value's).
        synchronization: a ``cr.VariableSynchronization`` (or its name); AUTO means ON_WRITE.
        aggregation: a ``cr.VariableAggregation`` (or its name).

    Created inside a replica function (every replica creates it, as TF code under
    ``strategy.scope()`` may), the replicas meet in a ``merge_call`` that creates one
    variable from replica 0's arguments (across workers: the chief's initial value),
    and every replica gets that same variable. Create it once (the first step), not
    on every call.

    Raises:
        ValueError: ON_READ with aggregation NONE, ON_READ and trainable, or
            synchronization NONE with several replicas.
        TypeError: MEAN aggregation of a dtype that is not floating point or complex.
    """

    _cr_variable = True  # the cross-device ops (a lower layer) take it as destinations: its copies' devices

    def __new__(cls, *args: Any, **kwargs: Any) -> "Variable":
        rctx = context.current_replica_context()
        if rctx is None or not (args or kwargs):  # (no arguments: copy / pickle)
            return super().__new__(cls)
        # Every replica creates it: one variable, made once in cross-replica context.
        created: Variable = rctx.merge_call(functools.partial(_create_in_merge, cls), args=(args, kwargs))
        return created

    def __init__(self, initial_value: Any, trainable: bool | None = None, name: str | None = None,
                 dtype: torch.dtype | None = None,
                 synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
                 aggregation: VariableAggregation | str = VariableAggregation.NONE):
        if "_copies" in self.__dict__:  # made by __new__'s merge_call in a replica function
            return
        sync = VariableSynchronization.from_any(synchronization, "synchronization")
        agg = VariableAggregation.from_any(aggregation, "aggregation")
        if sync is VariableSynchronization.AUTO:
            sync = VariableSynchronization.ON_WRITE
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None; got {summarize(name)}")
        if trainable is not None and not isinstance(trainable, bool):
            raise TypeError(f"trainable must be a bool or None; got {summarize(trainable)}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None; got {summarize(dtype)}")
        strategy = context.get_strategy()
        if sync is VariableSynchronization.ON_READ:
            if agg is VariableAggregation.NONE:
                raise ValueError(
                    f"cr.Variable {name!r}: synchronization=ON_READ needs an aggregation (SUM, MEAN or "
                    f"ONLY_FIRST_REPLICA) to combine the replicas' copies when read; got aggregation=NONE")
            if trainable:
                raise ValueError(f"cr.Variable {name!r}: synchronization=ON_READ is only for variables that "
                                 f"are not trainable (metrics, counters); got trainable=True")
        if sync is VariableSynchronization.NONE and strategy.num_replicas_in_sync > 1:
            raise ValueError(f"cr.Variable {name!r}: synchronization=NONE is not supported with a strategy of "
                             f"{strategy.num_replicas_in_sync} replicas; use ON_WRITE (or AUTO) or ON_READ")
        plain = not isinstance(initial_value, DistributedValues)  # callable too: it calls its replica's copy
        value = initial_value() if callable(initial_value) and plain else initial_value
        if isinstance(value, (Variable, DistributedValues)):
            raise TypeError(f"initial_value must be a plain tensor or number, not a {type(value).__name__}; "
                            f"pass one value (every replica starts from it)")
        try:
            init = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"initial_value must be a tensor, a number or a nested list of numbers; got "
                            f"{summarize(value)} ({e})") from None
        if dtype is not None:
            init = init.to(dtype)
        if agg is VariableAggregation.MEAN:
            check_dtype(ReduceOp.MEAN, init.dtype, f"cr.Variable {name!r} with aggregation=MEAN")
        if trainable is None:
            trainable = sync is not VariableSynchronization.ON_READ
        grad = trainable and (init.dtype.is_floating_point or init.dtype.is_complex)
        ext = strategy.extended
        copies = [init.to(d, copy=True).requires_grad_(grad) for d in ext.worker_devices]
        # Across processes every worker starts from the chief's value (a collective).
        ext.broadcast_initial_state(Mirrored(copies))
        self._strategy = strategy
        self._copies = tuple(copies)
        self._name = name
        self._sync, self._agg, self._trainable = sync, agg, bool(trainable)

    # ------------------------------------------------------------ facts

    name = property(lambda self: self._name, doc="The name given at creation (or None).")
    synchronization = property(lambda self: self._sync, doc="ON_WRITE, ON_READ or NONE (AUTO became ON_WRITE).")
    aggregation = property(lambda self: self._agg, doc="How replicas' values are combined.")
    trainable = property(lambda self: self._trainable, doc="Whether the copies take part in autograd.")
    distribute_strategy = property(lambda self: self._strategy, doc="The strategy the variable belongs to.")
    values = property(lambda self: self._copies, doc="The local copies, one per local replica, in local order.")
    dtype = property(lambda self: self._copies[0].dtype, doc="The dtype of every copy.")
    shape = property(lambda self: self._copies[0].shape, doc="The shape of every copy.")

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self._copies[0].size(dim)

    def dim(self) -> int:
        return self._copies[0].dim()

    @property
    def device(self) -> torch.device:
        """The device of the copy read here (the replica's; replica 0's in cross-replica context)."""
        local = self._local()
        return (local if local is not None else self._copies[0]).device

    def _local(self) -> torch.Tensor | None:
        """This replica's copy, or None in cross-replica context."""
        rctx = context.current_replica_context()
        if rctx is None:
            update = context.current_update()
            if update is not None and update[0] is self._strategy:
                index = update[1]
                if not 0 <= index < len(self._copies):
                    raise ValueError(f"{self._what()} has {len(self._copies)} local copies, but is used in the "
                                     f"update of device {index}; update it on non_slot_devices()")
                return self._copies[index]
            return None
        if rctx.strategy is not self._strategy:
            raise ValueError(f"{self._what()} belongs to {self._strategy!r}, but is used in a replica "
                             f"function of {rctx.strategy!r}; create it under that strategy's scope")
        return self._copies[rctx.local_index]

    def _what(self) -> str:
        return "cr.Variable" + (f" {self._name!r}" if self._name else "")

    # ------------------------------------------------------------ reading

    def value(self) -> torch.Tensor:
        """The value here: in a replica function its own copy (the tensor itself, so gradients
        reach it); in cross-replica context replica 0's copy (ON_WRITE) or the aggregate of
        every replica's copy (ON_READ: a collective across workers)."""
        local = self._local()
        if local is not None:
            return local
        if self._sync is not VariableSynchronization.ON_READ:
            return self._copies[0]
        self._check_strategy("read")
        ext = self._strategy.extended
        with torch.no_grad():
            if self._agg is VariableAggregation.ONLY_FIRST_REPLICA:
                return ext.broadcast_values(list(self._copies))
            return ext.cross_device_reduce(_OPS[self._agg], list(self._copies))

    def read_value(self) -> torch.Tensor:
        """A snapshot of ``value()`` (later updates do not change it)."""
        return self.value().clone()

    def numpy(self) -> Any:
        return self.value().detach().cpu().numpy()

    # ------------------------------------------------------------ updates

    def assign(self, value: Any, read_value: bool = True) -> "Variable | None":
        """Sets the variable to ``value`` (see the module docstring for where and how)."""
        return self._update("assign", value, read_value)

    def assign_add(self, delta: Any, read_value: bool = True) -> "Variable | None":
        """Adds ``delta`` (aggregated like ``assign`` in a replica function of an ON_WRITE variable)."""
        return self._update("assign_add", delta, read_value)

    def assign_sub(self, delta: Any, read_value: bool = True) -> "Variable | None":
        """Subtracts ``delta`` (aggregated like ``assign`` in a replica function of an ON_WRITE variable)."""
        return self._update("assign_sub", delta, read_value)

    def _convert(self, value: Any, device: torch.device, argname: str) -> torch.Tensor:
        """``value`` as a tensor of this variable's dtype and shape on ``device``."""
        if isinstance(value, Variable):
            value = value.value()
        if isinstance(value, DistributedValues):
            raise TypeError(f"{self._what()}: {argname} is a {type(value).__name__}; in a replica function "
                            f"pass the replica's own tensor")
        try:
            t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{self._what()}: {argname} must be a tensor or a number; got {summarize(value)}") \
                from None
        if not torch.can_cast(t.dtype, self.dtype):
            raise TypeError(f"{self._what()}: {argname} has dtype {t.dtype}, which does not convert safely to the "
                            f"variable's dtype {self.dtype}; cast it first")
        try:
            ok = torch.broadcast_shapes(t.shape, self.shape) == self.shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{self._what()}: {argname} has shape {list(t.shape)}, which does not fit the "
                             f"variable's shape {list(self.shape)}")
        return t.to(device=device, dtype=self.dtype).expand(self.shape).contiguous()

    def _check_strategy(self, api: str) -> None:
        if context.has_strategy() and context.get_strategy() is not self._strategy:
            raise ValueError(f"{self._what()} belongs to {self._strategy!r}; {api} it outside the scope of "
                             f"{context.get_strategy()!r}")

    def _update(self, kind: str, value: Any, read_value: bool) -> "Variable | None":
        argname = "value" if kind == "assign" else "delta"
        local = self._local()
        if local is None:
            self._update_cross_replica(kind, value, argname)
        else:
            t = self._convert(value, local.device, argname)
            if context.current_replica_context() is None:  # an update context: this copy only (TF)
                _apply(local, kind, t)
            elif self._sync is VariableSynchronization.ON_WRITE and self._strategy.num_replicas_in_sync > 1:
                rctx = context.require_replica_context(f"{self._what()}.{kind}")
                rctx.merge_call(functools.partial(_merge_update, self, kind, argname), args=(t,))
            else:
                _apply(local, kind, t)
        return self if read_value else None

    def _update_cross_replica(self, kind: str, value: Any, argname: str) -> None:
        self._check_strategy(kind)
        if isinstance(value, PerReplica):
            raise TypeError(f"{self._what()}.{kind} in cross-replica context got a PerReplica; reduce it "
                            f"first (strategy.reduce) or update the variable inside the replica function")
        per_copy = value.values if isinstance(value, Mirrored) else (value,) * len(self._copies)
        if len(per_copy) != len(self._copies):
            raise ValueError(f"{self._what()}.{kind}: a Mirrored of {len(per_copy)} values for "
                             f"{len(self._copies)} local copies")
        ts = [self._convert(v, c.device, argname) for v, c in zip(per_copy, self._copies)]
        if self._sync is VariableSynchronization.ON_READ and self._agg is VariableAggregation.SUM:
            if kind != "assign":
                raise ValueError(f"{self._what()}: {kind} in cross-replica context is not supported for an "
                                 f"ON_READ variable with aggregation SUM (as in TF); assign the new total instead")
            n = self._strategy.num_replicas_in_sync
            ids = self._strategy.extended.local_replica_ids
            if self.dtype.is_floating_point or self.dtype.is_complex:
                ts = [t / n for t in ts]
            else:  # exact: the whole value on replica 0, zeros elsewhere
                ts = [t if i == 0 else torch.zeros_like(t) for t, i in zip(ts, ids)]
        for c, t in zip(self._copies, ts):
            _apply(c, kind, t)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"value": ...}``: the value read in cross-replica context (ON_READ: the aggregate,
        a collective across workers, so every worker calls it, as ``cr.save`` does)."""
        if context.current_replica_context() is not None:
            raise ReplicaContextError(f"{self._what()}.state_dict must be called in cross-replica context "
                                      f"(outside strategy.run), as cr.save is")
        return {"value": self.value().detach().clone()}

    def load_state_dict(self, state_dict: Any) -> None:
        """Restores what :meth:`state_dict` returned (assigned in cross-replica context)."""
        if context.current_replica_context() is not None:
            raise ReplicaContextError(f"{self._what()}.load_state_dict must be called in cross-replica "
                                      f"context (outside strategy.run), as cr.load is")
        if not isinstance(state_dict, dict) or "value" not in state_dict:
            raise ValueError(f"{self._what()}.load_state_dict expects {{'value': tensor}} from state_dict(); "
                             f"got {summarize(state_dict)}")
        value = state_dict["value"]
        if not isinstance(value, torch.Tensor) or value.shape != self.shape:
            raise ValueError(f"{self._what()}.load_state_dict: 'value' must be a tensor of shape "
                             f"{list(self.shape)}; got {summarize(value)}")
        self._update_cross_replica("assign", value, "state_dict['value']")

    # ------------------------------------------------------------ acting as a tensor

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return func(*_unwrap(tuple(args)), **_unwrap(kwargs or {}))

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __float__(self) -> float:
        return float(self.value().detach())

    def __int__(self) -> int:
        return int(self.value().detach())

    def __bool__(self) -> bool:
        return bool(self.value().detach())

    def __index__(self) -> int:
        return self.value().__index__()

    def __len__(self) -> int:
        return len(self._copies[0])

    def __neg__(self) -> torch.Tensor:
        return -self.value()

    def __abs__(self) -> torch.Tensor:
        return abs(self.value())

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self.value()[key]

    def __repr__(self) -> str:
        copies = ", ".join(str(c.detach().cpu().tolist()) if c.numel() <= 8 else f"<{list(c.shape)}>"
                           for c in self._copies)
        return (f"cr.Variable(name={self._name!r}, shape={list(self.shape)}, dtype={self.dtype}, "
                f"synchronization={self._sync.name}, aggregation={self._agg.name}, local copies=[{copies}])")


def _binary(name: str) -> Callable[[Variable, Any], Any]:
    def op(self: Variable, other: Any) -> Any:
        return getattr(self.value(), name)(_unwrap(other))
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor"):
    setattr(Variable, f"__{_name}__", _binary(f"__{_name}__"))
    setattr(Variable, f"__r{_name}__", _binary(f"__r{_name}__"))
for _name in ("lt", "le", "gt", "ge"):
    setattr(Variable, f"__{_name}__", _binary(f"__{_name}__"))


def _merge_update(var: Variable, kind: str, argname: str, strategy: Strategy, value: Any) -> None:
    """In cross-replica context, once per worker: aggregates what the local replicas passed
    (with every other worker's) and applies the result to every local copy."""
    ext = strategy.extended
    local = list(value.values) if isinstance(value, DistributedValues) else [value] * len(var.values)
    agg = var.aggregation
    if agg in _OPS:
        new = ext.cross_device_reduce(_OPS[agg], local)
    elif agg is VariableAggregation.ONLY_FIRST_REPLICA:
        new = ext.broadcast_values(local)
    else:
        rows = ext.gather_values([t.reshape(1, *t.shape) for t in local], 0)
        first = rows[0]
        same = (rows == first) | ((rows != rows) & (first != first)) if rows.dtype.is_floating_point \
            else rows == first
        differ = [i for i in range(rows.shape[0]) if not bool(same[i].all())]
        if differ:
            raise ValueError(
                f"{var._what()} has aggregation NONE, but in {kind} the replicas passed different {argname}s "
                f"(replicas {differ} differ from replica 0); give the variable an aggregation (SUM, MEAN, "
                f"ONLY_FIRST_REPLICA) to combine them, or pass the same value on every replica")
        new = first
    for c in var.values:
        _apply(c, kind, new.to(c.device))


def _create_in_merge(cls: type, strategy: Strategy, args: Any, kwargs: Any) -> Variable:
    """merge_fn of a variable created in a replica function: one variable from local replica
    0's arguments (across workers the chief's initial value wins, as at any creation)."""
    args, kwargs = select_replica(0, (args, kwargs))
    return cls(*args, **kwargs)
