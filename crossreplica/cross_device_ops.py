"""Cross-device ops: reductions and broadcasts in cross-replica context.

A :class:`CrossDeviceOps` reduces a per-replica value (one tensor per local
replica) and places the result on ``destinations``: a device string, a
torch.device, a tensor (its device), a DistributedValues (the device of each
of its values) or a ``cr.Variable`` (the device of each copy, as TF's optimizers
pass it). Like TF's, the ops work in cross-replica context only. Results are
always :class:`~crossreplica.values.Mirrored`, one copy per destination device,
each a distinct tensor. An implementation may return, as TF's contract allows,
a tensor (TF's ``add_n``) or a DistributedValues: :func:`as_mirrored` turns
either into that Mirrored, so every caller of the ops gets one form.

What the ops need from a strategy is a :class:`Reducer` (the strategy's
``extended``), passed explicitly by ``strategy.extended.reduce_to`` and
friends; called directly, as tf.distribute users do inside
``strategy.scope()``, the ops take the strategy in scope.

The arithmetic is the strategy's: :meth:`StrategyExtended.reduce_values`
reduces in ascending replica order (and, for multi-process strategies, across
processes), so a cross-device reduction equals the sequential
``((x0 + x1) + x2) + ...`` exactly, like every other reduction of the library.

* :class:`ReductionToOneDevice` copies every value to one device, accumulates
  there (optionally with a user ``accumulation_fn``) and copies the result out.
* :class:`AllReduceCrossDeviceOps` (the default) reduces each value with the
  strategy's all-reduce; ``batch_reduce`` packs small tensors of one dtype and
  device into flat buffers first, so many small reductions become one.

Every cross-device reduction of a strategy goes through its ops, in a replica
context by :meth:`CrossDeviceOps.replica_all_reduce` (a merge_call;
``replica_reduce.py``); only the exact default lets replica-context reductions
run straight on the engine (:meth:`CrossDeviceOps.replica_reductions_on_engine`),
with the same numbers. Which call takes which path: docs/collectives.md.
"""

from __future__ import annotations

import numbers
from collections import abc
from typing import Any, Protocol, cast
from collections.abc import Callable, Sequence

import torch

from . import context
from .arguments import check_int
from .context import options_or_hints
from .collectives import all_reduce as engine_all_reduce
from .devices import canonical_device
from .packing import DEFAULT_BYTES_PER_PACK, flatten_pack, plan_packs
from .timeouts import canonical_timeout
from .reduce_op import ReduceOp, canonical_compression, check_dtype, compresses, reduce_non_distributed_value
from .values import DistributedValues, Mirrored, PerReplica
from .errors import summarize
from .replica_reduce import all_reduce_in_replica
from .cross_device_compat import check_same_shapes, get_devices_from, require_cross_replica, takes_reducer

__all__ = [
    "CommunicationOptions",
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "AllReduceCrossDeviceOps",
    "Reducer",
    "as_mirrored",
    "compression_of",
    "get_devices_from",
]


class CommunicationOptions:
    """How a cross-device reduction communicates.

    Args:
        bytes_per_pack: the most bytes fused into one pack by ``batch_reduce``;
            0 lets the implementation choose.
        timeout_seconds: how long a reduction waits for the other replicas before
            raising CollectiveTimeoutError naming them (None: the strategy's
            timeout). In a replica context it bounds the replicas' meeting and
            the cross-process reduction; in cross-replica context the latter.
        compression: None, ``torch.bfloat16`` or ``torch.float16``: SUM and MEAN
            reductions of floating-point tensors wider than that dtype cross the wire
            in it (``reduce_op.compress``; what it does to the bits: docs/optimizers.md,
            "Compression"). Other ops and dtypes travel as they are. For
            ``extended.reduce_to`` / ``batch_reduce_to``, ``ReplicaContext.all_reduce``
            and ``CrossShardOptimizer(communication_options=...)``.
    """

    __slots__ = ("bytes_per_pack", "compression", "timeout_seconds")

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: float | None = None,
                 compression: torch.dtype | None = None):
        self.bytes_per_pack = check_int(bytes_per_pack, "bytes_per_pack", low=0, hint=" (0: automatic)")
        self.timeout_seconds = (None if timeout_seconds is None
                                else canonical_timeout(timeout_seconds, "timeout_seconds"))
        self.compression = canonical_compression(compression)

    def with_compression(self, compression: torch.dtype | None) -> CommunicationOptions:
        """A copy of these options with ``compression`` instead of theirs."""
        return CommunicationOptions(self.bytes_per_pack, self.timeout_seconds, compression)

    def __repr__(self) -> str:
        shown = f", compression={self.compression}" if self.compression is not None else ""
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}{shown})")


def compression_of(options: Any) -> torch.dtype | None:
    """The compression ``options`` ask for (None for no options, or options without one)."""
    return getattr(options, "compression", None)


# --------------------------------------------------------------------------- destinations

def _as_tensor(x: Any, argname: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (numbers.Number, bool)):
        return torch.as_tensor(x)
    raise ValueError(f"{argname} must hold tensors (or Python numbers); got {type(x).__name__}: {summarize(x)}")


def _copies(t: torch.Tensor, devices: Sequence[torch.device], fresh: bool = True) -> Mirrored:
    """One distinct copy of ``t`` per device; the first is ``t`` itself when ``fresh``
    (a result we made) and on the right device, so no caller's tensor is handed back."""
    out = []
    for i, d in enumerate(devices):
        if i == 0 and fresh and t.device == d:
            out.append(t)
        else:
            out.append(t.to(d, copy=True))
    return Mirrored(out)


def _aliases(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``t`` shares memory with one of ``inputs`` (a caller's tensor)."""
    if t.layout is not torch.strided:
        return any(t is x for x in inputs)
    ptr = t.untyped_storage().data_ptr()
    return any(x.layout is torch.strided and x.untyped_storage().data_ptr() == ptr for x in inputs)


def as_mirrored(result: Any, devices: Sequence[torch.device], inputs: Sequence[torch.Tensor],
                where: str) -> Mirrored:
    """What a cross-device reduction returned, as the Mirrored every caller reads: one distinct
    copy per destination device. TF's contract lets ``reduce`` return a tensor or a
    DistributedValues: a tensor (or a DistributedValues of one value) is copied to every
    destination; a DistributedValues of one value per destination keeps its values (copied
    where they are a caller's tensor or placed elsewhere). ``where`` names the method for errors."""
    if isinstance(result, DistributedValues):
        values = list(result.values)
        if len(values) == len(devices) and all(isinstance(v, torch.Tensor) for v in values):
            out = [v.to(d, copy=True) if v.device != d or _aliases(v, inputs) or any(v is w for w in values[:i])
                   else v for i, (v, d) in enumerate(zip(values, devices))]
            return result if isinstance(result, Mirrored) and all(a is b for a, b in zip(out, values)) \
                else Mirrored(out)
        if len(values) != 1:
            raise ValueError(
                f"{where} returned a {type(result).__name__} of {len(values)} values for {len(devices)} "
                f"destination device(s) {[str(d) for d in devices]}; return one tensor (copied to every "
                f"destination) or one tensor per destination device")
        result = values[0]
    if not isinstance(result, torch.Tensor):
        raise ValueError(
            f"{where} must return a tensor or a cr.DistributedValues (one value per destination device); it "
            f"returned {type(result).__name__}: {summarize(result)}")
    return _copies(result, devices, fresh=not _aliases(result, inputs))


class Reducer(Protocol):
    """What cross-device ops need from a strategy: its ``extended`` satisfies this."""

    @property
    def num_replicas_in_sync(self) -> int: ...

    def reduce_values(self, op: ReduceOp, tensors: Sequence[torch.Tensor], *,
                      compression: torch.dtype | None = None) -> torch.Tensor:
        """Reduces one tensor per local replica over every replica in sync, in replica order;
        ``compression``: the narrow dtype a SUM or MEAN crosses the wire in (``reduce_op.compress``)."""
        ...

    def gather_values(self, tensors: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        """Concatenates one tensor per local replica over every replica in sync, in replica order."""
        ...


# TF 2's CrossDeviceOps reads a plain tensor as the one value of a single replica.
_PLAIN_TENSOR_HINT = ("; TF's CrossDeviceOps.reduce reads a plain tensor as one replica's value and gives it back "
                      "unchanged: for that, use the tensor itself (ops.broadcast(t, destinations) copies it onto "
                      "the destinations)")


def _reducer(reducer: Reducer | None) -> Reducer:
    return reducer if reducer is not None else context.get_strategy().extended


def _check_options(options: Any) -> "CommunicationOptions":
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise ValueError(f"options must be a cr.CommunicationOptions or None; got {summarize(options)}")
    return options


def _reduce_values(reducer: Reducer, op: ReduceOp, values: Sequence[torch.Tensor], options: Any) -> torch.Tensor:
    """``reducer.reduce_values``, compressed where ``options`` ask for it and the op and dtype
    compress (SUM or MEAN of dense floating-point tensors wider than the compression)."""
    compression = compression_of(options)
    if (compression is not None and (op is ReduceOp.SUM or op is ReduceOp.MEAN) and values[0].layout is torch.strided
            and compresses(values[0].dtype, compression)):
        return reducer.reduce_values(op, values, compression=compression)
    return reducer.reduce_values(op, values)


def _local_values(value: Any, argname: str) -> list[torch.Tensor]:
    return [_as_tensor(v, f"{argname}.values[{i}]") for i, v in enumerate(value.values)]


def _impl_args(values: Any, devices: Any, reducer: Reducer | None
               ) -> tuple[list[torch.Tensor], tuple[torch.device, ...], Reducer]:
    """An implementation's arguments, also when a subclass with TF's signature calls it as TF
    does (``super().reduce_implementation(op, per_replica_value, destinations, options)``)."""
    if isinstance(values, DistributedValues):
        values = _local_values(values, "per_replica_value")
    return values, get_devices_from(devices), _reducer(reducer)


# --------------------------------------------------------------------------- base

class CrossDeviceOps:
    """Base class: how a strategy reduces and broadcasts in cross-replica context.

    Subclasses implement :meth:`reduce_implementation` (and may override
    :meth:`batch_reduce_implementation` to batch); validation is done here.
    """

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None, *, reducer: Reducer | None = None,
               experimental_hints: CommunicationOptions | None = None) -> Mirrored:
        """Reduces ``per_replica_value`` and places the result on ``destinations``.

        A value that is not distributed is the same on every replica and
        reduces as tf.distribute's ``reduce_non_distributed_value`` says: MEAN
        (MAX, MIN) gives it back, a zero is its own reduction by any op, and SUM
        or PROD of another value over several replicas is a ValueError.
        ``reducer`` is the strategy machinery that reduces across replicas
        (None: ``cr.get_strategy().extended``). ``reduce_op`` may be a
        ``cr.VariableAggregation`` SUM or MEAN (TF 1.x's); ``experimental_hints``
        is TF 2.2/2.3's name for ``options``.

        Raises:
            ValueError: a bad op, value, destinations or options.
        """
        require_cross_replica(self, "reduce")
        options = options_or_hints(options, experimental_hints, f"{type(self).__name__}.reduce")
        op = ReduceOp.from_any(reduce_op, "reduce_op")
        devices = get_devices_from(destinations)
        _check_options(options)
        reducer = _reducer(reducer)
        if not isinstance(per_replica_value, DistributedValues):
            t = _as_tensor(per_replica_value, "per_replica_value")
            n = reducer.num_replicas_in_sync
            return _copies(reduce_non_distributed_value(op, t, n, _PLAIN_TENSOR_HINT), devices, fresh=False)
        values = _local_values(per_replica_value, "per_replica_value")
        for v in values:
            check_dtype(op, v.dtype, "per_replica_value")
        check_same_shapes(values, "per_replica_value")
        return self._reduce_one(op, values, devices, destinations, options, reducer)

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]],
                     options: CommunicationOptions | None = None, *,
                     reducer: Reducer | None = None,
                     experimental_hints: CommunicationOptions | None = None) -> list[Mirrored]:
        """Reduces each ``(value, destinations)`` pair; returns one Mirrored per pair.

        ``reducer``, ``reduce_op`` and ``experimental_hints`` as for :meth:`reduce`.

        Raises:
            ValueError: ``value_destination_pairs`` is not a sequence of
                (value, destinations) pairs, or an element is bad.
            ReplicaContextError: called inside a replica function.
        """
        require_cross_replica(self, "batch_reduce")
        options = options_or_hints(options, experimental_hints, f"{type(self).__name__}.batch_reduce")
        op = ReduceOp.from_any(reduce_op, "reduce_op")
        _check_options(options)
        if isinstance(value_destination_pairs, (str, bytes)) or \
                not isinstance(value_destination_pairs, abc.Sequence):
            raise ValueError(
                f"value_destination_pairs must be a list of (value, destinations) tuples; got "
                f"{summarize(value_destination_pairs)}")
        pairs = []
        for i, pair in enumerate(value_destination_pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(
                    f"value_destination_pairs[{i}] must be a (value, destinations) tuple; got {summarize(pair)}")
            value, dest = pair
            devices = get_devices_from(dest, f"value_destination_pairs[{i}][1]")
            pairs.append((value, devices, dest))
        if not pairs:
            return []
        reducer = _reducer(reducer)
        results: list[Any] = [None] * len(pairs)
        batch: list[tuple[int, list[torch.Tensor], tuple[torch.device, ...], Any]] = []
        n_local = None
        for i, (value, devices, dest) in enumerate(pairs):
            if not isinstance(value, DistributedValues):
                t = _as_tensor(value, f"value_destination_pairs[{i}][0]")
                n = reducer.num_replicas_in_sync
                results[i] = _copies(reduce_non_distributed_value(op, t, n, _PLAIN_TENSOR_HINT), devices,
                                     fresh=False)
                continue
            values = _local_values(value, f"value_destination_pairs[{i}][0]")
            for v in values:
                check_dtype(op, v.dtype, f"value_destination_pairs[{i}][0]")
            check_same_shapes(values, f"value_destination_pairs[{i}][0]")
            if n_local is not None and len(values) != n_local:
                raise ValueError(
                    f"value_destination_pairs[{i}][0] has {len(values)} values but the first "
                    f"distributed value has {n_local}; every value needs one entry per replica")
            n_local = len(values)
            batch.append((i, values, devices, dest))
        if batch:
            if takes_reducer(self, "batch_reduce_implementation"):
                outs = self.batch_reduce_implementation(op, [(v, d) for _, v, d, _ in batch], options, reducer)
            else:  # TF's signature: (reduce_op, value_destination_pairs, options)
                tf_pairs: Any = [(PerReplica(v), dest) for _, v, _, dest in batch]
                outs = self.batch_reduce_implementation(op, tf_pairs, options)  # type: ignore[call-arg]
            where = f"{type(self).__name__}.batch_reduce_implementation"
            if isinstance(outs, (torch.Tensor, DistributedValues)) or not isinstance(outs, abc.Sequence) \
                    or len(outs) != len(batch):
                raise ValueError(f"{where} must return a list of one result per (value, destinations) pair "
                                 f"({len(batch)}); it returned {summarize(outs)}")
            for (i, values, devices, _), out in zip(batch, outs):
                results[i] = as_mirrored(out, devices, values, f"{where} (pair {i})")
        return results

    def broadcast(self, tensor: Any, destinations: Any) -> Mirrored:
        """``tensor`` copied to every device of ``destinations`` (cross-replica context)."""
        require_cross_replica(self, "broadcast")
        devices = get_devices_from(destinations)
        return _copies(_as_tensor(tensor, "tensor"), devices, fresh=False)

    def replica_all_reduce(self, reduce_op: ReduceOp | str, value: Any,
                           options: CommunicationOptions | None = None) -> Any:
        """Reduces ``value`` (a tensor, number or nest) over every replica in sync; called by
        every replica in a replica context, each getting the result (TF's ``_all_reduce``).

        The replicas meet in ``merge_call`` (within ``options.timeout_seconds``), where
        :meth:`batch_reduce` reduces their values; differentiable for SUM and MEAN.
        """
        op = ReduceOp.from_any(reduce_op, "reduce_op")
        return all_reduce_in_replica(self, op, value, _check_options(options) if options is not None else None)

    def replica_reductions_on_engine(self, options: CommunicationOptions | None = None) -> bool:
        """Whether replica-context reductions may skip :meth:`replica_all_reduce` and run as
        engine all-reduces (CrossShardOptimizer's fused and overlapped paths): only for
        ops whose arithmetic is the engine's, and no ``timeout_seconds``."""
        return False

    def _reduce_one(self, op: ReduceOp, values: list[torch.Tensor], devices: tuple[torch.device, ...],
                    destinations: Any, options: CommunicationOptions | None, reducer: Reducer) -> Mirrored:
        """:meth:`reduce_implementation` called with crossreplica's arguments, or with TF's
        four (a PerReplica and the caller's destinations) when the override takes those."""
        if takes_reducer(self, "reduce_implementation"):
            out: Any = self.reduce_implementation(op, values, devices, options, reducer)
        else:
            out = self.reduce_implementation(op, PerReplica(values), destinations, options)  # type: ignore[call-arg,arg-type]
        return as_mirrored(out, devices, values, f"{type(self).__name__}.reduce_implementation")

    # ---------------------------------------------------------------- to implement

    def reduce_implementation(self, reduce_op: ReduceOp, values: list[torch.Tensor],
                              devices: tuple[torch.device, ...], options: CommunicationOptions | None,
                              reducer: Reducer | None = None) -> Mirrored:
        """Reduces validated per-replica ``values`` onto ``devices`` (across replicas through
        ``reducer``). An override may use TF's signature instead, ``(reduce_op,
        per_replica_value, destinations, options)``: it then gets a PerReplica and the
        caller's destinations (the ``reducer`` is ``cr.get_strategy().extended``). It may
        return, as TF's may, a tensor (copied to every destination) or a DistributedValues
        of one value per destination device (:func:`as_mirrored`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement reduce_implementation")

    def batch_reduce_implementation(self, reduce_op: ReduceOp,
                                    pairs: list[tuple[list[torch.Tensor], tuple[torch.device, ...]]],
                                    options: CommunicationOptions | None,
                                    reducer: Reducer | None = None) -> list[Mirrored]:
        """Reduces validated pairs; the default reduces them one by one. An override may use
        TF's signature, ``(reduce_op, value_destination_pairs, options)``, and return for each
        pair what :meth:`reduce_implementation` may."""
        args = [_impl_args(v, d, reducer) for v, d in pairs]
        return [self._reduce_one(reduce_op, v, d, dest, options, r) for (v, d, r), (_, dest) in zip(args, pairs)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# --------------------------------------------------------------------------- implementations

class ReductionToOneDevice(CrossDeviceOps):
    """Copies every value to one device, reduces there, copies the result out.

    Args:
        reduce_to_device: where to reduce; None is the first destination device.
        accumulation_fn: ``fn(list_of_tensors) -> tensor`` that sums (TF's
            ``add_n``), called on every SUM and MEAN reduction (MEAN then divides
            by the count) with every replica's value in replica order, in scope
            or not; across processes the values are first gathered from every
            worker. None sums in replica order (the strategy's reduction).
            MAX, MIN and PROD use the strategy's reduction.
    """

    def __init__(self, reduce_to_device: Any = None,
                 accumulation_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None):
        if reduce_to_device is not None:
            reduce_to_device = canonical_device(reduce_to_device, "reduce_to_device")
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise ValueError(f"accumulation_fn must be callable or None; got {summarize(accumulation_fn)}")
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn

    def reduce_implementation(self, reduce_op: ReduceOp, values: list[torch.Tensor],
                              devices: tuple[torch.device, ...], options: CommunicationOptions | None,
                              reducer: Reducer | None = None) -> Mirrored:
        values, devices, reducer = _impl_args(values, devices, reducer)
        target = self.reduce_to_device or devices[0]
        local = [v.to(target) for v in values]
        if self.accumulation_fn is not None and reduce_op in (ReduceOp.SUM, ReduceOp.MEAN):
            if compression_of(options) is not None:
                raise ValueError(
                    f"CommunicationOptions(compression={compression_of(options)}) cannot apply to "
                    f"ReductionToOneDevice(accumulation_fn=...): your function gets every replica's value whole; "
                    f"leave compression out, or drop accumulation_fn (the strategy's reduction compresses)")
            if reducer.num_replicas_in_sync > len(local):
                # Other workers hold the other values: every worker gathers them all, in
                # replica order, and accumulates them on its reduce_to_device.
                local = [v.to(target) for v in reducer.gather_values([v.unsqueeze(0) for v in local], 0)]
            out = self.accumulation_fn(local)
            if not isinstance(out, torch.Tensor):
                raise ValueError(
                    f"accumulation_fn must return a tensor; it returned {type(out).__name__}: {summarize(out)}")
            if reduce_op is ReduceOp.MEAN:
                out = out / len(local)
        else:
            out = _reduce_values(reducer, reduce_op, local, options)
        return _copies(out, devices)

    def __repr__(self) -> str:
        return (f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r}, "
                f"accumulation_fn={self.accumulation_fn!r})")


class AllReduceCrossDeviceOps(CrossDeviceOps):
    """The default: the strategy's all-reduce; ``batch_reduce`` packs small tensors.

    Tensors smaller than the pack size are concatenated per (device, dtype)
    into flat buffers, reduced together and split again, which is bitwise the
    same as reducing each one (the reduction is elementwise).
    """

    def reduce_implementation(self, reduce_op: ReduceOp, values: list[torch.Tensor],
                              devices: tuple[torch.device, ...], options: CommunicationOptions | None,
                              reducer: Reducer | None = None) -> Mirrored:
        values, devices, reducer = _impl_args(values, devices, reducer)
        return _copies(_reduce_values(reducer, reduce_op, values, options), devices)

    def replica_reductions_on_engine(self, options: CommunicationOptions | None = None) -> bool:
        # A subclass may change the arithmetic: only this class is the engine's all-reduce.
        # (Compression is the caller's: CrossShardOptimizer compresses its engine calls itself.)
        return type(self) is AllReduceCrossDeviceOps and (options is None or options.timeout_seconds is None)

    def replica_all_reduce(self, reduce_op: ReduceOp | str, value: Any,
                           options: CommunicationOptions | None = None) -> Any:
        """The engine's all-reduce (``cr.all_reduce``), unless a subclass, a timeout or a
        compression needs the merge_call path; the same numbers either way."""
        if options is not None:
            _check_options(options)
        if self.replica_reductions_on_engine(options) and compression_of(options) is None:
            return engine_all_reduce(value, reduce_op)
        return super().replica_all_reduce(reduce_op, value, options)

    def batch_reduce_implementation(self, reduce_op: ReduceOp,
                                    pairs: list[tuple[list[torch.Tensor], tuple[torch.device, ...]]],
                                    options: CommunicationOptions | None,
                                    reducer: Reducer | None = None) -> list[Mirrored]:
        args = [_impl_args(v, d, reducer) for v, d in pairs]
        pairs, reducer = [(v, d) for v, d, _ in args], _reducer(reducer)
        limit = (options.bytes_per_pack if options is not None and options.bytes_per_pack
                 else DEFAULT_BYTES_PER_PACK)
        n_local = len(pairs[0][0])
        firsts = [v[0] for v, _ in pairs]
        reduced: list[torch.Tensor | None] = [None] * len(pairs)
        packs = plan_packs(firsts, limit)
        for pack in packs:
            # A pack is keyed on replica 0's device; other replicas must agree.
            same_devices = all(
                all(pairs[i][0][r].device == pairs[pack[0]][0][r].device for i in pack)
                for r in range(n_local))
            if len(pack) == 1 or not same_devices:
                for i in pack:
                    reduced[i] = _reduce_values(reducer, reduce_op, pairs[i][0], options)
                continue
            flats = [flatten_pack([pairs[i][0][r] for i in pack]) for r in range(n_local)]
            out = _reduce_values(reducer, reduce_op, flats, options)
            offset = 0
            for i in pack:
                n = firsts[i].numel()
                reduced[i] = out[offset:offset + n].view_as(firsts[i])
                offset += n
        return [_copies(cast(torch.Tensor, t), devices) for t, (_, devices) in zip(reduced, pairs)]
