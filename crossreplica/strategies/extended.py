"""StrategyExtended: a strategy's machinery (devices, engine, replica threads, merge_call).

``run_replicas`` runs the replica function once per local replica, in a thread
per replica when there are several, under a fresh ``run_token``; the
cross-replica hooks (:meth:`StrategyExtended.reduce_values`,
:meth:`StrategyExtended.gather_values`, ...) are where multi-process strategies
extend it. It satisfies the context layer's ``ReplicaHost`` and the cross-device
ops' ``Reducer`` interfaces.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator, Sequence

import torch

from .. import collectives, context, torch_state
from ..arguments import check_int
from ..context import ReplicaContext, options_or_hints
from ..cross_device_ops import AllReduceCrossDeviceOps, CommunicationOptions, CrossDeviceOps, as_mirrored
from ..engines.base import MERGE_CALL, Engine, check_agreement
from ..engines.reduction import reduce_into
from ..engines.sparse import reduce_coo_tensors
from ..errors import ReplicaContextError, summarize
from ..input_shards import split_sizes
from ..micro_batches import LayoutInvariant, PendingGradients, replica_share
from ..random_streams import draw_base, replica_stream, suspended
from ..reduce_op import ReduceOp, compress, compresses, compression_scale, decompress, from_wire, mean_scale, to_wire
from ..values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    regroup,
    select_replica,
)
from ..variables import VariableAggregation
from .buffers import MirroredBuffers
from . import logical_devices, updates
from .logical_devices import LogicalDevices
from .micro_batched import MicroBatchedRun
from .replica_threads import ReplicaThreads, raise_first_failure
from .steps import MultiStepContext, run_steps_on_iterator

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["StrategyExtended"]


class StrategyExtended:
    """The strategy's machinery: devices, engine, replica threads, merge_call."""

    #: Whether each replica draws from its own random stream (seeded from the caller's
    #: generator and the replica id; docs/fidelity.md, "Random numbers"). Set False to let
    #: replicas share torch's default generators, as plain threads would.
    random_streams: bool = True

    def __init__(self, container: "Strategy", devices: Sequence[torch.device], engine: Engine,
                 cross_device_ops: CrossDeviceOps | None = None):
        # A strong reference: ``ext = Strategy(...).extended`` keeps working after the strategy
        # object is dropped, as in TF. The cycle (strategy <-> extended) is freed by the garbage
        # collector, whose finalizer below then stops the replica threads.
        self._container_strong = container
        self._logical = LogicalDevices([(d,) for d in devices])
        self.engine = engine
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(
                f"cross_device_ops must be a cr.CrossDeviceOps (e.g. cr.ReductionToOneDevice() or "
                f"cr.AllReduceCrossDeviceOps()) or None; got {summarize(cross_device_ops)}")
        #: every cross-device reduction of the strategy goes through these ops (docs/collectives.md)
        self.cross_device_ops: CrossDeviceOps = (AllReduceCrossDeviceOps() if cross_device_ops is None
                                                 else cross_device_ops)
        #: the options a reduction uses when it is given none (MultiWorkerMirroredStrategy's
        #: ``communication_options``)
        self.communication_options: CommunicationOptions | None = None
        n = len(devices)
        self._running = False
        self._run_token: object = None
        # the modules strategy.mirror made, whose buffers each run keeps in agreement
        self.mirrored_buffers = MirroredBuffers()
        #: The layout-invariant mode (``layout_invariant=`` of the strategy), or None.
        self.layout_invariant: LayoutInvariant | None = None
        self._pending: list[PendingGradients] = []
        self._micro_runs = 0
        self._steps_per_run = 1
        self._threads = ReplicaThreads(n, type(container).__name__) if n > 1 else None
        if self._threads is not None:
            # Not at interpreter exit: waking daemon threads while the interpreter
            # finalizes makes them die mid-flight (std::terminate, exit code 134).
            weakref.finalize(container, self._threads.close).atexit = False

    @property
    def _container(self) -> "Strategy":
        return self._container_strong

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
    def steps_per_run(self) -> int:
        """TPUStrategy's steps per dispatch (default 1): how many steps
        ``strategy.experimental_run_steps`` and ``experimental_run_steps_on_iterator``
        take when given no count. Settable, or ``MirroredStrategy(steps_per_run=k)``."""
        return self._steps_per_run

    @steps_per_run.setter
    def steps_per_run(self, value: int | None) -> None:
        self._steps_per_run = 1 if value is None else check_int(value, "steps_per_run", low=1,
                                                                 hint=" (or None: 1)")

    # ------------------------------------------------------------ workers

    @property
    def worker_rank(self) -> int:
        """This worker's rank (0 in a single process)."""
        return 0

    @property
    def num_workers(self) -> int:
        """Worker processes in the job (1 in a single process)."""
        return 1

    @property
    def is_chief(self) -> bool:
        """True on the worker that holds replica 0."""
        return self.worker_rank == 0

    # ------------------------------------------------------------ TF's other names for the worker facts

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoints of its own (TF: the chief). ``cr.save``
        is called on every worker and writes on the chief by itself."""
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker writes summaries (TF: the chief)."""
        return self.is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether to run initializers here: always (every worker builds its state)."""
        return True

    @property
    def num_hosts(self) -> int:
        """Input hosts (TPUStrategy's): processes that feed their local replicas, one per worker."""
        return self.num_workers

    @property
    def num_replicas_per_host(self) -> int:
        """Replicas each host (worker process) feeds: its local replicas."""
        return len(self.worker_devices)

    # ------------------------------------------------------------ devices

    @property
    def worker_devices(self) -> tuple[torch.device, ...]:
        """The local replicas' devices, in local order: logical device 0 of each, or, inside
        ``experimental_logical_device(j)`` (in this thread), logical device ``j`` of each (as TF)."""
        return self._logical.column(logical_devices.current_id(self))

    @property
    def logical_devices(self) -> tuple[tuple[torch.device, ...], ...]:
        """Per local replica, its logical devices in order (logical device 0 is its own device)."""
        return self._logical.groups

    @property
    def logical_devices_per_replica(self) -> int:
        """How many logical devices each replica owns (1 unless the strategy was given more)."""
        return self._logical.per_replica

    def set_logical_devices(self, groups: Sequence[Sequence[torch.device]]) -> None:
        """Records the devices of each local replica (first = the replica's device)."""
        logical = LogicalDevices(groups)
        if logical.column(0) != self._logical.column(0):
            raise ValueError(
                f"logical device groups {summarize(logical.groups)} must hold one group per local replica, "
                f"starting with that replica's device {summarize(self._logical.column(0))}")
        self._logical = logical

    def replica_logical_devices(self) -> tuple[torch.device, ...]:
        """The logical devices of the replica running in this thread.

        Raises:
            ReplicaContextError: outside a replica function of this strategy.
        """
        rctx = context.require_replica_context("logical devices")
        if rctx.strategy.extended is not self:
            raise ReplicaContextError("the replica function running belongs to another strategy; use the "
                                      "logical devices of the strategy that runs it")
        return self._logical.groups[rctx.local_index]

    def logical_device(self, logical_device_id: int) -> torch.device:
        """The current replica's logical device ``logical_device_id``."""
        j = self._logical.check_id(logical_device_id)
        return self.replica_logical_devices()[j]

    @property
    def current_logical_device_id(self) -> int:
        """The logical device made current by ``experimental_logical_device`` in this thread (0 outside)."""
        return logical_devices.current_id()

    def experimental_logical_device(self, logical_device_id: int) -> contextlib.AbstractContextManager[Any]:
        """Makes logical device ``logical_device_id`` current in the block, as TF's TPUStrategy.

        Inside a replica function of this strategy, the replica's logical device
        ``logical_device_id`` becomes the default device (for new tensors, and the current
        CUDA device); the block yields it. In cross-replica context (under ``scope()``,
        outside any scope, in ``merge_fn``) no default device is set; the block yields the
        local replicas' logical devices ``logical_device_id``. Either way
        ``worker_devices`` is that logical device of every local replica, so a
        ``cr.Variable`` created (or a module mirrored) in the block has its copies there.

        Raises:
            ValueError: ``logical_device_id`` is not in ``[0, logical_devices_per_replica)``.
            ReplicaContextError: called in a replica function of another strategy.
        """
        j = self._logical.check_id(logical_device_id)
        if context.current_replica_context() is None:
            return logical_devices.made_current(self, j, None, self._logical.column(j))
        device = self.logical_device(j)
        return logical_devices.made_current(self, j, device, device)

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        """The devices variables are placed on: every local replica's device."""
        return tuple(self.worker_devices)

    def non_slot_devices(self, var_list: Any) -> tuple[torch.device, ...]:
        """Where non-slot variables (a step counter, Adam's beta powers) live: mirrored on
        every local replica's device, as in TF's MirroredStrategy; pass the result to
        ``update_non_slot``. ``var_list`` is accepted for TF's signature."""
        if var_list is not None and (isinstance(var_list, (str, bytes)) or not isinstance(var_list, Sequence)):
            raise TypeError(f"var_list must be a list of variables (or None); got {summarize(var_list)}")
        return tuple(self.worker_devices)

    @property
    def always_wrap(self) -> bool:
        """Whether run/merge_call wrap every per-replica leaf, even with one local replica or
        when the local replicas hold the same object: true across processes, where a local
        value is only one of several."""
        return False

    # ------------------------------------------------------------ replica execution

    def call_for_each_replica(self, fn: Callable[..., Any], args: Sequence[Any] | None = (),
                              kwargs: dict | None = None) -> Any:
        """TF's ``extended.call_for_each_replica``: ``strategy.run(fn, args, kwargs)``, with
        ``args`` and ``kwargs`` optional (None allowed), the results regrouped as ``run`` does."""
        return self._container.run(fn, () if args is None else args, kwargs)

    def run_replicas(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        """Runs ``fn`` once per local replica (``strategy.run``'s work); returns the results in
        local order."""
        # Checked before anything is reset: a run started from merge_fn would re-arm
        # the engine under the replicas waiting in merge_call (they would wait out
        # the whole timeout).
        if self._running:
            raise RuntimeError(
                "strategy.run was called while a run of the same strategy is in progress (from a "
                "replica function or merge_fn); call it from the main program only")
        self._running = True
        saved = torch.get_num_threads()
        share = self._intra_op_threads(saved)
        if self._threads is None and share != saved:  # the one replica runs in this thread
            torch.set_num_threads(share)
        try:
            return self._call_for_each_replica(fn, args, kwargs, share)
        finally:
            self._running = False
            if share != saved:
                # A replica thread's set also changes the count torch gives new threads.
                torch.set_num_threads(saved)

    def _intra_op_threads(self, caller: int) -> int:
        """The intra-op threads each replica computes with (torch keeps the count per
        thread): the layout-invariant mode's setting, else an equal share of the caller's
        ``caller`` threads, at least 1, as torchrun gives each process one
        (OMP_NUM_THREADS=1), so that replicas never oversubscribe the cores."""
        layout = self.layout_invariant
        if layout is not None and layout.intra_op_threads is not None:
            return layout.intra_op_threads
        return max(1, caller // len(self.local_replica_ids))

    def _call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
                               threads: int) -> list[Any]:
        strategy, engine = self._container, self.engine
        ids, devices = self.local_replica_ids, self._logical.column(0)
        # A replica abandoned by an earlier failed run may return later; it must
        # not report to this run's engine (it would look like a replica that
        # returned early, or abort this run).
        self._run_token = token = object()
        # The caller's thread-local torch state (grad mode, autocast, default device,
        # ...): each replica thread runs under it, as the caller's thread would.
        state = torch_state.capture()
        # One draw from the caller's generator per run; replica i's stream is seeded from it and i.
        base = draw_base() if self.random_streams else None
        micro = self._micro_batched(args, kwargs, base)
        # The layout-invariant mode combines the buffers itself (bitwise the same on every replica).
        buffer_sync = self.mirrored_buffers.for_run(self.num_replicas_in_sync, len(ids)) if micro is None else None
        engine.begin_run()

        def body(i: int) -> Any:
            rctx = ReplicaContext(strategy, ids[i], i, engine, run=token)
            a, kw = select_replica(i, args), select_replica(i, kwargs)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            context.push(strategy, rctx)
            try:
                with torch_state.applied(state), replica_stream(base, ids[i], self.timeout):
                    call = (functools.partial(fn, *a, **kw) if micro is None
                            else functools.partial(micro, fn, i, rctx))
                    if devices[i].type == "cuda":
                        # Autograd runs a GPU's backward work on one engine thread per device,
                        # shared by every thread that calls backward. A collective's backward
                        # waits for its peers, so replicas sharing a GPU would wait for each
                        # other behind that one thread: each replica's own thread runs its
                        # backward instead (thread-local; CPU work runs there anyway).
                        with torch.cuda.device(devices[i]), torch.autograd.set_multithreading_enabled(False):
                            out = call()
                    else:
                        out = call()
                if buffer_sync is not None:
                    buffer_sync.sync(i)
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
                with logical_devices.suspended():  # the caller's block is not the replica's
                    results = [body(0)]
            except Exception as e:
                engine.abort(ids[0], e)
                raise_first_failure([(0, e)], ids)
        else:
            results = self._threads.run(body, on_error, self.timeout, ids)
        self.mirrored_buffers.after_run(buffer_sync, self.reduce_values)
        return results

    def _micro_batched(self, args: tuple, kwargs: dict, base: int | None) -> MicroBatchedRun | None:
        """The layout-invariant mode's run (None in the default mode)."""
        layout = self.layout_invariant
        if layout is None:
            return None
        if not self._pending:
            self._pending = [PendingGradients() for _ in self.local_replica_ids]
        self._micro_runs += 1
        return MicroBatchedRun.of(layout, args, kwargs, self.num_replicas_in_sync, self.local_replica_ids,
                               self.mirrored_buffers.local_modules, self._pending, self._micro_runs, base)

    def reset_pending(self) -> None:
        """Drops the layout-invariant mode's pending gradient sums (a run that failed midway)."""
        self._pending = []

    def batch_split(self, rows: int) -> list[int]:
        """The rows of a global batch of ``rows`` each replica in sync gets (distribute_dataset)."""
        if self.layout_invariant is not None:
            return replica_share(rows, self.layout_invariant.micro_batches, self.num_replicas_in_sync)
        return split_sizes(rows, self.num_replicas_in_sync)

    def merge_call(self, rctx: ReplicaContext, merge_fn: Callable[..., Any], args: tuple,
                   kwargs: dict, timeout: float | None = None) -> Any:
        """Pauses the local replicas, runs ``merge_fn`` once in cross-replica context; the
        replicas wait for each other at most ``timeout`` seconds (None: the engine's)."""
        strategy = self._container
        rctx.check_current("merge_call")

        def lead(calls: list, payloads: list) -> Any:
            # the last to arrive leads: every other replica must be in merge_call too
            check_agreement(calls, self.local_replica_ids)
            merge_args = regroup(tuple(p[1] for p in payloads), always_wrap=self.always_wrap)
            merge_kwargs = regroup(tuple(p[2] for p in payloads), always_wrap=self.always_wrap)
            # cross-replica context: draws use the caller's (default) generators, not a replica's
            with context.frame(strategy, None), suspended():
                return payloads[0][0](strategy, *merge_args, **merge_kwargs)

        result = self.engine.exchange_objects(rctx.replica_id_in_sync_group, MERGE_CALL,
                                              (merge_fn, args, kwargs), lead, timeout)
        return select_replica(rctx.local_index, result)

    def replica_all_reduce(self, rctx: ReplicaContext, reduce_op: ReduceOp | str, value: Any,
                           options: Any = None) -> Any:
        """``ReplicaContext.all_reduce``: every replica in sync, through the strategy's
        cross-device ops (the default's is the engine's all-reduce)."""
        return self.cross_device_ops.replica_all_reduce(reduce_op, value, self.resolve_options(options))

    def replica_all_gather(self, rctx: ReplicaContext, value: Any, axis: int) -> Any:
        """``ReplicaContext.all_gather``: every replica in sync, in replica order."""
        return collectives.all_gather(value, axis)

    # ------------------------------------------------------------ cross-replica hooks

    def resolve_options(self, options: Any) -> Any:
        """``options``, or the strategy's default communication options when None."""
        return self.communication_options if options is None else options

    @contextlib.contextmanager
    def collective_timeout(self, seconds: float | None) -> Iterator[None]:
        """Bounds the cross-process waits of the reductions inside by ``seconds`` (None: the
        engine's timeout). In-process there are none: the caller holds every value."""
        yield

    def cross_device_reduce(self, op: ReduceOp, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Reduces one tensor per local replica through the strategy's cross-device ops, onto
        the first one's device (``strategy.reduce``, cr.Variable aggregation). In the strategy's
        scope, as ``reduce_to``: an override with TF's signature reduces through the strategy in
        scope. An override of ``reduce`` itself may return a tensor, as TF's contract allows."""
        xs = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors]
        options = self.communication_options
        ops = self.cross_device_ops
        with self._container.scope(), self.collective_timeout(options.timeout_seconds if options is not None else None):
            out = ops.reduce(op, PerReplica(xs), xs[0].device, options, reducer=self)
        return as_mirrored(out, (xs[0].device,), xs, f"{type(ops).__name__}.reduce").values[0]

    def reduce_values(self, op: ReduceOp, tensors: Sequence[torch.Tensor], *,
                      compression: torch.dtype | None = None) -> torch.Tensor:
        """Reduces one tensor per local replica (in local order) over all replicas in sync;
        a SUM or MEAN with ``compression`` in that narrow dtype (``reduce_op.compress``)."""
        if tensors[0].layout is not torch.strided:
            return reduce_coo_tensors(op, tensors)  # sparse COO: coalesced, never densified
        device, dtype = tensors[0].device, tensors[0].dtype
        if compression is not None and op in (ReduceOp.SUM, ReduceOp.MEAN) and compresses(dtype, compression):
            # As the engines reduce a compressed call: the narrow values summed in replica order
            # (each addition rounded to the narrow dtype), widened, scaled back, divided.
            factor = compression_scale(len(tensors))
            narrow = [compress(t.to(device), compression, factor) for t in tensors]
            out = reduce_into(ReduceOp.SUM, torch.empty_like(narrow[0], memory_format=torch.contiguous_format), narrow)
            return decompress(out, dtype, factor, len(tensors) if op is ReduceOp.MEAN else None)
        # In the wire dtype (float16 sums in float32, rounded once; unsigned ints as
        # signed), as the collectives do, so every strategy and engine gives the same bytes.
        scale = mean_scale(op, len(tensors), dtype)  # a MEAN of huge values: no overflow of the sum
        xs = [to_wire(op, t.to(device), scale) for t in tensors]
        out = reduce_into(op, torch.empty_like(xs[0], memory_format=torch.contiguous_format), xs)
        return from_wire(op, out, dtype, scale)

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
        return self.num_workers

    @property
    def input_pipeline_id(self) -> int:
        """This process's input pipeline (its worker rank)."""
        return self.worker_rank

    # ------------------------------------------------------------ cross-device ops

    @property
    def _cross_device_ops(self) -> CrossDeviceOps:
        return self.cross_device_ops

    def _reducing(self, options: Any) -> contextlib.AbstractContextManager[None]:
        timeout = getattr(options, "timeout_seconds", None)
        return self.collective_timeout(timeout)

    def _require_cross_replica(self, api: str) -> None:
        if context.current_replica_context() is not None:
            raise ReplicaContextError(
                f"strategy.extended.{api} must be called in cross-replica context (outside "
                f"strategy.run, or in a merge_call's merge_fn); inside a replica function use "
                f"cr.all_reduce / cr.broadcast")

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: Any = None, *, experimental_hints: Any = None) -> Any:
        """Reduces ``value`` (a DistributedValues or a tensor) onto ``destinations``.

        Returns a Mirrored with one copy per destination device. A value that is
        not distributed is the same on every replica (reduce_non_distributed_value).
        ``reduce_op`` may be a ``cr.VariableAggregation``, as TF 1.x's ``reduce`` took:
        SUM and MEAN reduce, ONLY_FIRST_REPLICA is replica 0's value (across workers
        global replica 0's). ``experimental_hints`` is TF 2.2/2.3's name for ``options``.
        """
        self._require_cross_replica("reduce_to")
        options = self.resolve_options(options_or_hints(options, experimental_hints, "extended.reduce_to"))
        with self._container.scope(), self._reducing(options):
            if reduce_op is VariableAggregation.ONLY_FIRST_REPLICA:
                return self._first_replica_to(value, destinations, "value")
            return self._cross_device_ops.reduce(reduce_op, value, destinations, options, reducer=self)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[Any],
                        options: Any = None, *, experimental_hints: Any = None) -> list[Any]:
        """Reduces each ``(value, destinations)`` pair; small tensors travel packed.
        ``reduce_op`` and ``experimental_hints`` as for :meth:`reduce_to`."""
        self._require_cross_replica("batch_reduce_to")
        options = self.resolve_options(options_or_hints(options, experimental_hints, "extended.batch_reduce_to"))
        with self._container.scope(), self._reducing(options):
            if reduce_op is VariableAggregation.ONLY_FIRST_REPLICA:
                return self._first_replica_pairs(value_destination_pairs)
            return self._cross_device_ops.batch_reduce(reduce_op, value_destination_pairs, options,
                                                       reducer=self)

    def _first_replica_pairs(self, pairs: Any) -> list[Any]:
        """``_first_replica_to`` of each ``(value, destinations)`` pair."""
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
            raise ValueError(f"value_destination_pairs must be a list of (value, destinations) tuples; got "
                             f"{summarize(pairs)}")
        out = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"value_destination_pairs[{i}] must be a (value, destinations) tuple; got "
                                 f"{summarize(pair)}")
            out.append(self._first_replica_to(pair[0], pair[1], f"value_destination_pairs[{i}][0]"))
        return out

    def _first_replica_to(self, value: Any, destinations: Any, argname: str) -> Any:
        """TF 1.x's ONLY_FIRST_REPLICA reduction: replica 0's value (global replica 0's across
        workers) copied onto ``destinations``; a value that is not distributed is itself."""
        if isinstance(value, DistributedValues):
            tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in value.values]
            if len(tensors) != len(self.worker_devices):
                raise ValueError(f"{argname} holds {len(tensors)} values, but the strategy has "
                                 f"{len(self.worker_devices)} local replicas; pass one value per replica")
            value = self.broadcast_values(tensors)
        elif not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        return self._cross_device_ops.broadcast(value, destinations)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """``tensor`` copied to every device of ``destinations`` (a Mirrored, one distinct copy
        per destination value); a Python number is returned as it is, as TF does."""
        self._require_cross_replica("broadcast_to")
        with self._container.scope():
            return updates.broadcast_to(self._cross_device_ops, tensor, destinations)

    def update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: dict | None = None, group: bool = True) -> Any:
        """Runs ``fn(v, *args, **kwargs)`` on every copy ``v`` of ``var`` (a Mirrored or a
        cr.Variable), on its device, under ``torch.no_grad()``, in copy ``i``'s update context
        (a cr.Variable used in ``fn`` is its copy ``i``, as in TF's UpdateContext).

        Distributed ``args``/``kwargs`` must be Mirrored; copy ``i`` gets their
        ``i``-th value. With ``group`` the results are regrouped (Mirrored where
        they differ); otherwise a tuple with one result per copy.

        Raises:
            TypeError: ``fn`` is not callable, bad ``args``/``kwargs``/``group``, or an
                argument is a PerReplica.
        """
        self._require_cross_replica("update")
        return updates.update(self._container, var, fn, args, kwargs, group)

    def update_non_slot(self, colocate_with: Any, fn: Callable[..., Any], args: Sequence[Any] = (),
                        kwargs: dict | None = None, group: bool = True) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per device of ``colocate_with`` (from
        ``non_slot_devices``), in cross-replica context, under ``torch.no_grad()``, with
        that device as the default device and in an update context: a ``cr.Variable``
        read or updated in ``fn`` is its copy ``i`` for the ``i``-th device (TF's
        UpdateContext), so ``v.assign_add(1)`` adds 1 to every copy once. Mirrored
        ``args``/``kwargs`` give device ``i`` their ``i``-th value.

        Returns, with ``group``, the results regrouped (Mirrored where they differ; one
        device: the result itself); otherwise a tuple with one result per device.

        Raises:
            ReplicaContextError: called inside a replica function.
            TypeError: ``fn`` is not callable, bad ``args``/``kwargs``, or a PerReplica argument.
            ValueError: ``colocate_with`` names no devices, or a Mirrored argument has
                another number of values.
        """
        self._require_cross_replica("update_non_slot")
        return updates.update_non_slot(self._container, colocate_with, fn, args, kwargs, group)

    # ------------------------------------------------------------ multi-step loops

    def experimental_run_steps_on_iterator(self, fn: Callable[[MultiStepContext, Any], Any], iterator: Any,
                                           iterations: int | None = None,
                                           initial_loop_values: dict[str, Any] | None = None
                                           ) -> MultiStepContext:
        """Runs ``fn(ctx, inputs)`` in cross-replica context on ``iterations`` elements of
        ``iterator`` (None: :attr:`steps_per_run`, as TPUStrategy's estimator loop passes it),
        as TF does; ``ctx`` (a cr.MultiStepContext, returned) holds what ``fn`` set with
        ``ctx.set_last_step_output`` / ``ctx.set_non_tensor_output``."""
        steps = self.steps_per_run if iterations is None else iterations
        return run_steps_on_iterator(self._container, fn, iterator, steps, initial_loop_values)
