"""Multi-step loops: experimental_run_steps (several steps per dispatch) and TF's
extended.experimental_run_steps_on_iterator with a MultiStepContext.

A linear model trained by SGD on global-batch-mean gradients (all-reduced in the
replica function) is run step by step, in chunks of steps, and through the TF
loop, in one process (MirroredStrategy, 4 replicas) and across worker processes
(2x1, 2x2); every way must match plain PyTorch on the whole batch.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from plain_torch import mse, one_device_training

import crossreplica as cr
from crossreplica.testing import run_workers

LAYOUTS = [
    pytest.param(("threads", 1, 4), id="threads-1x4"),
    pytest.param(("processes", 2, 1), id="processes-2x1", marks=pytest.mark.multiprocess),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]
STEPS, BATCH, LR = 7, 8, 0.1


def run_main(main, layout) -> list:
    engine, workers, per_worker = layout
    if engine == "threads":
        return [main(cr.MirroredStrategy(per_worker, devices=["cpu"] * per_worker))]
    return run_workers(main, workers, per_worker)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 3, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _reference() -> tuple[list[torch.Tensor], list[float]]:
    """Plain PyTorch on the whole global batch: the weights after the last step and every loss."""
    ref = one_device_training(_model(), functools.partial(torch.optim.SGD, lr=LR), _batches(), mse)
    return ref.params, [loss.item() for loss in ref.losses]


def _train_step(models: cr.Mirrored, batch) -> torch.Tensor:
    """One SGD step on this replica's rows: the loss's share of the global mean, gradients summed."""
    model = models.values[cr.get_replica_context().local_index]
    x, y = batch
    loss = ((model(x) - y) ** 2).sum() / BATCH
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= LR * cr.all_reduce(g, "sum")
    return loss.detach()


PER_DISPATCH = (0, 1, 3, STEPS, 20)


def _train(strategy, steps_per_dispatch: int) -> dict:
    """Trains STEPS steps, ``steps_per_dispatch`` per call (0: strategy.run per step)."""
    models = strategy.mirror(_model())
    step = functools.partial(_train_step, models)
    it = iter(strategy.distribute_dataset(_batches()))
    losses, chunks = [], 0
    while True:
        try:
            out = (strategy.run(step, args=(next(it),)) if steps_per_dispatch == 0
                   else strategy.experimental_run_steps(step, it, steps_per_dispatch))
        except StopIteration:
            break
        chunks += 1
        losses.append(strategy.reduce("sum", out).item())
    return {"weights": [[p.detach().clone() for p in m.parameters()] for m in strategy.experimental_local_results(models)],
            "losses": losses, "chunks": chunks}


def _steps_main(strategy) -> dict:
    return {k: _train(strategy, k) for k in PER_DISPATCH}


def _steps_main_without_random_streams(strategy) -> dict:
    strategy.extended.random_streams = False
    return _steps_main(strategy)


@pytest.mark.parametrize("main", [_steps_main, _steps_main_without_random_streams], ids=["streams", "no-streams"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_steps_per_dispatch_match_plain_torch(layout, main):
    """Chunks of 1, 3, 7 and 20 steps give the same training as one step per run and as plain
    torch; each chunk returns its last step's outputs, and a short last chunk runs what is left."""
    weights, losses = _reference()
    for worker in run_main(main, layout):
        for per_dispatch, res in worker.items():
            k = per_dispatch or 1
            last_of_chunk = [min(i + k, STEPS) - 1 for i in range(0, STEPS, k)]
            assert res["chunks"] == len(last_of_chunk), per_dispatch
            assert res["losses"] == pytest.approx([losses[i] for i in last_of_chunk], rel=1e-5), per_dispatch
            for copy in res["weights"]:
                for got, want in zip(copy, weights):
                    torch.testing.assert_close(got, want)


def _tf_loop_main(strategy) -> dict:
    """TF's loop: fn(ctx, inputs) in cross-replica context, outputs set both ways."""
    models = strategy.mirror(_model())
    it = iter(strategy.distribute_dataset(_batches()))
    contexts = []

    def fn(ctx: cr.MultiStepContext, inputs) -> None:
        def replica_fn(batch):
            loss = _train_step(models, batch)
            ctx.set_last_step_output("replica_loss", loss, reduce_op="sum")  # merge_call + strategy.reduce
            ctx.set_non_tensor_output("ids", cr.replica_id())
            return loss

        out = strategy.run(replica_fn, args=(inputs,))
        ctx.set_last_step_output("loss", out, reduce_op=cr.ReduceOp.SUM)
        ctx.set_last_step_output("per_replica", out)
        ctx.set_non_tensor_output("where", cr.in_cross_replica_context())

    while True:
        try:
            ctx = strategy.extended.experimental_run_steps_on_iterator(
                fn, it, iterations=3, initial_loop_values={"loss": torch.tensor(-1.0), "before": 5})
        except StopIteration:
            break
        contexts.append({
            "loss": ctx.last_step_outputs["loss"].item(),
            "replica_loss": ctx.last_step_outputs["replica_loss"].item(),
            "per_replica": [t.item() for t in strategy.experimental_local_results(ctx.last_step_outputs["per_replica"])],
            "before": ctx.last_step_outputs["before"],
            "ids": list(ctx.non_tensor_outputs["ids"]), "where": ctx.non_tensor_outputs["where"]})
    return {"contexts": contexts, "local": list(strategy.extended.local_replica_ids),
            "weights": [p.detach().clone() for p in strategy.experimental_local_results(models)[0].parameters()]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_run_steps_on_iterator_as_tf(layout):
    weights, losses = _reference()
    last = [2, 5, 6]  # chunks of 3 steps over 7 elements
    for res in run_main(_tf_loop_main, layout):
        assert len(res["contexts"]) == len(last)
        for ctx, i in zip(res["contexts"], last):
            assert ctx["loss"] == pytest.approx(losses[i], rel=1e-5)
            assert ctx["replica_loss"] == pytest.approx(losses[i], rel=1e-5)
            assert len(ctx["per_replica"]) == len(res["local"])
            assert ctx["before"] == 5  # an initial loop value no step overwrote
            assert ctx["ids"] == res["local"] and ctx["where"] is True
        for got, want in zip(res["weights"], weights):
            torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ errors, failures, one device

def test_one_device_and_context_basics():
    s = cr.OneDeviceStrategy()
    it = iter(s.distribute_dataset([torch.ones(2) * i for i in range(5)]))
    assert s.experimental_run_steps(lambda x: x.sum(), it, 2).item() == 2.0
    assert s.experimental_run_steps(lambda x: x.sum(), it, 10).item() == 8.0  # what was left: 2 elements
    with pytest.raises(StopIteration):
        s.experimental_run_steps(lambda x: x.sum(), it, 1)
    ctx = cr.MultiStepContext()
    assert ctx.last_step_outputs == {} and ctx.non_tensor_outputs == {}
    with s.scope():
        ctx.set_last_step_output("a", torch.tensor(3.0))
        ctx.set_non_tensor_output("b", "x")
    assert ctx.last_step_outputs["a"].item() == 3.0 and ctx.non_tensor_outputs == {"b": "x"}
    assert "a" in repr(ctx)


def test_bad_arguments():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    dist = s.distribute_dataset([torch.ones(2)])
    ext = s.extended
    with pytest.raises(ValueError, match=r"iterator must be an iterator .*\(pass iter\(dataset\)\)"):
        s.experimental_run_steps(lambda x: x, dist, 2)
    with pytest.raises(ValueError, match="steps must be a positive int; got 0"):
        s.experimental_run_steps(lambda x: x, iter(dist), 0)
    with pytest.raises(ValueError, match="fn must be callable"):
        s.experimental_run_steps(3, iter(dist), 1)
    with pytest.raises(ValueError, match="iterations must be a positive int"):
        ext.experimental_run_steps_on_iterator(lambda c, x: x, iter(dist), -1)
    with pytest.raises(ValueError, match="initial_loop_values must be a dict"):
        ext.experimental_run_steps_on_iterator(lambda c, x: x, iter(dist), 1, initial_loop_values=[1])
    with pytest.raises(cr.ReplicaContextError, match="cross-replica context"):
        s.run(lambda: s.experimental_run_steps(lambda x: x, iter(dist), 1))
    ctx = cr.MultiStepContext()
    with pytest.raises(ValueError, match="name must be a string"):
        ctx.set_last_step_output(3, torch.ones(1))
    with pytest.raises(ValueError, match="reduce_op"):
        ctx.set_last_step_output("x", torch.ones(1), reduce_op="median")
    with pytest.raises(ValueError, match=r"set_last_step_output\('x'\) in a replica function needs a reduce_op"):
        s.run(lambda: ctx.set_last_step_output("x", torch.ones(1)))


def test_a_failing_replica_ends_the_chunk_and_releases_the_others():
    """Replica 1 fails at the third step; replica 0, waiting in the all-reduce, is released."""
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    it = iter(s.distribute_dataset([torch.ones(2, 1) * i for i in range(5)]))

    def fn(x):
        if cr.replica_id() == 1 and x.item() == 2.0:
            raise KeyError("bad row")
        return cr.all_reduce(x, "sum")

    t0 = time.monotonic()
    with pytest.raises(KeyError, match="bad row"):
        s.experimental_run_steps(fn, it, 4)
    assert time.monotonic() - t0 < 30
    out = s.experimental_run_steps(fn, it, 4)  # the strategy runs on: element 4 was left
    assert [t.item() for t in s.experimental_local_results(out)] == [8.0, 8.0]



def _dropout_train_step(models: cr.Mirrored, batch) -> torch.Tensor:
    """One SGD step whose loss applies dropout (masks from the replica's random stream)."""
    model = models.values[cr.get_replica_context().local_index]
    x, y = batch
    loss = ((torch.nn.functional.dropout(model(x), p=0.5, training=True) - y) ** 2).sum() / BATCH
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= LR * cr.all_reduce(g, "sum")
    return loss.detach()


def _dropout_main(strategy) -> dict:
    """Dropout training one run per step and in chunks of 3: the weights and the caller's
    next draw after all steps."""
    results = {}
    for per_dispatch in (0, 3):
        torch.manual_seed(11)
        models = strategy.mirror(_model())
        step = functools.partial(_dropout_train_step, models)
        it = iter(strategy.distribute_dataset(_batches()))
        while True:
            try:
                if per_dispatch == 0:
                    strategy.run(step, args=(next(it),))
                else:
                    strategy.experimental_run_steps(step, it, per_dispatch)
            except StopIteration:
                break
        results[per_dispatch] = {
            "weights": [[p.detach().clone() for p in m.parameters()]
                        for m in strategy.experimental_local_results(models)],
            "next_draw": torch.rand(4)}
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_steps_per_dispatch_draw_as_one_run_per_step(layout):
    """With dropout, chunks of steps train bitwise as one strategy.run per step and leave the
    caller's generator where those runs leave it."""
    for worker in run_main(_dropout_main, layout):
        per_run, chunked = worker[0], worker[3]
        assert torch.equal(per_run["next_draw"], chunked["next_draw"])
        for a, b in zip(per_run["weights"], chunked["weights"]):
            for p, q in zip(a, b):
                assert torch.equal(p, q)
