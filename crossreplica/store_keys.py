"""Every key crossreplica writes to a job's store, in one place: the store's schema.

The raw store (rank 0's, a launcher's agent's, or the coordinator's) holds::

    crossreplica/greeting/<rank>, crossreplica/answer/<rank>
                                          a start's token asked for and answered (job_store.round_token)
    crossreplica/arrivals/<token>         workers arrived at a start, under any secret (a count)
    crossreplica/<namespace>/start        the newest start's token; <namespace> derives from the job secret
    crossreplica/<namespace>/launch/hosts the launchers' places across hosts (a count)
    crossreplica/<namespace>/<token>/     the job's store: one start of the job, where everything else lives

and the job's store (a PrefixStore under ``crossreplica/<namespace>/<token>/``)::

    arrivals                              workers arrived under this secret (a count)
    crossreplica/engines-of-rank<r>       worker r's engines so far: names each engine's keys
    crossreplica/engine<e>/heartbeat/<r>  worker r's heartbeat counter
    crossreplica/engine<e>/progress/<r>   the call worker r has posted (a stalled wait names the late)
    crossreplica/engine<e>/abort          why the job's workers must stop; read/<r>: r has read it
    crossreplica/engine<e>/meet/<n>/<r>   host-side collective n (cr.save), worker r's arrival
    crossreplica/engine<e>/p2p/<a>-><b>   point-to-point exchanges from worker a to b so far
    crossreplica/engine<e>/shm/<what>/<r> same-host shared memory set-up, worker r's part
    crossreplica/ft/founders              the workers that started a fault-tolerant job (a count)
    crossreplica/ft/joins                 joining workers' tickets (a count); join/<t>: ticket t's invitation
    crossreplica/ft/launched/<id>         the identity a worker restarted by a launcher (CROSSREPLICA_LAUNCH_ID) got
    crossreplica/ft/<epoch>/alive/<m>     member m's completed steps after epoch <epoch> failed
    crossreplica/ft/<epoch>/decided       the next epoch's members (the first proposal wins)
    crossreplica/ft/<epoch>/fatal         a failure no regrouping mends
    crossreplica/ft/<epoch>/grow          the step at which joining workers are admitted, and their tickets
    crossreplica/ft/<epoch>/group/...     the process group of epoch <epoch> (torch's own keys)

torch.distributed's own keys (the process group's rendezvous) live beside them in
the job's store. Nothing here is secret: the job secret only names the namespace.
"""

from __future__ import annotations

__all__ = ["ROOT", "abort", "alive", "answer", "arrivals", "decided", "engine", "engine_serial", "epoch",
           "fatal", "founders", "greeting", "grow", "heartbeat", "invitation", "job", "joins", "launch_hosts",
           "launched", "meeting", "p2p", "progress", "read", "shared_memory", "start"]

ROOT = "crossreplica"

# ------------------------------------------------------------------ the raw store


def greeting(rank: int) -> str:
    return f"{ROOT}/greeting/{rank}"


def answer(rank: int) -> str:
    return f"{ROOT}/answer/{rank}"


def arrivals(token: str) -> str:
    return f"{ROOT}/arrivals/{token}"


def start(namespace: str) -> str:
    return f"{ROOT}/{namespace}/start"


def launch_hosts(namespace: str) -> str:
    return f"{ROOT}/{namespace}/launch/hosts"


def job(namespace: str, token: str) -> str:
    """The prefix of one start of the job: the job's store."""
    return f"{ROOT}/{namespace}/{token}"


# ------------------------------------------------------------------ the job's store: engines


def engine_serial(rank: int) -> str:
    return f"{ROOT}/engines-of-rank{rank}"


def engine(serial: int) -> str:
    """The prefix of one engine's keys."""
    return f"{ROOT}/engine{serial}"


def heartbeat(engine_prefix: str, rank: int) -> str:
    return f"{engine_prefix}/heartbeat/{rank}"


def progress(engine_prefix: str, rank: int) -> str:
    return f"{engine_prefix}/progress/{rank}"


def abort(engine_prefix: str) -> str:
    return f"{engine_prefix}/abort"


def read(engine_prefix: str, rank: int) -> str:
    return f"{engine_prefix}/read/{rank}"


def meeting(engine_prefix: str, number: str, rank: int) -> str:
    return f"{engine_prefix}/meet/{number}/{rank}"


def p2p(engine_prefix: str, source: int, dest: int) -> str:
    return f"{engine_prefix}/p2p/{source}->{dest}"


def shared_memory(engine_prefix: str, what: str, rank: int) -> str:
    return f"{engine_prefix}/shm/{what}/{rank}"


# ------------------------------------------------------------------ the job's store: fault tolerance

def founders() -> str:
    return f"{ROOT}/ft/founders"


def joins() -> str:
    return f"{ROOT}/ft/joins"


def invitation(ticket: int) -> str:
    return f"{ROOT}/ft/join/{ticket}"


def launched(launch_id: str) -> str:
    return f"{ROOT}/ft/launched/{launch_id}"


def epoch(number: int) -> str:
    """The prefix of membership epoch ``number``'s keys (its process group's among them)."""
    return f"{ROOT}/ft/{number}"


def alive(number: int, member: int) -> str:
    return f"{epoch(number)}/alive/{member}"


def decided(number: int) -> str:
    return f"{epoch(number)}/decided"


def fatal(number: int) -> str:
    return f"{epoch(number)}/fatal"


def grow(number: int) -> str:
    return f"{epoch(number)}/grow"
