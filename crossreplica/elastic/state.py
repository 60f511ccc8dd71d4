"""The live training state a fault-tolerant job keeps, puts back and hands over.

``cr.FaultTolerance(strategy, state)`` takes a nest of the objects a step
changes. Each object gets one handler of its type, with one interface:

* ``snapshot()`` / ``rollback()``: a copy in memory at each step's start, put
  back when the step fails and is redone on the survivors;
* ``state()`` / ``load(state)``: the live state as tensors and plain values,
  which the chief hands to a worker that joins or fell behind.

Handlers: modules (parameters and buffers), optimizers (a
``CrossShardOptimizer``'s wrapped one), ``torch.Generator`` random streams, and
any object with ``state_dict`` / ``load_state_dict`` (LR schedulers,
``GradScaler``, a sampler or data position of the user's own). The process's
default random stream is always part of the state.

What crosses the wire is the checkpoint's safe encoding (``checkpoint/
safe_values.py``: tensors, builtins, numpy, namedtuples, dataclasses), read with
``torch.load(weights_only=True)``: bytes from a peer never run code on a worker.
An object whose ``state_dict`` holds anything else is refused when the job
starts, naming the object and the value, not when a peer first needs it.
"""

from __future__ import annotations

import abc
import copy
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import nest
from .. import torch_private as tp
from ..checkpoint.safe_values import decode, encode
from ..errors import CheckpointError, summarize
from ..optim import CrossShardOptimizer
from ..values import DistributedValues

__all__ = ["Handler", "TrainingState", "handler_for"]

# The first word of the hand-over: a worker of another encoding says so instead of misreading it.
_FORMAT = "crossreplica.elastic.state/1"


class Saved:
    """A copy of some tensors, kept in buffers of its own that each save reuses."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def save(self, tensors: Sequence[torch.Tensor]) -> None:
        fits = len(self.buffers) == len(tensors) and all(
            b.shape == t.shape and b.dtype == t.dtype and b.device == t.device
            for b, t in zip(self.buffers, tensors))
        with torch.no_grad():
            if not fits:
                self.buffers = [t.detach().clone() for t in tensors]
                return
            if self.buffers:
                tp.foreach_copy_(self.buffers, list(tensors))


class Handler(abc.ABC):
    """One object of the training state (see the module docstring)."""

    kind = "object"

    def __init__(self, obj: Any):
        self.obj = obj

    @abc.abstractmethod
    def snapshot(self) -> None:
        """Keeps the object's state as it is now (a step's start), in memory."""

    @abc.abstractmethod
    def rollback(self) -> None:
        """Puts back the state of the last :meth:`snapshot`."""

    @abc.abstractmethod
    def state(self) -> Any:
        """The live state as tensors and plain values (what a joining worker loads)."""

    @abc.abstractmethod
    def load(self, state: Any) -> None:
        """Takes ``state`` (what :meth:`state` gave on another worker)."""


class ModuleHandler(Handler):
    """A module's parameters and buffers; a rollback also drops the gradients."""

    kind = "module"

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self._saved = Saved()

    def _tensors(self) -> list[torch.Tensor]:
        m = self.obj
        return [*(p.data for p in m.parameters()), *m.buffers()]

    def snapshot(self) -> None:
        self._saved.save(self._tensors())

    def rollback(self) -> None:
        with torch.no_grad():
            for t, b in zip(self._tensors(), self._saved.buffers):
                t.copy_(b)
        for p in self.obj.parameters():
            p.grad = None

    def state(self) -> Any:
        return self.obj.state_dict()

    def load(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class OptimizerHandler(Handler):
    """A torch optimizer's state and hyperparameters (its tensors copied into reused buffers)."""

    kind = "optimizer"

    def __init__(self, opt: torch.optim.Optimizer):
        super().__init__(opt)
        self.tensors = Saved()
        self.layout: list[tuple[int, str, Any]] = []  # (param position, key, value or None for a tensor)
        self.groups: list[dict[str, Any]] = []

    def snapshot(self) -> None:
        params = [p for g in self.obj.param_groups for p in g["params"]]
        layout, tensors = [], []
        for i, p in enumerate(params):
            for key, value in self.obj.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    layout.append((i, key, None))
                    tensors.append(value)
                else:
                    layout.append((i, key, copy.deepcopy(value)))
        self.layout = layout
        self.tensors.save(tensors)
        self.groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in self.obj.param_groups]

    def rollback(self) -> None:
        params = [p for g in self.obj.param_groups for p in g["params"]]
        self.obj.state.clear()
        saved = iter(self.tensors.buffers)
        for i, key, value in self.layout:
            self.obj.state[params[i]][key] = next(saved).clone() if value is None else copy.deepcopy(value)
        for group, hyper in zip(self.obj.param_groups, self.groups):
            group.update(copy.deepcopy(hyper))

    def state(self) -> Any:
        return self.obj.state_dict()

    def load(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class GeneratorHandler(Handler):
    """A ``torch.Generator``: its state, a uint8 tensor."""

    kind = "generator"

    def __init__(self, gen: torch.Generator):
        super().__init__(gen)
        self._saved: torch.Tensor | None = None

    def snapshot(self) -> None:
        self._saved = self.obj.get_state()

    def rollback(self) -> None:
        if self._saved is not None:
            self.obj.set_state(self._saved)

    def state(self) -> Any:
        return self.obj.get_state()

    def load(self, state: Any) -> None:
        self.obj.set_state(state)


class DefaultRandomHandler(Handler):
    """The process's default CPU random stream (``torch.get_rng_state``)."""

    kind = "default random stream"

    def __init__(self) -> None:
        super().__init__(None)
        self._saved = torch.get_rng_state()

    def snapshot(self) -> None:
        self._saved = torch.get_rng_state()

    def rollback(self) -> None:
        torch.set_rng_state(self._saved)

    def state(self) -> Any:
        return torch.get_rng_state()

    def load(self, state: Any) -> None:
        torch.set_rng_state(state)


class StatefulHandler(Handler):
    """Any object with ``state_dict`` / ``load_state_dict``: LR schedulers, ``GradScaler``,
    a sampler or data position (the snapshot is a deep copy of its state_dict)."""

    kind = "state_dict"

    def __init__(self, obj: Any):
        super().__init__(obj)
        self._saved: Any = None

    def snapshot(self) -> None:
        self._saved = copy.deepcopy(self.obj.state_dict())

    def rollback(self) -> None:
        if self._saved is not None:
            self.obj.load_state_dict(copy.deepcopy(self._saved))

    def state(self) -> Any:
        return self.obj.state_dict()

    def load(self, state: Any) -> None:
        self.obj.load_state_dict(state)


def handler_for(obj: Any) -> Handler:
    """The handler of one object of the training state; a TypeError names what is accepted."""
    if isinstance(obj, torch.nn.Module):
        return ModuleHandler(obj)
    if isinstance(obj, CrossShardOptimizer):
        if obj.shards_state:
            raise ValueError("FaultTolerance does not support CrossShardOptimizer(shard_optimizer_state=True): "
                             "a lost worker takes its shard of the optimizer state with it; leave it False")
        return OptimizerHandler(obj.optimizer)
    if isinstance(obj, torch.optim.Optimizer):
        return OptimizerHandler(obj)
    if isinstance(obj, torch.Generator):
        return GeneratorHandler(obj)
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return StatefulHandler(obj)
    raise TypeError(f"state must hold modules, optimizers, torch.Generators and objects with state_dict / "
                    f"load_state_dict (LR schedulers, GradScaler, samplers), or Mirrored / PerReplica values of "
                    f"them; got {summarize(obj)}")


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _unsafe(value: Any, where: str) -> str | None:
    """Where in an encoded nest a value sits that ``torch.load(weights_only=True)`` refuses."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, _PLAIN):
                return f"{where} (key {summarize(k)})"
            found = _unsafe(v, f"{where}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _unsafe(v, f"{where}[{i}]")
            if found:
                return found
        return None
    return f"{where}: {summarize(value)}"


class TrainingState:
    """One handler per object of a fault-tolerant job's state, local copies included (each
    replica's copy of a Mirrored module or PerReplica optimizer), in the state's order."""

    def __init__(self, local_results: Callable[[Any], Sequence[Any]], state: Any):
        objects: list[Any] = []
        for leaf in nest.flatten(state)[0]:
            objects += list(local_results(leaf)) if isinstance(leaf, DistributedValues) else [leaf]
        self.objects = objects
        self.handlers = [handler_for(obj) for obj in objects] + [DefaultRandomHandler()]
        for number, handler in enumerate(self.handlers):
            bad = _unsafe(encode(handler.state()), "state_dict()")
            if bad is not None:
                raise TypeError(
                    f"FaultTolerance hands the state to joining workers as tensors and plain values (never a "
                    f"pickle); object {number} of the state ({summarize(handler.obj)}) holds another value at "
                    f"{bad}; make its state_dict return tensors, numbers, strings and lists / dicts of them")

    def snapshot(self) -> None:
        """Keeps the state as it is now (a step's start)."""
        for handler in self.handlers:
            handler.snapshot()

    def rollback(self) -> None:
        """Puts back the state of the last :meth:`snapshot`."""
        for handler in self.handlers:
            handler.rollback()

    def serialize(self, completed: int, result: Any) -> bytes:
        """The live state, the completed steps and the last step's result, as bytes a peer
        reads without unpickling code (the module docstring)."""
        result = encode(result)
        bad = _unsafe(result, "the step's result")
        if bad is not None:
            raise TypeError(f"FaultTolerance hands the last step's result to a joining worker as tensors and plain "
                            f"values; it holds {bad}; return tensors, numbers or nests of them from the step")
        buf = io.BytesIO()
        torch.save({"format": _FORMAT, "kinds": [h.kind for h in self.handlers],
                    "states": [encode(h.state()) for h in self.handlers],
                    "completed": completed, "result": result}, buf)
        return buf.getvalue()

    def load(self, data: bytes, source: str) -> tuple[int, Any]:
        """Loads what :meth:`serialize` wrote on ``source`` (a worker, named in errors);
        returns its completed steps and the result of its last step."""
        try:
            got = torch.load(io.BytesIO(data), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"the training state handed over by {source} is not tensors and plain values (refused unread: it "
                f"may not come from a worker of this job, or from another version of crossreplica): {first}") from None
        if not isinstance(got, dict) or got.get("format") != _FORMAT:
            raise CheckpointError(f"the training state handed over by {source} is not in the format "
                                  f"{_FORMAT!r} (another version of crossreplica?)")
        kinds = [h.kind for h in self.handlers]
        if got["kinds"] != kinds:
            raise CheckpointError(
                f"the training state handed over by {source} holds {got['kinds']}, this worker's holds {kinds}: "
                f"every worker must pass FaultTolerance the same state")
        for handler, state in zip(self.handlers, got["states"]):
            handler.load(decode(state, source))
        return got["completed"], decode(got["result"], source)
