"""A TPU-era training script in the style of mnist_tpu.py, ported to crossreplica.

The TF 1.x original builds a ``TPUEstimator`` whose ``model_fn`` wraps Adam in
``tf.contrib.tpu.CrossShardOptimizer`` (gradients summed over the 8 shards of a TPU),
decays the learning rate with the global step, feeds fixed-size batches from a repeated,
shuffled dataset (``drop_remainder=True``) and runs ``iterations_per_loop`` training steps
per host-to-TPU dispatch; then it evaluates the accuracy. Here: 8 replicas (threads of this
process, ``cr.MirroredStrategy(8)``), ``cr.CrossShardOptimizer``, a per-replica LR
scheduler, and ``strategy.experimental_run_steps``, which hands ``--iterations`` steps to
the replicas in one dispatch. The images are scikit-learn's bundled 8x8 digits (random
class-dependent images without scikit-learn).

    python examples/tpu_cross_shard.py                             # 8 replicas, 200 steps
    python examples/tpu_cross_shard.py --iterations 1              # one dispatch per step: the same numbers

``reference(args)`` trains the same model on one device with plain PyTorch on the whole
global batches; ``--compare`` prints the largest parameter difference against it, and
against ``reference(args, shards=8)``, plain PyTorch again but with each batch's loss the
mean of its 8 shards' losses, as the replicas sum. The two plain-PyTorch runs differ
from each other as much as the replicas differ from the first: it is float rounding (the
shards' sums round otherwise than the whole batch's), which Adam amplifies as training
goes on (it divides each gradient by its running size, so the rounding of a gradient near
zero becomes a step of the learning rate's size): about 3e-6 after 23 steps and 8e-2
after the default 200, while the replicas stay within about 2e-6 of the sharded reference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import crossreplica as cr


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels); images N x 1 x 8 x 8 in [0, 1]."""
    try:
        from sklearn.datasets import load_digits
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
    except ImportError:
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(10, (1800,), generator=g)
        patterns = torch.rand(10, 1, 8, 8, generator=g)
        images = (patterns[labels] + 0.3 * torch.randn(1800, 1, 8, 8, generator=g)).clamp(0, 1)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    cut = len(labels) * 4 // 5
    return images[:cut], labels[:cut], images[cut:], labels[cut:]


def create_model() -> nn.Module:
    """mnist_tpu's model (conv, pool, dense, logits), shrunk for 8x8 images."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def train_input_fn(images: torch.Tensor, labels: torch.Tensor, batch_size: int, seed: int) -> Iterator[tuple]:
    """TF: dataset.cache().repeat().shuffle(...).batch(batch_size, drop_remainder=True): global
    batches of a fixed size, forever, reshuffled each pass (seeded: the reference sees the same)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(labels), generator=g)
        for start in range(0, len(labels) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield images[idx], labels[idx]


def learning_rate_factor(step: int, args: argparse.Namespace) -> float:
    """TF: tf.train.exponential_decay(lr, global_step, decay_steps, decay_rate=0.96)."""
    return 0.96 ** (step / args.decay_steps)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains and evaluates; returns the final parameters, the loss of the last step of each
    loop (one per dispatch, as TPUEstimator logs it), and the test accuracy."""
    args = parse_args(argv)
    strategy = cr.MirroredStrategy(args.num_shards)  # TF: TPUConfig(iterations, num_shards)
    train_x, train_y, test_x, test_y = load_data(args.seed)
    with strategy.scope():
        torch.manual_seed(args.seed)
        model = strategy.mirror(create_model())

        def make_optimizer(m: nn.Module) -> cr.CrossShardOptimizer:
            # TF: optimizer = tf.train.AdamOptimizer(learning_rate)
            #     if FLAGS.use_tpu: optimizer = tf.contrib.tpu.CrossShardOptimizer(optimizer)
            return cr.CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=args.learning_rate))

        optimizers = strategy.run(make_optimizer, args=(model,))
        schedulers = strategy.run(
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: learning_rate_factor(step, args)),
            args=(optimizers,))

    def this_replicas(*values: Any) -> list[Any]:
        """This replica's part of each distributed value. experimental_run_steps hands the replica
        function the batch only, so the model, optimizer and scheduler come from here: a worker
        holds its own replicas' parts, and replica id = worker rank x replicas per worker + local
        index (docs/multi_process.md), which makes this right on every strategy."""
        ext = strategy.extended
        local = cr.get_replica_context().replica_id_in_sync_group - ext.worker_rank * ext.num_replicas_per_host
        return [cr.select_replica(local, v) for v in values]

    def train_step(inputs: Any) -> torch.Tensor:
        """TF's model_fn in TRAIN mode, on this replica's shard of the batch."""
        images, labels = inputs
        net, opt, sched = this_replicas(model, optimizers, schedulers)
        opt.zero_grad()
        loss = F.cross_entropy(net(images), labels)  # the shard's mean loss
        loss.backward()
        opt.step()    # TF: optimizer.minimize(loss, global_step): the mean of the shards' gradients
        sched.step()  # the global step advances
        return loss.detach()

    def eval_step(inputs: Any) -> torch.Tensor:
        images, labels = inputs
        (net,) = this_replicas(model)
        with torch.no_grad():
            predictions = net(images).argmax(1)
        return torch.stack([(predictions == labels).sum(), torch.tensor(len(labels))])

    batches = iter(strategy.distribute_dataset(train_input_fn(train_x, train_y, args.batch_size, args.seed)))
    losses: list[float] = []
    step = 0
    while step < args.train_steps:  # TF: estimator.train(input_fn=train_input_fn, max_steps=train_steps)
        steps = min(args.iterations, args.train_steps - step)
        last = strategy.experimental_run_steps(train_step, batches, steps)  # one dispatch, `steps` steps
        step += steps
        losses.append(float(strategy.reduce("mean", last)))
        if not args.quiet:
            print(f"global step {step}: loss {losses[-1]:.4f}")

    counts = torch.zeros(2, dtype=torch.long)  # TF: estimator.evaluate(input_fn=eval_input_fn)
    for inputs in strategy.distribute_dataset(list(zip(test_x.split(args.batch_size), test_y.split(args.batch_size)))):
        counts += strategy.reduce("sum", strategy.run(eval_step, args=(inputs,)))
    accuracy = counts[0].item() / counts[1].item()
    if not args.quiet:
        print(f"eval accuracy: {accuracy:.4f}")
    params = {k: v.detach().clone() for k, v in model.values[0].state_dict().items()}
    result = {"params": params, "losses": losses, "accuracy": accuracy}
    if args.compare:
        result["differences"] = compare(params, args)
    return result


def compare(params: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, float]:
    """Prints, and returns, the largest parameter difference of ``params`` against plain PyTorch
    on the whole global batches and on their shards, and between those two references: what
    agreement to expect, and why."""
    def largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    whole, sharded = reference(args)["params"], reference(args, shards=args.num_shards)["params"]
    got = {"whole": largest(params, whole), "sharded": largest(params, sharded),
           "references": largest(whole, sharded)}
    print(f"largest parameter difference against plain PyTorch on one device: {got['whole']:.3g}, after "
          f"{args.train_steps} Adam steps")
    print(f"  against plain PyTorch with each batch's loss the mean of its {args.num_shards} shards' (the replicas' "
          f"summation order): {got['sharded']:.3g}")
    print(f"  the two plain-PyTorch runs against each other: {got['references']:.3g}")
    print("  expected: float rounding. It depends on the summation order, and Adam, dividing each gradient by its "
          "running size, turns the rounding of near-zero gradients into whole steps, so it grows with the steps; in "
          "the replicas' summation order it stays near 1e-6")
    return got


def reference(args: argparse.Namespace | list[str] | None = None, shards: int = 1) -> dict[str, Any]:
    """The same training with plain PyTorch on one device, on the whole global batches; with
    ``shards`` > 1 each batch's loss is the mean of the losses of its ``shards`` equal parts
    (the same value; the sums round as the replicas' do)."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    train_x, train_y, test_x, test_y = load_data(args.seed)
    torch.manual_seed(args.seed)
    model = create_model()
    opt = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: learning_rate_factor(step, args))
    batches = train_input_fn(train_x, train_y, args.batch_size, args.seed)
    losses: list[float] = []
    for step in range(args.train_steps):
        images, labels = next(batches)
        opt.zero_grad()
        if shards == 1:
            loss = F.cross_entropy(model(images), labels)
        else:
            parts = zip(images.chunk(shards), labels.chunk(shards))
            loss = torch.stack([F.cross_entropy(model(x), y) for x, y in parts]).mean()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % args.iterations == 0 or step + 1 == args.train_steps:
            losses.append(float(loss.detach()))
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "accuracy": accuracy}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-shards", type=int, default=8, help="replicas (TPU cores)")
    p.add_argument("--batch-size", type=int, default=128, help="global batch; a multiple of --num-shards")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--iterations", type=int, default=50, help="training steps per dispatch (iterations_per_loop)")
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--decay-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--compare", action="store_true", help="also train with plain PyTorch on one device and compare")
    args = p.parse_args(argv)
    if args.batch_size % args.num_shards:
        p.error(f"--batch-size {args.batch_size} is not a multiple of --num-shards {args.num_shards} "
                "(TPUEstimator requires it too)")
    return args


if __name__ == "__main__":
    main(sys.argv[1:])
