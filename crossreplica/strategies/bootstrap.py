"""How a worker joins its job: the launcher's environment (:class:`JobEnv`), the store and the first
process group (``MultiWorkerMirroredStrategy``'s set-up).

:class:`JobEnv` reads the job's environment, in one place, from whichever launcher
started the worker: torchrun, ``crossreplica launch`` or a hand launch (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or SLURM's
``srun`` (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the step's node list
and job id), torchrun's variables first when both are present. Rank 0 serves the
store on MASTER_ADDR only, unless a launcher's agent serves it or the job has a
coordinator (``CROSSREPLICA_COORDINATOR``: ``crossreplica coordinator``, reached with
the job secret, :mod:`crossreplica.elastic.store`); every worker meets
the others under the job's prefix (:mod:`.job_store`) before the process group
forms, bounded by the timeout (:mod:`.network`). Without a launcher's environment
the worker runs alone, so the same script runs as ``python script.py``. A worker
started with ``CROSSREPLICA_JOIN`` joins a running fault-tolerant job instead:
alone until ``cr.FaultTolerance`` admits it.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import re
import secrets
import socket
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist

from .. import settings
from ..errors import ConfigurationWarning, summarize
from ..elastic.store import CoordinatorStore
from ..elastic.job_store import form_job, join_job
from .network import bounded, choose_gloo_interface

__all__ = ["JobEnv", "env_int", "form_process_group", "init_process_group", "local_placement", "nodelist_hosts",
           "slurm_port", "tasks_per_node", "torchrun_agent"]

_log = logging.getLogger(__name__)

#: SLURM without MASTER_PORT: this plus the last 4 digits of SLURM_JOB_ID (as Lightning does)
SLURM_BASE_PORT = 15000


def env_int(name: str, default: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """An integer from the launcher's environment (torchrun's RANK, WORLD_SIZE, ...)."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {summarize(raw)}") from None


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """This worker's place in its job, as its launcher describes it.

    Attributes:
        launcher: "torchrun", "crossreplica launch", "srun" or "hand" (RANK and the
            others set by hand, or by a launcher we do not know).
        rank, world_size: this worker's rank and the job's worker count.
        local_rank, local_world_size: its rank among the workers of its host, and their
            count (1 when the launcher does not say).
        master_addr, master_port: where the job's store is served.
        agent_store: whether a launcher's agent serves the store (rank 0 does not).
        coordinator: the job's coordinator (``CROSSREPLICA_COORDINATOR``), which serves
            the store to the workers that know the job secret; None: MASTER_ADDR's store.
        restart_count: torchrun's TORCHELASTIC_RESTART_COUNT ("0": the first start).
        derived: how master_addr / master_port were found when the environment did not
            give them (SLURM; "" when it did), for the log.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool = False
    restart_count: str = "0"
    derived: str = ""
    coordinator: tuple[str, int] | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> JobEnv | None:
        """The job's environment (``os.environ`` by default); None when no launcher started
        this worker (it runs alone). torchrun's variables come first; SLURM's are read when
        neither RANK nor WORLD_SIZE is set.

        Raises:
            ValueError: the environment is partial or inconsistent (naming the variable and the fix).
        """
        env = os.environ if environ is None else environ
        # With a coordinator, it serves the store: MASTER_ADDR:MASTER_PORT are its address.
        text = env.get(settings.COORDINATOR, "").strip()
        coordinator = settings.SETTINGS[settings.COORDINATOR].parse(text) if text else None
        if env_int("WORLD_SIZE", environ=env) is not None or env_int("RANK", environ=env) is not None:
            return cls._torchrun(env, coordinator)
        if _slurm_step(env):
            return cls._slurm(env, coordinator)
        return None

    def environ(self) -> dict[str, str]:
        """The environment a launcher gives this worker (torchrun's variables, and the
        coordinator's address): what :meth:`read` reads back as this JobEnv."""
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "LOCAL_WORLD_SIZE": str(self.local_world_size), "ROLE_RANK": str(self.rank),
               "GROUP_RANK": str(self.rank // self.local_world_size), "MASTER_ADDR": self.master_addr,
               "MASTER_PORT": str(self.master_port)}
        if self.agent_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        if self.coordinator is not None:
            host, port = self.coordinator
            env[settings.COORDINATOR] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return env

    @classmethod
    def _torchrun(cls, env: Mapping[str, str], coordinator: tuple[str, int] | None) -> JobEnv:
        needed = ("RANK", "WORLD_SIZE") + (("MASTER_ADDR", "MASTER_PORT") if coordinator is None else ())
        missing = [k for k in needed if not env.get(k)]
        if missing:
            raise ValueError(
                f"MultiWorkerMirroredStrategy reads the torchrun environment, but {missing} "
                f"{'is' if len(missing) == 1 else 'are'} not set; launch with "
                f"`torchrun --nproc-per-node=2 script.py` (or set RANK, WORLD_SIZE, MASTER_ADDR, "
                f"MASTER_PORT yourself)")
        rank, world = _required(env, "RANK"), _required(env, "WORLD_SIZE")
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        launcher = ("torchrun" if env.get("TORCHELASTIC_RUN_ID") else
                    "crossreplica launch" if agent_store else "hand")
        local_rank, local_world = _local(env, "LOCAL_RANK", env_int("LOCAL_WORLD_SIZE", environ=env))
        address, port = coordinator or (env["MASTER_ADDR"], env_int("MASTER_PORT", environ=env))
        return cls._checked(launcher, rank, world, local_rank, local_world, address, port,
                            agent_store or coordinator is not None, env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0",
                            coordinator=coordinator)

    @classmethod
    def _slurm(cls, env: Mapping[str, str], coordinator: tuple[str, int] | None) -> JobEnv:
        rank, world = _required(env, "SLURM_PROCID"), _required(env, "SLURM_STEP_NUM_TASKS")
        local_rank, local_world = _local(env, "SLURM_LOCALID", _slurm_local_world(env))
        if coordinator is not None:
            return cls._checked("srun", rank, world, local_rank, local_world, *coordinator, agent_store=True,
                                coordinator=coordinator)
        derived = []
        address = env.get("MASTER_ADDR")
        if not address:
            source = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                           if env.get(k)), None)
            if source is None:
                raise ValueError("SLURM gave this worker no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, "
                                 "SLURM_NODELIST) to find rank 0's host in; set MASTER_ADDR to rank 0's host")
            address = next(nodelist_hosts(env[source], source))
            here = env.get("SLURMD_NODENAME")
            if rank == 0 and here and here != address:
                raise ValueError(f"SLURM put rank 0 on {here!r}, not on the first node of {source} "
                                 f"({address!r}), where the others would look for its store; set MASTER_ADDR "
                                 f"(to {here!r}) and MASTER_PORT for every task, e.g. in the job script")
            derived.append(f"MASTER_ADDR: the first node of {source}")
        if env.get("MASTER_PORT"):
            port = env_int("MASTER_PORT", environ=env)
        else:
            port = slurm_port(env.get("SLURM_JOB_ID"))
            derived.append(f"MASTER_PORT: {SLURM_BASE_PORT} + the last 4 digits of SLURM_JOB_ID")
        return cls._checked("srun", rank, world, local_rank, local_world, address, port, derived="; ".join(derived))

    @classmethod
    def _checked(cls, launcher: str, rank: int, world: int, local_rank: int, local_world: int, address: str,
                 port: int | None, agent_store: bool = False, restart_count: str = "0",
                 derived: str = "", coordinator: tuple[str, int] | None = None) -> JobEnv:
        names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS") if launcher == "srun" else ("RANK", "WORLD_SIZE")
        if not 0 <= rank < world:
            raise ValueError(f"{names[0]}={rank} must be in [0, {names[1]}={world})")
        if port is None or not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT={port} must be a TCP port in 1..65535")
        return cls(launcher, rank, world, local_rank, local_world, address, port, agent_store, restart_count,
                   derived, coordinator)


def _required(env: Mapping[str, str], name: str) -> int:
    """An integer variable the caller knows is set."""
    value = env_int(name, environ=env)
    if value is None:
        raise ValueError(f"environment variable {name} must be set")
    return value


def _local(env: Mapping[str, str], rank_name: str, world: int | None) -> tuple[int, int]:
    """This worker's local rank (from ``rank_name``, 0 when unset) and its host's worker count
    (``world``; 1 when unknown)."""
    local_rank = env_int(rank_name, 0, environ=env) or 0
    return local_rank, world if world is not None and world >= 1 else 1


def _slurm_step(env: Mapping[str, str], warn: bool = True) -> bool:
    """Whether ``srun`` started this process as a task of a job step. A batch script that
    runs the program itself also has SLURM_PROCID and SLURM_NTASKS (those of the
    allocation) but no step's task count: it runs alone (with ``warn``, told so)."""
    if not env.get("SLURM_PROCID"):
        return False
    if env.get("SLURM_STEP_NUM_TASKS"):
        return True
    tasks = env.get("SLURM_NTASKS", "")
    if warn and tasks.isdigit() and int(tasks) > 1:
        warnings.warn(f"SLURM allocated {tasks} tasks (SLURM_NTASKS) but this process was not started by srun "
                      f"(no SLURM_STEP_NUM_TASKS), so it runs as a single worker; start one worker per task with "
                      f"`srun python script.py` in the job script", ConfigurationWarning, stacklevel=5)
    return False


def _slurm_local_world(env: Mapping[str, str]) -> int | None:
    """The tasks of this step on this node: SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID."""
    text, node = env.get("SLURM_STEP_TASKS_PER_NODE"), env_int("SLURM_NODEID", environ=env)
    if not text or node is None:
        return None
    counts = tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE")
    return counts[node] if 0 <= node < len(counts) else None


def local_placement(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """This worker's local rank and its host's worker count, from whichever launcher started
    it ((0, 1) without one): where its default devices are (``MultiWorkerMirroredStrategy``),
    also when the user initialised the process group."""
    env = os.environ if environ is None else environ
    torchrun = env_int("WORLD_SIZE", environ=env) is not None or env_int("RANK", environ=env) is not None
    if not torchrun and _slurm_step(env, warn=False):
        return _local(env, "SLURM_LOCALID", _slurm_local_world(env))
    return _local(env, "LOCAL_RANK", env_int("LOCAL_WORLD_SIZE", environ=env))


def torchrun_agent(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """torchrun's agent on this host, as its workers see it: how many workers it started here
    (LOCAL_WORLD_SIZE; it stops all of them when one fails) and how many times it may start
    them again (TORCHELASTIC_MAX_RESTARTS; a restart restarts every agent's workers). None
    when torchrun (TORCHELASTIC_RUN_ID) did not start this worker."""
    env = os.environ if environ is None else environ
    if not env.get("TORCHELASTIC_RUN_ID"):
        return None
    return (env_int("LOCAL_WORLD_SIZE", 1, environ=env) or 1,
            env_int("TORCHELASTIC_MAX_RESTARTS", 0, environ=env) or 0)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def nodelist_hosts(text: str, name: str = "the node list") -> Iterator[str]:
    """The host names of a SLURM host list, in order: ``node[01-03,07],login`` is node01,
    node02, node03, node07, login; ``rack[1-2]-n[1-2]`` is rack1-n1, rack1-n2, rack2-n1,
    rack2-n2 (a range keeps its lower bound's zero padding).

    Raises:
        ValueError: ``text`` (read from ``name``) is not such a list.
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"{name} must be a SLURM host list such as 'node[01-03],login'; got {summarize(text)} "
                          f"({why})")

    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise bad("brackets do not pair up")
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise bad("a '[' is not closed")
    items.append(text[start:])
    for item in items:
        item = item.strip()
        if not item:
            raise bad("an empty name")
        parts: list[list[str]] = []
        pos = 0
        for m in re.finditer(r"\[([^\]]*)\]", item):
            parts += [[item[pos:m.start()]], _numbers(m.group(1), bad)]
            pos = m.end()
        parts.append([item[pos:]])
        for combination in itertools.product(*parts):
            yield "".join(combination)


def _numbers(inside: str, bad: Callable[[str], ValueError]) -> list[str]:
    """The numbers of a host list's brackets, ``01-03,07``, each padded as its range's lower bound."""
    names: list[str] = []
    for piece in inside.split(","):
        m = _RANGE.match(piece.strip())
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise bad(f"{piece!r} is not a number or an ascending range")
        low, high = m.group(1), m.group(2) or m.group(1)
        names.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return names


def tasks_per_node(text: str, name: str = "the tasks per node") -> list[int]:
    """SLURM's tasks per node, ``2(x3),1``, as a list: [2, 2, 2, 1]."""
    counts = []
    for piece in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if m is None:
            raise ValueError(f"{name} must be counts such as '2(x3),1'; got {summarize(text)}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_port(job_id: str | None) -> int:
    """The store's port for a SLURM job without MASTER_PORT: :data:`SLURM_BASE_PORT` plus the
    last 4 digits of its SLURM_JOB_ID, the same on every task of the job."""
    if not job_id or not job_id.isdigit():
        raise ValueError(f"SLURM_JOB_ID must be the job's number to derive the store's port from; got "
                         f"{summarize(job_id)}; set MASTER_PORT to a free port, the same for every task")
    return SLURM_BASE_PORT + int(job_id[-4:])


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
    job = JobEnv.read()
    if job is None:
        # No launcher: a single worker, so the same script runs as `python script.py`.
        _log.info("no launcher environment (RANK, WORLD_SIZE): running as a single worker (backend %s)", backend)
        _init_group(backend, dist.HashStore(), 0, 1, timeout)
        return True, None, False
    rank, world, address, port = job.rank, job.world_size, job.master_addr, job.master_port
    if job.derived:
        _log.info("started by srun: rank %d of %d (SLURM_PROCID, SLURM_STEP_NUM_TASKS), store at %s:%d (%s)",
                  rank, world, address, port, job.derived)
    is_master = rank == 0 and not job.agent_store and not settings.join()
    tcp_store = (_tcp_store(job, is_master, td) if job.coordinator is None else
                 _coordinator_store(*job.coordinator, td))
    if settings.join():
        # Alone until cr.FaultTolerance admits it into the job at a step boundary
        # (regroup): set-up collectives (mirror, ...) meet nobody meanwhile.
        job_store = join_job(tcp_store, timeout)
        _log.info("joining the running job in the store at MASTER_ADDR=%s MASTER_PORT=%d (CROSSREPLICA_JOIN); "
                  "alone until cr.FaultTolerance admits this worker", address, port)
        _init_group(backend, dist.PrefixStore(f"joiners/{secrets.token_hex(8)}", job_store), 0, 1, timeout)
        return True, job_store, True
    if job.restart_count not in ("", "0"):
        _log.warning("worker rank %d was restarted by the elastic agent (TORCHELASTIC_RESTART_COUNT=%s): "
                     "the previous attempt failed; resume from the last checkpoint", rank, job.restart_count)
    _log.info("initialising the process group: rank %d of %d, backend %s, store at MASTER_ADDR=%s "
              "MASTER_PORT=%d (%s), timeout %gs", rank, world, backend, address, port,
              "the coordinator's store, authenticated" if job.coordinator is not None else
              "the elastic agent's store" if job.agent_store else
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
    form_process_group(backend, store, rank, world, timeout)
    return True, store, False


def form_process_group(backend: str, store: Any, rank: int, world: int, timeout: float,
                       regroup: bool = False) -> None:
    """The default process group of ``world`` workers meeting in ``store``: formed as a job
    starts, and formed again by the members of a fault-tolerant job after a loss
    (``regroup``); bounded by ``timeout``, and a failure says what to check."""
    what = "re-forming" if regroup else "forming"
    hint = ("Check that the surviving workers still reach each other" if regroup else
            "Check that every host reaches the others at the address gloo advertises (this host's name must not "
            "resolve to 127.0.1.1 when peers are remote), or set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) to the "
            "interface that reaches MASTER_ADDR")
    with bounded(f"{what} the process group (worker rank {rank} of {world}, backend {backend})", timeout, hint):
        _init_group(backend, store, rank, world, timeout)


#: sys.excepthook as it was before this process's first process group
_hook_before_groups: Any = None


def _init_group(backend: str, store: Any, rank: int, world: int, timeout: float) -> None:
    """``dist.init_process_group``, each time over the excepthook the process had before its
    first group: torch wraps the hook it finds with one that prefixes ``[rank<r>]:``, so a
    job that regroups would otherwise prefix a traceback once per group it ever had."""
    global _hook_before_groups
    if _hook_before_groups is None:
        _hook_before_groups = sys.excepthook
    else:
        sys.excepthook = _hook_before_groups
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def _tcp_store(job: JobEnv, is_master: bool, td: datetime.timedelta) -> dist.TCPStore:
    """The store at MASTER_ADDR:MASTER_PORT, served by this worker when ``is_master``."""
    # The store serves where the user asked (MASTER_ADDR), not on every interface.
    listener = _listen(job.master_addr, job.master_port) if is_master else None
    try:
        store = dist.TCPStore(job.master_addr, job.master_port, world_size=job.world_size, is_master=is_master,
                              timeout=td, wait_for_workers=False,
                              master_listen_fd=None if listener is None else listener.fileno())
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if listener is not None:
        listener.detach()  # the store's server now owns the socket; closing ours would close it
    return store


def _coordinator_store(host: str, port: int, td: datetime.timedelta) -> CoordinatorStore:
    """The store the job's coordinator at ``host:port`` serves, reached with the job secret."""
    secret = settings.job_secret()
    if secret is None:
        raise ValueError(f"{settings.COORDINATOR} names the job's coordinator, which serves only the workers "
                         f"that know the job secret; set CROSSREPLICA_JOB_SECRET to the coordinator's (the same "
                         f"on every host)")
    return CoordinatorStore(host, port, secret, td)


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
