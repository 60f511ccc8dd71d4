"""The engine contract every transport satisfies.

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
   replica's call instead of a hang or garbage.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple, Sequence

import torch

from ..groups import Groups

__all__ = ["Call", "Engine", "KINDS", "INPLACE", "is_inplace", "check_inplace", "scatter_slice"]

INPLACE = "inplace"

# all_reduce params: (op,) or (op, INPLACE); reduce_scatter: (op, dims, sizes);
# all_gather: (dims,); all_to_all: (split_dims, concat_dims); broadcast: (source,);
# permute: (pairs,). An in-place all-reduce writes the results into the input
# tensors (which must be contiguous) and returns them: for callers that own
# their buffers, such as the optimizer's gradient packs.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "permute",
         "merge_call", "barrier")


def is_inplace(call: "Call") -> bool:
    return call.kind == "all_reduce" and len(call.params) > 1 and call.params[1] == INPLACE


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
    equal chunks, or the per-member ``sizes`` an uneven all_gather's backward passes."""
    if sizes is None:
        c = extent // k
        return pos * c, c
    return sum(sizes[:pos]), sizes[pos]


class Call(NamedTuple):
    """One replica's description of a collective, compared across replicas."""

    kind: str
    groups: Groups
    params: tuple
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()

    @staticmethod
    def of(kind: str, groups: Groups, params: tuple, tensors: Sequence[torch.Tensor]) -> "Call":
        if len(tensors) == 1:
            t = tensors[0]
            return Call(kind, groups, params, (tuple(t.shape),), (t.dtype,))
        return Call(kind, groups, params, tuple([tuple(t.shape) for t in tensors]),
                    tuple([t.dtype for t in tensors]))

    def describe(self) -> str:
        if self.kind == "merge_call":
            return "merge_call()"
        if self.kind == "finished":
            return "<returned from the replica function>"
        names = {"all_reduce": ("op",), "reduce_scatter": ("op", "dim"), "all_gather": ("dim",),
                 "all_to_all": ("split_dim", "concat_dim"), "broadcast": ("source",),
                 "permute": ("pairs",)}.get(self.kind, ())
        parts = [f"{n}={_fmt(v)}" for n, v in zip(names, self.params)]
        if self.kind != "permute":
            parts.append(f"groups={[list(g) for g in self.groups]}")
        parts.append(f"shapes={[list(s) for s in self.shapes]}")
        parts.append(f"dtypes={[str(d).replace('torch.', '') for d in self.dtypes]}")
        return f"{self.kind}({', '.join(parts)})"


def _fmt(v: Any) -> str:
    return str(v) if not isinstance(v, tuple) else str([list(p) if isinstance(p, tuple) else p for p in v])


class Engine(abc.ABC):
    """Moves tensors between replicas; see the module docstring for the contract."""

    #: replicas in sync across every process
    num_replicas: int
    #: global ids of the replicas this process drives, in local order
    local_replica_ids: tuple[int, ...]

    @abc.abstractmethod
    def execute(self, replica_id: int, call: Call, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Runs ``call`` for ``replica_id`` and returns its outputs."""

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
