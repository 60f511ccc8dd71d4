"""MultiWorkerMirroredStrategy: replicas in several processes (and hosts), joined by torch.distributed.

Each process is a *worker* that drives ``replicas_per_worker`` local replicas
(threads, as MirroredStrategy does). Replicas are numbered globally:
``replica id = worker rank * replicas_per_worker + local index``. The workers
are found from the standard launcher environment (``torchrun`` sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT); without it the strategy
runs as a single worker, so the same script also runs as ``python script.py``.

tf semantics: ``run`` returns the LOCAL replicas' results (a PerReplica of
``replicas_per_worker`` values); ``merge_call`` runs ``merge_fn`` once per
worker on its local replicas; ``reduce`` / ``gather`` in cross-replica context
cover every replica of every worker (the hooks below).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from typing import Any, cast
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from ..micro_batches import LayoutInvariant, check_layout
from .. import nest, settings
from .. import torch_private as tp
from ..arguments import check_int
from ..cross_device_ops import CommunicationOptions
from ..devices import canonical_device
from ..engines.base import AllGatherParams, AllReduceParams, BroadcastParams, Call, Kind
from ..engines.hierarchical import HierarchicalEngine
from ..engines.sparse import reduce_gathered, sparse_leaves
from ..engines.torch_dist import TorchDistEngine
from ..engines.torch_dist.plan import keep_for_good
from ..errors import summarize
from ..groups import Groups
from ..logs import ConfigurationWarning
from ..reduce_op import ReduceOp, compress, compresses, compression_scale, decompress, from_wire, mean_scale, to_wire
from ..timeouts import canonical_timeout
from .base import Strategy, StrategyExtended
from .bootstrap import form_process_group, init_process_group, local_placement
from .logical_devices import LogicalDevices

__all__ = ["MultiWorkerMirroredStrategy", "MultiWorkerExtended", "running"]

_BACKENDS = ("gloo", "nccl")

_log = logging.getLogger(__name__)

#: the strategies built in this process, oldest first (:func:`running`)
_BUILT: list[weakref.ref[MultiWorkerMirroredStrategy]] = []


def running() -> MultiWorkerMirroredStrategy | None:
    """The newest MultiWorkerMirroredStrategy of this process, not closed, whose engine spans
    the current default process group; None if there is none. ``cr.save`` and ``cr.load``
    called outside any scope reach the other workers through it (bounded, watched waits),
    not through bare torch.distributed calls."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    _BUILT[:] = [ref for ref in _BUILT if ref() is not None]
    for ref in reversed(_BUILT):
        strategy = ref()
        if strategy is None or strategy.closed:
            continue
        engine = cast(MultiWorkerExtended, strategy.extended).engine
        if engine.world_size == dist.get_world_size() and engine.rank == dist.get_rank():
            return strategy
    return None


def _state_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nest of modules (parameters, then buffers) and tensors, in a fixed order."""
    tensors: list[torch.Tensor] = []
    for leaf in nest.flatten(obj)[0]:
        if isinstance(leaf, torch.nn.Module):
            tensors += [p.data for p in leaf.parameters()] + list(leaf.buffers())
        elif isinstance(leaf, torch.Tensor):
            tensors.append(leaf.data)
    return tensors


def _build_engine(options: dict[str, Any]) -> TorchDistEngine:
    """The engine over the current process group: one local replica, or several (hierarchical)."""
    if len(options["devices"]) == 1:
        # Same-host workers all-reduce floating point through shared memory
        # (engines/torch_dist/shared_memory.py) unless CROSSREPLICA_SHARED_MEMORY=0.
        return TorchDistEngine(**options)
    return HierarchicalEngine(**{k: v for k, v in options.items() if k != "shared_memory"})


class MultiWorkerExtended(StrategyExtended):
    """Cross-process versions of the cross-replica hooks, plus worker facts."""

    engine: TorchDistEngine
    #: how the strategy built its engine (``regroup`` builds the next one the same way)
    engine_options: dict[str, Any]
    #: the store every worker of the job shares, or None
    job_store: Any
    #: this worker waits, alone, to join a running fault-tolerant job (``CROSSREPLICA_JOIN``)
    joining: bool = False

    @property
    def worker_rank(self) -> int:
        return self.engine.rank

    @property
    def num_workers(self) -> int:
        return self.engine.world_size

    @property
    def always_wrap(self) -> bool:
        return self.engine.world_size > 1

    @contextlib.contextmanager
    def collective_timeout(self, seconds: float | None) -> Iterator[None]:
        """Bounds the cross-process waits inside by ``seconds`` (None: the engine's timeout)."""
        with self.engine.timeout_override(seconds):
            yield

    def _world(self) -> Groups:
        return (tuple(range(self.engine.num_replicas)),)

    def reduce_values(self, op: ReduceOp, tensors: Sequence[torch.Tensor], *,
                      compression: torch.dtype | None = None) -> torch.Tensor:
        """Reduces the local replicas' tensors with every other worker's (one collective);
        with ``compression``, as StrategyExtended.reduce_values."""
        if self.engine.world_size == 1:
            return super().reduce_values(op, tensors, compression=compression)
        xs = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors]
        if xs[0].layout is not torch.strided:
            return self._reduce_sparse_values(op, xs)
        dtype = xs[0].dtype
        if compression is not None and op in (ReduceOp.SUM, ReduceOp.MEAN) and compresses(dtype, compression):
            # The narrow tensors cross the wire as they are (no widening): a SUM, then scaled back.
            n = self.num_replicas_in_sync
            factor = compression_scale(n)
            narrow = [compress(x, compression, factor) for x in xs]
            calls = [Call.of(Kind.ALL_REDUCE, self._world(), AllReduceParams(ReduceOp.SUM), [x]) for x in narrow]
            out = self.engine.process(calls, [[x] for x in narrow])[0][0]
            return decompress(out, dtype, factor, n if op is ReduceOp.MEAN else None)
        # as StrategyExtended.reduce_values: a MEAN of huge values scaled down, no overflow of the sum
        scale = mean_scale(op, self.num_replicas_in_sync, xs[0].dtype)
        return self._on_workers(Kind.ALL_REDUCE, AllReduceParams(op), xs, op, scale)

    def _reduce_sparse_values(self, op: ReduceOp, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Sparse COO: every replica's (indices, values) gathered, reduced in replica order."""
        leaves = [sparse_leaves([t], t.device) for t in tensors]
        calls = [Call.of(Kind.ALL_GATHER, self._world(), AllGatherParams((0,) * len(ls)), ls) for ls in leaves]
        gathered = self.engine.process(calls, leaves)[0]
        world = self._world()[0]
        return reduce_gathered(op, gathered, world, self.local_replica_ids[0], tensors[:1])[0]

    def gather_values(self, tensors: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        """Concatenates every replica's tensor along ``axis``, in global replica order."""
        if self.engine.world_size == 1:
            return super().gather_values(tensors, axis)
        xs = [t.unsqueeze(0) if t.dim() == 0 else t for t in tensors]
        return self._on_workers(Kind.ALL_GATHER, AllGatherParams((axis % xs[0].dim(),)), xs)

    def broadcast_values(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Replica 0's tensor (of worker 0), given one tensor per local replica."""
        if self.engine.world_size == 1:
            return super().broadcast_values(tensors)
        return self._on_workers(Kind.BROADCAST, BroadcastParams(0), list(tensors))

    def _on_workers(self, kind: Kind, params: Any, xs: list[torch.Tensor], op: ReduceOp | None = None,
                    scale: float | None = None) -> torch.Tensor:
        """One worker-level call over every replica in sync, one tensor per local replica, in
        the wire dtype (float16 sums in float32, unsigned ints as signed: engines/wire.py);
        the first local replica's result, in the tensors' dtype."""
        dtype = xs[0].dtype
        wire = [to_wire(op, x, scale) for x in xs]
        calls = [Call.of(kind, self._world(), params, [x]) for x in wire]
        return from_wire(op, self.engine.process(calls, [[x] for x in wire])[0][0], dtype, scale)

    def broadcast_initial_state(self, mirrored: Any) -> Any:
        """Overwrites every local copy in ``mirrored`` (a Mirrored of modules, tensors or
        nests of them) with global replica 0's values, in place; returns ``mirrored``.

        The hook ``Strategy.mirror`` calls, so every worker starts from the chief's
        initial weights whatever its own random initialisation was."""
        if self.engine.world_size == 1:
            return mirrored
        per_copy = [_state_tensors(copy) for copy in mirrored.values]
        counts = {len(ts) for ts in per_copy}
        if len(counts) != 1:
            raise ValueError(f"the local copies of a Mirrored value differ in structure ({sorted(counts)} "
                             f"tensors); build it with strategy.mirror")
        if not per_copy[0]:
            return mirrored
        calls = [Call.of(Kind.BROADCAST, self._world(), BroadcastParams(0), ts) for ts in per_copy]
        outs = self.engine.process(calls, per_copy)
        with torch.no_grad():
            for ts, news in zip(per_copy, outs):
                for t, new in zip(ts, news):
                    t.copy_(new)
        return mirrored

    def barrier(self, what: str = "barrier") -> None:
        """Every worker waits here for the others (bounded by the timeout)."""
        self.engine.barrier(what)

    def regroup(self, store: Any, rank: int, world_size: int) -> None:
        """Replaces the process group and the engine with new ones over ``store``: this
        worker becomes ``rank`` of ``world_size`` (a fault-tolerant job's new membership,
        every member calling it with the same ``store``). The old group is aborted first,
        so work pending on a lost peer cannot block; anything it still delivers lands in
        a group nobody reads (the lost worker is fenced out)."""
        layout = self.layout_invariant
        num_replicas = world_size * len(self.worker_devices)
        if layout is not None:
            check_layout(layout, num_replicas)
        backend = self.engine.backend
        self.engine.close()
        if dist.is_initialized():
            old = dist.group.WORLD
            with contextlib.suppress(Exception):  # a group whose peers are gone: nothing to tell them
                old.abort()  # type: ignore[union-attr]
            tp.retire_default_group()
            if old is not None:
                keep_for_good(old)
        form_process_group(backend, store, rank, world_size, float(self.engine_options["timeout"]), regroup=True)
        self._container._owns_process_group = True  # type: ignore[attr-defined]
        self.engine = _build_engine(self.engine_options)
        self.reset_pending()


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous replicas across processes and hosts.

    Args:
        replicas_per_worker: local replicas per process (threads, one per
            device); global replica id = rank * replicas_per_worker + local index.
        backend: "gloo" or "nccl"; default nccl when the replicas sit on CUDA
            devices, else gloo. Ignored when the process group already exists.
        timeout_seconds: bound on every collective and on process-group set-up
            (env CROSSREPLICA_TIMEOUT, default 300). A worker that dies or
            raises makes the others fail within it.
        devices: this worker's devices, one per local replica. Default, when CUDA
            is available and the backend is not gloo: the host's GPUs split evenly
            between its LOCAL_WORLD_SIZE processes, local replica ``i`` on the
            process's ``i % share``-th GPU (NCCL needs a GPU of its own per process:
            with more processes than GPUs the CPU is used, with a warning, or
            ``backend="nccl"`` raises); else the CPU.
        check_collectives: before every collective, compare every replica's
            call across workers and raise CollectiveMismatchError listing them
            on a mismatch (env CROSSREPLICA_CHECK_COLLECTIVES=1). Costs one
            small collective per collective.
        ordered_reductions: reduce floating-point values in ascending replica id,
            exactly as the in-process engine does, so results are bitwise the same
            as with MirroredStrategy (default). This gathers every member's tensor
            for groups of three or more replicas; False uses the backend's ring
            all-reduce instead (less traffic with many workers, results equal up to
            rounding). Groups of two replicas, integers, bool, MAX and MIN are exact
            either way.
        logical_devices_per_replica: devices each local replica owns (model
            parallelism inside a replica): ``devices`` then lists ``k`` per replica,
            consecutive; the default spreads them over the process's GPUs as above.
        cross_device_ops: how every cross-device reduction is done (default
            ``cr.AllReduceCrossDeviceOps()``; see docs/collectives.md).
        communication_options: a ``cr.CommunicationOptions``, as TF's argument of that
            name: the options of every reduction given none. Its ``timeout_seconds``
            is also the strategy's timeout when ``timeout_seconds`` is not given.
        layout_invariant: a ``cr.LayoutInvariant(micro_batches=M)`` for training whose
            bits do not depend on the number of workers and replicas
            (docs/layout_invariance.md).
    """

    def __init__(self, replicas_per_worker: int = 1, backend: str | None = None,
                 timeout_seconds: float | None = None, *, devices: Sequence[Any] | None = None,
                 check_collectives: bool | None = None, cross_device_ops: Any = None,
                 ordered_reductions: bool = True, logical_devices_per_replica: int = 1,
                 communication_options: CommunicationOptions | None = None,
                 layout_invariant: LayoutInvariant | None = None):
        check_int(replicas_per_worker, "replicas_per_worker", low=1)
        check_layout(layout_invariant, 1)  # its type, before any process group is set up
        if communication_options is not None and not isinstance(communication_options, CommunicationOptions):
            raise ValueError(f"communication_options must be a cr.CommunicationOptions or None; got "
                             f"{summarize(communication_options)}")
        if timeout_seconds is None and communication_options is not None:
            timeout_seconds = communication_options.timeout_seconds
        k = check_int(logical_devices_per_replica, "logical_devices_per_replica", low=1)
        if backend is not None and backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {list(_BACKENDS)} or None (automatic); got {summarize(backend)}")
        if backend is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() != backend:
            warnings.warn(f"backend={backend!r} is ignored: the process group already exists with backend "
                          f"{dist.get_backend()!r}; leave backend out, or create the process group with the "
                          f"backend you want", ConfigurationWarning, stacklevel=2)
            backend = str(dist.get_backend())
        timeout = (settings.timeout() if timeout_seconds is None
                   else canonical_timeout(timeout_seconds, "timeout_seconds"))
        if check_collectives is None:
            check_collectives = settings.check_collectives()
        # The other settings it reads are validated before anything is set up, so a bad
        # one leaves no process group behind.
        shared = settings.shared_memory()
        settings.job_secret()
        settings.join()
        settings.slow_seconds()
        settings.heartbeat_seconds()
        local_rank = local_placement()[0]
        logical = LogicalDevices.consecutive(self._devices(replicas_per_worker, backend, devices, local_rank, k), k)
        devs = list(logical.column(0))
        on_cuda = devs[0].type == "cuda"
        if backend is None:
            backend = "nccl" if on_cuda else "gloo"
        if backend == "nccl" and not on_cuda:
            raise ValueError("backend='nccl' needs the replicas on CUDA devices; use backend='gloo' on CPU")
        self._owns_process_group, job_store, joining = init_process_group(backend, timeout)
        comm = None
        if str(dist.get_backend()) == "nccl":
            torch.cuda.set_device(devs[0])
            comm = devs[0]
        options = dict(devices=devs, timeout=timeout, check_collectives=bool(check_collectives),
                       comm_device=comm, ordered_reductions=bool(ordered_reductions), shared_memory=shared)
        engine = _build_engine(options)
        self.extended = MultiWorkerExtended(self, devs, engine, cross_device_ops)
        self.extended.engine_options = options
        #: the store every worker of this job shares (the first process group's): where a
        #: fault-tolerant job agrees on its membership after a loss (``regroup``)
        self.extended.job_store = tp.default_store() if job_store is None else job_store
        self.extended.joining = joining
        self.extended.communication_options = communication_options
        self.extended.set_logical_devices(logical.groups)
        self.extended.layout_invariant = check_layout(layout_invariant, engine.num_replicas)
        #: whether :meth:`close` has run
        self.closed = False
        _BUILT.append(weakref.ref(self))
        if str(dist.get_backend()) == "nccl":
            engine.barrier("set-up")  # creates the communicators with every rank present
        _log.info("MultiWorkerMirroredStrategy: %d replicas in sync, %d workers x %d local replicas (%s engine), "
                  "worker rank %d on %s, backend %s, timeout %gs", engine.num_replicas, engine.world_size,
                  replicas_per_worker, "torch_dist" if replicas_per_worker == 1 else "hierarchical",
                  engine.rank, [str(d) for d in devs], engine.backend, timeout)

    @staticmethod
    def _devices(r: int, backend: str | None, devices: Sequence[Any] | None,
                 local_rank: int, k: int = 1) -> list[torch.device]:
        """This worker's devices: ``k`` consecutive ones per local replica."""
        if devices is not None:
            if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence) \
                    or len(devices) != r * k:
                per = "one device" if k == 1 else f"{k} devices"
                raise ValueError(
                    f"devices must be a list with {per} per local replica ({r * k}, from "
                    f"replicas_per_worker={r}, logical_devices_per_replica={k}); got {summarize(devices)}")
            devs = [canonical_device(d, f"devices[{i}]") for i, d in enumerate(devices)]
            if len({d.type for d in devs}) != 1:
                raise ValueError(f"devices must all be CPU or all CUDA; got {summarize(devices)}")
            return devs
        if backend != "gloo" and torch.cuda.is_available() and torch.cuda.device_count():
            gpus = torch.cuda.device_count()
            local_world = local_placement()[1]
            if local_world <= gpus:
                # Each process of this host gets its own GPUs: NCCL refuses two ranks on one GPU.
                share = gpus // local_world
                return [torch.device("cuda", local_rank * share + i % share) for i in range(r * k)]
            why = (f"{local_world} worker processes on this host (LOCAL_WORLD_SIZE) but {gpus} visible "
                   f"GPU{'s' if gpus > 1 else ''}, and NCCL cannot run two processes on one GPU")
            fix = (f"start at most {gpus} process{'es' if gpus > 1 else ''} per host (torchrun "
                   f"--nproc-per-node={gpus}) and use replicas_per_worker for more replicas per GPU")
            if backend == "nccl":
                raise ValueError(f"backend='nccl': {why}; {fix}, or use backend='gloo'")
            warnings.warn(f"MultiWorkerMirroredStrategy runs on the CPU with gloo: {why}; {fix}, or pass "
                          f"backend='gloo' to choose the CPU without this warning", ConfigurationWarning,
                          stacklevel=4)
        return [torch.device("cpu")] * (r * k)

    def close(self) -> None:
        """Releases subgroups and, if this strategy created it, the process group. A worker
        that failed first waits (briefly) for the others to read why (``Watchdog.linger``)."""
        self.closed = True
        engine = cast(MultiWorkerExtended, self.extended).engine
        engine.watchdog.linger()
        engine.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    def __repr__(self) -> str:
        e: Any = self.extended.engine  # a TorchDistEngine or HierarchicalEngine
        return (f"MultiWorkerMirroredStrategy(num_replicas_in_sync={e.num_replicas}, worker_rank={e.rank}, "
                f"num_workers={e.world_size}, local_replicas={list(e.local_replica_ids)}, "
                f"devices={[str(d) for d in self.extended.worker_devices]}, backend={e.backend})")
