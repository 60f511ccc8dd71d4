"""Where the workers of one job meet: the store prefix their secret gives, and the arrival
check before the process group forms.

The store (rank 0's, or torchrun's agent's) has no authentication, so every key
crossreplica writes lives under a prefix derived from a job secret
(:func:`job_namespace`). Workers given different secrets never meet: each waits
under its own prefix, and torch's process-group set-up would time out with
``DistStoreError: wait timeout ... keys: /crossreplica/<hash>`` after the whole
timeout. :func:`await_workers` makes that a fast, plain error: each worker also
counts itself under a key every job shares (a count, nothing of the secret), so
once every worker has arrived while fewer share this worker's secret, the cause
is known.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from typing import Any

from .. import settings
from ..logs import ConfigurationWarning

__all__ = ["await_workers", "job_namespace"]

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
            "every worker", ConfigurationWarning, stacklevel=4)
        secret = "none"
    elif not settings.job_secret() and (len(secret) < _MIN_RUN_ID or not any(c.isdigit() for c in secret)):
        warnings.warn(
            "MultiWorkerMirroredStrategy: torchrun's run id (--rdzv-id) is the job secret here, and this one "
            "looks easy to guess (short, or a name without digits) for anyone who can reach the store; use a "
            "random id (`--rdzv-id=$(openssl rand -hex 16)`, the same on every host) or set "
            "CROSSREPLICA_JOB_SECRET", ConfigurationWarning, stacklevel=4)
    return hashlib.sha256(f"crossreplica-job:{secret}".encode()).hexdigest()[:32]


def await_workers(raw: Any, job: Any, attempt: str, world: int, timeout: float) -> None:
    """Waits until all ``world`` workers of this attempt have reached the store under this
    job's prefix (``job``, a PrefixStore over ``raw``).

    Raises:
        RuntimeError: every worker arrived but some under another job secret (at once), or
            not all of them within ``timeout`` seconds (naming how many did).
    """
    everyone = f"crossreplica/arrivals/attempt{attempt}"  # a count only: no secret in it
    # In this order, and read back in the reverse: every worker counted in ``everyone`` has
    # counted itself under its own prefix already, so ``mine`` read after ``total`` includes
    # every worker of this job that ``total`` does.
    job.add("arrivals", 1)
    raw.add(everyone, 1)
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        total = raw.add(everyone, 0)
        mine = job.add("arrivals", 0)
        if mine >= world:
            return
        if total >= world:
            raise RuntimeError(
                f"the workers disagree on the job secret: {total} workers reached the store at "
                f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, but only {mine} "
                f"of them with this worker's; give every worker the same CROSSREPLICA_JOB_SECRET (or, under "
                f"torchrun without it, the same --rdzv-id)")
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"only {mine} of {world} workers reached the store at MASTER_ADDR="
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {timeout:g}s (attempt "
                f"{attempt}); start every worker (WORLD_SIZE={world}) and check that each can reach that address")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
