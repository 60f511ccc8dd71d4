"""Multi-step loops: several training steps per dispatch (TPU ``steps_per_run``).

``strategy.extended.experimental_run_steps_on_iterator(fn, iterator, iterations)``
follows TF: ``fn(ctx, inputs)`` runs ``iterations`` times in cross-replica
context, once per element of ``iterator``, and records what the caller wants
back from the last step on ``ctx`` (a :class:`MultiStepContext`).

``strategy.experimental_run_steps(fn, iterator, steps)`` goes further: it takes
``steps`` elements of the iterator and hands them to the replicas in one
dispatch; each replica runs the replica function ``fn(element)`` on its part of
each element in turn, without returning to the caller between steps, and the
last step's outputs come back as ``strategy.run``'s would.

Both take fewer steps when the iterator runs out first (the last chunk of an
epoch), and raise ``StopIteration`` when it is already exhausted, as ``next``
does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

import torch

from .. import context
from ..arguments import check_int
from ..errors import ReplicaContextError, summarize
from ..random_streams import draw_base, replica_stream
from ..reduce_op import ReduceOp

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["MultiStepContext", "run_steps_on_iterator", "run_steps"]


class MultiStepContext:
    """What a multi-step loop's ``fn(ctx, inputs)`` sends back from its last step.

    ``last_step_outputs`` maps names to the outputs set by
    :meth:`set_last_step_output` (reduced over every replica in sync when a
    ``reduce_op`` was given); ``non_tensor_outputs`` maps names to what
    :meth:`set_non_tensor_output` recorded.
    """

    def __init__(self) -> None:
        self._last_step_outputs: dict[str, Any] = {}
        self._last_step_outputs_reduce_ops: dict[str, ReduceOp | None] = {}
        self._non_tensor_outputs: dict[str, Any] = {}

    @property
    def last_step_outputs(self) -> dict[str, Any]:
        """The outputs of the last step, by name (reduced ones reduced)."""
        return self._last_step_outputs

    @property
    def non_tensor_outputs(self) -> dict[str, Any]:
        """The non-tensor outputs, by name."""
        return self._non_tensor_outputs

    def set_last_step_output(self, name: str, output: Any, reduce_op: ReduceOp | str | None = None) -> None:
        """Records ``output`` under ``name``; the last step's value is what the loop returns.

        In cross-replica context (in ``fn`` itself) ``output`` is typically a
        PerReplica from ``strategy.run``; with ``reduce_op`` it is reduced with
        ``strategy.reduce``. In a replica function ``reduce_op`` is required:
        the replicas' values meet in a ``merge_call`` and are reduced there.

        Raises:
            ValueError: ``name`` is not a string, ``reduce_op`` is unknown, or it is
                missing in a replica function.
        """
        if not isinstance(name, str):
            raise ValueError(f"name must be a string naming the output; got {summarize(name)}")
        op = None if reduce_op is None else ReduceOp.from_any(reduce_op, "reduce_op")
        rctx = context.current_replica_context()
        if rctx is None:
            self._last_step_outputs_reduce_ops[name] = op
            self._last_step_outputs[name] = (output if op is None
                                             else context.get_strategy().reduce(op, output, axis=None))
            return
        if op is None:
            raise ValueError(
                f"set_last_step_output({name!r}) in a replica function needs a reduce_op (e.g. 'sum' or "
                f"'mean') to combine the replicas' values; without one, return the value from the "
                f"replica function and set it in cross-replica context")

        def merge_fn(strategy: Strategy, value: Any) -> None:
            # Set once, in merge_fn: every replica shares this context object.
            self._last_step_outputs[name] = strategy.reduce(op, value, axis=None)
            self._last_step_outputs_reduce_ops[name] = op

        rctx.merge_call(merge_fn, args=(output,))

    def set_non_tensor_output(self, name: str, output: Any) -> None:
        """Records a non-tensor ``output`` under ``name``. In a replica function every local
        replica's value is kept (a tuple, in local order): there is nothing to reduce."""
        if not isinstance(name, str):
            raise ValueError(f"name must be a string naming the output; got {summarize(name)}")
        rctx = context.current_replica_context()
        if rctx is None:
            self._non_tensor_outputs[name] = output
            return

        def merge_fn(strategy: Strategy, value: Any) -> None:
            self._non_tensor_outputs[name] = strategy.experimental_local_results(value)

        rctx.merge_call(merge_fn, args=(output,))

    def __repr__(self) -> str:
        return (f"MultiStepContext(last_step_outputs={sorted(self._last_step_outputs)}, "
                f"non_tensor_outputs={sorted(self._non_tensor_outputs)})")


def _check_iterator(iterator: Any) -> Iterator[Any]:
    if not hasattr(iterator, "__next__"):
        hint = " (pass iter(dataset))" if hasattr(iterator, "__iter__") else ""
        raise ValueError(f"iterator must be an iterator over a distributed dataset{hint}; got "
                         f"{type(iterator).__name__}: {summarize(iterator)}")
    return iterator


def _require_cross_replica(api: str) -> None:
    if context.current_replica_context() is not None:
        raise ReplicaContextError(
            f"{api} must be called in cross-replica context (from the main program, outside strategy.run)")


def run_steps_on_iterator(strategy: "Strategy", fn: Callable[[MultiStepContext, Any], Any], iterator: Any,
                          iterations: int, initial_loop_values: dict[str, Any] | None = None) -> MultiStepContext:
    """The implementation of ``strategy.extended.experimental_run_steps_on_iterator``:
    ``fn(ctx, next(iterator))`` ``iterations`` times in cross-replica context.

    ``initial_loop_values`` (a dict by name, as ``last_step_outputs``) are the
    outputs before the first step, which the steps then overwrite.
    """
    _require_cross_replica("strategy.extended.experimental_run_steps_on_iterator")
    if not callable(fn):
        raise ValueError(f"fn must be callable as fn(ctx, inputs); got {summarize(fn)}")
    it = _check_iterator(iterator)
    check_int(iterations, "iterations", low=1)
    if initial_loop_values is not None and not isinstance(initial_loop_values, dict):
        raise ValueError(f"initial_loop_values must be a dict of outputs by name, as last_step_outputs, "
                         f"or None; got {summarize(initial_loop_values)}")
    ctx = MultiStepContext()
    ctx._last_step_outputs.update(initial_loop_values or {})
    with strategy.scope():
        for step in range(iterations):
            try:
                inputs = next(it)
            except StopIteration:
                if step == 0:
                    raise
                break
            fn(ctx, inputs)
    return ctx


def _loop(fn: Callable[[Any], Any], elements: list[Any], bases: list[int] | None) -> Any:
    """A replica's multi-step body: ``fn`` on its part of each element, the last result kept.

    With ``bases``, step ``k`` draws from the stream one ``strategy.run`` that drew
    ``bases[k]`` would give this replica, so dropout trains as one run per step.
    """
    rctx = context.require_replica_context("strategy.experimental_run_steps")
    rid, timeout = rctx.replica_id_in_sync_group, rctx.strategy.extended.timeout
    out = None
    for k, element in enumerate(elements):
        with replica_stream(None if bases is None else bases[k], rid, timeout):
            out = fn(element)
    return out


def run_steps(strategy: "Strategy", fn: Callable[[Any], Any], iterator: Any, steps: int) -> Any:
    """The implementation of ``Strategy.experimental_run_steps``: ``steps`` elements of
    ``iterator`` in one dispatch; each replica runs ``fn`` on its part of each in turn."""
    _require_cross_replica("strategy.experimental_run_steps")
    if not callable(fn):
        raise ValueError(f"fn must be callable as fn(per_replica_element); got {summarize(fn)}")
    it = _check_iterator(iterator)
    check_int(steps, "steps", low=1)
    elements = []
    for _ in range(steps):
        try:
            elements.append(next(it))
        except StopIteration:
            break
    if not elements:
        raise StopIteration
    if strategy.extended.layout_invariant is not None:
        # Each step is its own micro-batched run (one dispatch would cut every step's rows at once).
        for element in elements:
            out = strategy.run(fn, args=(element,))
        return out
    if not strategy.extended.random_streams:
        # By keyword: run drops trailing None args (TPUStrategy's rule).
        return strategy.run(_loop, args=(fn, elements), kwargs={"bases": None})
    # One random base per step, drawn from the caller's generator as ``len(elements)``
    # runs would draw them: the run itself draws the first, the rest are drawn after it.
    saved = torch.get_rng_state()
    bases = [draw_base() for _ in elements]
    torch.set_rng_state(saved)
    out = strategy.run(_loop, args=(fn, elements, bases))
    for _ in elements[1:]:
        draw_base()
    return out
