"""Where the workers of one job meet: the store prefix their secret and this start of the
job give, and the arrival check before the process group forms.

A store served by rank 0 or torchrun's agent has no authentication (a coordinator's
has: :mod:`.coordinator`); every key crossreplica writes lives under a prefix derived
from a job secret (:func:`job_namespace`). Workers given different secrets never meet: each waits
under its own prefix, and torch's process-group set-up would time out with
``DistStoreError: wait timeout ... keys: /crossreplica/<hash>`` after the whole
timeout. :func:`await_workers` makes that a fast, plain error: each worker also
counts itself under a key every job shares (a count, nothing of the secret), so
once every worker has arrived while fewer share this worker's secret, the cause
is known.

Under the prefix, each start of the job (torchrun restarts the workers after a
failure) gets keys of its own: a token rank 0 draws and hands to the others
(:func:`round_token`), since the attempt numbers the agents give their workers
differ from host to host after a restart.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .. import settings, store_keys
from ..engines.deadline import Deadline
from ..logs import ConfigurationWarning

__all__ = ["await_workers", "form_job", "job_namespace", "join_job", "poll", "round_token", "started_job",
           "take_host_place"]

T = TypeVar("T")

#: a torchrun run id shorter than this, or without digits, is warned about as a job secret
#: (a random hex id has 32 characters; a uuid 36)
_MIN_RUN_ID = 16


def job_namespace() -> str:
    """The store prefix of this job: derived from a secret the launcher shares with every
    worker and nobody else (``CROSSREPLICA_JOB_SECRET``, or torchrun's run id), so a process
    that reaches the store cannot guess the keys (the abort key among them)."""
    secret = settings.job_secret() or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not secret or secret == "none":
        warnings.warn(
            "MultiWorkerMirroredStrategy: no job secret (CROSSREPLICA_JOB_SECRET, or torchrun's "
            "--rdzv-id / --standalone run id), so the store's keys are predictable to anyone who can "
            "reach MASTER_ADDR:MASTER_PORT; set CROSSREPLICA_JOB_SECRET to the same random value on "
            "every worker", ConfigurationWarning, stacklevel=5)
        secret = "none"
    elif not settings.job_secret() and (len(secret) < _MIN_RUN_ID or not any(c.isdigit() for c in secret)):
        warnings.warn(
            "MultiWorkerMirroredStrategy: torchrun's run id (--rdzv-id) is the job secret here, and this one "
            "looks easy to guess (short, or a name without digits) for anyone who can reach the store; use a "
            "random id (`--rdzv-id=$(openssl rand -hex 16)`, the same on every host) or set "
            "CROSSREPLICA_JOB_SECRET", ConfigurationWarning, stacklevel=5)
    return _namespace_of(secret)


def _namespace_of(secret: str) -> str:
    return hashlib.sha256(f"crossreplica-job:{secret}".encode()).hexdigest()[:32]


def started_job(raw: Any, secret: str) -> Any | None:
    """The store of the newest start of the job whose secret is ``secret`` (what its workers
    share), read by whoever serves ``raw`` (``crossreplica launch``); None when no such job
    has started there."""
    key = store_keys.start(_namespace_of(secret))
    if not raw.check([key]):
        return None
    return dist.PrefixStore(store_keys.job(_namespace_of(secret), raw.get(key).decode()), raw)


def take_host_place(raw: Any, secret: str, hosts: int, where: str) -> int:
    """This host's place (0 .. ``hosts``-1) among the hosts of the job whose secret is
    ``secret``, in the order their launchers reach its coordinator at ``where``.

    Raises:
        ValueError: more launchers than ``hosts`` came (a second run of the job at the same
            coordinator, or --nnodes too small).
    """
    place = int(raw.add(store_keys.launch_hosts(_namespace_of(secret)), 1)) - 1
    if place >= hosts:
        raise ValueError(f"this is launcher {place + 1} to reach the coordinator at {where}, but the job has "
                         f"--nnodes {hosts} hosts; start one launcher per host, and a fresh `crossreplica "
                         f"coordinator` for each run of the job")
    return place


def form_job(raw: Any, rank: int, world: int, timeout: float) -> Any:
    """The store every worker of this start of the job shares: a PrefixStore over ``raw``
    under the job's namespace and this start's token (:func:`round_token`), once all
    ``world`` workers have arrived there (:func:`await_workers`)."""
    deadline = Deadline(timeout)
    answer = None
    namespace = job_namespace()
    if rank == 0:
        token = secrets.token_hex(8)
        answer = _Answers(raw, world, token)
        raw.set(store_keys.start(namespace), token)  # for workers that join later (join_job), and the launcher
    else:
        token = round_token(raw, rank, deadline, timeout)
    job = dist.PrefixStore(store_keys.job(namespace, token), raw)
    await_workers(raw, job, token, world, deadline, timeout, answer)
    return job


def join_job(raw: Any, timeout: float) -> Any:
    """The store of the running start of this job, for a worker that joins it later
    (``CROSSREPLICA_JOIN``): the prefix its rank 0 published under the job's namespace."""
    namespace = job_namespace()
    key = store_keys.start(namespace)
    token = poll(lambda: raw.get(key).decode() if raw.check([key]) else None, Deadline(timeout),
                  lambda: RuntimeError(
                      f"this worker was asked to join a running job (CROSSREPLICA_JOIN) but no job with its "
                      f"secret has started in the store at {_store_address()} within {timeout:g}s; check "
                      f"MASTER_ADDR, MASTER_PORT and CROSSREPLICA_JOB_SECRET, or unset CROSSREPLICA_JOIN to "
                      f"start a job"))
    return dist.PrefixStore(store_keys.job(namespace, token), raw)


def round_token(raw: Any, rank: int, deadline: Deadline, timeout: float) -> str:
    """The token rank 0 of this start of the job drew, asked for with a fresh greeting.

    torchrun's agent keeps one store for the whole job, and after a restart the
    agents' attempt numbers differ (the agent whose worker failed counts a restart,
    the others a membership change), so nothing in the environment names a start of
    the job on every host. Keys of an earlier start (its token among them) are still
    in the store; an answer that quotes this worker's fresh greeting can only come
    from the rank 0 of this start (every worker of an earlier start is gone before a
    new one begins).
    """
    greeting = secrets.token_hex(8)
    raw.set(store_keys.greeting(rank), greeting)
    key = store_keys.answer(rank)

    def answered() -> str | None:
        if raw.check([key]):
            token, _, quoted = raw.get(key).decode().partition(":")
            if quoted == greeting:
                return token
        return None

    return poll(answered, deadline, lambda: RuntimeError(
        f"worker rank 0 did not answer worker rank {rank} in the store at {_store_address()} within "
        f"{timeout:g}s; start rank 0 too, and check that every worker reaches that address"))


def _store_address() -> str:
    return f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def poll(ready: Callable[[], T | None], deadline: Deadline, late: Callable[[], Exception]) -> T:
    """``ready()``'s first answer other than None, polled with a growing pause (1 ms, doubling
    up to 50 ms); ``late()`` is raised once ``deadline`` has passed."""
    while True:
        answer = ready()
        if answer is not None:
            return answer
        if deadline.expired():
            raise late()
        deadline.back_off(0.001, 0.05)


class _Answers:
    """Rank 0's side of :func:`round_token`: answers every greeting it has not answered
    yet with this start's token (a stale greeting's answer is never read)."""

    def __init__(self, raw: Any, world: int, token: str):
        self.raw, self.token = raw, token
        self.keys = {rank: store_keys.greeting(rank) for rank in range(1, world)}
        self.answered: dict[int, str] = {}

    def __call__(self) -> None:
        raw, keys = self.raw, self.keys
        if raw.check(list(keys.values())):
            present = list(keys)
            values = raw.multi_get([keys[rank] for rank in present])
        else:
            present = [rank for rank, key in keys.items() if raw.check([key])]
            values = [raw.get(keys[rank]) for rank in present]
        for rank, value in zip(present, values):
            greeting = value.decode()
            if self.answered.get(rank) != greeting:
                raw.set(store_keys.answer(rank), f"{self.token}:{greeting}")
                self.answered[rank] = greeting


def await_workers(raw: Any, job: Any, token: str, world: int, deadline: Deadline, timeout: float,
                  answer: Callable[[], None] | None = None) -> None:
    """Waits until all ``world`` workers of this start have reached the store under this
    job's prefix (``job``, a PrefixStore over ``raw``); rank 0 calls ``answer`` meanwhile.

    Raises:
        RuntimeError: every worker arrived but some under another job secret (at once), or
            not all of them by ``deadline`` (naming how many did).
    """
    everyone = store_keys.arrivals(token)  # a count only: no secret in it
    # In this order, and read back in the reverse: every worker counted in ``everyone`` has
    # counted itself under its own prefix already, so ``mine`` read after ``total`` includes
    # every worker of this job that ``total`` does.
    job.add("arrivals", 1)
    raw.add(everyone, 1)
    mine = 0

    def arrived() -> bool | None:
        nonlocal mine
        if answer is not None:
            answer()
        total = raw.add(everyone, 0)
        mine = job.add("arrivals", 0)
        if mine >= world:
            return True
        if total >= world:
            raise RuntimeError(
                f"the workers disagree on the job secret: {total} workers reached the store at "
                f"{_store_address()}, but only {mine} of them with this worker's; give every worker the same "
                f"CROSSREPLICA_JOB_SECRET (or, under torchrun without it, the same --rdzv-id)")
        return None

    poll(arrived, deadline, lambda: RuntimeError(
        f"only {mine} of {world} workers reached the store at {_store_address()} within {timeout:g}s; "
        f"start every worker (WORLD_SIZE={world}) and check that each can reach that address"))
