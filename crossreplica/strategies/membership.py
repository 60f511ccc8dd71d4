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
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..engines.torch_dist.store_probe import StoreProbe
from ..engines.torch_dist import WorkerFailedError
from ..errors import CrossReplicaError

__all__ = ["FencedOutError", "Membership", "agree", "epoch_prefix", "give_up"]

_UNANSWERED = object()


class FencedOutError(CrossReplicaError):
    """This worker was left out of the job's new membership (it was judged lost)."""


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


def epoch_prefix(epoch: int) -> str:
    """The store prefix of membership epoch ``epoch``'s keys (its process group's among them)."""
    return f"crossreplica/ft/{epoch}"


def agree(store: Any, epoch: int, identity: int, completed: int, members: Sequence[int],
          stopped: Callable[[], Sequence[int]], timeout: float, pace: float = 0.01) -> Membership:
    """The members of epoch ``epoch + 1``, agreed by the survivors of epoch ``epoch``.

    Args:
        store: the job's store (every worker's, for the whole job).
        epoch: the epoch whose process group failed.
        identity: this worker's identity; ``completed`` its completed steps.
        members: epoch ``epoch``'s members (identities, in rank order).
        stopped: the ranks of epoch ``epoch`` whose heartbeat stopped.
        timeout: how long a member that neither posts nor stops is waited for.

    Raises:
        FencedOutError: the survivors decided without this worker.
        WorkerFailedError: a member failed in a way no regrouping mends (it raised),
            or this worker cannot reach the store.
    """
    probe = StoreProbe(store)
    base = epoch_prefix(epoch)
    decided, fatal = f"{base}/decided", f"{base}/fatal"
    alive = {m: f"{base}/alive/{m}" for m in members}

    def call(what: str, fn: Callable[[Any], Any]) -> Any:
        try:
            answer = probe(_UNANSWERED, fn, raises=True)
        except Exception as e:  # noqa: BLE001 - the store host is gone: no agreement is possible
            raise WorkerFailedError(f"worker {identity} cannot reach the job's store to {what} ({e}); it "
                                    f"stops rather than go on alone") from None
        if answer is _UNANSWERED:
            raise WorkerFailedError(f"worker {identity} is cut off from the job's store (it did not answer "
                                    f"within {probe.seconds:g}s while trying to {what}); it stops rather than "
                                    f"go on alone")
        return answer

    call("post that it is alive", lambda s: s.set(alive[identity], str(completed)))
    deadline = time.monotonic() + timeout
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
        if not waiting or time.monotonic() >= deadline:
            _propose(call, decided, alive, posted, epoch + 1)
            continue
        time.sleep(pace)


def _propose(call: Callable[[str, Callable[[Any], Any]], Any], decided: str, alive: dict[int, str],
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
    probe(None, lambda s: s.set(f"{epoch_prefix(epoch)}/fatal", message))
