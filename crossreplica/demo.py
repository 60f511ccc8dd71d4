"""The demo: data-parallel training of a small MLP on scikit-learn's digits.

``train(TrainConfig(...))`` trains an MLP classifier on the 8x8 digits bundled
with scikit-learn (no download) with a strategy (by default in-process
replicas, one per core: :func:`default_replicas`), then trains the same model
on one device with plain torch on the same global batches and reports the
largest absolute parameter difference: the library's promise, measured.

The replica function is what a user writes: forward on the replica's part of
the batch, mean loss over its rows, backward, ``CrossShardOptimizer.step``
with the row count as weight so the last, uneven batch of each epoch still
gives the exact global mean gradient.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import statistics
import sys
import time
from typing import Any
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from .arguments import check_int, check_number
from .checkpoint.per_replica import digest
from .data import split_batch
from .elastic.fault_tolerance import FaultTolerance
from .micro_batches import LayoutInvariant
from .optim import CrossShardOptimizer
from .strategies import MirroredStrategy, MultiWorkerMirroredStrategy, OneDeviceStrategy, Strategy

__all__ = ["COMPRESSIONS", "TrainConfig", "EpochStats", "default_replicas", "TrainResult", "STRATEGIES", "load_digits",
           "make_model", "make_strategy", "global_batches", "train", "train_reference"]


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def default_replicas() -> int:
    """The demo's in-process replicas: one per core this process may run on, at least 2
    (it shows data parallelism) and at most 4.

    More replicas than cores would be oversubscribed: each replica computes with an
    equal share of the intra-op threads (at least one), and every replica's Python runs
    under the one GIL, so on 2 cores 4 replicas train the demo model about twice as
    slowly as 2 (BENCHMARKS.md, "Demo model on 1, 2 and 4 replicas").
    """
    return min(4, max(2, _cores()))


#: the demo's compression names -> the dtype its gradients cross the wire in
COMPRESSIONS = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class TrainConfig:
    """What to train and how."""

    replicas: int = dataclasses.field(default_factory=default_replicas)
    strategy: str = "mirrored"
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    hidden: int = 128
    dropout: float = 0.0  # after each hidden layer; replicas draw from their own random streams
    seed: int = 0
    progress: bool = True
    compare: bool = True
    threads: int | None = None  # torch intra-op threads per replica; None: an equal share of the cores
    replicas_per_worker: int = 1  # for multi_worker: local replicas of each torchrun process
    micro_batches: int | None = None  # the layout-invariant mode with this many micro-batches per batch
    save_params: str | None = None  # torch.save the final model's state_dict here (on the chief)
    fault_tolerant: bool = False  # multi_worker: survive lost workers (cr.FaultTolerance)
    kill_worker_at_step: tuple[int, int] | None = None  # (worker, step): it exits abruptly as that step starts
    freeze_worker_at_step: tuple[int, int] | None = None  # (worker, step): it stops itself (SIGSTOP) there
    compression: str | None = None  # "bfloat16" / "float16": the gradients cross the wire in it (CrossShardOptimizer)

    def validate(self) -> None:
        for name in ("replicas", "epochs", "batch_size", "hidden", "replicas_per_worker"):
            check_int(getattr(self, name), name, low=1)
        if self.micro_batches is not None:
            check_int(self.micro_batches, "micro_batches", low=1, hint=" or None")
        check_number(self.lr, "lr", positive=True)
        check_number(self.dropout, "dropout")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1); got {self.dropout!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}; got {self.strategy!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive int or None; got {self.threads!r}")
        if self.fault_tolerant and self.strategy != "multi_worker":
            raise ValueError(f"fault_tolerant needs strategy='multi_worker'; got strategy={self.strategy!r}")
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)} or None; got {self.compression!r}")
        if self.compression is not None and self.micro_batches is not None:
            raise ValueError(f"compression={self.compression!r} cannot be used in the layout-invariant mode (its "
                             f"promise is the same bits on every layout); drop one of them")
        for name in ("kill_worker_at_step", "freeze_worker_at_step"):
            at = getattr(self, name)
            if at is not None and (len(at) != 2 or at[0] < 0 or at[1] < 1):
                raise ValueError(f"{name} must be (worker rank >= 0, step >= 1) or None; got {at!r}")


@dataclasses.dataclass
class EpochStats:
    epoch: int
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float
    seconds: float


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` measured. Times: ``seconds`` is the whole run after set-up (training,
    evaluation, logging); ``step_seconds`` and ``reference_step_seconds`` are the median time of
    one training step, measured the same way on both runs (from a global batch in hand to the
    optimizer's step done), so only they compare like with like."""

    config: TrainConfig
    history: list[EpochStats]
    seconds: float
    replicas_identical: bool  # every replica's parameters and buffers, on every worker
    max_abs_param_diff: float | None = None
    reference_threads: int | None = None  # the one-device run's intra-op threads: those of each replica
    reference_seconds: float | None = None
    reference_test_acc: float | None = None
    model: nn.Module | None = None
    chief: bool = True  # false on the other workers of a multi-process run (they stay quiet)
    replicas_in_sync: int = 1  # at the end (a fault-tolerant run may have lost or gained workers)
    steps: int = 0  # training steps this worker timed
    step_seconds: float | None = None  # median over those steps
    reference_step_seconds: float | None = None  # the same for the one-device run
    cores: int = dataclasses.field(default_factory=_cores)  # this process's cores: the replicas share them


# --------------------------------------------------------------------------- pieces

def _layout(config: TrainConfig) -> LayoutInvariant | None:
    # The train step returns sums (loss, correct, rows): its micro-batches' results add up.
    return None if config.micro_batches is None else LayoutInvariant(config.micro_batches, results="sum")


def _one_device(config: TrainConfig) -> Strategy:
    return OneDeviceStrategy("cpu", layout_invariant=_layout(config))


def _mirrored(config: TrainConfig) -> Strategy:
    return MirroredStrategy(num_replicas=config.replicas, devices=["cpu"] * config.replicas,
                            layout_invariant=_layout(config))


def _multi_worker(config: TrainConfig) -> Strategy:
    # Built from torchrun's environment; without one it is a single worker.
    return MultiWorkerMirroredStrategy(replicas_per_worker=config.replicas_per_worker,
                                       layout_invariant=_layout(config))


#: strategy name -> factory; the CLI offers exactly these.
STRATEGIES: dict[str, Callable[[TrainConfig], Strategy]] = {
    "mirrored": _mirrored,
    "one_device": _one_device,
    "multi_worker": _multi_worker,
}


def make_strategy(config: TrainConfig) -> Strategy:
    return STRATEGIES[config.strategy](config)


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[torch.Tensor, ...]:
    """``(x_train, y_train, x_test, y_test)``: features scaled to [0, 1], a seeded split."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError("the demo needs scikit-learn: pip install 'crossreplica[examples]'") from None
    data = sk_load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model(hidden: int = 128, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """The MLP classifier, 64 -> hidden -> hidden -> 10, initialised from ``seed``; with
    ``dropout`` > 0 a dropout layer follows each hidden layer."""
    def drop() -> list[nn.Module]:
        return [nn.Dropout(dropout)] if dropout > 0 else []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), *drop(), nn.Linear(hidden, hidden), nn.ReLU(),
                             *drop(), nn.Linear(hidden, 10))


def global_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, epoch: int,
                   seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The epoch's shuffled global batches; the last one may be smaller."""
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
    return [(x[perm[i:i + batch_size]], y[perm[i:i + batch_size]]) for i in range(0, len(x), batch_size)]


def _make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)


def _train_step(model: nn.Module, opt: CrossShardOptimizer, batch: Any) -> torch.Tensor:
    """The replica function: returns [sum of losses, correct predictions, rows]."""
    x, y = batch
    rows = x.shape[0]
    opt.zero_grad()
    logits = model(x)
    loss_sum = F.cross_entropy(logits, y, reduction="sum")
    (loss_sum / max(rows, 1)).backward()  # this replica's mean loss; empty part: zero
    opt.step(weight=rows)  # weighted by rows: the exact global mean gradient
    correct = (logits.argmax(1) == y).sum()
    return torch.stack([loss_sum.detach(), correct.to(loss_sum.dtype), torch.tensor(float(rows))])


def _eval_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    model.eval()  # no dropout while evaluating
    try:
        with torch.no_grad():
            logits = model(x)
            return torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                                (logits.argmax(1) == y).sum().to(logits.dtype), torch.tensor(float(x.shape[0]))])
    finally:
        model.train()


# --------------------------------------------------------------------------- training

def train(config: TrainConfig | None = None, log: Callable[[str], None] | None = print) -> TrainResult:
    """Trains with ``config.strategy``; with ``config.compare`` also on one device.

    Returns the per-epoch history and, when compared, the largest absolute
    difference between the distributed and the one-device parameters.
    """
    config = config or TrainConfig()
    config.validate()
    if config.strategy == "one_device":
        config = dataclasses.replace(config, replicas=1)
    log = log or (lambda s: None)
    x_train, y_train, x_test, y_test = load_digits(config.seed)
    initial = make_model(config.hidden, config.seed, config.dropout)
    net = copy.deepcopy(initial)
    strategy = make_strategy(config)
    n = strategy.num_replicas_in_sync
    if strategy.extended.input_pipeline_id != 0 or getattr(strategy.extended, "joining", False):  # the chief reports
        config = dataclasses.replace(config, progress=False)
    report = log
    # The chief reports: worker 0, or (after lost workers) the first survivor.
    # A joining worker is rank 0 of its own until it joins: it reports nothing before.
    log = lambda line: (report(line) if strategy.extended.input_pipeline_id == 0  # noqa: E731
                        and not getattr(strategy.extended, "joining", False) else None)
    log(f"crossreplica train: {config.strategy} strategy, {n} replica(s) in sync, {config.epochs} "
        f"epochs, global batch {config.batch_size}, lr {config.lr}, seed {config.seed}"
        + (f", gradients compressed to {config.compression}" if config.compression is not None else ""))
    saved_threads, saved_rng = torch.get_num_threads(), torch.get_rng_state()
    if config.threads is not None:  # the strategy gives each local replica an equal share of this thread's
        torch.set_num_threads(config.threads * len(strategy.extended.local_replica_ids))
    # Every strategy.run draws the replicas' stream base from this generator
    # (docs/fidelity.md, "Random numbers"); train_reference makes the same draws.
    torch.manual_seed(config.seed)
    bar = _progress(config)
    history = []
    try:
        model = strategy.mirror(net)
        compression = None if config.compression is None else COMPRESSIONS[config.compression]
        opts = strategy.run(lambda m: CrossShardOptimizer(_make_optimizer(m, config), compression=compression),
                            args=(model,))
        # A worker started with CROSSREPLICA_JOIN joins the running job here, with its state.
        ft = FaultTolerance(strategy, (model, opts)) if config.fault_tolerant else None  # type: ignore[arg-type]
        # The injectors name a worker as launched (a joining worker has a new identity).
        rank = strategy.extended.input_pipeline_id if ft is None else ft.identity
        runs = 0  # ft.run calls so far: a joining worker skips those the job made before it came
        reported = 0 if ft is None else len(ft.recoveries)  # membership changes the chief has reported
        step_times: list[float] = []
        test_set = strategy.distribute_dataset([(x_test, y_test)])
        start = time.perf_counter()  # after the one-time set-up (the first optimizer imports a lot)
        steps = 0
        for epoch in range(1, config.epochs + 1):
            t0 = time.perf_counter()
            batches = global_batches(x_train, y_train, config.batch_size, epoch, config.seed)
            totals = torch.zeros(3)
            it = bar(batches if ft is not None else strategy.distribute_dataset(batches), epoch, len(batches))
            for batch in it:
                steps += 1
                if ft is not None and (runs := runs + 1) <= ft.completed:
                    continue
                _inject_failure(config, rank, steps)
                t_step = time.perf_counter()
                if ft is not None:  # the global batch: split over whoever is left at each try
                    step = ft.run(_train_step, batch, args=(model, opts), reduce="sum")
                else:
                    step = strategy.reduce("sum", strategy.run(_train_step, args=(model, opts, batch)))
                step_times.append(time.perf_counter() - t_step)
                if ft is not None:
                    reported = _report_membership(ft, reported, f"step {steps}", log)
                totals += step
                if hasattr(it, "set_postfix"):
                    it.set_postfix(loss=f"{step[0].item() / max(step[2].item(), 1):.4f}", refresh=False)
            if hasattr(it, "close"):
                it.close()
            test = torch.zeros(3)
            if ft is None:
                for batch in test_set:
                    test += strategy.reduce("sum", strategy.run(_eval_step, args=(model, batch)))
            elif (runs := runs + 1) > ft.completed:
                test += ft.run(_eval_step, (x_test, y_test), args=(model,), reduce="sum")
                reported = _report_membership(ft, reported, f"the evaluation after epoch {epoch}", log)
            stats = EpochStats(epoch, (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item(),
                               (test[0] / test[2]).item(), (test[1] / test[2]).item(),
                               time.perf_counter() - t0)
            history.append(stats)
            log(f"epoch {epoch:>3}/{config.epochs}  train loss {stats.train_loss:.4f} acc "
                f"{stats.train_acc:.4f}  |  test loss {stats.test_loss:.4f} acc {stats.test_acc:.4f}  "
                f"({stats.seconds:.2f} s)")
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(saved_threads)
        torch.set_rng_state(saved_rng)
    copies = strategy.experimental_local_results(model)
    chief = strategy.extended.input_pipeline_id == 0  # the first chief may have been lost
    result = TrainResult(config, history, seconds, _identical(strategy, copies), model=copies[0], chief=chief,
                         replicas_in_sync=strategy.num_replicas_in_sync, steps=len(step_times),
                         step_seconds=statistics.median(step_times) if step_times else None)
    if config.save_params is not None and chief:
        torch.save(copies[0].state_dict(), config.save_params)
    # With the replicas' intra-op thread count: it decides how some kernels sum (the bits).
    threads = int(strategy.experimental_local_results(strategy.run(_threads))[0])
    if config.compare and chief:
        # The chief alone: the other workers' runs on the same cores (workers of one host,
        # or simulated hosts) would slow it down, and only the chief reports it.
        t0 = time.perf_counter()
        # The layout-invariant mode's parts are the micro-batches (same draws, same split).
        parts = n if config.micro_batches is None else config.micro_batches
        result.reference_threads = threads
        reference_times: list[float] = []
        with _intra_op_threads(threads):
            reference = train_reference(config, copy.deepcopy(initial), x_train, y_train, parts,
                                        step_seconds=reference_times)
        result.reference_seconds = time.perf_counter() - t0
        result.reference_step_seconds = statistics.median(reference_times)
        result.max_abs_param_diff = max(
            (a - b).abs().max().item() for a, b in zip(copies[0].parameters(), reference.parameters()))
        test = _eval_step(reference, (x_test, y_test))
        result.reference_test_acc = (test[1] / test[2]).item()
    return result


def _report_membership(ft: FaultTolerance, reported: int, during: str, log: Callable[[str], None]) -> int:
    """Logs one line per membership change that ``ft`` recorded since the first ``reported``
    (who was lost or joined, the new worker and replica counts, where the run goes on);
    returns how many it has recorded."""
    for change in ft.recoveries[reported:]:
        size = f"{len(change['members'])} worker(s), {ft.strategy.num_replicas_in_sync} replica(s) in sync"
        if change["lost"]:
            joined = f", worker(s) {_names(change['joined'])} joined" if change["joined"] else ""
            log(f"crossreplica train: lost worker(s) {_names(change['lost'])} during {during}{joined}; going on "
                f"with {size}, {during} redone on them")
        else:
            log(f"crossreplica train: worker(s) {_names(change['joined'])} joined as {during} starts; going on "
                f"with {size}")
    return len(ft.recoveries)


def _names(identities: list[int]) -> str:
    return ", ".join(map(str, identities))


def _inject_failure(config: TrainConfig, rank: int, step: int) -> None:
    """The failure injectors of the fault-tolerance demo: worker ``rank`` exits abruptly
    (no clean-up, as a crash or a lost machine) or freezes (SIGSTOP) as ``step`` starts."""
    if config.kill_worker_at_step == (rank, step):
        print(f"crossreplica train: worker {rank} exits abruptly at the start of step {step} "
              f"(--kill-worker-at-step)", file=sys.stderr, flush=True)
        os._exit(1)
    if config.freeze_worker_at_step == (rank, step):
        print(f"crossreplica train: worker {rank} freezes at the start of step {step} "
              f"(--freeze-worker-at-step)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def _identical(strategy: Strategy, copies: Any) -> bool:
    """Whether every replica's model, on every worker, holds the same bytes (a digest per
    local copy, gathered across the workers)."""
    rows = [torch.frombuffer(bytearray(digest(m.state_dict())), dtype=torch.uint8).reshape(1, -1) for m in copies]
    table = strategy.extended.gather_values(rows, 0)
    return bool((table == table[0]).all())


def _threads() -> torch.Tensor:
    return torch.tensor(torch.get_num_threads())


@contextlib.contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def train_reference(config: TrainConfig, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                    replicas: int = 1, step_seconds: list[float] | None = None) -> nn.Module:
    """The same training on one device with plain torch: the whole global batch at once.

    With dropout, each replica's rows are drawn as the library's rule says
    (docs/fidelity.md, "Random numbers"): every ``strategy.run`` of :func:`train` makes
    one draw ``base`` from the seeded generator, and replica ``i`` then draws as after
    ``torch.manual_seed(base + i)``; the loss is the global batch's mean over the
    replicas' parts (split as ``strategy.distribute_dataset`` splits them). Each training
    step's time is appended to ``step_seconds``, measured as :func:`train` measures its own.
    """
    opt = _make_optimizer(model, config)
    caller = torch.Generator().manual_seed(config.seed)  # the generator train()'s runs draw from
    with torch.random.fork_rng(devices=[]):
        _draw(caller)  # the run that builds the optimizers
        for epoch in range(1, config.epochs + 1):
            for xb, yb in global_batches(x, y, config.batch_size, epoch, config.seed):
                started = time.perf_counter()
                opt.zero_grad()
                base = _draw(caller)  # this step's run
                if config.dropout == 0:
                    F.cross_entropy(model(xb), yb).backward()
                else:
                    parts = split_batch((xb, yb), replicas)
                    losses = [_replica_loss(model, part, base + i) for i, part in enumerate(parts)]
                    (torch.stack(losses).sum() / xb.shape[0]).backward()
                opt.step()
                if step_seconds is not None:
                    step_seconds.append(time.perf_counter() - started)
            _draw(caller)  # the evaluation run
    return model


def _draw(caller: torch.Generator) -> int:
    """The draw each strategy.run makes from the caller's generator."""
    return int(torch.randint(0, 2**63 - 1, (), generator=caller).item())


def _replica_loss(model: nn.Module, part: Any, seed: int) -> torch.Tensor:
    """Replica ``i``'s summed loss, drawing its dropout masks as after ``manual_seed(seed)``."""
    torch.manual_seed(seed)
    px, py = part
    return F.cross_entropy(model(px), py, reduction="sum")


def _progress(config: TrainConfig) -> Callable[[Any, int, int], Any]:
    """A tqdm bar per epoch on a terminal; elsewhere (CI logs, files, pipes) no bar.

    A bar redraws itself with carriage returns, which a log file keeps as residue;
    without one the per-epoch line of :func:`train` is the progress report.
    """
    if not config.progress or not _is_terminal(sys.stderr):
        return lambda it, epoch, total: it
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return lambda it, epoch, total: it
    return lambda it, epoch, total: tqdm(it, total=total, desc=f"epoch {epoch}/{config.epochs}",
                                         leave=False, unit="step", dynamic_ncols=True)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
