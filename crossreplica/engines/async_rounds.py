"""In-place all-reduces that in-process replicas start and finish apart.

The optimizer starts a gradient bucket's all-reduce as soon as backward has
produced it (``Engine.execute_async``). Met as an ordinary rendezvous round,
every replica would stop in the middle of its backward pass until the slowest
one got there, three or four times a step. Here a replica only *deposits* its
tensors and goes on; once every replica has deposited a round, its work (the
reduction, in chunks of whole blocks) is claimed chunk by chunk, under one lock,
by whichever replica comes by: at its next bucket start, or while it waits for
its own rounds at the end of backward. A replica that finished backward early
thus does the work that is ready instead of idling, and a replica busy elsewhere
never holds up the others' rounds.

Invariant: the bytes are the synchronous path's. A chunk is reduced in ascending
replica id into the first member's tensor (``reduction.reduce_into``), then
copied into every other member's, so the results are the same elementwise
reduction whichever replica computes which chunk.

Failures share the rendezvous's sticky error (``Rendezvous.fail``,
``Rendezvous.failure``): a replica that raises, calls that disagree, a replica
that returned from the replica function while others wait for its deposit, or
the timeout (naming the replicas that never deposited) release every waiter.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from typing import cast

import torch

from ..errors import CollectiveMismatchError, CollectiveTimeoutError
from ..reduce_op import ReduceOp
from .base import Call, Pending, check_agreement
from .deadline import Deadline
from .reduction import reduce_into
from .rendezvous import Rendezvous

__all__ = ["AsyncRounds"]

_log = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20  # the unit of work one replica claims


class _AsyncRound:
    """One round of asynchronous in-place all-reduces: every replica's deposit and the chunks of work."""

    __slots__ = ("calls", "tensors", "deposited", "chunks", "claimed", "done", "waited")

    def __init__(self, n: int):
        self.calls: list[Call | None] = [None] * n
        self.tensors: list[list[torch.Tensor] | None] = [None] * n
        self.deposited = 0
        self.chunks: list[tuple[int, int, int]] | None = None  # (leaf, start, stop), once all deposited
        self.claimed = 0  # chunks handed out
        self.done = 0  # chunks finished
        self.waited = 0  # replicas that have collected the round


class AsyncRounds:
    """The asynchronous in-place all-reduces of one threads engine; see the module docstring."""

    def __init__(self, rendezvous: Rendezvous, names: Sequence[int]):
        self._rendezvous = rendezvous
        self._names = tuple(names)
        self._n = len(self._names)
        self._cond = threading.Condition(threading.Lock())
        self._rounds: dict[int, _AsyncRound] = {}
        self._started = [0] * self._n  # rounds each replica has started in this run
        rendezvous.listeners.append(self._wake_all)

    def reset(self) -> None:
        """Forgets every round (a new run: every replica has left the previous one)."""
        with self._cond:
            self._rounds.clear()
            self._started = [0] * self._n

    def _wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------ rounds

    def start(self, i: int, call: Call, tensors: list[torch.Tensor], timeout: float) -> Pending:
        """Deposits local replica ``i``'s tensors for its next round; the Pending waits for it."""
        failure = self._rendezvous.failure()
        if failure is not None:
            raise failure
        with self._cond:
            k = self._started[i]
            self._started[i] = k + 1
            r = self._rounds.get(k)
            if r is None:
                r = self._rounds[k] = _AsyncRound(self._n)
            r.calls[i], r.tensors[i] = call, tensors
            r.deposited += 1
            complete = r.deposited == self._n
        if complete:
            self._complete(r)
        self.progress()
        return Pending(lambda: self._wait(i, k, call, timeout))

    def _complete(self, r: _AsyncRound) -> None:
        """The last deposit of a round: checks the calls agree and cuts the work into chunks."""
        calls = cast("list[Call]", r.calls)  # every replica has deposited
        first = calls[0]
        if calls.count(first) != self._n:
            try:
                check_agreement(calls, self._names)
            except CollectiveMismatchError as e:
                self._rendezvous.fail(e)
                raise
        chunks = []
        for leaf, (shape, dtype) in enumerate(zip(first.shapes, first.dtypes)):
            n = math.prod(shape)
            step = max(1, _CHUNK_BYTES // dtype.itemsize)
            chunks += [(leaf, s, min(n, s + step)) for s in range(0, n, step)]
        with self._cond:
            r.chunks = chunks
            self._cond.notify_all()

    def progress(self) -> None:
        """Reduces chunks of complete rounds until none is left to claim."""
        while True:
            with self._cond:
                job = None
                for r in self._rounds.values():
                    chunks = r.chunks
                    if chunks is not None and r.claimed < len(chunks):
                        job = r, chunks[r.claimed], len(chunks)
                        r.claimed += 1
                        break
            if job is None:
                return
            r, (leaf, lo, hi), total = job
            op: ReduceOp = r.calls[0].params.op  # type: ignore[union-attr]
            blocks = [ts[leaf].view(-1)[lo:hi] for ts in r.tensors]  # type: ignore[index]
            try:
                reduce_into(op, blocks[0], blocks)
                for b in blocks[1:]:
                    b.copy_(blocks[0])
            except BaseException as e:
                self._rendezvous.fail(e)  # the chunk will never be done: release the others
                raise
            with self._cond:
                r.done += 1
                if r.done == total:
                    self._cond.notify_all()

    def _wait(self, i: int, k: int, call: Call, timeout: float) -> list[torch.Tensor]:
        """Helps with whatever work is ready until round ``k`` is reduced; bounded, failure-aware,
        and warning once, as the rendezvous does, when the round is slow."""
        wait = Deadline(timeout, self._rendezvous.slow)
        while True:
            self.progress()
            failure = self._rendezvous.failure()
            if failure is not None:
                raise failure
            with self._cond:
                r = self._rounds[k]
                if r.chunks is not None:
                    if r.done == len(r.chunks):
                        r.waited += 1
                        if r.waited == self._n:
                            del self._rounds[k]
                        return r.tensors[i]  # type: ignore[return-value]
                    if r.claimed < len(r.chunks):
                        continue  # work to claim
                missing = [j for j in range(self._n) if r.calls[j] is None]
                if missing and wait.turned_slow():
                    names = self._names
                    _log.warning("collective %s has waited %.3gs: replicas %s have not arrived yet (replicas %s are "
                                 "waiting; asynchronous round #%d of this run); it fails after %gs", call.describe(),
                                 wait.waited, [names[j] for j in missing],
                                 [names[j] for j in range(self._n) if r.calls[j] is not None], k + 1, timeout)
                if not wait.expired() and not any(self._rendezvous.has_finished(j) for j in missing):
                    self._cond.wait(wait.next_block(cap=1.0))
                    continue
            self._fail(i, k, call, missing, timeout)

    def _fail(self, i: int, k: int, call: Call, missing: list[int], timeout: float) -> None:
        names = self._names
        gone = [names[j] for j in missing if self._rendezvous.has_finished(j)]
        if gone:
            exc: BaseException = CollectiveMismatchError(
                f"replicas made different collective calls: replicas {gone} returned from the replica "
                f"function while replica {names[i]} waits in {call.describe()} (asynchronous round #{k + 1} "
                f"of this run)")
        else:
            exc = CollectiveTimeoutError(
                f"collective {call.describe()} timed out after {timeout:g}s: replicas "
                f"{[names[j] for j in missing]} never arrived (asynchronous round #{k + 1} of this run)",
                tuple(names[j] for j in missing))
        self._rendezvous.fail(exc)
        failure = self._rendezvous.failure()
        raise failure if failure is not None else exc
