"""JAX's SPMD MNIST example (examples/spmd_mnist_classifier_fromscratch.py), ported to crossreplica.

The JAX original trains an MLP from scratch (tanh layers, log-softmax, plain SGD on a list of
``(w, b)`` pairs) with ``pmap``: each global batch is reshaped to ``(devices, per_device, ...)``,
the parameters are broadcast to a leading device axis, and ``spmd_update`` runs on every device,
taking ``jax.grad`` of its own shard's loss and summing the gradients with
``lax.psum(g, 'batch')``; evaluation takes ``x[0]`` of every replicated parameter. Here, each
line has its counterpart, marked ``JAX:``: the stacked batch becomes one value per replica
(``strategy.experimental_distribute_values_from_function``), the broadcast parameters
``strategy.mirror(params)``, ``jax.grad`` is ``torch.func.grad`` inside the replica function,
``lax.psum`` ``cr.cross_replica_sum`` (or, with ``--named-axis``, a reduction over the mesh axis
named ``batch``), and ``x[0]`` ``cr.select_replica(0, ...)``. The images are synthetic 28x28
MNIST-like digits (ten noisy class patterns, one-hot labels, as JAX's ``datasets.mnist()``
returns them): no download.

    python examples/pmap_mnist.py                       # 4 in-process replicas ("devices"), 3 epochs
    python examples/pmap_mnist.py --replicas 2 --compare
    python examples/pmap_mnist.py --layer-sizes 784,1024,1024,10 --step-size 0.001 --epochs 10   # JAX's settings

``reference(args)`` trains the same model on one device with plain PyTorch on the whole global
batches; ``reference(args, per_device=True)`` computes each device's gradient on its shard and
adds them in device order, the arithmetic of the replicas: the numbers ``main`` must reproduce
bitwise. ``--compare`` prints the difference against both and the agreement to expect.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

import crossreplica as cr

Params = list[tuple[torch.Tensor, torch.Tensor]]
Batch = tuple[torch.Tensor, torch.Tensor]


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels), as JAX's ``datasets.mnist()``:
    images N x 784 float32 in [0, 1], labels N x 10 one-hot float32. Each class is a fixed random
    28x28 pattern of strokes; an image is its class's pattern plus noise."""
    g = torch.Generator().manual_seed(args.seed)
    patterns = (torch.rand(10, 28, 28, generator=g) > 0.8).float()
    patterns = torch.nn.functional.avg_pool2d(patterns.unsqueeze(1), 3, stride=1, padding=1).squeeze(1)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(10, (n,), generator=g)
        images = (patterns[labels] + 0.5 * torch.rand(n, 28, 28, generator=g)).clamp(0, 1)
        return images.reshape(n, 784), torch.nn.functional.one_hot(labels, 10).float()

    return (*draw(args.num_train), *draw(args.num_test))


def init_random_params(scale: float, layer_sizes: list[int], seed: int) -> Params:
    """JAX: [(scale * rng.randn(m, n), scale * rng.randn(n)) for m, n in zip(sizes[:-1], sizes[1:])]."""
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(m, n, generator=g), scale * torch.randn(n, generator=g))
            for m, n in zip(layer_sizes[:-1], layer_sizes[1:])]


def predict(params: Params, inputs: torch.Tensor) -> torch.Tensor:
    activations = inputs
    for w, b in params[:-1]:
        activations = torch.tanh(activations @ w + b)
    final_w, final_b = params[-1]
    logits = activations @ final_w + final_b
    return logits - torch.logsumexp(logits, dim=1, keepdim=True)


def loss(params: Params, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    preds = predict(params, inputs)
    return -torch.mean(torch.sum(preds * targets, dim=1))


def accuracy(params: Params, batch: Batch) -> float:
    inputs, targets = batch
    with torch.no_grad():
        return float(torch.mean((predict(params, inputs).argmax(1) == targets.argmax(1)).float()))


def data_stream(images: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace,
                num_devices: int) -> Iterator[Batch]:
    """JAX's ``data_stream()``: global batches of ``--batch-size`` rows in a new random order each
    pass (the last one of a pass shorter when the set does not divide), reshaped to
    ``(num_devices, batch_size_per_device, ...)``."""
    g = torch.Generator().manual_seed(args.seed)  # JAX: rng = npr.RandomState(0)
    num_train = len(images)
    num_batches = -(-num_train // args.batch_size)
    while True:
        perm = torch.randperm(num_train, generator=g)
        for i in range(num_batches):
            batch_idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            x, y = images[batch_idx], labels[batch_idx]
            # JAX: the batch dimension reshaped into two, the first one mapped over devices.
            shape_prefix = (num_devices, x.shape[0] // num_devices)
            yield x.reshape(shape_prefix + x.shape[1:]), y.reshape(shape_prefix + y.shape[1:])


def check_divisible(args: argparse.Namespace, num_devices: int) -> None:
    """JAX raises in the data stream when a batch does not split into equal device shards; here
    before training, naming the sizes: a smaller shard would weigh its rows more (psum of means)."""
    full = args.batch_size if args.num_train >= args.batch_size else 0  # none when the set is smaller
    last = args.num_train % args.batch_size
    for name, rows in (("--batch-size", full), ("the last batch of a pass", last)):
        if rows % num_devices:
            raise ValueError(
                f"{name} has {rows} rows, which do not split into {num_devices} equal device shards "
                f"(--batch-size {args.batch_size}, --num-train {args.num_train}); choose sizes divisible "
                f"by --replicas {num_devices}, as JAX's example requires")


def main(argv: list[str] | None = None, strategy: cr.Strategy | None = None) -> dict[str, Any]:
    """Trains; returns {"params": the final parameters by name ("0.w", "0.b", ...), "train_accuracy"
    and "test_accuracy": one per epoch}. ``strategy``: use this one instead of a
    ``cr.MirroredStrategy(--replicas)`` (a test's worker processes pass theirs)."""
    args = parse_args(argv)
    strategy = strategy or cr.MirroredStrategy(args.replicas)
    num_devices = strategy.num_replicas_in_sync  # JAX: num_devices = jax.device_count()
    check_divisible(args, num_devices)
    train_images, train_labels, test_images, test_labels = load_data(args)
    num_batches = -(-args.num_train // args.batch_size)
    batches = data_stream(train_images, train_labels, args, num_devices)
    batch_mesh = cr.Mesh({"batch": num_devices})  # JAX: pmap(..., axis_name='batch')

    def spmd_update(params: Params, batch: Batch) -> Params:
        """JAX: @partial(pmap, axis_name='batch'); runs on every replica with its shard."""
        grads = torch.func.grad(loss)(params, batch)  # JAX: grads = grad(loss)(params, batch)
        # JAX: [(lax.psum(dw, 'batch'), lax.psum(db, 'batch')) for dw, db in grads]. One call
        # for the whole nest: every leaf travels in one engine call, summed in replica order.
        if args.named_axis:
            grads = cr.cross_replica_sum(grads, mesh=batch_mesh, axes="batch")
        else:
            grads = cr.cross_replica_sum(grads)
        return [(w - args.step_size * dw, b - args.step_size * db)
                for (w, b), (dw, db) in zip(params, grads)]

    def distribute(stacked: Batch) -> Any:
        """JAX: pmap maps axis 0 of every argument; here replica r takes row r of the stacked
        batch. The id is global, so each worker of a multi-process run takes its replicas' rows."""
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tuple(t[ctx.replica_id_in_sync_group] for t in stacked))

    # JAX: replicated_params = tree_map(lambda x: broadcast_to(x, (num_devices,) + x.shape), init)
    replicated_params: Any = strategy.mirror(init_random_params(args.param_scale, args.layer_sizes, args.seed))
    history: dict[str, list[float]] = {"train_accuracy": [], "test_accuracy": []}
    for epoch in range(args.epochs):
        start_time = time.time()
        for _ in range(num_batches):
            # JAX: replicated_params = spmd_update(replicated_params, next(batches))
            replicated_params = strategy.run(spmd_update, args=(replicated_params, distribute(next(batches))))
        epoch_time = time.time() - start_time
        # JAX: params = tree_map(lambda x: x[0], replicated_params): replica 0's copy.
        params = cr.select_replica(0, replicated_params)
        history["train_accuracy"].append(accuracy(params, (train_images, train_labels)))
        history["test_accuracy"].append(accuracy(params, (test_images, test_labels)))
        if not args.quiet and strategy.extended.is_chief:
            print(f"Epoch {epoch} in {epoch_time:0.2f} sec")
            print(f"Training set accuracy {history['train_accuracy'][-1]}")
            print(f"Test set accuracy {history['test_accuracy'][-1]}")
    result = {"params": named(cr.select_replica(0, replicated_params)), **history}
    if args.compare and strategy.extended.is_chief:
        compare(result, args, num_devices)
    return result


def worker_main(strategy: cr.Strategy, argv: list[str]) -> dict[str, Any]:
    """``main`` on a worker process's strategy (crossreplica.testing.WorkerPool's ``mode="main"``)."""
    return main(argv, strategy=strategy)


def named(params: Params) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": t.detach().clone() for i, (w, b) in enumerate(params) for k, t in (("w", w), ("b", b))}


def reference(args: argparse.Namespace | list[str] | None = None, per_device: bool = False,
              num_devices: int | None = None) -> dict[str, Any]:
    """The same training with plain PyTorch on one device.

    JAX's ``spmd_update`` sums (psum) the devices' gradients of their own shard's *mean* loss:
    with equal shards that is ``num_devices`` times the gradient of the global batch's mean loss,
    so each step moves ``step_size * num_devices`` along it (``lax.pmean`` would move
    ``step_size``). By default the reference takes that gradient on the whole global batch (the
    rows are summed in another order: float32 rounding apart). With ``per_device=True`` it takes
    each device's gradient on its shard, one after the other, and adds them left to right in
    device order, as the replicas' sum does: the same arithmetic, bitwise the same result.
    ``num_devices``: default ``--replicas``.
    """
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    num_devices = num_devices or args.replicas
    check_divisible(args, num_devices)
    train_images, train_labels, test_images, test_labels = load_data(args)
    num_batches = -(-args.num_train // args.batch_size)
    batches = data_stream(train_images, train_labels, args, num_devices)
    params = init_random_params(args.param_scale, args.layer_sizes, args.seed)
    history: dict[str, list[float]] = {"train_accuracy": [], "test_accuracy": []}
    for _ in range(args.epochs):
        for _ in range(num_batches):
            images, labels = next(batches)
            if per_device:
                grads = torch.func.grad(loss)(params, (images[0], labels[0]))
                for d in range(1, num_devices):
                    shard = torch.func.grad(loss)(params, (images[d], labels[d]))
                    grads = [(dw + sw, db + sb) for (dw, db), (sw, sb) in zip(grads, shard)]
            else:
                whole = (images.flatten(0, 1), labels.flatten(0, 1))
                grads = [(num_devices * dw, num_devices * db)
                         for dw, db in torch.func.grad(loss)(params, whole)]
            params = [(w - args.step_size * dw, b - args.step_size * db)
                      for (w, b), (dw, db) in zip(params, grads)]
        history["train_accuracy"].append(accuracy(params, (train_images, train_labels)))
        history["test_accuracy"].append(accuracy(params, (test_images, test_labels)))
    return {"params": named(params), **history}


def compare(result: dict[str, Any], args: argparse.Namespace, num_devices: int) -> None:
    """Prints the largest parameter difference against both references and what to expect."""
    for per_device, expect in (
            (True, "expect 0: the same per-shard gradients added in the same order (replicas that "
                   "compute with other intra-op thread counts than this process may round a kernel "
                   "differently)"),
            (False, "expect float32 rounding, about 1e-7 to 1e-6: the whole batch's rows are summed in "
                    "another order, and training carries the difference on")):
        ref = reference(args, per_device=per_device, num_devices=num_devices)
        diff = max((result["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
        how = "gradients per device shard" if per_device else "the whole global batches"
        print(f"largest parameter difference against plain PyTorch on one device ({how}): {diff:.3g}; {expect}")


def layer_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) < 2 or sizes[0] != 784 or sizes[-1] != 10 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"--layer-sizes must be comma-separated positive ints from 784 (the pixels) to 10 (the "
            f"classes), e.g. 784,256,256,10; got {text!r}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4, help="in-process replicas (JAX: the devices)")
    p.add_argument("--layer-sizes", type=layer_sizes, default=[784, 256, 256, 10],
                   help="JAX's example uses 784,1024,1024,10")
    p.add_argument("--param-scale", type=float, default=0.1)
    p.add_argument("--step-size", type=float, default=0.003,
                   help="JAX's example uses 0.001 for 10 epochs of 60000 images; this data has far fewer")
    p.add_argument("--epochs", type=int, default=3, help="JAX's example runs 10")
    p.add_argument("--batch-size", type=int, default=128, help="global batch; divisible by --replicas")
    p.add_argument("--num-train", type=int, default=2000, help="synthetic training images")
    p.add_argument("--num-test", type=int, default=500, help="synthetic test images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--named-axis", action="store_true",
                   help="sum over the mesh axis named 'batch' (cr.Mesh) instead of every replica: the same numbers")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--compare", action="store_true", help="also train with plain PyTorch on one device and compare")
    args = p.parse_args(argv)
    for name in ("replicas", "epochs", "batch_size", "num_train", "num_test"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive int; got {getattr(args, name)}")
    return args


if __name__ == "__main__":
    main(sys.argv[1:])
