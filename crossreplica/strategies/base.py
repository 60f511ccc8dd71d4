"""What every strategy shares: scope, run, reduce, gather, local results, merge_call.

A strategy owns a list of local devices (one replica each) and an engine.
``run`` calls the replica function once per local replica, in a thread per
replica when there are several, with each replica's part of the arguments
(``select_replica``), and regroups the results. Engine-specific behaviour is
confined to the engine and to the two hooks :meth:`StrategyExtended.reduce_values`
and :meth:`StrategyExtended.gather_values`, which multi-process strategies extend.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import collectives, context, data, nest
from ..context import ReplicaContext
from ..cross_device_ops import AllReduceCrossDeviceOps, CrossDeviceOps
from ..engines.base import MERGE_CALL, Engine, check_agreement
from ..engines.reduction import reduce_into
from ..errors import ReplicaContextError, summarize
from ..reduce_op import ReduceOp, check_dtype, reduce_non_distributed_value
from ..values import DistributedValues, Mirrored, regroup, select_replica, select_replica_mirrored
from .replica_threads import ReplicaThreads, raise_first_failure

__all__ = ["Strategy", "StrategyExtended"]

class StrategyExtended:
    """The strategy's machinery: devices, engine, replica threads, merge_call."""

    def __init__(self, container: "Strategy", devices: Sequence[torch.device], engine: Engine,
                 cross_device_ops: CrossDeviceOps | None = None):
        self._container_ref = weakref.ref(container)
        self.worker_devices = tuple(devices)
        self.engine = engine
        if cross_device_ops is not None:
            if not isinstance(cross_device_ops, CrossDeviceOps):
                raise ValueError(
                    f"cross_device_ops must be a cr.CrossDeviceOps (e.g. cr.ReductionToOneDevice() or "
                    f"cr.AllReduceCrossDeviceOps()) or None; got {summarize(cross_device_ops)}")
        self.cross_device_ops = cross_device_ops
        n = len(self.worker_devices)
        self._running = False
        self._run_token: object = None
        self._threads = ReplicaThreads(n, type(container).__name__) if n > 1 else None
        if self._threads is not None:
            # Not at interpreter exit: waking daemon threads while the interpreter
            # finalizes makes them die mid-flight (std::terminate, exit code 134).
            weakref.finalize(container, self._threads.close).atexit = False

    @property
    def _container(self) -> "Strategy":
        return self._container_ref()  # type: ignore[return-value]

    @property
    def num_replicas_in_sync(self) -> int:
        return self.engine.num_replicas

    @property
    def local_replica_ids(self) -> tuple[int, ...]:
        return self.engine.local_replica_ids

    @property
    def run_token(self) -> object:
        """Identifies the run in progress: each ``run`` gets a new token, so a replica
        abandoned by an earlier failed run can tell that it no longer takes part."""
        return self._run_token

    @property
    def timeout(self) -> float:
        return getattr(self.engine, "timeout", 300.0)

    @property
    def always_wrap(self) -> bool:
        """Whether run/merge_call wrap every per-replica leaf, even with one local replica or
        when the local replicas hold the same object: true across processes, where a local
        value is only one of several."""
        return False

    # ------------------------------------------------------------ replica execution

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        """Runs ``fn`` once per local replica; returns the results in local order."""
        # Checked before anything is reset: a run started from merge_fn would re-arm
        # the engine under the replicas waiting in merge_call (they would wait out
        # the whole timeout).
        if self._running:
            raise RuntimeError(
                "strategy.run was called while a run of the same strategy is in progress (from a "
                "replica function or merge_fn); call it from the main program only")
        self._running = True
        try:
            return self._call_for_each_replica(fn, args, kwargs)
        finally:
            self._running = False

    def _call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        strategy, engine = self._container, self.engine
        ids, devices = self.local_replica_ids, self.worker_devices
        # A replica abandoned by an earlier failed run may return later; it must
        # not report to this run's engine (it would look like a replica that
        # returned early, or abort this run).
        self._run_token = token = object()
        engine.begin_run()

        def body(i: int) -> Any:
            rctx = ReplicaContext(strategy, ids[i], i, engine, run=token)
            a, kw = select_replica(i, args), select_replica(i, kwargs)
            context.push(strategy, rctx)
            try:
                if devices[i].type == "cuda":
                    with torch.cuda.device(devices[i]):
                        out = fn(*a, **kw)
                else:
                    out = fn(*a, **kw)
            finally:
                context.pop()
            if self._run_token is token:
                engine.finish(ids[i])
            return out

        def on_error(i: int, e: BaseException) -> None:
            if self._run_token is token:
                engine.abort(ids[i], e)

        if self._threads is None:
            try:
                return [body(0)]
            except Exception as e:
                engine.abort(ids[0], e)
                raise_first_failure([(0, e)], ids)
        return self._threads.run(body, on_error, self.timeout, ids)

    def merge_call(self, rctx: ReplicaContext, merge_fn: Callable[..., Any], args: tuple,
                   kwargs: dict) -> Any:
        """Pauses the local replicas, runs ``merge_fn`` once in cross-replica context."""
        strategy = self._container
        rctx.check_current("merge_call")

        def lead(calls: list, payloads: list) -> Any:
            # the last to arrive leads: every other replica must be in merge_call too
            check_agreement(calls, self.local_replica_ids)
            merge_args = regroup(tuple(p[1] for p in payloads), always_wrap=self.always_wrap)
            merge_kwargs = regroup(tuple(p[2] for p in payloads), always_wrap=self.always_wrap)
            with context.frame(strategy, None):
                return payloads[0][0](strategy, *merge_args, **merge_kwargs)

        result = self.engine.exchange_objects(rctx.replica_id_in_sync_group, MERGE_CALL,
                                              (merge_fn, args, kwargs), lead)
        return select_replica(rctx.local_index, result)

    def replica_all_reduce(self, rctx: ReplicaContext, reduce_op: ReduceOp | str, value: Any) -> Any:
        """``ReplicaContext.all_reduce``: every replica in sync, through the engine."""
        return collectives.all_reduce(value, reduce_op)

    def replica_all_gather(self, rctx: ReplicaContext, value: Any, axis: int) -> Any:
        """``ReplicaContext.all_gather``: every replica in sync, in replica order."""
        return collectives.all_gather(value, axis)

    # ------------------------------------------------------------ cross-replica hooks

    def reduce_values(self, op: ReduceOp, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Reduces one tensor per local replica (in local order) over all replicas in sync."""
        device = tensors[0].device
        xs = [t.to(device) for t in tensors]
        return reduce_into(op, torch.empty_like(xs[0], memory_format=torch.contiguous_format), xs)

    def gather_values(self, tensors: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        """Concatenates one tensor per local replica over all replicas in sync."""
        device = tensors[0].device
        return torch.cat([t.to(device) for t in tensors], axis)

    def broadcast_values(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Replica 0's tensor, given one tensor per local replica (multi-process
        strategies return global replica 0's, for ``mirror`` and checkpoints)."""
        return tensors[0]

    def broadcast_initial_state(self, mirrored: Mirrored) -> Mirrored:
        """Makes every replica start from replica 0's copy of ``mirrored``.

        In-process the copies are already identical (``Strategy.mirror`` deep-copies
        replica 0's object), so this is a no-op; multi-process strategies override
        it to broadcast replica 0's tensors to the other processes.
        """
        return mirrored

    # ------------------------------------------------------------ input pipelines

    @property
    def num_input_pipelines(self) -> int:
        """Input pipelines feeding the replicas (one per worker process)."""
        return 1

    @property
    def input_pipeline_id(self) -> int:
        """This process's input pipeline (its worker id)."""
        return 0

    # ------------------------------------------------------------ cross-device ops

    @property
    def _cross_device_ops(self) -> CrossDeviceOps:
        if self.cross_device_ops is None:
            self.cross_device_ops = AllReduceCrossDeviceOps()
        return self.cross_device_ops

    def _require_cross_replica(self, api: str) -> None:
        if context.get_replica_context() is not None:
            raise ReplicaContextError(
                f"strategy.extended.{api} must be called in cross-replica context (outside "
                f"strategy.run, or in a merge_call's merge_fn); inside a replica function use "
                f"cr.all_reduce / cr.broadcast")

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: Any = None) -> Any:
        """Reduces ``value`` (a DistributedValues or a tensor) onto ``destinations``.

        Returns a Mirrored with one copy per destination device. A value that is
        not distributed is the same on every replica (reduce_non_distributed_value).
        """
        self._require_cross_replica("reduce_to")
        with self._container.scope():
            return self._cross_device_ops.reduce(reduce_op, value, destinations, options, reducer=self)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[Any],
                        options: Any = None) -> list[Any]:
        """Reduces each ``(value, destinations)`` pair; small tensors travel packed."""
        self._require_cross_replica("batch_reduce_to")
        with self._container.scope():
            return self._cross_device_ops.batch_reduce(reduce_op, value_destination_pairs, options,
                                                       reducer=self)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """``tensor`` copied to every device of ``destinations`` (a Mirrored)."""
        self._require_cross_replica("broadcast_to")
        with self._container.scope():
            return self._cross_device_ops.broadcast(tensor, destinations)

    def update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: dict | None = None, group: bool = True) -> Any:
        """Runs ``fn(v, *args, **kwargs)`` on every copy ``v`` of ``var`` (a Mirrored),
        on its device, under ``torch.no_grad()``.

        Distributed ``args``/``kwargs`` must be Mirrored; copy ``i`` gets their
        ``i``-th value. With ``group`` the results are regrouped (Mirrored where
        they differ); otherwise a tuple with one result per copy.

        Raises:
            TypeError: ``fn`` is not callable, or an argument is a PerReplica.
        """
        self._require_cross_replica("update")
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(var, *args, **kwargs); got {summarize(fn)}")
        if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of positional arguments; got {summarize(args)}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict or None; got {summarize(kwargs)}")
        kwargs = kwargs or {}
        copies = var.values if isinstance(var, DistributedValues) else (var,)
        results = []
        with self._container.scope(), torch.no_grad():
            for i, v in enumerate(copies):
                a = select_replica_mirrored(i, tuple(args))
                kw = select_replica_mirrored(i, kwargs)
                device = getattr(v, "device", None)
                if device is not None and device.type == "cuda":
                    with torch.cuda.device(device):
                        results.append(fn(v, *a, **kw))
                else:
                    results.append(fn(v, *a, **kw))
        if not group:
            return tuple(results)
        return regroup(results, Mirrored)


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

    # ------------------------------------------------------------ run

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Runs ``fn`` on every local replica and regroups the results.

        ``args``/``kwargs`` go through ``select_replica`` (a PerReplica gives each
        replica its own value); trailing ``None`` args are dropped. A replica that
        raises releases the others; the run then raises a ReplicaError that is
        also an instance of the original exception's type.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable; got {summarize(fn)}")
        if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple or list of positional arguments; got {summarize(args)}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict or None; got {summarize(kwargs)}")
        if context.get_replica_context() is not None:
            raise ReplicaContextError(
                "strategy.run was called inside a replica function; call it from the main program "
                "(cross-replica context)")
        args = tuple(args)
        while args and args[-1] is None:
            args = args[:-1]
        kwargs = kwargs or {}
        self._check_distributed(("args", args), ("kwargs", kwargs))
        with self.scope():
            results = self.extended.call_for_each_replica(fn, args, kwargs)
        return regroup(results, always_wrap=self.extended.always_wrap)

    def _check_distributed(self, *named: tuple[str, Any]) -> None:
        n = len(self.extended.worker_devices)
        for name, value in named:
            leaves, _ = nest.flatten(value)
            for leaf in leaves:
                if isinstance(leaf, DistributedValues) and len(leaf.values) != n:
                    raise ValueError(
                        f"{name} holds a {type(leaf).__name__} with {len(leaf.values)} values, but "
                        f"{type(self).__name__} has {n} local replicas; build it with one value per "
                        f"replica (strategy.experimental_local_results shows the layout)")

    # ------------------------------------------------------------ cross-replica API

    def _require_cross_replica(self, api: str) -> None:
        if context.get_replica_context() is not None:
            raise ReplicaContextError(
                f"strategy.{api} must be called in cross-replica context (outside strategy.run); "
                f"inside a replica function use cr.all_reduce / cr.all_gather")

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values held by this process's replicas, in local order."""
        if isinstance(value, DistributedValues):
            return value.values
        leaves, _ = nest.flatten(value)
        if any(isinstance(v, DistributedValues) for v in leaves):
            return tuple(select_replica(i, value) for i in range(len(self.extended.worker_devices)))
        return (value,)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces a per-replica value (or nest of them) over every replica in sync.

        With ``axis``, each replica's tensor is first reduced along it too; MEAN
        then divides by the total number of elements along ``axis`` on every
        replica, so uneven per-replica batches give the exact global mean.
        """
        self._require_cross_replica("reduce")
        self._check_distributed(("value", value))
        op = ReduceOp.from_any(reduce_op, "reduce_op")
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise TypeError(f"axis must be an int or None; got {summarize(axis)}")
        return nest.map_structure(lambda v: self._reduce_one(op, v, axis), value)

    def _reduce_one(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        distributed = isinstance(value, DistributedValues)
        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
                   for v in self.experimental_local_results(value)]
        for t in tensors:
            check_dtype(op, t.dtype, "value")
        if axis is not None:
            for t in tensors:
                if not -max(t.dim(), 1) <= axis < max(t.dim(), 1):
                    raise ValueError(
                        f"axis={axis} is out of range for a per-replica value of shape {list(t.shape)}")
            if op is ReduceOp.MEAN:
                total = self.extended.reduce_values(ReduceOp.SUM, [t.sum(axis) for t in tensors])
                count = self.extended.reduce_values(
                    ReduceOp.SUM, [torch.tensor(t.shape[axis] if t.dim() else 1) for t in tensors])
                return total / count.to(total.device)
            local = {ReduceOp.SUM: lambda t: t.sum(axis), ReduceOp.MAX: lambda t: t.amax(axis),
                     ReduceOp.MIN: lambda t: t.amin(axis), ReduceOp.PROD: lambda t: t.prod(axis)}[op]
            tensors = [local(t) for t in tensors]
        if not distributed:
            return reduce_non_distributed_value(op, tensors[0], self.num_replicas_in_sync)
        return self.extended.reduce_values(op, tensors)

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
            return self.extended.gather_values(tensors, axis)

        return nest.map_structure(one, value)

    # ------------------------------------------------------------ replicated state and input

    def mirror(self, obj: Any) -> Mirrored:
        """``obj`` (a module, tensor or nest of them) as a Mirrored: one identical
        copy per local replica, on that replica's device.

        Replica 0 keeps ``obj`` itself (a module is moved in place with
        ``.to(device)``); every other replica gets a ``copy.deepcopy`` of it, so
        objects that refer to each other in ``obj`` (a model and its optimizer)
        stay linked within each copy. Across processes replica 0's copy wins
        (``extended.broadcast_initial_state``). Inside ``run``, each replica sees
        its own copy.

        Raises:
            ReplicaContextError: called inside a replica function.
            ValueError: ``obj`` is already a DistributedValues.
        """
        self._require_cross_replica("mirror")
        leaves, _ = nest.flatten(obj)
        if isinstance(obj, DistributedValues) or any(isinstance(v, DistributedValues) for v in leaves):
            raise ValueError(
                f"obj is already distributed ({type(obj).__name__}); mirror takes a plain module, "
                f"tensor or nest of them and makes one copy per replica")
        devices = self.extended.worker_devices
        copies = [_to_device(obj, devices[0])]
        for d in devices[1:]:
            copies.append(_to_device(copy.deepcopy(copies[0]), d))
        return self.extended.broadcast_initial_state(Mirrored(copies))

    def distribute_dataset(self, dataset: Any) -> Any:
        """Splits each global batch of ``dataset`` along dim 0, one part per replica.

        Yields, per step, the batch's nest with PerReplica leaves (pass it to
        ``run``). An uneven batch is split as evenly as possible; see
        :mod:`crossreplica.data` for keeping the mean gradient exact.
        """
        return data.distribute_dataset(self, dataset)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any]) -> Any:
        """Calls ``dataset_fn(cr.InputContext)`` for this process's input pipeline and
        splits each batch it yields among the local replicas."""
        return data.distribute_datasets_from_function(self, dataset_fn)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"devices={[str(d) for d in self.extended.worker_devices]})")


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
