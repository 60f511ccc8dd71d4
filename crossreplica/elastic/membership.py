"""Who is left: the membership a fault-tolerant job agrees on after losing a worker.

Each worker has an *identity*, its rank when the job started, which it keeps
while ranks change. Membership epoch ``e`` is a list of identities in rank
order; epoch 0 is the job as launched. When a step fails, every survivor posts
``alive`` under epoch ``e`` with the number of steps it has completed, and
watches the others: a member is waited for until it posts, its heartbeat stops
(dead, frozen or cut off: it is lost), or the timeout passes (hung: it is
lost too). Then any survivor proposes the next epoch's list and the store's
compare-and-set makes the first proposal the decision, so every survivor reads
the same one. Workers that completed the most steps come first, so the new
rank 0 holds the newest state and can hand it to the others.

A worker that is not in the decision (it came too late, or was frozen and
thawed) is fenced out: it raises :class:`FencedOutError` and must stop. It can
do no harm meanwhile, since the next epoch's process group lives under a new
store prefix that only the decided members join. A worker that cannot reach
the store cannot agree and stops too, so a partitioned worker never goes on as
a second job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..engines.deadline import Deadline
from ..engines.torch_dist.store_probe import StoreProbe
from ..engines.torch_dist import WorkerFailedError
from .. import store_keys
from ..errors import FencedOutError
from .job_store import poll

__all__ = ["FencedOutError", "Membership", "StoreCalls", "agree", "announce_growth", "await_invitation",
           "found", "give_up", "growth", "joiners_waiting", "latest", "request_join"]

_UNANSWERED = object()


@dataclasses.dataclass(frozen=True)
class Membership:
    """Epoch ``epoch``'s members (identities, in rank order) and the steps each had completed."""

    epoch: int
    members: tuple[int, ...]
    completed: tuple[int, ...]

    @property
    def newest(self) -> int:
        """The most steps any member has completed (rank 0 holds that state)."""
        return max(self.completed)

    def rank_of(self, identity: int) -> int:
        return self.members.index(identity)

    def encode(self) -> str:
        return ",".join(f"{m}:{c}" for m, c in zip(self.members, self.completed))

    @classmethod
    def decode(cls, epoch: int, text: str) -> "Membership":
        pairs = [item.split(":") for item in text.split(",") if item]
        return cls(epoch, tuple(int(m) for m, _ in pairs), tuple(int(c) for _, c in pairs))


class StoreCalls:
    """This worker's calls to the job's store, each bounded (:class:`StoreProbe`): a store
    that is gone or cut off raises WorkerFailedError, so the worker stops rather than go on
    alone."""

    def __init__(self, store: Any, identity: int):
        self.probe = StoreProbe(store)
        self.identity = identity

    def __call__(self, what: str, fn: Callable[[Any], Any]) -> Any:
        try:
            answer = self.probe(_UNANSWERED, fn, raises=True)
        except Exception as e:  # noqa: BLE001 - the store host is gone: no agreement is possible
            raise WorkerFailedError(f"worker {self.identity} cannot reach the job's store to {what} ({e}); it "
                                    f"stops rather than go on alone") from None
        if answer is _UNANSWERED:
            raise WorkerFailedError(f"worker {self.identity} is cut off from the job's store (it did not answer "
                                    f"within {self.probe.seconds:g}s while trying to {what}); it stops rather "
                                    f"than go on alone")
        return answer


def agree(store: Any, epoch: int, identity: int, completed: int, members: Sequence[int],
          stopped: Callable[[], Sequence[int]], timeout: float, pace: float = 0.01,
          propose: bool = True) -> Membership:
    """The members of epoch ``epoch + 1``, agreed by the survivors of epoch ``epoch``.

    Args:
        store: the job's store (every worker's, for the whole job).
        epoch: the epoch whose process group failed.
        identity: this worker's identity; ``completed`` its completed steps.
        members: epoch ``epoch``'s members (identities, in rank order).
        stopped: the ranks of epoch ``epoch`` whose heartbeat stopped.
        timeout: how long a member that neither posts nor stops is waited for.
        propose: False for a joining worker: it only posts and reads the decision (the
            members, which it cannot watch, decide).

    Raises:
        FencedOutError: the survivors decided without this worker.
        WorkerFailedError: a member failed in a way no regrouping mends (it raised),
            or this worker cannot reach the store.
    """
    call = StoreCalls(store, identity)
    decided, fatal = store_keys.decided(epoch), store_keys.fatal(epoch)
    alive = {m: store_keys.alive(epoch, m) for m in members}

    call("post that it is alive", lambda s: s.set(alive[identity], str(completed)))
    deadline = Deadline(timeout)
    while True:
        if call("read the decision", lambda s: s.check([decided])):
            text = call("read the decision", lambda s: s.get(decided)).decode()
            membership = Membership.decode(epoch + 1, text)
            if identity not in membership.members:
                raise FencedOutError(
                    f"worker {identity} was left out of the job's membership (epoch {epoch + 1}: workers "
                    f"{list(membership.members)}): the others judged it lost, so it stops; a worker restarted "
                    f"in its place would join at a step boundary")
            return membership
        if call("read the failures", lambda s: s.check([fatal])):
            raise WorkerFailedError(call("read the failures", lambda s: s.get(fatal)).decode())
        posted: list[int] = call("read who is alive", lambda s: [m for m, key in alive.items() if s.check([key])])
        gone = {members[r] for r in stopped() if r < len(members)} - set(posted)
        waiting = set(members) - set(posted) - gone
        if not propose and deadline.expired():
            raise WorkerFailedError(f"worker {identity} asked to join epoch {epoch + 1}, but its members did not "
                                    f"decide within {timeout:g}s")
        if propose and (not waiting or deadline.expired()):
            _propose(call, decided, alive, posted, epoch + 1)
            continue
        deadline.sleep(pace)


def latest(store: Any) -> Membership | None:
    """The newest membership the job agreed on (None: it never agreed on one, so its members
    are the workers that started it); read, once the workers are gone, by whoever serves the
    store (``crossreplica launch``)."""
    decision, epoch = None, 0
    while store.check([store_keys.decided(epoch)]):
        decision = Membership.decode(epoch + 1, store.get(store_keys.decided(epoch)).decode())
        epoch += 1
    return decision


def _propose(call: StoreCalls, decided: str, alive: dict[int, str],
             posted: list[int], epoch: int) -> None:
    """Proposes the members that posted, newest state first; the store keeps the first proposal."""
    steps: dict[int, int] = call("read who is alive", lambda s: {m: int(s.get(alive[m])) for m in posted})
    order = sorted(steps, key=lambda m: (-steps[m], m))
    text = Membership(epoch, tuple(order), tuple(steps[m] for m in order)).encode()
    call("propose the membership", lambda s: s.compare_set(decided, "", text))


def give_up(store: Any, epoch: int, message: str) -> None:
    """Tells the other survivors of epoch ``epoch`` that this worker failed in a way no
    regrouping mends (its replica function raised): they stop too, with ``message``."""
    probe = StoreProbe(store)
    probe(None, lambda s: s.set(store_keys.fatal(epoch), message))


# ---------------------------------------------------------------------- joining

_JOINS = store_keys.joins()  # a count: each joining worker's ticket is its place in it
_FOUNDERS = store_keys.founders()  # how many workers started the job (identities 0..n-1)


def found(store: Any, workers: int) -> None:
    """Records, once, how many workers started the job: a joining worker's identity comes
    after theirs."""
    StoreCalls(store, 0)("record the job's size", lambda s: s.compare_set(_FOUNDERS, "", str(workers)))


def request_join(store: Any, timeout: float) -> tuple[int, int]:
    """Asks to join the running job; returns this worker's ticket and identity (the
    founders' count plus the ticket)."""
    call = StoreCalls(store, -1)
    ticket = int(call("ask to join", lambda s: s.add(_JOINS, 1))) - 1

    def founders() -> int | None:
        if not call("read the job's size", lambda s: s.check([_FOUNDERS])):
            return None
        return int(call("read the job's size", lambda s: s.get(_FOUNDERS)))

    return ticket, ticket + poll(founders, Deadline(timeout), lambda: RuntimeError(
        f"no fault-tolerant job (cr.FaultTolerance) runs in this store: none started within {timeout:g}s; start "
        f"the job's workers, or unset CROSSREPLICA_JOIN"))


def joiners_waiting(call: StoreCalls, seen: int) -> range:
    """The tickets of workers that asked to join since ticket ``seen``."""
    return range(seen, int(call("read who asks to join", lambda s: s.add(_JOINS, 0))))


def announce_growth(call: StoreCalls, epoch: int, members: Sequence[int], at_step: int, tickets: range) -> None:
    """Epoch ``epoch``'s chief admits the workers holding ``tickets`` as step ``at_step``
    starts: every member reads the decision at a step's start (:func:`growth`), and each
    joining worker learns the epoch and its members."""
    text = f"{at_step}:{tickets.start}:{tickets.stop}"
    call("admit joining workers", lambda s: s.compare_set(store_keys.grow(epoch), "", text))
    invitation = f"{epoch}:" + ",".join(map(str, members))
    keys = [store_keys.invitation(t) for t in tickets]
    call("admit joining workers", lambda s: [s.set(key, invitation) for key in keys])


def growth(call: StoreCalls, epoch: int) -> tuple[int, range] | None:
    """Epoch ``epoch``'s decision to admit joining workers: the step as which they join
    and their tickets; None when there is none."""
    key = store_keys.grow(epoch)
    text = call("read who joins", lambda s: s.get(key) if s.check([key]) else None)  # one hop: every step
    if text is None:
        return None
    step, start, stop = (int(v) for v in text.decode().split(":"))
    return step, range(start, stop)


def await_invitation(store: Any, identity: int, ticket: int, after_epoch: int,
                     timeout: float) -> tuple[int, tuple[int, ...]]:
    """The epoch (later than ``after_epoch``) at whose agreement this joining worker is
    expected, and that epoch's members."""
    call = StoreCalls(store, identity)
    key = store_keys.invitation(ticket)

    def invitation() -> tuple[int, tuple[int, ...]] | None:
        if call("read its invitation", lambda s: s.check([key])):
            epoch, _, members = call("read its invitation", lambda s: s.get(key)).decode().partition(":")
            if int(epoch) > after_epoch:
                return int(epoch), tuple(int(m) for m in members.split(","))
        return None

    return poll(invitation, Deadline(timeout), lambda: RuntimeError(
        f"worker {identity} asked to join the running job, but no member admitted it within {timeout:g}s (members "
        f"admit joining workers as a step of cr.FaultTolerance.run starts); is the job still training?"))
