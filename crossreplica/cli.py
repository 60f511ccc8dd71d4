"""The ``crossreplica`` command line: ``crossreplica train`` runs the demo."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .elastic import launch as launch_module
from .elastic import coordinator as coordinator_module
from .demo import COMPRESSIONS, STRATEGIES, TrainConfig, TrainResult, train
from .errors import FencedOutError
from .logs import LOGGER_NAME
from .version import __version__

__all__ = ["main", "build_parser"]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _usage_error(prog: str, message: str) -> NoReturn:
    """A usage error: one line on stderr, exit code 2 (argparse's, without the usage block)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: what is wrong, and where the options are."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, f"{message} (`{self.prog} --help` lists the options)")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
    return v


def _dropout(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1); got {text!r}")
    return v


def _rank_step(text: str) -> tuple[int, int]:
    rank, sep, step = text.partition(":")
    try:
        at = (int(rank), int(step))
    except ValueError:
        at = (-1, 0)
    if not sep or at[0] < 0 or at[1] < 1:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, a worker rank >= 0 and a step >= 1; got {text!r}")
    return at


#: --micro-batches' default with --layout-invariant
_MICRO_BATCHES = 8

_TRAIN_EPILOG = """\
multi-process training (--strategy multi_worker) is launched by torchrun:

  one host, 4 processes:
    torchrun --standalone --nproc-per-node=4 -m crossreplica.cli train --strategy multi_worker

  several hosts (the same command on every host; HOST_A:29400 is reachable from all;
  JOB_ID is one random value, e.g. from `openssl rand -hex 16`, the same on every host):
    torchrun --nnodes=2 --nproc-per-node=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST_A:29400 --rdzv-id=$JOB_ID \\
        -m crossreplica.cli train --strategy multi_worker

  each process runs --replicas-per-worker in-process replicas, all in sync; see
  docs/multi_process.md.
"""


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    parser = _Parser(
        prog="crossreplica", description="tf.distribute-style synchronous data-parallel training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    train = sub.add_parser(
        "train", help="train an MLP on scikit-learn's digits on in-process replicas",
        # Raw text (the epilog's commands keep their line breaks), so wrapped by hand.
        description="Trains an MLP classifier on scikit-learn's bundled digits data with a\n"
                    "distribution strategy, then trains it again on one device with plain torch\n"
                    "and reports the largest parameter difference.",
        epilog=_TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Options of one strategy or mode default to None: given with another one they are refused (_check_train).
    train.add_argument("--replicas", type=_positive_int, default=None,
                       help=f"in-process replicas for --strategy mirrored (default: one per core, 2 to 4; "
                            f"{d.replicas} here)")
    train.add_argument("--replicas-per-worker", type=_positive_int, default=None,
                       help="local replicas of each process for --strategy multi_worker, launched "
                            f"with torchrun (default {d.replicas_per_worker})")
    train.add_argument("--strategy", choices=sorted(STRATEGIES), default=d.strategy,
                       help=f"distribution strategy (default {d.strategy})")
    train.add_argument("--epochs", type=_positive_int, default=d.epochs, help=f"default {d.epochs}")
    train.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                       help=f"global batch size, split over the replicas (default {d.batch_size})")
    train.add_argument("--lr", type=_positive_float, default=d.lr, help=f"SGD learning rate (default {d.lr})")
    train.add_argument("--dropout", type=_dropout, default=d.dropout,
                       help="dropout after each hidden layer, in [0, 1): each replica draws its masks from "
                            f"its own random stream (default {d.dropout})")
    train.add_argument("--seed", type=int, default=d.seed, help=f"data split, shuffling and init (default {d.seed})")
    train.add_argument("--no-progress", action="store_true",
                       help="no progress bar (when stderr is not a terminal there is none anyway: "
                            "one line per epoch)")
    train.add_argument("--no-compare", action="store_true", help="skip the one-device comparison run")
    train.add_argument("--layout-invariant", action="store_true",
                       help="train in the layout-invariant mode: the final parameters are bitwise the same "
                            "for any number of replicas, workers and hosts (docs/layout_invariance.md)")
    train.add_argument("--micro-batches", type=_positive_int, default=None,
                       help="micro-batches per global batch with --layout-invariant; any number of replicas "
                            "in sync up to it gives the same bits, so a fault-tolerant job may shrink to any "
                            f"count (default {_MICRO_BATCHES}; a multiple of the replica count balances their "
                            "work)")
    train.add_argument("--save-params", metavar="PATH", default=None,
                       help="torch.save the final model's state_dict to PATH (on the chief), e.g. to compare "
                            "two layouts: torch.equal on every tensor")
    train.add_argument("--fault-tolerant", action="store_true",
                       help="with --strategy multi_worker: go on through lost workers (dead, frozen, hung or cut "
                            "off) without a restart, redoing the interrupted step on the survivors; launch with "
                            "`crossreplica launch` (docs/reliability.md)")
    train.add_argument("--kill-worker-at-step", metavar="RANK:STEP", type=_rank_step, default=None,
                       help="failure injection: worker RANK exits abruptly (os._exit) as training step STEP "
                            "(counted from 1 over all epochs) starts")
    train.add_argument("--freeze-worker-at-step", metavar="RANK:STEP", type=_rank_step, default=None,
                       help="failure injection: worker RANK freezes itself (SIGSTOP) as training step STEP starts")
    train.add_argument("--compression", choices=sorted(COMPRESSIONS), default=None,
                       help="the gradients cross the wire in this dtype (CrossShardOptimizer(compression=...); "
                            "pays across hosts; not with --layout-invariant); default: their own")
    train.add_argument("--log-level", choices=_LOG_LEVELS, type=str.upper, default=None,
                       help="write crossreplica's log records at this level and above to stderr (set-up "
                            "at INFO, slow collectives and failures at WARNING/ERROR); default: none")
    launch = sub.add_parser(
        "launch", help="start a host's workers of a job; the survivors of a lost worker go on",
        description="Starts WORKERS copies of COMMAND with torchrun's environment; hosts the job's store, or "
                    "with --coordinator meets the other hosts' launchers at the job's coordinator. Unlike "
                    "torchrun, a worker that fails does not stop the others (for --fault-tolerant jobs).")
    launch_module.add_arguments(launch)
    coordinator = sub.add_parser(
        "coordinator", help="serve a job's store apart from its workers, to the clients that know the job secret",
        description="Runs the job's coordination service (its store: rendezvous, memberships, heartbeats) on any "
                    "machine, holding no training state, so that losing any worker host leaves it standing. "
                    "Every client authenticates with CROSSREPLICA_JOB_SECRET.")
    coordinator_module.add_arguments(coordinator)
    return parser


def _check_train(args: argparse.Namespace) -> None:
    """Refuses options that the chosen strategy or mode would ignore, naming the fix."""
    prog, strategy = "crossreplica train", args.strategy
    launched = "crossreplica launch --workers 3 -- crossreplica train --strategy multi_worker --fault-tolerant"
    if args.fault_tolerant and strategy != "multi_worker":
        _usage_error(prog, f"--fault-tolerant needs --strategy multi_worker (got --strategy {strategy}): it keeps a "
                           f"multi-process job going through a lost worker; start one with `{launched}`")
    for flag, at in (("--kill-worker-at-step", args.kill_worker_at_step),
                     ("--freeze-worker-at-step", args.freeze_worker_at_step)):
        if at is not None and strategy != "multi_worker":
            _usage_error(prog, f"{flag} needs --strategy multi_worker (got --strategy {strategy}): it stops one worker "
                               f"process of a multi-process job, and --strategy {strategy} runs in this one process; "
                               f"try `{launched} {flag} 1:4`")
    if args.replicas is not None and strategy != "mirrored":
        fix = ("use --replicas-per-worker for each process's replicas" if strategy == "multi_worker"
               else "drop it, or use --strategy mirrored")
        _usage_error(prog, f"--replicas sets the in-process replicas of --strategy mirrored; --strategy {strategy} "
                           f"ignores it: {fix}")
    if args.replicas_per_worker is not None and strategy != "multi_worker":
        _usage_error(prog, f"--replicas-per-worker applies to --strategy multi_worker; --strategy {strategy} ignores "
                           f"it: use --replicas for in-process replicas, or add --strategy multi_worker")
    if args.compression is not None and args.layout_invariant:
        _usage_error(prog, f"--compression {args.compression} cannot be used with --layout-invariant: the mode "
                           f"promises the same bits on every layout; drop one of them")
    if args.compression is not None and strategy == "one_device":
        _usage_error(prog, "--compression compresses the reduction between replicas; --strategy one_device has none "
                           "to compress: drop it, or use --strategy mirrored")
    if args.micro_batches is not None and not args.layout_invariant:
        _usage_error(prog, "--micro-batches applies to the layout-invariant mode only: add --layout-invariant, or "
                           "drop --micro-batches")


def _train(args: argparse.Namespace) -> int:
    _check_train(args)
    d = TrainConfig()
    micro_batches = _MICRO_BATCHES if args.micro_batches is None else args.micro_batches
    config = TrainConfig(replicas=d.replicas if args.replicas is None else args.replicas, strategy=args.strategy,
                         epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, dropout=args.dropout,
                         seed=args.seed, progress=not args.no_progress, compare=not args.no_compare,
                         replicas_per_worker=(d.replicas_per_worker if args.replicas_per_worker is None
                                              else args.replicas_per_worker),
                         micro_batches=micro_batches if args.layout_invariant else None,
                         save_params=args.save_params, fault_tolerant=args.fault_tolerant,
                         kill_worker_at_step=args.kill_worker_at_step,
                         freeze_worker_at_step=args.freeze_worker_at_step, compression=args.compression)
    try:
        config.validate()
    except ValueError as e:  # the options parsed, but do not combine
        _usage_error("crossreplica train", str(e))
    try:
        result = train(config)
    except FencedOutError as e:  # a worker the others went on without: it must stop, and says why
        print(f"crossreplica train: {e}", file=sys.stderr)
        return 3
    if not result.chief:  # the chief reports for every worker
        return 0 if result.replicas_identical else 1
    last = result.history[-1]
    print(f"done in {result.seconds:.2f} s ({len(result.history)} epoch(s): training, evaluation and logging): test "
          f"accuracy {last.test_acc:.4f}, every replica's parameters bitwise identical (all workers): "
          f"{'yes' if result.replicas_identical else 'NO'}")
    if result.max_abs_param_diff is not None:
        print(f"one-device run (plain torch, same batches, {result.reference_threads} intra-op thread(s) as each "
              f"replica): test accuracy {result.reference_test_acc:.4f}; max |parameter difference| = "
              f"{result.max_abs_param_diff:.3e}")
    for line in _step_times(result):
        print(line)
    return 0 if result.replicas_identical else 1


def _step_times(result: TrainResult) -> list[str]:
    """The time of one training step on the replicas and, when compared, on one device, both
    measured the same way; and what their ratio means here."""
    if result.step_seconds is None:
        return []
    n, ms = result.replicas_in_sync, result.step_seconds * 1e3
    line = f"one training step (median of {result.steps}): {ms:.2f} ms on {n} replica(s)"
    if result.reference_step_seconds is None:
        return [line]
    ref = result.reference_step_seconds * 1e3
    line += f", {ref:.2f} ms on one device with plain torch ({ms / ref:.1f}x the time)"
    strategy, cores = result.config.strategy, result.cores
    if strategy == "mirrored":
        meaning = (f"on a CPU the {n} replicas are threads of this process sharing its {cores} core(s) and one "
                   f"interpreter lock, so it is the cost of in-process replicas on a model this small, not a "
                   f"speed-up (that takes a device per replica)")
    elif strategy == "one_device":
        meaning = "one replica does the same work with nothing to reduce, so it is the strategy's own cost per step"
    else:
        meaning = ("each step includes the all-reduce between the workers' processes, and workers on one host's CPU "
                   "share its cores, so it is that cost on a model this small, not a speed-up")
    return [line, f"what the ratio means: {meaning}"]


def _log_to_stderr(level: str) -> logging.Handler:
    """Sends crossreplica's records at ``level`` and above to stderr (each line names the
    worker's rank under torchrun); returns the handler, for removal."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``crossreplica`` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `launch ... -- COMMAND`: the worker's command line is everything after the first `--`.
    worker_command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:len(argv) - len(worker_command) - (1 if "--" in argv else 0)])
    args.worker_command = worker_command
    if args.command == "launch":
        return launch_module.main(args)
    if args.command == "coordinator":
        return coordinator_module.main(args)
    if args.command == "train":
        if not faulthandler.is_enabled():
            # A crash inside a native library (SIGABRT, SIGSEGV) prints every thread's Python
            # stack, so a worker that dies that way says where.
            with contextlib.suppress(AttributeError, OSError, ValueError):  # a stderr without a file
                faulthandler.enable()
        if args.log_level is None:
            return _train(args)
        logger = logging.getLogger(LOGGER_NAME)
        level = logger.level
        handler = _log_to_stderr(args.log_level)
        try:
            return _train(args)
        finally:  # main() may be called in-process (tests): leave logging as it was
            logger.removeHandler(handler)
            logger.setLevel(level)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
