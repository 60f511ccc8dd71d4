"""The tests' plain-PyTorch reference: the same training on one device, with no crossreplica.

A replicated run is checked against what one process computes with plain torch from the same
model, optimizer and global batches. ``one_device_training`` is that computation, written once:

* by default each global batch is taken whole (the mean loss over all its rows), as DDP and a
  single-device run see it: replicas must match it to float rounding;
* with ``replicas=n`` each global batch is cut as the replicas get it (``torch.tensor_split``),
  each piece's gradient is taken on its own and the pieces' gradients are averaged in replica
  order (``replica_mean``): the engines' arithmetic, so replicas must match it bit for bit.

A reference that computes something else (a GradScaler's skipped steps, dropout masks drawn
by the replicas' seeds, several backward passes per replica) keeps its own code in its test.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

#: ``loss(model, x, y)``: the loss of ``model`` on the rows ``x`` with targets ``y``.
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``optimizer(parameters)``: a torch optimizer over them (``functools.partial(torch.optim.SGD, lr=0.1)``).
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass
class Trained:
    """What ``one_device_training`` ends with."""

    model: nn.Module  #: the trained copy (its last gradients and buffers kept)
    optimizer: torch.optim.Optimizer  #: its optimizer (state, step counts)
    losses: list[torch.Tensor]  #: every batch's loss, detached (closure=True: what ``step`` returned)

    @property
    def params(self) -> list[torch.Tensor]:
        """The trained parameters, detached, in ``model.parameters()`` order."""
        return [p.detach() for p in self.model.parameters()]


def replica_mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The engines' mean of one value per replica: summed left to right in replica order, then
    divided by the count (a mean all-reduce's bits)."""
    if len(values) == 0:
        raise ValueError("values must hold one tensor per replica; got an empty sequence")
    total = values[0].clone()
    for v in values[1:]:
        total = total + v
    return total / len(values)


def _per_replica(model: nn.Module, loss: Loss, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    params = list(model.parameters())
    losses, grads = [], []
    for x, y in batches:
        value = loss(model, x, y)
        grads.append(list(torch.autograd.grad(value, params, allow_unused=True)))
        losses.append(value.detach())
    return losses, grads


def _mean_per_parameter(per_replica: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for i, grads in enumerate(zip(*per_replica)):
        missing = [r for r, g in enumerate(grads) if g is None]
        if missing and len(missing) < len(grads):
            raise ValueError(f"parameter {i} has no gradient on replicas {missing} but has one on the others: "
                             "give every replica a loss that reaches it, or none")
        out.append(None if missing else replica_mean(grads))
    return out


def mean_gradients(model: nn.Module, loss: Loss,
                   batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor | None]:
    """The replicas' mean gradient per parameter: replica ``r``'s is ``loss(model, *batches[r])``
    differentiated on its own (``model`` is not changed), then ``replica_mean`` of them, what a
    CrossShardOptimizer's mean reduction hands each replica; None for a parameter no loss reaches."""
    return _mean_per_parameter(_per_replica(model, loss, batches)[1])


def one_device_training(model: nn.Module, optimizer: MakeOptimizer,
                        batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss: Loss, *,
                        replicas: int | None = None, accumulate: int = 1,
                        before_step: Callable[[nn.Module], object] | None = None, closure: bool = False,
                        device: str | torch.device | None = None) -> Trained:
    """Trains a copy of ``model`` (the caller's is left as it is) with ``optimizer(params)`` over
    the global ``batches`` on one device, plain torch, and returns it with its losses.

    ``replicas``: the gradient of each batch is the replicas' mean (see the module docstring)
    instead of the whole batch's. ``accumulate``: gradients add up over that many batches before
    each step. ``before_step(model)`` runs between the backward passes and the step (clipping).
    ``closure``: ``optimizer.step(closure)`` (LBFGS). ``device``: the copy and the batches are
    moved there.
    """
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"replicas must be None or a positive int; got {replicas!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int; got {accumulate!r}")
    if closure and (replicas is not None or accumulate != 1 or before_step is not None):
        raise ValueError("closure=True steps with the whole batch's closure: it takes no replicas, accumulate or "
                         f"before_step; got replicas={replicas!r}, accumulate={accumulate!r}, "
                         f"before_step={before_step!r}")
    if replicas is not None and accumulate != 1:
        raise ValueError(f"replicas={replicas!r} sets each step's gradient to the replicas' mean: use accumulate=1; "
                         f"got accumulate={accumulate!r}")
    net = copy.deepcopy(model)
    if device is not None:
        net = net.to(device)
    opt = optimizer(net.parameters())
    losses: list[torch.Tensor] = []
    for i, (x, y) in enumerate(batches):
        if device is not None:
            x, y = x.to(device), y.to(device)
        if closure:
            def full_batch(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                value = loss(net, x, y)
                value.backward()
                return value

            losses.append(opt.step(full_batch).detach())  # type: ignore[union-attr]
            continue
        if i % accumulate == 0:
            opt.zero_grad()
        if replicas is None:
            value = loss(net, x, y)
            value.backward()
            losses.append(value.detach())
        else:
            pieces = list(zip(torch.tensor_split(x, replicas), torch.tensor_split(y, replicas)))
            values, grads = _per_replica(net, loss, pieces)
            for p, g in zip(net.parameters(), _mean_per_parameter(grads)):
                p.grad = g
            losses.append(replica_mean(values))
        if (i + 1) % accumulate == 0:
            if before_step is not None:
                before_step(net)
            opt.step()
    return Trained(net, opt, losses)


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A ``Loss``: the mean cross-entropy of ``model(x)`` against the class indices ``y``."""
    return nn.functional.cross_entropy(model(x), y)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A ``Loss``: the mean squared error of ``model(x)`` against ``y``."""
    return nn.functional.mse_loss(model(x), y)
