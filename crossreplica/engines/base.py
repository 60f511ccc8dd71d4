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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import CollectiveMismatchError
from ..groups import Groups
from .kinds import (SPECS, AllGatherParams, AllReduceParams, AllToAllParams, BroadcastParams, Kind, PermuteParams,
                    ReduceScatterParams, scatter_slice)

__all__ = ["BARRIER", "FINISHED", "MERGE_CALL", "SPECS", "AllGatherParams", "AllReduceParams", "AllToAllParams",
           "BroadcastParams", "Call", "Engine", "Kind", "Pending", "PermuteParams", "ReduceScatterParams",
           "WorkerEngine", "check_agreement", "check_inplace", "is_inplace", "scatter_slice"]


def is_inplace(call: Call) -> bool:
    return call.kind is Kind.ALL_REDUCE and call.params.inplace


def check_inplace(payloads: Sequence[Sequence[torch.Tensor]]) -> None:
    """In-place all-reduce writes into its inputs, so they must be contiguous."""
    for xs in payloads:
        for t, x in enumerate(xs):
            if not x.is_contiguous():
                raise ValueError(
                    f"an in-place all_reduce needs contiguous tensors; tensor {t} has shape "
                    f"{list(x.shape)} and strides {list(x.stride())}")


class Call(NamedTuple):
    """One replica's description of a collective, compared across replicas."""

    kind: Kind
    groups: Groups
    #: the kind's parameter record (``kinds.py``; ``()`` for the meetings)
    params: Any
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    #: the dtypes the caller passed, when the tensors travel in wire dtypes (engines/wire.py):
    #: compared too, so a float16 and a float32 replica disagree although both carry float32
    source_dtypes: tuple[torch.dtype, ...] = ()

    @staticmethod
    def of(kind: Kind, groups: Groups, params: Any, tensors: Sequence[torch.Tensor]) -> Call:
        if len(tensors) == 1:
            t = tensors[0]
            return Call(kind, groups, params, (tuple(t.shape),), (t.dtype,))
        return Call(kind, groups, params, tuple([tuple(t.shape) for t in tensors]),
                    tuple([t.dtype for t in tensors]))

    def describe(self) -> str:
        """The call as messages show it; also what the torch_dist engine hashes to compare workers."""
        spec = SPECS[self.kind]
        if spec.text is not None:
            return spec.text
        parts = spec.describe_params(self.params)
        if spec.grouped:
            parts.append(f"groups={[list(g) for g in self.groups]}")
        parts.append(f"shapes={[list(s) for s in self.shapes]}")
        parts.append(f"dtypes={[str(d).replace('torch.', '') for d in self.source_dtypes or self.dtypes]}")
        return f"{self.kind.value}({', '.join(parts)})"


#: The calls of the meetings that carry no tensors.
MERGE_CALL = Call(Kind.MERGE_CALL, (), ())
BARRIER = Call(Kind.BARRIER, (), ())
#: What a replica that returned from its function "calls" where others may still wait.
FINISHED = Call(Kind.FINISHED, (), ())


def check_agreement(calls: Sequence[Call], names: Sequence[int], shown: Sequence[Call] | None = None) -> None:
    """Raises CollectiveMismatchError unless the calls agree: kind and groups everywhere;
    within each group, parameters, shapes and dtypes as the kind's spec rules (``kinds.py``).

    ``names`` are the replica ids of ``calls``, in the same order; group members
    outside ``names`` (another worker's) are not compared. The message lists
    ``shown`` (the replicas' calls as they made them, when ``calls`` are views of them)."""
    first_call = calls[0]
    ok = all(c.kind is first_call.kind and c.groups == first_call.groups for c in calls)
    spec = SPECS[first_call.kind]
    if ok and not spec.meeting:
        pos = {r: i for i, r in enumerate(names)}
        groups = first_call.groups if spec.grouped else (tuple(names),)
        for g in groups:
            members = [r for r in g if r in pos]
            if not members:
                continue
            first = calls[pos[members[0]]]
            for r in members[1:]:
                c = calls[pos[r]]
                if (not spec.params_agree(first.params, c.params) or c.dtypes != first.dtypes
                        or c.source_dtypes != first.source_dtypes or not spec.shapes_agree(first, c)):
                    ok = False
                    break
            if ok and spec.group_agree is not None:
                ok = spec.group_agree(g, [calls[pos[r]] if r in pos else None for r in g])
            if not ok:
                break
    if not ok:
        lines = "\n".join(f"  replica {r}: {c.describe()}" for r, c in zip(names, shown or calls))
        raise CollectiveMismatchError(
            f"replicas made different collective calls (they must call the same collectives, in the "
            f"same order, with the same op, group, shapes and dtypes):\n{lines}")


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

    def checks_mean_overflow(self, call: Call) -> bool:
        """Whether ``execute`` of this MEAN all-reduce (plain, not in place) itself redoes it
        scaled when an element of a result is not finite (``reduce_op.all_finite``), as the
        collectives layer would on every replica (``collectives.autodiff``): once for every
        replica instead. The default: no."""
        return False

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

    # What recovery (cr.FaultTolerance) reads, and nothing else of the engine's insides.

    @property
    def broken(self) -> BaseException | None:
        """The failure that put the workers out of step (a lost peer, an abort), or None."""
        return None

    def stopped_peers(self) -> list[int]:
        """The peers whose heartbeat has stopped, as far as this worker has watched them."""
        return []

    def store_lost(self) -> str | None:
        """Why the job's store no longer answers this worker (its host died, froze or was
        cut off), or None while it does."""
        return None
