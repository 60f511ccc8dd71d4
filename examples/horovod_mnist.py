"""Horovod's ``pytorch_mnist.py``, ported to crossreplica.

The Horovod original trains a small CNN with two dropout layers on MNIST: ``hvd.init()``,
a ``DistributedSampler`` per worker, the learning rate scaled by ``hvd.size()``,
``hvd.broadcast_parameters`` / ``broadcast_optimizer_state``, ``hvd.DistributedOptimizer``,
``model.train()`` / ``model.eval()`` per epoch, a mixed-precision loop (``synchronize();
scaler.unscale_(opt); with opt.skip_synchronize(): scaler.step(opt)``) and test metrics
averaged with ``hvd.allreduce``. The comments marked ``Horovod:`` say what each line replaces
(docs/horovod_porting.md maps every call). The images are synthetic MNIST-like 28x28 digits
(one noisy template per class, from ``--seed``), so nothing is downloaded.

    python examples/horovod_mnist.py                              # 2 in-process replicas
    python examples/horovod_mnist.py --replicas 4 --use-mixed-precision --grad-clip 1.0
    python examples/horovod_mnist.py --backward-passes-per-step 2 --compare
    torchrun --standalone --nproc-per-node=2 examples/horovod_mnist.py --strategy multi_worker

``reference(args)`` trains the same model on one device with plain PyTorch: each replica's
rows with that replica's random stream (dropout), the gradients averaged as the replicas
average them. ``--compare`` prints the largest parameter difference against it: 0, bitwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import crossreplica as cr

# ---------------------------------------------------------------------------- the model and data


class Net(nn.Module):
    """Horovod's (and torch's MNIST example's) network, with its two dropouts."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def make_data(n: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` MNIST-like images (n x 1 x 28 x 28, normalised as Horovod's transform does) and labels
    of ``split`` ("train" or "test"): a random blocky glyph per class (the same in both splits),
    shifted by up to 2 pixels, plus noise."""
    glyphs = (torch.rand(10, 1, 5, 5, generator=torch.Generator().manual_seed(seed)) > 0.5).float()
    g = torch.Generator().manual_seed(2 * seed + (split == "test"))
    templates = F.pad(F.interpolate(glyphs, scale_factor=4), (4, 4, 4, 4))  # 20 x 20 strokes on a 28 x 28 field
    labels = torch.randint(10, (n,), generator=g)
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    images = torch.stack([templates[c].roll((int(dy), int(dx)), dims=(1, 2))
                          for c, (dy, dx) in zip(labels.tolist(), shifts)])
    images = (images + 0.1 * torch.randn(images.shape, generator=g)).clamp(0, 1)
    return (images - 0.1307) / 0.3081, labels


def train_groups(images: torch.Tensor, labels: torch.Tensor, epoch: int, global_batch: int, passes: int,
                 seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The epoch's global batches in ``passes``-long groups (one optimizer step each). Horovod:
    ``DistributedSampler(...)`` + ``set_epoch(epoch)``; here one global order per epoch, the same
    on every worker (the sampler's own rule: shuffled with ``seed + epoch``)."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed + epoch))
    batches = [(images[order[i:i + global_batch]], labels[order[i:i + global_batch]])
               for i in range(0, len(labels) - global_batch + 1, global_batch)]  # full batches only
    return [batches[i:i + passes] for i in range(0, len(batches), passes)]


def test_batches(images: torch.Tensor, labels: torch.Tensor, global_batch: int) -> list[tuple[torch.Tensor, ...]]:
    return [(images[i:i + global_batch], labels[i:i + global_batch]) for i in range(0, len(labels), global_batch)]


# ---------------------------------------------------------------------------- replica functions


def train_step(model: nn.Module, opt: cr.CrossShardOptimizer, scaler: torch.amp.GradScaler,
               micro_batches: list, args: argparse.Namespace) -> torch.Tensor:
    """One optimizer step on this replica's rows of each micro-batch (Horovod's loop body)."""
    opt.zero_grad()
    total = torch.zeros(())
    for data, target in micro_batches:  # backward_passes_per_step passes, reduced once
        with torch.autocast("cpu", dtype=getattr(torch, args.amp_dtype), enabled=args.use_mixed_precision):
            output = model(data)
            loss = F.nll_loss(output, target) / len(micro_batches)
        scaler.scale(loss).backward()  # a disabled scaler returns the loss as it is
        total += loss.detach().float()
    if args.use_mixed_precision or args.grad_clip:
        # Horovod: "Make sure all async allreduces are done": the gradients are reduced here
        opt.synchronize()
        scaler.unscale_(opt)  # in-place unscaling of the reduced gradients
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        with opt.skip_synchronize():  # step() does not reduce again
            scaler.step(opt)
        scaler.update()
    else:
        opt.step()  # reduces the gradients (the mean over the replicas), then SGD steps
    return total


def eval_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's summed loss and correct predictions on its rows of a test batch."""
    data, target = batch
    with torch.no_grad():
        output = model(data)
    loss = F.nll_loss(output, target, reduction="sum")  # Horovod: size_average=False
    correct = output.argmax(1).eq(target).sum().float()
    return loss, correct


# ---------------------------------------------------------------------------- the program


def make_strategy(args: argparse.Namespace) -> cr.Strategy:
    """Horovod: ``hvd.init()``."""
    if args.strategy == "mirrored":
        return cr.MirroredStrategy(args.replicas or 2)
    if args.strategy == "multi_worker":  # under torchrun (horovodrun's place), one process per worker
        return cr.MultiWorkerMirroredStrategy(replicas_per_worker=args.replicas or 1)
    return cr.OneDeviceStrategy()


def main(argv: list[str] | None = None, strategy: cr.Strategy | None = None) -> dict[str, Any]:
    """Trains; returns {"params": the final state dict, "losses": the global loss of every step,
    "test_loss" / "test_accuracy": one per epoch}. ``strategy``: use it instead of ``--strategy``."""
    args = parse_args(argv)
    strategy = strategy or make_strategy(args)
    size = strategy.num_replicas_in_sync  # Horovod: hvd.size()
    chief = strategy.extended.is_chief  # Horovod: hvd.rank() == 0
    torch.manual_seed(args.seed)  # once: each replica draws dropout masks from its own stream
    train_images, train_labels = make_data(args.train_size, args.seed, "train")
    test_images, test_labels = make_data(args.test_size, args.seed, "test")
    with strategy.scope():
        # Horovod: hvd.broadcast_parameters(model.state_dict(), root_rank=0). mirror copies
        # replica 0's parameters to every replica (across workers too).
        model = strategy.mirror(Net())
        # Horovod: optimizer = hvd.DistributedOptimizer(optim.SGD(..., lr=args.lr * hvd.size()), ...)
        # and hvd.broadcast_optimizer_state(optimizer, root_rank=0): each replica builds its own
        # optimizer over its own copy, in the same (fresh) state. One run builds every replica's
        # optimizer and GradScaler (Horovod: scaler = torch.cuda.amp.GradScaler()).
        opts, scalers = strategy.run(lambda m: (
            cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=args.lr * size, momentum=args.momentum),
                                   backward_passes_per_step=args.backward_passes_per_step),
            torch.amp.GradScaler("cpu", enabled=args.use_mixed_precision)), args=(model,))
        losses, test_loss_history, test_accuracy_history = [], [], []
        for epoch in range(1, args.epochs + 1):
            model.train()  # every replica's copy, in cross-replica context; draws nothing
            groups = train_groups(train_images, train_labels, epoch, args.batch_size * size,
                                  args.backward_passes_per_step, args.seed)
            for batch_idx, micro_batches in enumerate(strategy.distribute_dataset(groups)):
                loss = strategy.reduce("mean", strategy.run(train_step, args=(model, opts, scalers, micro_batches,
                                                                              args))).item()
                losses.append(loss)
                if chief and not args.quiet and batch_idx % args.log_interval == 0:
                    print(f"Train Epoch: {epoch} [{batch_idx + 1}/{len(groups)} steps]\tLoss: {loss:.6f}")
            # test(): Horovod: model.eval(); per-worker sums over its DistributedSampler shard, then
            # metric_average (hvd.allreduce). Here every test batch is split over the replicas
            # and strategy.reduce sums the replicas' sums: the same averages.
            model.eval()
            test_loss, correct = 0.0, 0.0
            for batch in strategy.distribute_dataset(test_batches(test_images, test_labels,
                                                                  args.test_batch_size * size)):
                loss_sum, right = strategy.run(eval_step, args=(model, batch))
                test_loss += strategy.reduce("sum", loss_sum).item()
                correct += strategy.reduce("sum", right).item()
            test_loss_history.append(test_loss / args.test_size)
            test_accuracy_history.append(correct / args.test_size)
            if chief and not args.quiet:
                print(f"\nTest set: Average loss: {test_loss / args.test_size:.4f}, "
                      f"Accuracy: {100.0 * correct / args.test_size:.2f}%\n")
    params = {k: v.detach().clone() for k, v in strategy.experimental_local_results(model)[0].state_dict().items()}
    result = {"params": params, "losses": losses, "test_loss": test_loss_history,
              "test_accuracy": test_accuracy_history}
    if args.save_params and chief:
        torch.save(result, args.save_params)
    if args.compare and chief:
        ref = reference(args, num_replicas=size)
        diff = max((params[k] - ref["params"][k]).abs().max().item() for k in params)
        print(f"largest parameter difference against plain PyTorch on one device: {diff:.3g} "
              f"(expected: 0; the reference runs each replica's rows on that replica's random stream and "
              f"averages the gradients in the replicas' order, so every operation is the same)")
    return result


def worker_main(strategy: cr.Strategy, argv: list[str]) -> dict[str, Any]:
    """``main`` on a worker process's strategy (crossreplica.testing.WorkerPool's ``mode="main"``)."""
    return main(argv, strategy=strategy)


def reference(args: argparse.Namespace | list[str] | None = None, num_replicas: int | None = None
              ) -> dict[str, Any]:
    """The same training with plain PyTorch on one device, bitwise what ``main`` computes.

    Each ``strategy.run`` draws one number ``base`` from the caller's generator, and replica
    ``r`` then draws (dropout) as plain torch does after ``torch.manual_seed(base + r)``
    (docs/fidelity.md, "Random numbers"). So each replica's rows run on their own, after
    that seed, their gradients are kept apart, and the step uses their mean, summed in
    replica order and divided by the count, as the replicas' reduction computes it. It
    computes with each replica's share of the intra-op threads (docs/fidelity.md,
    "Intra-op threads"): a kernel's reduction order may depend on the thread count.
    ``num_replicas``: default ``--replicas`` (2) for mirrored, 1 for one_device."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    n = num_replicas or (1 if args.strategy == "one_device" else args.replicas or 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // n))
    try:
        return _reference(args, n)
    finally:
        torch.set_num_threads(threads)


def _reference(args: argparse.Namespace, n: int) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    train_images, train_labels = make_data(args.train_size, args.seed, "train")
    test_images, test_labels = make_data(args.test_size, args.seed, "test")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * n, momentum=args.momentum)
    scaler = torch.amp.GradScaler("cpu", enabled=args.use_mixed_precision)
    caller = torch.get_rng_state()

    def run_base() -> int:  # what one strategy.run takes from the caller's generator
        nonlocal caller
        torch.set_rng_state(caller)
        base = int(torch.randint(0, 2**63 - 1, ()).item())
        caller = torch.get_rng_state()
        return base

    def summed(values: list[torch.Tensor]) -> torch.Tensor:  # the replicas' reduction: in replica order
        out = values[0].clone()
        for v in values[1:]:
            out += v
        return out

    def mean(values: list[torch.Tensor]) -> torch.Tensor:  # ... then divided by the count
        return summed(values) / len(values) if len(values) > 1 else values[0]

    def rows(t: torch.Tensor, r: int) -> torch.Tensor:
        return t.tensor_split(n)[r]

    run_base()  # the run that builds the optimizers and scalers
    losses, test_loss_history, test_accuracy_history = [], [], []
    for epoch in range(1, args.epochs + 1):
        model.train()
        groups = train_groups(train_images, train_labels, epoch, args.batch_size * n,
                              args.backward_passes_per_step, args.seed)
        for micro_batches in groups:
            base = run_base()
            grads, replica_losses = [], []
            for r in range(n):
                torch.manual_seed(base + r)
                opt.zero_grad()
                total = torch.zeros(())
                for data, target in micro_batches:
                    with torch.autocast("cpu", dtype=getattr(torch, args.amp_dtype),
                                        enabled=args.use_mixed_precision):
                        loss = F.nll_loss(model(rows(data, r)), rows(target, r)) / len(micro_batches)
                    scaler.scale(loss).backward()
                    total += loss.detach().float()
                grads.append([p.grad for p in model.parameters()])
                replica_losses.append(total)
            for p, *gs in zip(model.parameters(), *grads):
                p.grad = mean(gs)
            if args.use_mixed_precision or args.grad_clip:
                scaler.unscale_(opt)
                if args.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            losses.append(mean(replica_losses).item())
        model.eval()
        test_loss, correct = 0.0, 0.0
        for data, target in test_batches(test_images, test_labels, args.test_batch_size * n):
            run_base()  # the evaluation's strategy.run draws too (eval mode uses none of it)
            with torch.no_grad():
                outputs = [(model(rows(data, r)), rows(target, r)) for r in range(n)]
            loss_sums = [F.nll_loss(o, t, reduction="sum") for o, t in outputs]
            rights = [o.argmax(1).eq(t).sum().float() for o, t in outputs]
            test_loss += summed(loss_sums).item()
            correct += summed(rights).item()
        test_loss_history.append(test_loss / args.test_size)
        test_accuracy_history.append(correct / args.test_size)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "test_loss": test_loss_history, "test_accuracy": test_accuracy_history}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=["mirrored", "multi_worker", "one_device"], default="mirrored")
    p.add_argument("--replicas", type=int, default=None,
                   help="mirrored: in-process replicas (default 2); multi_worker: replicas per process (default 1)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per replica and step (Horovod: per worker)")
    p.add_argument("--test-batch-size", type=int, default=128, help="test rows per replica")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01, help="scaled by the number of replicas, as Horovod does")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-size", type=int, default=2048, help="synthetic training images")
    p.add_argument("--test-size", type=int, default=512, help="synthetic test images")
    p.add_argument("--use-mixed-precision", action="store_true",
                   help="autocast and a GradScaler, with Horovod's synchronize / skip_synchronize loop")
    p.add_argument("--amp-dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--grad-clip", type=float, default=0.0, help="clip the reduced gradients to this norm (0: off)")
    p.add_argument("--backward-passes-per-step", type=int, default=1,
                   help="global batches accumulated locally per optimizer step (Horovod's argument)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--compare", action="store_true", help="also train on one device with plain PyTorch and compare")
    p.add_argument("--save-params", default=None, help="torch.save the result here (on the chief)")
    args = p.parse_args(argv)
    for name in ("batch_size", "test_batch_size", "epochs", "train_size", "test_size", "backward_passes_per_step"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    return args


if __name__ == "__main__":
    main(sys.argv[1:])
