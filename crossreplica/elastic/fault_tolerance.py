"""Training that goes on through a lost worker, without restarting processes.

``cr.FaultTolerance(strategy, state)`` wraps the steps of a
MultiWorkerMirroredStrategy job. Each ``ft.run(fn, global_batch, ...)`` keeps a
copy of the training state in memory (parameters, buffers, optimizer state, LR
schedulers and other objects with a state_dict, and the caller's random stream,
``elastic/state.py``) and runs the step on the global batch, split over the
replicas in sync. When the step fails because a worker died, froze, hung
past the timeout or was cut off, the survivors

1. put their state back as it was when the step began,
2. agree on who is left through the job's store (:mod:`.membership`):
   the lost workers are fenced out,
3. form a new process group and engine under a new store prefix
   (``MultiWorkerExtended.regroup``),
4. bring every survivor to the newest state (a survivor that completed the step
   before the others noticed the loss hands its state to them), and
5. run the step again, the same global batch now split over fewer replicas, so no
   sample is skipped or seen twice.

A worker started with ``CROSSREPLICA_JOIN`` (``crossreplica launch
--max-restarts``) joins the running job: it asks in the store, the chief admits
it as the next step starts, and it takes the live state from the chief through
the same agreement, regrouping and hand-over.

In the layout-invariant mode (``cr.LayoutInvariant``) a step's bits do not
depend on the replica count, so the run ends with bitwise the parameters of the
uninterrupted run, through losses and joins. Both are logged at WARNING.

Why our own: torchrun's answer to a lost worker is to stop every worker and
start them again (from the last checkpoint); torchft and Horovod Elastic keep
the processes but not the numbers. Holding the step's state in memory and
redoing the step on the survivors is what keeps both.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch.distributed as dist

from .. import settings, store_keys
from ..checkpoint.workers import Workers
from ..engines.torch_dist import WorkerFailedError
from ..errors import CollectiveTimeoutError, ConfigurationWarning, ReplicaAborted, summarize
from ..optim import CrossShardOptimizer
from ..reduce_op import ReduceOp
from ..strategies.bootstrap import torchrun_agent
from ..strategies.multi_worker import MultiWorkerExtended, MultiWorkerMirroredStrategy
from .membership import (FencedOutError, Membership, StoreCalls, agree, announce_growth, await_invitation, found,
                         give_up, growth, joiners_waiting, request_join)
from .state import TrainingState

__all__ = ["FaultTolerance", "FencedOutError"]

_log = logging.getLogger(__name__)

#: what a step may fail with that regrouping mends (a lost, frozen, hung or cut-off worker)
_RECOVERABLE = (CollectiveTimeoutError, ReplicaAborted)


class FaultTolerance:
    """Runs the steps of a multi-worker job so that it survives losing workers.

    Args:
        strategy: the job's ``cr.MultiWorkerMirroredStrategy`` (gloo).
        state: what a step changes and a redo must start from, in any nest: the
            model(s) from ``strategy.mirror``, the optimizers (a PerReplica of
            ``cr.CrossShardOptimizer``), and any ``torch.Generator`` or object with
            ``state_dict`` / ``load_state_dict`` (LR schedulers, ``GradScaler``, a
            sampler or data position), or Mirrored / PerReplica values of them
            (``elastic/state.py``; a joining worker gets them as tensors and plain
            values, never a pickle).

    Every cross-replica step goes through :meth:`run` (or :meth:`call` for work
    that changes no state, such as ``cr.save``); a collective outside them that
    fails raises as usual, and the next :meth:`run` regroups first. The step
    function must start from zeroed gradients (``opt.zero_grad()``, as usual).
    On a worker that joins a running job, the constructor waits until it is
    admitted and has the job's state; its loop then skips the first
    ``completed`` steps.

    Attributes:
        completed: steps this job has completed.
        identity: this worker's rank when the job started (kept while ranks change).
        members: the identities of the current members, in rank order.
        recoveries: one record per regrouping (who was lost, the step redone, or with
            ``call`` true the step after which a ``call`` was interrupted; how long it took).
    """

    def __init__(self, strategy: MultiWorkerMirroredStrategy, state: Any):
        if not isinstance(strategy, MultiWorkerMirroredStrategy):
            raise TypeError(f"strategy must be a cr.MultiWorkerMirroredStrategy; got {summarize(strategy)}")
        ext = cast(MultiWorkerExtended, strategy.extended)
        if ext.engine.backend != "gloo":
            raise ValueError(f"FaultTolerance needs the gloo backend; this strategy uses {ext.engine.backend!r} "
                             f"(pass backend='gloo')")
        if ext.job_store is None:
            raise RuntimeError("FaultTolerance needs the process group's store, which this torch does not expose")
        _warn_if_torchrun_stops_survivors()
        self.strategy = strategy
        self._ext: MultiWorkerExtended = ext
        self._last_result: Any = None
        self._state = TrainingState(strategy.experimental_local_results, state)
        self._wrappers = [obj for obj in self._state.objects if isinstance(obj, CrossShardOptimizer)]
        self.identity = ext.worker_rank
        self.members: tuple[int, ...] = tuple(range(ext.num_workers))
        self.epoch = 0
        self.completed = 0
        self.recoveries: list[dict[str, Any]] = []
        self._founders = ext.num_workers  # identities 0..founders-1 started the job; joiners come after
        self._tickets_seen = 0  # joining workers' tickets this job has dealt with
        self._growth: tuple[int, range] | None = None  # this epoch's decision to admit joiners
        self._calls = StoreCalls(ext.job_store, self.identity)
        if ext.joining:
            self._join()
        elif self.identity == 0:
            found(ext.job_store, self._founders)

    def run(self, fn: Callable[..., Any], batch: Any, args: Sequence[Any] = (), kwargs: dict | None = None,
            reduce: ReduceOp | str | None = None) -> Any:
        """One step: ``strategy.run(fn, args=(*args, part))`` with ``part`` each replica's
        share of ``batch`` (a global batch, the same on every worker), then, with
        ``reduce``, ``strategy.reduce(reduce, result)``; returns that (else the PerReplica
        result). Redone on the survivors if a worker is lost meanwhile.

        A worker whose step the others completed before it noticed the loss gets their
        state and returns their reduced result (None without ``reduce``).
        """
        while True:
            self._check_store()
            if self._ext.engine.broken is not None:
                done, result = self._recover(self._ext.engine.broken)
                if done:
                    return result
            self._admit_joiners()
            self._state.snapshot()
            try:
                part = next(iter(self.strategy.distribute_dataset([batch])))
                out = self.strategy.run(fn, args=(*args, part), kwargs=kwargs)
                result = out if reduce is None else self.strategy.reduce(reduce, out)
            except _RECOVERABLE as e:
                self._state.rollback()
                done, result = self._recover(e)
                if done:
                    return result
                continue
            except BaseException as e:
                give_up(self._ext.job_store, self.epoch,
                        f"worker {self.identity} failed in step {self.completed + 1}, and regrouping cannot mend "
                        f"that: {type(e).__name__}: {e}")
                raise
            self.completed += 1
            self._last_result = None if reduce is None else result
            return result

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in the strategy's scope (cross-replica context), again on the survivors if a worker is lost
        meanwhile: for collective work that changes no training state (``cr.save``,
        evaluation with ``strategy.reduce``)."""
        while True:
            self._check_store()
            self._calls("confirm that it still answers before the call", _round_trip(self.epoch))
            if self._ext.engine.broken is not None:
                self._recover(self._ext.engine.broken, call=True)
            try:
                with self.strategy.scope():
                    return fn()
            except _RECOVERABLE as e:
                self._recover(e, call=True)

    def _check_store(self) -> None:
        """Stops this worker once the job's store (the coordinator, or the host serving it) is
        lost: no fault could be agreed on any more, and no checkpoint is written after it."""
        lost = self._ext.engine.store_lost()
        if lost is not None:
            raise WorkerFailedError(
                f"worker {self.identity} lost the job's store ({lost}); without it no loss can be agreed on, so "
                f"the worker stops, before step {self.completed + 1} and without writing anything; start the job "
                f"again from its last checkpoint")

    # ------------------------------------------------------------ recovery

    def _recover(self, cause: BaseException | None, call: bool = False) -> tuple[bool, Any]:
        """Agrees on the members of the next epoch (the survivors, and the joining workers
        admitted in this one), regroups and brings every one to the newest state; returns
        whether this worker's interrupted step turned out complete (and its result).
        ``cause``: the failure (None: admitting joining workers as a step starts);
        ``call``: the interrupted work was a ``call`` between steps, not a step."""
        ext = self._ext
        started = time.monotonic()
        gone = ext.engine.store_lost()
        if gone is not None:  # the failed step found the store gone: no agreement
            raise WorkerFailedError(f"worker {self.identity} is cut off from the job's store ({gone} during the "
                                    f"failed work); it stops rather than go on alone")
        joining = [self._founders + t for t in self._growth[1]] if self._growth is not None else []
        membership = agree(ext.job_store, self.epoch, self.identity, self.completed, (*self.members, *joining),
                           ext.engine.stopped_peers, ext.timeout)
        old = self.members
        if cause is None and self._growth is not None:  # a joiner that did not come is not asked again
            self._tickets_seen = max(self._tickets_seen, self._growth[1].stop)
        done, result = self._adopt(membership)
        lost = sorted(set(old) - set(self.members))
        joined = sorted(set(self.members) - set(old))
        seconds = time.monotonic() - started
        step = self.completed + (0 if done or call else 1)
        self.recoveries.append({"epoch": self.epoch, "lost": lost, "joined": joined, "step": step, "call": call,
                                "members": list(self.members), "seconds": seconds})
        shape = (f"regrouped into {len(self.members)} workers ({ext.num_replicas_in_sync} replicas in sync, "
                 f"epoch {self.epoch}) in {seconds:.2f}s")
        if cause is None:
            _log.warning("worker %d: admitted joining workers %s as step %d starts; %s; they took the state of "
                         "step %d from worker %d", self.identity, joined, step, shape, self.completed,
                         self.members[0])
            return done, result
        during = f"the call after step {step}" if call else f"step {step}"
        _log.warning("worker %d: lost workers %s during %s (%s: %s)%s; %s; %s", self.identity, lost, during,
                     type(cause).__name__, str(cause).splitlines()[0][:200],
                     f" and admitted joining workers {joined}" if joined else "", shape,
                     "this worker's step was complete: it took the newest state" if done else
                     f"redoing {during} on the survivors")
        return done, result

    def _adopt(self, membership: Membership) -> tuple[bool, Any]:
        """Becomes a member of ``membership``: a new process group and engine, then the
        newest state (:meth:`_catch_up`). A member lost meanwhile (the group does not form,
        or the hand-over fails) makes the others agree again, without it."""
        ext = self._ext
        while True:
            try:
                store = dist.PrefixStore(f"{store_keys.epoch(membership.epoch)}/group", ext.job_store)
                ext.regroup(store, membership.rank_of(self.identity), len(membership.members))
                for wrapper in self._wrappers:
                    wrapper.forget_engine()
                self.epoch, self.members = membership.epoch, membership.members
                self._growth = None
                joined = [m - self._founders for m in membership.members if m >= self._founders]
                self._tickets_seen = max([self._tickets_seen, *(t + 1 for t in joined)])
                return self._catch_up(membership)
            except (*_RECOVERABLE, dist.DistError) as e:
                formed = self.epoch == membership.epoch  # else no heartbeats to watch: the timeout decides
                _log.warning("worker %d: regrouping into epoch %d failed (%s: %s); agreeing again", self.identity,
                             membership.epoch, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                membership = agree(ext.job_store, membership.epoch, self.identity, self.completed,
                                   membership.members, ext.engine.stopped_peers if formed else lambda: [],
                                   ext.timeout)

    def _admit_joiners(self) -> None:
        """At a step's start: the chief admits workers that asked to join as the next step
        starts (every member reads that decision as this step starts, so all of them are
        told by then), and every member admits them when that step comes."""
        step = self.completed + 1
        if self._growth is None:
            if self._ext.worker_rank == 0:
                tickets = joiners_waiting(self._calls, self._tickets_seen)
                if tickets:
                    announce_growth(self._calls, self.epoch, self.members, step + 1, tickets)
                    self._growth = (step + 1, tickets)
            else:
                self._growth = growth(self._calls, self.epoch)
        if self._growth is not None and self._growth[0] == step:
            self._recover(None)

    def _join(self) -> None:
        """A worker started with ``CROSSREPLICA_JOIN``: asks to join, waits to be admitted
        at a step boundary, and takes the live state from the job's chief."""
        ext = self._ext
        started = time.monotonic()
        ticket, self.identity = request_join(ext.job_store, ext.timeout)
        self._founders = self.identity - ticket
        self._calls = StoreCalls(ext.job_store, self.identity)
        launched = settings.launch_id()
        if launched is not None:  # so that its launcher can judge its exit (elastic/launch.py)
            identity = str(self.identity)
            self._calls("record its identity for its launcher",
                        lambda s: s.set(store_keys.launched(launched), identity))
        self.members, self.completed, after = (), -1, -1
        while True:
            epoch, members = await_invitation(ext.job_store, self.identity, ticket, after, ext.timeout)
            try:
                membership = agree(ext.job_store, epoch, self.identity, -1, (*members, self.identity),
                                   lambda: [], ext.timeout, propose=False)
                break
            except FencedOutError:  # the members regrouped without it (a loss came first): asked again
                after = epoch
        self.epoch = epoch
        self._adopt(membership)
        ext.joining = False
        self.recoveries.append({"epoch": self.epoch, "lost": [], "joined": [self.identity], "step": self.completed + 1,
                                "call": False, "members": list(self.members), "seconds": time.monotonic() - started})
        _log.warning("worker %d: joined the running job as step %d starts, as worker rank %d of %d (epoch %d), "
                     "with the state from worker %d", self.identity, self.completed + 1, ext.worker_rank,
                     len(membership.members), self.epoch, membership.members[0])

    def _catch_up(self, membership: Membership) -> tuple[bool, Any]:
        """When some members completed more steps than others (the loss came at a step's
        end), rank 0 (one of them) hands its state to the rest."""
        if min(membership.completed) == membership.newest:
            return False, None
        ext = self._ext
        behind = self.completed < membership.newest
        holder = ext.worker_rank == 0
        data = self._state.serialize(self.completed, self._last_result) if holder else b""
        n = len(ext.local_replica_ids)
        # the chief's bytes to every worker, as a checkpoint's are (checkpoint/workers.py)
        _, got = Workers(holder, lambda t: ext.broadcast_values([t] * n)).share_from_chief(0, data)
        if not behind:
            return False, None
        completed, result = self._state.load(got, f"worker {membership.members[0]} (rank 0)")
        self.completed = completed
        self._last_result = result
        return True, result


def _round_trip(epoch: int) -> Callable[[Any], Any]:
    """A store call that only goes there and back (any key will do)."""
    key = [store_keys.decided(epoch)]
    return lambda store: store.check(key)


def _warn_if_torchrun_stops_survivors() -> None:
    """A ConfigurationWarning when torchrun's agent would stop the survivors of a lost worker."""
    agent = torchrun_agent()
    if agent is None:
        return
    local, restarts = agent
    why = []
    if local > 1:
        why.append(f"torchrun started {local} workers on this host (LOCAL_WORLD_SIZE={local}), and when one of "
                   f"them fails its agent stops the others on this host")
    if restarts > 0:
        why.append(f"with --max-restarts={restarts} (TORCHELASTIC_MAX_RESTARTS) the agent of a failed worker "
                   f"starts its workers again, and every other agent then restarts its own, the survivors "
                   f"included")
    if why:
        warnings.warn(
            f"FaultTolerance cannot keep this job going when a worker fails: {'; and '.join(why)}; launch the "
            f"workers of one host with `crossreplica launch --workers {local} -- COMMAND`, or run torchrun with "
            f"--nproc-per-node=1 --max-restarts=0 on each host (docs/reliability.md, \"torchrun\")",
            ConfigurationWarning, stacklevel=3)
