"""The contract every transport satisfies.

A collective reaches the engine as ``execute(replica_id, call, tensors)``:
``call`` describes the operation (kind, groups, parameters, and the shape and
dtype of each tensor) and is what replicas compare to detect a mismatch;
``tensors`` are the leaves of the user's nest, already validated locally.
The engine returns one output per input (per output, for kinds that change
shape) and guarantees:

1. every replica in a group receives bitwise-identical reduction results;
2. no call waits forever: a missing replica is a CollectiveTimeoutError, a
   failed one releases the others at once (``abort``);
3. replicas that disagree on a call get a CollectiveMismatchError listing each
   replica's call instead of a hang or garbage (:func:`check_agreement`, the
   one comparison every engine uses).

``execute_async`` starts a call and returns a :class:`Pending` whose ``wait()``
gives the outputs; the caller may compute meanwhile (the optimizer reduces
gradient buckets during backward). Every replica starts its asynchronous calls
in the same order, and ``wait()`` is bounded by the engine's timeout like any
call. The default runs the call at once (``Pending.done``); an engine that can
overlap overrides it (torch_dist: async backend work or a shared-memory round;
hierarchical: one async all-gather per worker; threads: a round each replica
deposits into, ``async_rounds.py``).

The arithmetic every engine shares (the reduction order) is in
``reduction.py`` beside this module.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import CollectiveMismatchError
from ..groups import Groups

__all__ = ["BARRIER", "FINISHED", "INPLACE", "MERGE_CALL", "Call", "Engine", "Kind", "Pending", "WorkerEngine",
           "check_agreement", "check_inplace", "is_inplace", "scatter_slice"]

INPLACE = "inplace"


class Kind(enum.Enum):
    """What a :class:`Call` asks the engine to do; ``str(kind)`` is the name messages show.

    Parameters per kind: ALL_REDUCE ``(op,)`` or ``(op, INPLACE)`` (an in-place
    all-reduce writes the results into the input tensors, which must be
    contiguous, and returns them: for callers that own their buffers, such as the
    optimizer's gradient packs); REDUCE_SCATTER ``(op, dims, sizes)``; ALL_GATHER
    ``(dims,)``; ALL_TO_ALL ``(split_dims, concat_dims, input_splits, output_splits)`` (the
    splits are None for equal chunks, or one size per group member, the same for every
    leaf; they may differ between the members of a group); BROADCAST ``(source,)``;
    PERMUTE ``(pairs,)``. MERGE_CALL, BARRIER and FINISHED (a replica returned from
    its function) carry no tensors and are compared by kind only.
    """

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    PERMUTE = "permute"
    MERGE_CALL = "merge_call"
    BARRIER = "barrier"
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


# Kinds that move no tensors: replicas agree on them by kind alone.
_MEETINGS = (Kind.MERGE_CALL, Kind.BARRIER)
# Parameter names per kind, for Call.describe.
_PARAM_NAMES: dict[Kind, tuple[str, ...]] = {
    Kind.ALL_REDUCE: ("op",), Kind.REDUCE_SCATTER: ("op", "dim"), Kind.ALL_GATHER: ("dim",),
    Kind.ALL_TO_ALL: ("split_dim", "concat_dim", "input_split_sizes", "output_split_sizes"),
    Kind.BROADCAST: ("source",), Kind.PERMUTE: ("pairs",)}


def is_inplace(call: Call) -> bool:
    return call.kind is Kind.ALL_REDUCE and len(call.params) > 1 and call.params[1] == INPLACE


def check_inplace(payloads: Sequence[Sequence[torch.Tensor]]) -> None:
    """In-place all-reduce writes into its inputs, so they must be contiguous."""
    for xs in payloads:
        for t, x in enumerate(xs):
            if not x.is_contiguous():
                raise ValueError(
                    f"an in-place all_reduce needs contiguous tensors; tensor {t} has shape "
                    f"{list(x.shape)} and strides {list(x.stride())}")


def scatter_slice(extent: int, pos: int, k: int, sizes: Sequence[int] | None) -> tuple[int, int]:
    """``(start, length)`` along the scattered dim for the member at ``pos`` of ``k``:
    equal chunks, or the per-member ``sizes`` (an uneven all_gather's backward, an uneven
    all_to_all's split sizes)."""
    if sizes is None:
        chunk = extent // k
        return pos * chunk, chunk
    return sum(sizes[:pos]), sizes[pos]


class Call(NamedTuple):
    """One replica's description of a collective, compared across replicas."""

    kind: Kind
    groups: Groups
    params: tuple
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    #: the dtypes the caller passed, when the tensors travel in wire dtypes (engines/wire.py):
    #: compared too, so a float16 and a float32 replica disagree although both carry float32
    source_dtypes: tuple[torch.dtype, ...] = ()

    @staticmethod
    def of(kind: Kind, groups: Groups, params: tuple, tensors: Sequence[torch.Tensor]) -> Call:
        if len(tensors) == 1:
            t = tensors[0]
            return Call(kind, groups, params, (tuple(t.shape),), (t.dtype,))
        return Call(kind, groups, params, tuple([tuple(t.shape) for t in tensors]),
                    tuple([t.dtype for t in tensors]))

    def describe(self) -> str:
        if self.kind is Kind.MERGE_CALL:
            return "merge_call()"
        if self.kind is Kind.FINISHED:
            return "<returned from the replica function>"
        names = _PARAM_NAMES.get(self.kind, ())
        parts = [f"{n}={_fmt(v)}" for n, v in zip(names, self.params)]
        if self.kind is not Kind.PERMUTE:
            parts.append(f"groups={[list(g) for g in self.groups]}")
        parts.append(f"shapes={[list(s) for s in self.shapes]}")
        parts.append(f"dtypes={[str(d).replace('torch.', '') for d in self.source_dtypes or self.dtypes]}")
        return f"{self.kind.value}({', '.join(parts)})"


def _fmt(v: Any) -> str:
    return str(v) if not isinstance(v, tuple) else str([list(p) if isinstance(p, tuple) else p for p in v])


#: The calls of the meetings that carry no tensors.
MERGE_CALL = Call(Kind.MERGE_CALL, (), ())
BARRIER = Call(Kind.BARRIER, (), ())
#: What a replica that returned from its function "calls" where others may still wait.
FINISHED = Call(Kind.FINISHED, (), ())


def check_agreement(calls: Sequence[Call], names: Sequence[int], shown: Sequence[Call] | None = None) -> None:
    """Raises CollectiveMismatchError unless the calls agree (kind and groups
    everywhere; parameters, shapes and dtypes within each group; for an uneven
    all_to_all, what each member sends equals what its peer expects).

    ``names`` are the replica ids of ``calls``, in the same order; group members
    outside ``names`` (another worker's) are not compared. The message lists
    ``shown`` (the replicas' calls as they made them, when ``calls`` are views of them)."""
    first_call = calls[0]
    ok = all(c.kind is first_call.kind and c.groups == first_call.groups for c in calls)
    if ok and first_call.kind not in _MEETINGS:
        pos = {r: i for i, r in enumerate(names)}
        groups = first_call.groups if first_call.kind is not Kind.PERMUTE else (tuple(names),)
        for g in groups:
            members = [r for r in g if r in pos]
            if not members:
                continue
            first = calls[pos[members[0]]]
            for r in members[1:]:
                c = calls[pos[r]]
                if (not _params_agree(first, c) or c.dtypes != first.dtypes or c.source_dtypes != first.source_dtypes
                        or not _shapes_agree(first, c)):
                    ok = False
                    break
            if ok and first_call.kind is Kind.ALL_TO_ALL:
                ok = _splits_agree(g, [calls[pos[r]] if r in pos else None for r in g])
            if not ok:
                break
    if not ok:
        lines = "\n".join(f"  replica {r}: {c.describe()}" for r, c in zip(names, shown or calls))
        raise CollectiveMismatchError(
            f"replicas made different collective calls (they must call the same collectives, in the "
            f"same order, with the same op, group, shapes and dtypes):\n{lines}")


def _params_agree(a: Call, b: Call) -> bool:
    if a.kind is Kind.ALL_TO_ALL:  # split sizes are per member: see _splits_agree
        return a.params[:2] == b.params[:2]
    return a.params == b.params


def _shapes_agree(a: Call, b: Call) -> bool:
    """Shapes agree exactly, except along an all_gather's gather dims (uneven parts) and
    an uneven all_to_all's split dims."""
    uneven_a2a = a.kind is Kind.ALL_TO_ALL and any(p is not None for p in (*a.params[2:], *b.params[2:]))
    if a.kind is not Kind.ALL_GATHER and not uneven_a2a:
        return a.shapes == b.shapes
    dims = a.params[0]
    if len(a.shapes) != len(b.shapes):
        return False
    for d, sa, sb in zip(dims, a.shapes, b.shapes):
        if len(sa) != len(sb):
            return False
        if sa[:d] + sa[d + 1:] != sb[:d] + sb[d + 1:]:
            return False
    return True


def _splits_agree(group: tuple[int, ...], calls: Sequence[Call | None]) -> bool:
    """Member ``i`` sends member ``j`` as many rows as ``j`` expects from ``i``, on every leaf."""
    k = len(group)

    def sizes(call: Call, which: int, leaf: int) -> Sequence[int]:
        given = call.params[which]
        if given is not None:
            return given
        extent = call.shapes[leaf][call.params[0][leaf]]
        return [extent // k] * k

    for leaf in range(len(next(c for c in calls if c is not None).shapes)):
        for i, sender in enumerate(calls):
            for j, receiver in enumerate(calls):
                if sender is None or receiver is None:
                    continue
                if sizes(sender, 2, leaf)[j] != sizes(receiver, 3, leaf)[i]:
                    return False
    return True


class Pending:
    """An asynchronous call under way: ``wait()`` returns its outputs (waits once;
    later calls return the same outputs)."""

    __slots__ = ("_finish", "_outputs")

    def __init__(self, finish: Callable[[], list[torch.Tensor]]):
        self._finish: Callable[[], list[torch.Tensor]] | None = finish
        self._outputs: list[torch.Tensor] = []

    @staticmethod
    def done(outputs: list[torch.Tensor]) -> Pending:
        """A call that already finished with ``outputs``."""
        pending = Pending(_never)
        pending._finish, pending._outputs = None, outputs
        return pending

    def wait(self) -> list[torch.Tensor]:
        finish, self._finish = self._finish, None
        if finish is not None:
            self._outputs = finish()
        return self._outputs


def _never() -> list[torch.Tensor]:
    raise AssertionError("unreachable: a finished Pending has no finish function")


class Engine(abc.ABC):
    """Moves tensors between replicas; see the module docstring for the contract."""

    #: replicas in sync across every process
    num_replicas: int
    #: global ids of the replicas this process drives, in local order
    local_replica_ids: tuple[int, ...]
    #: gradients of at least this many bytes are worth an asynchronous call of their
    #: own, reduced in place, rather than a copy into the optimizer's bucket (None:
    #: pack them like the rest; calls that cost more than a copy)
    own_bucket_bytes: int | None = None
    #: the local replicas are threads of this process that meet through ``exchange_objects``
    #: alone, so an in-process form may read the tensors of a group of local replicas
    #: directly (the sharded optimizer's update); False where a worker-level transport is
    #: involved
    in_process: bool = False

    @abc.abstractmethod
    def execute(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Runs ``call`` for ``replica_id`` and returns its outputs."""

    def execute_async(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> Pending:
        """Starts ``call`` for ``replica_id``; see the module docstring. The default
        runs it now and returns it finished."""
        return Pending.done(self.execute(replica_id, call, tensors))

    def shared_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A buffer the engine all-reduces in place faster than any other tensor (the
        optimizer keeps its gradient buckets there), or None: the default, no such thing.
        Every replica asks for the same buffers in the same order."""
        return None

    def begin_run(self) -> None:
        """Called before a replica function starts on the local replicas."""

    def finish(self, replica_id: int) -> None:
        """Called when ``replica_id``'s function returned normally."""

    def abort(self, replica_id: int, exc: BaseException) -> None:
        """Releases every replica waiting in a collective because ``replica_id`` failed."""

    def close(self) -> None:
        """Releases resources (threads, process groups) held by the engine."""

    def exchange_objects(self, replica_id: int, call: Call, obj: Any, leader_fn: Any,
                         timeout: float | None = None) -> Any:
        """A meeting of the local replicas on Python objects; the last to arrive
        runs ``leader_fn(calls, objs)`` and everyone gets its result (merge_call).

        The default serves engines with a single local replica."""
        if len(self.local_replica_ids) != 1:
            raise NotImplementedError(f"{type(self).__name__} must implement exchange_objects")
        return leader_fn([call], [obj])


class WorkerEngine(Engine):
    """An engine whose replicas span processes (workers): what a multi-worker strategy and
    the checkpoints call besides the per-replica collectives. Each call is collective
    over every worker and bounded by the engine's timeout."""

    #: this worker's rank, and the number of workers
    rank: int
    world_size: int

    @abc.abstractmethod
    def process(self, calls: Sequence[Call], payloads: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Runs one collective for every local replica at once (``calls`` and ``payloads``
        in local order); returns each local replica's outputs."""

    @abc.abstractmethod
    def barrier(self, what: str = "barrier") -> None:
        """Waits until every worker reaches the same barrier."""

    @abc.abstractmethod
    def meet(self, what: str) -> None:
        """Waits until every worker reaches the host-side collective ``what`` (``cr.save``);
        fails at once if a worker went past it without calling it."""

    @abc.abstractmethod
    def timeout_override(self, seconds: float | None) -> contextlib.AbstractContextManager[None]:
        """Bounds the cross-process waits inside by ``seconds`` instead of the timeout."""
