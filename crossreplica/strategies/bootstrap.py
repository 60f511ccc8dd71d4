"""How a worker joins its job: the launcher's environment, the store and the first
process group (``MultiWorkerMirroredStrategy``'s set-up).

torchrun (or ``crossreplica launch``, or a hand launch) gives each worker RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Rank 0 serves the store on
MASTER_ADDR only (unless a launcher's agent serves it); every worker meets the
others under the job's prefix (:mod:`.job_store`) before the process group
forms, bounded by the timeout (:mod:`.network`). Without that environment the
worker runs alone, so the same script runs as ``python script.py``. A worker
started with ``CROSSREPLICA_JOIN`` joins a running fault-tolerant job instead:
alone until ``cr.FaultTolerance`` admits it.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
from typing import Any

import torch.distributed as dist

from .. import settings
from ..errors import summarize
from .job_store import form_job, join_job
from .network import bounded, choose_gloo_interface

__all__ = ["env_int", "init_process_group"]

_log = logging.getLogger(__name__)


def env_int(name: str, default: int | None = None) -> int | None:
    """An integer from the launcher's environment (torchrun's RANK, WORLD_SIZE, ...)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {summarize(raw)}") from None


def init_process_group(backend: str, timeout: float) -> tuple[bool, Any, bool]:
    """Initialises torch.distributed from the launcher environment unless the user did;
    returns whether it did, the store every worker of the job shares (None: the
    process group's), and whether this worker joins a running job (``CROSSREPLICA_JOIN``)."""
    if not dist.is_available():
        raise RuntimeError("MultiWorkerMirroredStrategy needs torch.distributed, which this "
                           "PyTorch build lacks")
    if dist.is_initialized():
        _log.info("using the existing process group: rank %d of %d, backend %s", dist.get_rank(),
                  dist.get_world_size(), dist.get_backend())
        return False, None, False
    td = datetime.timedelta(seconds=timeout)
    world = env_int("WORLD_SIZE")
    rank = env_int("RANK")
    if world is None and rank is None:
        # No launcher: a single worker, so the same script runs as `python script.py`.
        _log.info("no launcher environment (RANK, WORLD_SIZE): running as a single worker (backend %s)",
                  backend)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
        return True, None, False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(
            f"MultiWorkerMirroredStrategy reads the torchrun environment, but {missing} "
            f"{'is' if len(missing) == 1 else 'are'} not set; launch with "
            f"`torchrun --nproc-per-node=2 script.py` (or set RANK, WORLD_SIZE, MASTER_ADDR, "
            f"MASTER_PORT yourself)")
    if rank is None or world is None or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    port = env_int("MASTER_PORT")
    if port is None or not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} must be a TCP port in 1..65535")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    address = os.environ["MASTER_ADDR"]
    is_master = rank == 0 and not agent_store and not settings.join()
    # The store serves where the user asked (MASTER_ADDR), not on every interface.
    listener = _listen(address, port) if is_master else None
    try:
        tcp_store = dist.TCPStore(address, port, world_size=world, is_master=is_master, timeout=td,
                                  wait_for_workers=False,
                                  master_listen_fd=None if listener is None else listener.fileno())
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if listener is not None:
        listener.detach()  # the store's server now owns the socket; closing ours would close it
    if settings.join():
        # Alone until cr.FaultTolerance admits it into the job at a step boundary
        # (regroup): set-up collectives (mirror, ...) meet nobody meanwhile.
        job = join_job(tcp_store, timeout)
        _log.info("joining the running job in the store at MASTER_ADDR=%s MASTER_PORT=%d (CROSSREPLICA_JOIN); "
                  "alone until cr.FaultTolerance admits this worker", address, port)
        dist.init_process_group(backend, store=dist.PrefixStore(f"joiners/{secrets.token_hex(8)}", job),
                                rank=0, world_size=1, timeout=td)
        return True, job, True
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt not in ("", "0"):
        _log.warning("worker rank %d was restarted by the elastic agent (TORCHELASTIC_RESTART_COUNT=%s): "
                     "the previous attempt failed; resume from the last checkpoint", rank, attempt)
    _log.info("initialising the process group: rank %d of %d, backend %s, store at MASTER_ADDR=%s "
              "MASTER_PORT=%d (%s), timeout %gs", rank, world, backend, address, port,
              "the elastic agent's store" if agent_store else
              "served by this worker" if is_master else "served by rank 0", timeout)
    # torchrun's agent keeps one store across restarts: keys of an earlier start (gloo's
    # listening addresses among them) would be read as current, so each start gets a prefix.
    store = form_job(tcp_store, rank, world, timeout)
    if backend == "gloo":
        iface = choose_gloo_interface(address)
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
            _log.info("this host's name %r resolves to a loopback address (e.g. Debian's /etc/hosts: "
                      "127.0.1.1), which workers on other hosts cannot reach; gloo uses %s, the interface "
                      "that routes to MASTER_ADDR=%s (set GLOO_SOCKET_IFNAME to choose another)",
                      socket.gethostname(), iface, address)
    with bounded(f"forming the process group (worker rank {rank} of {world}, backend {backend})", timeout,
                 "Check that every host reaches the others at the address gloo advertises (this host's "
                 "name must not resolve to 127.0.1.1 when peers are remote), or set GLOO_SOCKET_IFNAME "
                 "(NCCL_SOCKET_IFNAME) to the interface that reaches MASTER_ADDR"):
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td)
    return True, store, False


def _listen(address: str, port: int) -> socket.socket:
    """A listening socket bound to ``address:port`` for the store's server."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"MASTER_ADDR={address!r} does not resolve to an address of this host: {e}") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(1024)
    except OSError as e:
        listener.close()
        raise RuntimeError(
            f"the store of rank 0 cannot listen on MASTER_ADDR={address!r}, MASTER_PORT={port}: {e}; "
            f"MASTER_ADDR must be an address of rank 0's host and the port free") from None
    return listener
