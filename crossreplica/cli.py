"""The ``crossreplica`` command line: ``crossreplica train`` runs the demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from . import launch as launch_module
from .demo import STRATEGIES, TrainConfig, train
from .fault_tolerance import FencedOutError
from .logs import LOGGER_NAME
from .version import __version__

__all__ = ["main", "build_parser"]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


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


def _rank_step(text: str) -> tuple[int, int]:
    rank, sep, step = text.partition(":")
    try:
        at = (int(rank), int(step))
    except ValueError:
        at = (-1, 0)
    if not sep or at[0] < 0 or at[1] < 1:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, a worker rank >= 0 and a step >= 1; got {text!r}")
    return at


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
    parser = argparse.ArgumentParser(
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
    train.add_argument("--replicas", type=_positive_int, default=d.replicas,
                       help=f"in-process replicas for --strategy mirrored (default: one per core, 2 to 4; "
                            f"{d.replicas} here)")
    train.add_argument("--replicas-per-worker", type=_positive_int, default=d.replicas_per_worker,
                       help="local replicas of each process for --strategy multi_worker, launched "
                            f"with torchrun (default {d.replicas_per_worker})")
    train.add_argument("--strategy", choices=sorted(STRATEGIES), default=d.strategy,
                       help=f"distribution strategy (default {d.strategy})")
    train.add_argument("--epochs", type=_positive_int, default=d.epochs, help=f"default {d.epochs}")
    train.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                       help=f"global batch size, split over the replicas (default {d.batch_size})")
    train.add_argument("--lr", type=_positive_float, default=d.lr, help=f"SGD learning rate (default {d.lr})")
    train.add_argument("--dropout", type=float, default=d.dropout,
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
    train.add_argument("--micro-batches", type=_positive_int, default=8,
                       help="micro-batches per global batch with --layout-invariant; any number of replicas "
                            "in sync up to it gives the same bits, so a fault-tolerant job may shrink to any "
                            "count (default 8; a multiple of the replica count balances their work)")
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
    train.add_argument("--log-level", choices=_LOG_LEVELS, type=str.upper, default=None,
                       help="write crossreplica's log records at this level and above to stderr (set-up "
                            "at INFO, slow collectives and failures at WARNING/ERROR); default: none")
    launch = sub.add_parser(
        "launch", help="start the workers of a one-host job; the survivors of a lost worker go on",
        description="Starts WORKERS copies of COMMAND with torchrun's environment and hosts the job's store. "
                    "Unlike torchrun, a worker that fails does not stop the others (for --fault-tolerant jobs).")
    launch_module.add_arguments(launch)
    return parser


def _train(args: argparse.Namespace) -> int:
    config = TrainConfig(replicas=args.replicas, strategy=args.strategy, epochs=args.epochs,
                         batch_size=args.batch_size, lr=args.lr, dropout=args.dropout, seed=args.seed,
                         progress=not args.no_progress, compare=not args.no_compare,
                         replicas_per_worker=args.replicas_per_worker,
                         micro_batches=args.micro_batches if args.layout_invariant else None,
                         save_params=args.save_params, fault_tolerant=args.fault_tolerant,
                         kill_worker_at_step=args.kill_worker_at_step,
                         freeze_worker_at_step=args.freeze_worker_at_step)
    try:
        result = train(config)
    except FencedOutError as e:  # a worker the others went on without: it must stop, and says why
        print(f"crossreplica train: {e}", file=sys.stderr)
        return 3
    if not result.chief:  # the chief reports for every worker
        return 0 if result.replicas_identical else 1
    last = result.history[-1]
    print(f"done in {result.seconds:.2f} s: test accuracy {last.test_acc:.4f}, every replica's parameters "
          f"bitwise identical (all workers): {'yes' if result.replicas_identical else 'NO'}")
    if result.max_abs_param_diff is not None:
        print(f"one-device run (plain torch, same batches, {result.reference_threads} intra-op thread(s) as each "
              f"replica) in {result.reference_seconds:.2f} s: test "
              f"accuracy {result.reference_test_acc:.4f}; max |parameter difference| = "
              f"{result.max_abs_param_diff:.3e}")
    return 0 if result.replicas_identical else 1


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
    if args.command == "train":
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
