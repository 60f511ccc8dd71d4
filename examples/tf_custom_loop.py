"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, ported to crossreplica.

The tutorial's steps, in its order, each with the TF line it replaces (``TF:``):
a CNN and its optimizer created under the strategy, a loss averaged over the *global*
batch (``tf.nn.compute_average_loss``), the dataset distributed over the replicas,
``strategy.run(train_step)`` with ``strategy.reduce`` of the per-replica losses, and
accuracy metrics kept as sync-on-read variables. The images are scikit-learn's bundled
8x8 digits (no download) in place of Fashion-MNIST; without scikit-learn, random
class-dependent images.

    python examples/tf_custom_loop.py                  # 2 in-process replicas, 5 epochs
    python examples/tf_custom_loop.py --replicas 4 --checkpoint-dir /tmp/tfloop

``reference(args)`` trains the same model on one device with plain PyTorch on the whole
global batches (the numbers ``main`` must reproduce); ``--compare`` prints the difference.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import crossreplica as cr


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels); images N x 1 x 8 x 8 in [0, 1]."""
    try:
        from sklearn.datasets import load_digits
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
    except ImportError:  # random images, one mean pattern per class
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(10, (1800,), generator=g)
        patterns = torch.rand(10, 1, 8, 8, generator=g)
        images = (patterns[labels] + 0.3 * torch.randn(1800, 1, 8, 8, generator=g)).clamp(0, 1)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    cut = len(labels) * 4 // 5
    return images[:cut], labels[:cut], images[cut:], labels[cut:]


def create_model() -> nn.Module:
    """The tutorial's Conv-Pool-Conv-Pool-Dense-Dense, sized for 8x8 images."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 2 * 2, 32), nn.ReLU(), nn.Linear(32, 10))


def make_loader(images: torch.Tensor, labels: torch.Tensor, batch_size: int, seed: int | None) -> DataLoader:
    """TF: Dataset.from_tensor_slices(...).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE); a seeded
    shuffle (the same order on every worker, and in the reference)."""
    shuffle = seed is not None
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=shuffle, generator=generator)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains; returns the final parameters and the per-epoch train loss, train accuracy,
    test loss and test accuracy."""
    args = parse_args(argv)
    strategy = cr.MirroredStrategy(args.replicas)  # TF: tf.distribute.MirroredStrategy()
    global_batch_size = args.batch_per_replica * strategy.num_replicas_in_sync
    train_x, train_y, test_x, test_y = load_data(args.seed)
    # TF: strategy.experimental_distribute_dataset(train_dataset)
    train_dist_dataset = strategy.distribute_dataset(make_loader(train_x, train_y, global_batch_size, args.seed))
    test_dist_dataset = strategy.distribute_dataset(make_loader(test_x, test_y, global_batch_size, None))

    with strategy.scope():  # TF: with strategy.scope(): model, optimizer, metrics, checkpoint
        torch.manual_seed(args.seed)
        model = strategy.mirror(create_model())
        # TF's apply_gradients sums the replicas' gradients (each replica's loss is already
        # divided by the global batch size): reduction="sum" does the same.
        optimizers = strategy.run(
            lambda m: cr.CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=args.lr), reduction="sum"),
            args=(model,))
        # TF: tf.keras.metrics.* are sync-on-read variables: each replica adds to its own copy,
        # a read in cross-replica context sums them.
        metrics = {name: cr.Variable(zero, synchronization="ON_READ", aggregation="SUM")
                   for name, zero in (("train_correct", 0), ("train_seen", 0), ("test_loss_sum", 0.0),
                                      ("test_correct", 0), ("test_seen", 0))}

    def compute_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # TF: per_example_loss = loss_object(labels, predictions)  (reduction=NONE)
        #     tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
        per_example_loss = F.cross_entropy(logits, labels, reduction="none")
        return per_example_loss.sum() / global_batch_size

    def train_step(model: nn.Module, optimizer: cr.CrossShardOptimizer, inputs: Any) -> torch.Tensor:
        images, labels = inputs
        optimizer.zero_grad()                 # TF: with tf.GradientTape() as tape:
        logits = model(images)
        loss = compute_loss(labels, logits)
        loss.backward()                       # TF: tape.gradient(loss, model.trainable_variables)
        optimizer.step()                      # TF: optimizer.apply_gradients(zip(gradients, ...))
        metrics["train_correct"].assign_add(int((logits.argmax(1) == labels).sum()))
        metrics["train_seen"].assign_add(len(labels))
        return loss.detach()

    def test_step(model: nn.Module, inputs: Any) -> None:
        images, labels = inputs
        with torch.no_grad():                 # TF: model(images, training=False)
            logits = model(images)
        metrics["test_loss_sum"].assign_add(float(F.cross_entropy(logits, labels, reduction="sum")))
        metrics["test_correct"].assign_add(int((logits.argmax(1) == labels).sum()))
        metrics["test_seen"].assign_add(len(labels))

    def distributed_train_step(inputs: Any) -> torch.Tensor:
        per_replica_losses = strategy.run(train_step, args=(model, optimizers, inputs))
        return strategy.reduce("sum", per_replica_losses, axis=None)  # TF: ReduceOp.SUM

    history: dict[str, list[float]] = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    with strategy.scope():
        for epoch in range(args.epochs):
            total_loss, num_batches = 0.0, 0
            for inputs in train_dist_dataset:
                total_loss += float(distributed_train_step(inputs))
                num_batches += 1
            for inputs in test_dist_dataset:
                strategy.run(test_step, args=(model, inputs))
            read = {name: float(v.read_value()) for name, v in metrics.items()}  # SUM over replicas
            history["train_loss"].append(total_loss / num_batches)
            history["train_accuracy"].append(read["train_correct"] / read["train_seen"])
            history["test_loss"].append(read["test_loss_sum"] / read["test_seen"])
            history["test_accuracy"].append(read["test_correct"] / read["test_seen"])
            if args.checkpoint_dir and epoch % 2 == 0:  # TF: checkpoint.save(checkpoint_prefix)
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                cr.save(os.path.join(args.checkpoint_dir, "ckpt.pt"),
                        {"model": model, "optimizer": optimizers, "epoch": epoch + 1})
            if not args.quiet:
                print(f"Epoch {epoch + 1}, Loss: {history['train_loss'][-1]:.4f}, "
                      f"Accuracy: {100 * history['train_accuracy'][-1]:.2f}, "
                      f"Test Loss: {history['test_loss'][-1]:.4f}, "
                      f"Test Accuracy: {100 * history['test_accuracy'][-1]:.2f}")
            for v in metrics.values():  # TF: metric.reset_states()
                v.assign(0)
    params = {k: v.detach().clone() for k, v in model.values[0].state_dict().items()}
    result = {"params": params, **history}
    if args.compare:
        ref = reference(args)
        diff = max((params[k] - ref["params"][k]).abs().max().item() for k in params)
        print(f"largest parameter difference against plain PyTorch on one device: {diff:.3g}")
    return result


def reference(args: argparse.Namespace | list[str] | None = None) -> dict[str, Any]:
    """The same training with plain PyTorch on one device, on the whole global batches."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    global_batch_size = args.batch_per_replica * args.replicas
    train_x, train_y, test_x, test_y = load_data(args.seed)
    torch.manual_seed(args.seed)
    model = create_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    history: dict[str, list[float]] = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    train_loader = make_loader(train_x, train_y, global_batch_size, args.seed)  # one shuffling generator
    for _ in range(args.epochs):
        total_loss, num_batches, correct, seen = 0.0, 0, 0, 0
        for images, labels in train_loader:
            optimizer.zero_grad()
            logits = model(images)
            loss = F.cross_entropy(logits, labels, reduction="sum") / global_batch_size
            loss.backward()
            optimizer.step()
            total_loss += float(loss.detach())
            num_batches += 1
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(labels)
        with torch.no_grad():
            logits = model(test_x)
        history["train_loss"].append(total_loss / num_batches)
        history["train_accuracy"].append(correct / seen)
        history["test_loss"].append(float(F.cross_entropy(logits, test_y, reduction="sum")) / len(test_y))
        history["test_accuracy"].append(int((logits.argmax(1) == test_y).sum()) / len(test_y))
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, **history}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2, help="in-process replicas")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-per-replica", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--compare", action="store_true", help="also train with plain PyTorch on one device and compare")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
