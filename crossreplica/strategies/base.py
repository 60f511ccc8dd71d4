"""Strategy: what every strategy offers (scope, run, reduce, gather, local results, mirror, input).

A strategy owns a list of local devices (one replica each) and its
:class:`~crossreplica.strategies.extended.StrategyExtended`, which holds the
engine. ``run`` calls the replica function once per local replica with each
replica's part of the arguments (``select_replica``) and regroups the results.
Engine-specific behaviour is confined to the engine and to the extended object's
cross-replica hooks, which multi-process strategies extend.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch

from .. import context, data, nest
from ..arguments import check_call
from ..errors import CrossReplicaWarning, ReplicaContextError, summarize
from ..logs import PortingWarning, SharedModuleWarning
from ..nn import replace_torch_sync_batchnorm
from ..reduce_op import (WIRE_DTYPES, ReduceOp, check_dtype, from_wire, mean_scale, reduce_non_distributed_value,
                         to_wire)
from ..values import DistributedValues, Mirrored, regroup, select_replica
from ..variables import Variable, VariableAggregation
from .buffers import check_policy
from .extended import StrategyExtended
from . import dist_guard, logical_devices
from .steps import run_steps

__all__ = ["Strategy", "StrategyExtended"]


def _trim_trailing_none(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """``args`` without its trailing ``None``s: TPUStrategy's rule (Keras passes ``None``
    targets), so the parameters there take their defaults.

    TF's MirroredStrategy passes them on, so the habit of ``run(fn, args=(x, None))``
    for ``def fn(x, w=1.0)`` would silently give ``w=1.0``: a dropped ``None`` that lands
    on a parameter with another default is a warning, and one that lands on a parameter
    without a default a TypeError, both naming the fix (pass it as a keyword)."""
    kept = len(args)
    while kept and args[kept - 1] is None:
        kept -= 1
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): the rule alone
        return args[:kept]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    dropped = [p for p in positional[kept:len(args)] if p.name not in kwargs]  # a keyword fills it
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    required = [p.name for p in dropped if p.default is p.empty]
    if required:
        raise TypeError(
            f"strategy.run drops trailing None args (TPUStrategy's rule), so {name}'s parameter(s) "
            f"{required} would get no value; to pass None, pass it by keyword: "
            f"kwargs={{{required[0]!r}: None}}")
    changed = [p for p in dropped if p.default is not None]
    if changed:
        warnings.warn(
            f"strategy.run drops trailing None args (TPUStrategy's rule), so {name} gets its default for "
            + ", ".join(f"{p.name}={p.default!r}" for p in changed)
            + f", not None; to pass None, pass it by keyword: kwargs={{{changed[0].name!r}: None}}",
            CrossReplicaWarning, stacklevel=3)
    return args[:kept]


class Strategy:
    """Base of every distribution strategy."""

    extended: StrategyExtended

    # ------------------------------------------------------------ scope

    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this the current strategy (cross-replica context) inside the block."""
        t = context.top()
        if t is not None and t[0] is not self:
            raise ValueError(
                f"cannot enter the scope of {self!r} inside the scope of {t[0]!r}; mixing "
                f"strategies is not supported, leave the outer scope first")
        with context.frame(self, None):
            yield self

    @property
    def num_replicas_in_sync(self) -> int:
        return self.extended.num_replicas_in_sync

    @property
    def steps_per_run(self) -> int:
        """TPUStrategy's (deprecated there too): ``strategy.extended.steps_per_run``."""
        return self.extended.steps_per_run

    # ------------------------------------------------------------ run

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Runs ``fn`` on every local replica and regroups the results.

        ``args``/``kwargs`` go through ``select_replica`` (a PerReplica gives each
        replica its own value); trailing ``None`` args are dropped, as TPUStrategy
        drops them (:func:`_trim_trailing_none`). With several replicas in this process,
        a torch.distributed collective or rank query in ``fn`` is a ReplicaContextError
        naming the ``cr.`` call to use (:mod:`crossreplica.strategies.dist_guard`). A replica that
        raises releases the others; the run then raises a ReplicaError that is
        also an instance of the original exception's type.
        """
        check_call(fn, args, kwargs)
        if context.current_replica_context() is not None:
            raise ReplicaContextError(
                "strategy.run was called inside a replica function; call it from the main program "
                "(cross-replica context)")
        args = tuple(args)
        kwargs = kwargs or {}
        if args and args[-1] is None:
            args = _trim_trailing_none(fn, args, kwargs)
        self._check_distributed(("args", args), ("kwargs", kwargs), run=True)
        self._check_captured(fn)
        if len(self.extended.worker_devices) > 1:
            dist_guard.install()  # torch.distributed calls cannot be right in these replicas
        with self.scope():
            results = self.extended.run_replicas(fn, args, kwargs)
        return regroup(results, always_wrap=self.extended.always_wrap)

    def _check_distributed(self, *named: tuple[str, Any], run: bool = False) -> None:
        """Every DistributedValues has one value per local replica; for ``run``, a module with
        trainable parameters handed to several replicas at once gets a SharedModuleWarning."""
        n = len(self.extended.worker_devices)
        for name, value in named:
            if type(value) is dict and not value:
                continue
            # args is usually a tuple of leaves: no walk of the nest needed
            flat = type(value) is tuple and all(nest.kind(x) is None for x in value)
            leaves = value if flat else nest.flatten(value)[0]
            for leaf in leaves:
                if run and n > 1 and isinstance(leaf, torch.nn.Module) and \
                        any(p.requires_grad for p in leaf.parameters()):
                    warnings.warn(
                        f"{name} holds a {type(leaf).__name__} with trainable parameters that all {n} replicas "
                        f"share: their backward passes would add into the same .grad and their optimizers "
                        f"step the same tensors. Give each replica its own copy: "
                        f"strategy.run(fn, args=(strategy.mirror(model),))", SharedModuleWarning, stacklevel=3)
                if isinstance(leaf, DistributedValues) and len(leaf.values) != n:
                    raise ValueError(
                        f"{name} holds a {type(leaf).__name__} with {len(leaf.values)} values, but "
                        f"{type(self).__name__} has {n} local replicas; build it with one value per "
                        f"replica (strategy.experimental_local_results shows the layout)")

    def _check_captured(self, fn: Callable[..., Any]) -> None:
        """A SharedModuleWarning for a plain module with trainable parameters that ``fn`` takes
        from its closure or its globals: every replica would train that one object."""
        n = len(self.extended.worker_devices)
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if n == 1 or code is None:
            return
        fn = getattr(fn, "__func__", fn)
        found = []
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            try:
                found.append((name, cell.cell_contents))
            except ValueError:  # a cell not yet assigned
                pass
        names = getattr(fn, "__globals__", {})
        found += [(name, names[name]) for name in code.co_names if name in names]
        for name, value in found:
            if isinstance(value, torch.nn.Module) and any(p.requires_grad for p in value.parameters()):
                warnings.warn(
                    f"the replica function {code.co_name} uses {name!r}, a {type(value).__name__} with trainable "
                    f"parameters that all {n} replicas share: their backward passes would add into the same .grad "
                    f"and their optimizers step the same tensors. Make it {name} = strategy.mirror({name}): "
                    f"inside strategy.run a cr.Mirrored is each replica's own copy", SharedModuleWarning,
                    stacklevel=3)

    # ------------------------------------------------------------ cross-replica API

    def _require_cross_replica(self, api: str) -> None:
        if context.current_replica_context() is not None:
            raise ReplicaContextError(
                f"strategy.{api} must be called in cross-replica context (outside strategy.run); "
                f"inside a replica function use cr.all_reduce / cr.all_gather")

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values held by this process's replicas, in local order (a cr.Variable: its copies)."""
        if isinstance(value, (DistributedValues, Variable)):
            return tuple(value.values)
        leaves, _ = nest.flatten(value)
        if any(isinstance(v, DistributedValues) for v in leaves):
            return tuple(select_replica(i, value) for i in range(len(self.extended.worker_devices)))
        return (value,)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces a per-replica value (or nest of them) over every replica in sync.

        With ``axis``, each replica's tensor is first reduced along it too; MEAN
        then divides by the total number of elements along ``axis`` on every
        replica, so uneven per-replica batches give the exact global mean. The
        reduction across replicas is the strategy's ``cross_device_ops``'.

        A value that is not distributed is the same on every replica, as in TF's
        ``reduce_non_distributed_value``: MEAN (MAX, MIN) gives it back, a zero is
        its own reduction by any op (``strategy.reduce("sum", 0)`` is 0), and SUM
        or PROD of another value over several replicas is a ValueError.
        ``reduce_op`` may be a ``cr.VariableAggregation``, as TF 1.x's ``reduce``
        took: SUM and MEAN reduce; ONLY_FIRST_REPLICA gives replica 0's value
        (across workers global replica 0's; no ``axis``).
        """
        self._require_cross_replica("reduce")
        self._check_distributed(("value", value))
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            hint = (" (TF 1.x's reduce(aggregation, value, destinations) is "
                    "strategy.extended.reduce_to(op, value, destinations))" if not isinstance(axis, float) else "")
            raise TypeError(f"axis must be an int or None; got {summarize(axis)}{hint}")
        if reduce_op is VariableAggregation.ONLY_FIRST_REPLICA:
            if axis is not None:
                raise ValueError(f"reduce_op=cr.VariableAggregation.ONLY_FIRST_REPLICA takes replica 0's value as it "
                                 f"is; got axis={axis}: reduce it along the axis first (strategy.reduce('sum', "
                                 f"value, axis={axis}) reduces every replica's)")
            return nest.map_structure(self._first_replica, value)
        op = ReduceOp.from_any(reduce_op, "reduce_op")
        return nest.map_structure(lambda v: self._reduce_one(op, v, axis), value)

    def _first_replica(self, value: Any) -> Any:
        """Replica 0's value of ``value`` (global replica 0's across workers); a value that
        is not distributed is the same everywhere: itself, as a tensor."""
        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
                   for v in self.experimental_local_results(value)]
        if not isinstance(value, DistributedValues):
            return tensors[0]
        return self.extended.broadcast_values(tensors)

    def _reduce_one(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        distributed = isinstance(value, DistributedValues)
        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
                   for v in self.experimental_local_results(value)]
        if not distributed and axis is None:
            # The same value everywhere: no arithmetic, so no dtype rule (TF gives MEAN of 3 as 3).
            return reduce_non_distributed_value(op, tensors[0], self.num_replicas_in_sync)
        for t in tensors:
            check_dtype(op, t.dtype, "value")
        if axis is not None and tensors[0].layout is not torch.strided:
            raise TypeError(
                f"axis={axis} is not supported for a sparse value ({tensors[0].layout}); reduce with "
                f"axis=None (the result stays sparse), or pass the dense value (x.to_dense())")
        if axis is not None:
            for t in tensors:
                if not -max(t.dim(), 1) <= axis < max(t.dim(), 1):
                    raise ValueError(
                        f"axis={axis} is out of range for a per-replica value of shape {list(t.shape)}")
            dtype = tensors[0].dtype
            if dtype in WIRE_DTYPES:
                # The local reduction too in the wire dtype (float16 sums in float32,
                # unsigned ints as signed), rounded once at the end.
                wop = ReduceOp.SUM if op is ReduceOp.MEAN else op
                wide = [to_wire(wop, t) for t in tensors]
                out = self._reduce_along(op, wide, axis, wide[0].dtype, distributed)
                return from_wire(wop, out, dtype)
            return self._reduce_along(op, tensors, axis, None, distributed)
        return self.extended.cross_device_reduce(op, tensors)

    def _reduce_along(self, op: ReduceOp, tensors: list[torch.Tensor], axis: int,
                      dtype: torch.dtype | None, distributed: bool) -> Any:
        """``reduce`` with ``axis``: each replica's tensor along ``axis`` (in ``dtype`` when
        given), then across replicas; MEAN divides by the total count along ``axis``."""
        if op is ReduceOp.MEAN:
            count = self.extended.cross_device_reduce(
                ReduceOp.SUM, [torch.tensor(t.shape[axis] if t.dim() else 1, device=t.device) for t in tensors])
            # Scaled by a power of two >= the count, so huge values do not overflow the sum
            # (reduce_op.mean_scale; bitwise the plain sum / count wherever that is finite).
            scale = mean_scale(op, int(count), tensors[0].dtype)
            if scale is not None:
                tensors = [t * (1.0 / scale) for t in tensors]
            total = self.extended.cross_device_reduce(ReduceOp.SUM, [t.sum(axis, dtype=dtype) for t in tensors])
            total = total / count.to(total.device)
            return total if scale is None else total * scale
        local = {ReduceOp.SUM: lambda t: t.sum(axis, dtype=dtype), ReduceOp.MAX: lambda t: t.amax(axis),
                 ReduceOp.MIN: lambda t: t.amin(axis), ReduceOp.PROD: lambda t: t.prod(axis, dtype=dtype)}[op]
        tensors = [local(t) for t in tensors]
        if not distributed:
            return reduce_non_distributed_value(op, tensors[0], self.num_replicas_in_sync)
        return self.extended.cross_device_reduce(op, tensors)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's value along ``axis`` (replica order)."""
        self._require_cross_replica("gather")
        self._check_distributed(("value", value))
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"axis must be an int; got {summarize(axis)}")

        def one(v: Any) -> Any:
            tensors = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t)
                       for t in self.experimental_local_results(v)]
            tensors = [t.unsqueeze(0) if t.dim() == 0 else t for t in tensors]
            for t in tensors:
                if not -t.dim() <= axis < t.dim():
                    raise ValueError(f"axis={axis} is out of range for a per-replica value of shape "
                                     f"{list(t.shape)}")
            if not isinstance(v, DistributedValues):
                tensors = tensors * self.num_replicas_in_sync
                return torch.cat(tensors, axis)
            _check_gather_shapes(self.extended, tensors, axis)
            return self.extended.gather_values(tensors, axis)

        return nest.map_structure(one, value)

    # ------------------------------------------------------------ replicated state and input

    def mirror(self, obj: Any, *, sync_buffers: str | None = "broadcast") -> Mirrored:
        """``obj`` (a module, tensor or nest of them) as a Mirrored: one identical
        copy per local replica, on that replica's device.

        Replica 0 keeps ``obj`` itself (a module is moved in place with
        ``.to(device)``); every other replica gets a ``copy.deepcopy`` of it, so
        objects that refer to each other in ``obj`` (a model and its optimizer)
        stay linked within each copy. Across processes replica 0's copy wins
        (``extended.broadcast_initial_state``). Inside ``run``, each replica sees
        its own copy.

        ``sync_buffers`` keeps the modules' buffers (BatchNorm's running
        statistics) identical too, at the end of every run
        (:mod:`crossreplica.strategies.buffers`): ``"broadcast"`` copies replica
        0's to every replica, ``"mean"`` averages the floating-point ones, None
        leaves each replica's own (and warns when they differ).

        ``torch.nn.SyncBatchNorm`` layers, which sync over torch.distributed's
        ranks (processes) rather than replicas, are replaced by
        ``cr.nn.SyncBatchNorm`` layers holding the same tensors, with one
        ``cr.logs.PortingWarning`` naming them (:func:`crossreplica.nn.replace_torch_sync_batchnorm`).

        Raises:
            ReplicaContextError: called inside a replica function.
            ValueError: ``obj`` is already a DistributedValues, or ``sync_buffers``
                is not one of "broadcast", "mean", None.
        """
        self._require_cross_replica("mirror")
        policy = check_policy(sync_buffers)
        leaves, _ = nest.flatten(obj)
        if isinstance(obj, DistributedValues) or any(isinstance(v, DistributedValues) for v in leaves):
            raise ValueError(
                f"obj is already distributed ({type(obj).__name__}); mirror takes a plain module, "
                f"tensor or nest of them and makes one copy per replica")
        obj = _with_replica_sync_batchnorm(obj)
        devices = self.extended.worker_devices
        copies = [_to_device(obj, devices[0])]
        for d in devices[1:]:
            copies.append(_to_device(copy.deepcopy(copies[0]), d))
        mirrored = self.extended.broadcast_initial_state(Mirrored(copies))
        self.extended.mirrored_buffers.register(mirrored, policy)
        return mirrored

    def distribute_dataset(self, dataset: Any) -> Any:
        """Splits each global batch of ``dataset`` along dim 0, one part per replica.

        Yields, per step, the batch's nest with PerReplica leaves (pass it to
        ``run``). An uneven batch is split as evenly as possible; see
        :mod:`crossreplica.data` for keeping the mean gradient exact. Across
        workers, a DataLoader over a map-style dataset is sharded by index (each
        worker reads only its replicas' rows); other sources are read whole by
        every worker.
        """
        return data.distribute_dataset(self, dataset)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any]) -> Any:
        """Calls ``dataset_fn(cr.InputContext)`` for this process's input pipeline, which
        yields per-replica batches (``ctx.get_per_replica_batch_size(global_batch_size)``
        rows each); the local replicas take whole elements in turn, as TF does."""
        return data.distribute_datasets_from_function(self, dataset_fn)

    def make_input_fn_iterator(self, input_fn: Callable[[Any], Any],
                               replication_mode: Any = data.InputReplicationMode.PER_WORKER) -> Any:
        """TF 1.x's input loop: an iterator over ``distribute_datasets_from_function(input_fn)``
        (``input_fn(cr.InputContext)`` once per worker, per-replica batches), with TF's
        ``get_next()`` and ``initialize()`` (starts a new pass; returns ``[]``, no ops to run).
        Feed it to ``experimental_run`` / ``experimental_run_steps`` /
        ``extended.experimental_run_steps_on_iterator``.

        Raises:
            ValueError: ``replication_mode`` is not ``cr.InputReplicationMode.PER_WORKER``
                (as TF, the only mode it supports), or a bad ``input_fn``.
        """
        mode = data.InputReplicationMode.from_any(replication_mode, "replication_mode")
        if mode is not data.InputReplicationMode.PER_WORKER:
            raise ValueError(
                f"make_input_fn_iterator supports replication_mode=cr.InputReplicationMode.PER_WORKER only (as TF); "
                f"got {mode}. For one value per replica use "
                f"strategy.experimental_distribute_values_from_function(value_fn)")
        return data.InputFunctionIterator(self.distribute_datasets_from_function(input_fn))

    def experimental_make_numpy_dataset(self, numpy_input: Any, session: Any = None) -> Any:
        """TF's: a dataset of the rows of ``numpy_input`` (a NumPy array, a tensor, or a nest of
        them; a list of arrays is stacked into one, as tf.data does), kept on the CPU. As
        in TF, batch it and distribute it: ``strategy.distribute_dataset(DataLoader(ds,
        batch_size=global_batch))``. ``session`` (TF 1.x graphs) must be None."""
        if session is not None:
            raise ValueError(f"session has no crossreplica counterpart (TF 1.x graph sessions); pass None, got "
                             f"{summarize(session)}")
        return data.NumpyDataset(numpy_input)

    def experimental_run(self, fn: Callable[..., Any], input_iterator: Any = None) -> Any:
        """TF 1.x's: ``run(fn, args=(next(input_iterator),))``, or ``run(fn)`` without an iterator
        (``input_iterator``: e.g. ``make_input_fn_iterator``'s, or ``iter(distributed_dataset)``)."""
        if input_iterator is None:
            return self.run(fn)
        if not hasattr(input_iterator, "__next__"):
            hint = " (pass iter(dataset))" if hasattr(input_iterator, "__iter__") else ""
            raise ValueError(f"input_iterator must be an iterator over a distributed dataset{hint} or None; got "
                             f"{summarize(input_iterator)}")
        return self.run(fn, args=(next(input_iterator),))

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """Calls ``value_fn(cr.ValueContext)`` once per local replica and returns the values
        as PerReplica leaves (tensors moved to each replica's device)."""
        self._require_cross_replica("experimental_distribute_values_from_function")
        return data.distribute_values_from_function(self, value_fn)

    def experimental_run_steps(self, fn: Callable[[Any], Any], iterator: Any, steps: int | None = None) -> Any:
        """Runs the replica function ``fn(element)`` on ``steps`` consecutive elements of
        ``iterator`` (an iterator over a distributed dataset) in one dispatch: each
        replica loops over its parts without returning between steps. Returns the
        last step's outputs, as ``run`` would; fewer steps when the iterator runs out,
        ``StopIteration`` when it already has. Each step draws random numbers as its
        own ``run`` would (one random base per step), so dropout trains the same.
        ``steps=None`` takes ``steps_per_run`` steps (TPUStrategy's, default 1)."""
        return run_steps(self, fn, iterator, self.extended.steps_per_run if steps is None else steps)

    # ------------------------------------------------------------ logical devices

    def experimental_assign_to_logical_device(self, tensor: torch.Tensor, logical_device_id: int) -> torch.Tensor:
        """``tensor`` on logical device ``logical_device_id`` of the current replica
        (differentiable; no copy when it is there already)."""
        return logical_devices.assign(tensor, self.extended.logical_device(logical_device_id),
                                      "experimental_assign_to_logical_device")

    def experimental_replicate_to_logical_devices(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One copy of ``tensor`` per logical device of the current replica, in order."""
        return logical_devices.replicate(tensor, self.extended.replica_logical_devices())

    def experimental_split_to_logical_devices(self, tensor: torch.Tensor,
                                              partition_dimensions: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The tiles of ``tensor``, tile ``j`` on logical device ``j`` of the current replica.

        ``partition_dimensions`` holds one split count per dimension of ``tensor``; their
        product must be ``logical_devices_per_replica`` and each must divide its dimension
        (as in TF). Tiles come in row-major order of the grid; ``join_logical_tiles``
        reassembles them.

        Raises:
            TypeError: ``tensor`` is not a tensor, or ``partition_dimensions`` is not a list of ints.
            ValueError: the counts do not match the tensor's rank, are below 1, do not divide
                their dimension, or multiply to something other than the logical device count.
            ReplicaContextError: called outside a replica function.
        """
        return logical_devices.split(tensor, partition_dimensions, self.extended.replica_logical_devices())

    # ------------------------------------------------------------ TF's other names

    def experimental_run_v2(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                            kwargs: dict | None = None) -> Any:
        """``run`` under its TF 2.0 / 2.1 name (TF's ``experimental_run_v2``)."""
        return self.run(fn, args, kwargs)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """``distribute_dataset`` under TF's name: each global batch split along dim 0, one
        part per replica. ``options`` (TF's ``tf.distribute.InputOptions``) has no
        counterpart here: only None is accepted."""
        _check_no_input_options(options)
        return self.distribute_dataset(dataset)

    def experimental_distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any],
                                                       options: Any = None) -> Any:
        """``distribute_datasets_from_function`` under its TF 2.1-2.3 name. ``options`` (TF's
        ``tf.distribute.InputOptions``) has no counterpart here: only None is accepted."""
        _check_no_input_options(options)
        return self.distribute_datasets_from_function(dataset_fn)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"devices={[str(d) for d in self.extended.worker_devices]})")


def _check_no_input_options(options: Any) -> None:
    if options is not None:
        raise ValueError(
            f"options has no crossreplica counterpart (TF's tf.distribute.InputOptions); pass None, "
            f"got {summarize(options)}")


def _with_replica_sync_batchnorm(obj: Any) -> Any:
    """``obj`` with its modules' torch.nn.SyncBatchNorm layers made cr.nn.SyncBatchNorm (in
    place; a nest leaf that is such a layer is replaced), and one PortingWarning naming them."""
    replaced: list[str] = []

    def convert(x: Any) -> Any:
        if isinstance(x, torch.nn.Module):
            x, names = replace_torch_sync_batchnorm(x)
            replaced.extend(names)
        return x

    obj = nest.map_structure(convert, obj)
    if replaced:
        named = summarize([name or "the module itself" for name in replaced])
        warnings.warn(
            f"strategy.mirror replaced {len(replaced)} torch.nn.SyncBatchNorm layer(s) ({named}) with "
            f"cr.nn.SyncBatchNorm: torch's layer syncs over torch.distributed's ranks, which are processes, so on "
            f"crossreplica's replicas it normalises each replica's rows alone (or fails on CPU), while "
            f"cr.nn.SyncBatchNorm normalises over the global batch of every replica in sync. The new layers hold the "
            f"same parameter and buffer tensors (the same state dict). To silence this, convert before mirroring: "
            f"model = cr.nn.convert_sync_batchnorm(model) (it makes every BatchNorm layer cr's)",
            PortingWarning, stacklevel=3)
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its modules and tensors on ``device`` (modules moved in place)."""
    def move(x: Any) -> Any:
        if isinstance(x, torch.nn.Module):
            return x.to(device)
        if isinstance(x, torch.Tensor) and x.device != device:
            moved = x.detach().to(device)
            return moved.requires_grad_(x.requires_grad) if x.is_leaf else moved
        return x
    return nest.map_structure(move, obj)


def _check_gather_shapes(ext: StrategyExtended, tensors: Sequence[torch.Tensor], axis: int) -> None:
    """Raises ValueError, on every worker alike, when the replicas' values (``tensors``: the
    local ones) differ in rank or in a dimension other than ``axis``; across workers the
    shapes travel first (two small gathers)."""
    local = [tuple(t.shape) for t in tensors]
    if ext.num_workers > 1:
        ranks = ext.gather_values([torch.tensor([len(s)], dtype=torch.int64) for s in local], 0).tolist()
        if len(set(ranks)) == 1:
            rows = ext.gather_values([torch.tensor([s], dtype=torch.int64) for s in local], 0).tolist()
            shapes = [tuple(r) for r in rows]
        else:
            shapes = [(None,) * r for r in ranks]
    else:
        shapes = local
    dims = {len(s) for s in shapes}
    keep = None if len(dims) > 1 else [d for d in range(dims.pop()) if d != axis % max(len(shapes[0]), 1)]
    if keep is not None and len({tuple(s[d] for d in keep) for s in shapes}) == 1:
        return
    by_shape: dict[tuple, list[int]] = {}
    for r, s in enumerate(shapes):
        by_shape.setdefault(s, []).append(r)
    described = "; ".join(
        (f"rank {len(s)}" if None in s else str(list(s))) + f" on replicas {rs}" for s, rs in by_shape.items())
    raise ValueError(
        f"strategy.gather: every replica's value must have the same shape except along axis={axis}; got "
        f"{described}")
