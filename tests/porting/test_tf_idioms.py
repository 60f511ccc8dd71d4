"""TF idioms that work as written: a model and optimizer captured by the replica function's
closure act as the replica's own copy, ``experimental_distribute_dataset``, the default
replica context outside any strategy, ``cr.nn.compute_average_loss`` /
``scale_regularization_loss`` and ``torch.compile`` of a mirrored model.

Training checks run in one process (MirroredStrategy threads) and across worker processes
(crossreplica.testing.run_workers), against plain torch on the whole batch.
"""

from __future__ import annotations

import copy
import functools
import pickle
import warnings

import pytest
import torch

from harness import run_layout as run_main
from plain_torch import one_device_training

import crossreplica as cr

# (engine, workers, replicas per worker)
LAYOUTS = [
    pytest.param(("threads", 1, 2), id="threads-1x2"),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]

STEPS, ROWS, LR = 3, 8, 0.1


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(ROWS, 3, generator=g), torch.randn(ROWS, 1, generator=g)) for _ in range(STEPS)]


def _fresh_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(3, 1)


def _plain_torch(weight_decay: float = 0.0) -> list[torch.Tensor]:
    """One device, the whole batch, the mean loss (plus an L2 term counted once)."""
    def loss(model, x, y):
        return ((model(x) - y) ** 2).mean() + weight_decay * model.weight.pow(2).sum()

    return one_device_training(_fresh_model(), functools.partial(torch.optim.SGD, lr=LR), _batches(), loss).params


def _params(strategy, model) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in m.parameters()] for m in strategy.experimental_local_results(model)]


# ------------------------------------------------------------------ 1. closure-captured model and optimizer


def _train(strategy, form: str) -> list[list[torch.Tensor]]:
    with strategy.scope():  # as TF's tutorial: build the model and optimizer under the scope
        model = strategy.mirror(_fresh_model())
        if form == "closure":
            opt = strategy.run(lambda: cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=LR)))
        else:
            opt = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=LR)),
                               args=(model,))

    def closure_step(x, y):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    def explicit_step(m, o, x, y):
        o.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        o.step()
        return loss.detach()

    for x, y in strategy.distribute_dataset(_batches()):
        if form == "closure":
            strategy.run(closure_step, args=(x, y))
        else:
            strategy.run(explicit_step, args=(model, opt, x, y))
    return _params(strategy, model)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_closure_captured_model_and_optimizer_train_like_plain_torch(layout):
    closure = [p for worker in run_main(_train, layout, "closure") for p in worker]
    explicit = [p for worker in run_main(_train, layout, "explicit") for p in worker]
    expected = _plain_torch()
    assert len(closure) == len(explicit) == layout[1] * layout[2]
    for got, same in zip(closure, explicit):
        for g, s, e in zip(got, same, expected):
            assert torch.equal(g, s)  # the same computation, bit for bit
            torch.testing.assert_close(g, e)
    assert any(not torch.equal(e, p) for e, p in zip(expected, _fresh_model().parameters()))  # it trained


def _train_closure_by(strategy, how: str) -> list[torch.Tensor]:
    model = strategy.mirror(_fresh_model())
    opt = strategy.run(lambda: cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=LR)))

    def step(batch):
        x, y = batch
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    batches = iter(strategy.experimental_distribute_dataset(_batches()))
    if how == "steps":
        strategy.experimental_run_steps(step, batches, STEPS)
    else:
        for batch in batches:
            strategy.run(step, args=(batch,))
    return [p.detach().clone() for m in strategy.experimental_local_results(model) for p in m.parameters()]


def test_closure_form_in_multi_step_loops_and_the_layout_invariant_mode():
    by_run = _train_closure_by(cr.MirroredStrategy(2), "run")
    assert all(torch.equal(a, b) for a, b in zip(_train_closure_by(cr.MirroredStrategy(2), "steps"), by_run))
    expected = _plain_torch()
    for got in (by_run[:2], by_run[2:]):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    # the layout-invariant mode: the same bits on 2 and 4 replicas
    two, four = (_train_closure_by(cr.MirroredStrategy(n, layout_invariant=cr.LayoutInvariant(micro_batches=4)), "run")
                 for n in (2, 4))
    assert all(torch.equal(a, b) for a, b in zip(two[:2], four[:2])) and len(four) == 8


def test_distributed_value_outside_a_replica_is_an_error_naming_the_fix():
    s = cr.MirroredStrategy(2)
    model = s.mirror(torch.nn.Linear(3, 1))
    opt = s.run(lambda: cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=LR)))
    fix = r"strategy\.run.*experimental_local_results"
    with pytest.raises(cr.ReplicaContextError, match=r"this Mirrored of Linear .*cross-replica context.*" + fix):
        model(torch.ones(1, 3))
    with pytest.raises(cr.ReplicaContextError, match=r"this PerReplica of CrossShardOptimizer .*" + fix):
        opt.step()
    with s.scope(), pytest.raises(cr.ReplicaContextError, match="Mirrored of Linear"):
        model.parameters()
    merged = s.run(lambda: cr.get_replica_context().merge_call(lambda st: _raises(lambda: model.weight)))
    assert merged is True  # merge_fn runs in cross-replica context: no single copy there either
    assert getattr(model, "weight", "absent") == "absent" and not hasattr(model, "bias")  # AttributeError too
    with pytest.raises(AttributeError, match="_private"):
        s.run(lambda: model._private)  # private names are never forwarded
    # copying and pickling a distributed value look up no replica
    assert isinstance(copy.deepcopy(model), cr.Mirrored)
    assert torch.equal(pickle.loads(pickle.dumps(cr.Mirrored([torch.ones(2)]))).values[0], torch.ones(2))


SHARED = torch.nn.Linear(2, 1)


def _uses_shared_global(x):
    return SHARED(x)


def test_a_plain_module_captured_by_the_replica_function_warns_naming_mirror():
    s = cr.MirroredStrategy(2)
    plain, mirrored, frozen = torch.nn.Linear(2, 1), s.mirror(torch.nn.Linear(2, 1)), torch.nn.Linear(2, 1)
    frozen.requires_grad_(False)
    x = torch.ones(1, 2)
    with pytest.warns(cr.logs.SharedModuleWarning, match=r"the replica function <lambda> uses 'plain', a Linear "
                      r"with trainable parameters that all 2 replicas share.*plain = strategy\.mirror\(plain\)"):
        s.run(lambda: plain(x))
    with pytest.warns(cr.logs.SharedModuleWarning, match="_uses_shared_global uses 'SHARED'"):
        s.run(_uses_shared_global, args=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.run(lambda: (mirrored(x), frozen(x)))  # a mirrored model, a frozen one: no warning
        cr.OneDeviceStrategy().run(lambda: plain(x))  # one replica shares with nobody


def _raises(fn) -> bool:
    try:
        fn()
    except cr.ReplicaContextError:
        return True
    return False


def test_each_replica_gets_its_own_copy_and_a_foreign_value_is_refused():
    s = cr.MirroredStrategy(3)
    model = s.mirror(torch.nn.Linear(2, 2))
    xs = s.experimental_distribute_values_from_function(lambda ctx: torch.zeros(ctx.replica_id_in_sync_group + 1))
    out = s.experimental_local_results(s.run(lambda: (model.local_value(), xs.shape[0], xs.local_value())))
    assert [o[0] for o in out] == list(model.values) and [o[1] for o in out] == [1, 2, 3]
    assert all(o[2] is x for o, x in zip(out, xs.values))
    # strategy.run(model, ...) as in TF: each replica calls its copy
    outs = s.experimental_local_results(s.run(model, args=(cr.PerReplica([torch.ones(2)] * 3),)))
    assert all(torch.equal(o, m(torch.ones(2))) for o, m in zip(outs, model.values))
    # setting a public attribute sets this replica's copy's; outside a replica it is an error
    s.run(lambda: setattr(model, "training", cr.replica_id() != 1))
    assert [m.training for m in model.values] == [True, False, True]
    with pytest.raises(cr.ReplicaContextError, match="Mirrored of Linear"):
        model.training = False
    other = cr.MirroredStrategy(2)
    with pytest.raises(ValueError, match="holds 3 values, but the running strategy has 2 local replicas"):
        other.run(lambda: model(torch.ones(2)))


def test_update_context_picks_the_devices_copy():
    s = cr.MirroredStrategy(2)
    m = s.mirror(torch.zeros(1))
    out = s.extended.update_non_slot(s.extended.non_slot_devices(None), lambda: m.local_value(), group=False)
    assert out[0] is m.values[0] and out[1] is m.values[1]


# ------------------------------------------------------------------ 2. experimental_distribute_dataset


def _both_datasets(strategy) -> tuple[list, list]:
    data = [torch.arange(16.0).reshape(8, 2) + 100 * i for i in range(2)]
    a = [strategy.experimental_local_results(b) for b in strategy.experimental_distribute_dataset(data)]
    b = [strategy.experimental_local_results(b) for b in strategy.distribute_dataset(data)]
    return a, b


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experimental_distribute_dataset_is_distribute_dataset(layout):
    for rank, (a, b) in enumerate(run_main(_both_datasets, layout)):
        assert len(a) == len(b) == 2
        n = layout[1] * layout[2]
        for i, (parts_a, parts_b) in enumerate(zip(a, b)):
            whole = torch.arange(16.0).reshape(8, 2) + 100 * i
            for j, (pa, pb) in enumerate(zip(parts_a, parts_b)):
                replica = rank * layout[2] + j
                assert torch.equal(pa, pb)
                assert torch.equal(pa, whole[replica * 8 // n:(replica + 1) * 8 // n])


def test_experimental_distribute_dataset_refuses_options():
    with pytest.raises(ValueError, match="options has no crossreplica counterpart.*pass None"):
        cr.MirroredStrategy(2).experimental_distribute_dataset([torch.ones(2, 1)], options="anything")


# ------------------------------------------------------------------ 3. the default replica context


def test_default_replica_context_outside_any_strategy():
    ctx = cr.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert ctx.strategy is cr.get_strategy() and ctx.devices == (torch.device("cpu"),)
    x = torch.tensor([1.5, -2.0])
    for op in ("sum", "mean", cr.ReduceOp.MAX):
        assert torch.equal(ctx.all_reduce(op, x), x)
    assert torch.equal(ctx.all_reduce("sum", {"a": x})["a"], x)
    assert torch.equal(ctx.all_gather(x, 0), x)
    with pytest.raises(ValueError, match="reduce_op"):
        ctx.all_reduce("median", x)

    def merge_fn(strategy, v, k=0):
        assert cr.in_cross_replica_context() and cr.get_replica_context() is None
        return strategy, v + k

    strategy, v = ctx.merge_call(merge_fn, args=(x,), kwargs={"k": 1})
    assert strategy is cr.get_strategy() and torch.equal(v, x + 1)
    assert cr.get_replica_context() is ctx and not cr.has_strategy()  # the frame is popped again


def test_replica_context_is_none_in_cross_replica_context_and_the_replicas_own_in_run():
    s = cr.MirroredStrategy(2)
    with s.scope():
        assert cr.get_replica_context() is None
    ids = s.experimental_local_results(s.run(lambda: cr.get_replica_context().replica_id_in_sync_group))
    assert ids == (0, 1)
    # the library still tells "outside any strategy" from "inside a replica function"
    assert s.experimental_local_results(s.run(cr.replica_id)) == (0, 1)
    with pytest.raises(cr.ReplicaContextError, match="outside any strategy"):
        cr.all_reduce(torch.ones(1))
    bn, sync = torch.nn.BatchNorm1d(2), cr.nn.SyncBatchNorm(2)
    x = torch.randn(4, 2)
    torch.testing.assert_close(sync(x), bn(x))


# ------------------------------------------------------------------ 4. compute_average_loss, scale_regularization_loss


def test_compute_average_loss_sums_to_the_global_mean():
    s = cr.MirroredStrategy(2)
    loss = torch.rand(8)
    weight = torch.rand(8)
    parts = s.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group)

    def fn(r):
        mine, w = loss[4 * r:4 * r + 4], weight[4 * r:4 * r + 4]
        return (cr.nn.compute_average_loss(mine), cr.nn.compute_average_loss(mine, sample_weight=w),
                cr.nn.compute_average_loss(mine, sample_weight=w[:, None]),
                cr.nn.compute_average_loss(mine, global_batch_size=10),
                cr.nn.compute_average_loss(mine, global_batch_size=torch.tensor(10)))

    out = s.experimental_local_results(s.run(fn, args=(parts,)))
    total = [sum(o[k] for o in out) for k in range(5)]
    torch.testing.assert_close(total[0], loss.mean())
    torch.testing.assert_close(total[1], (loss * weight).sum() / 8)
    torch.testing.assert_close(total[2], (loss * weight).sum() / 8)
    torch.testing.assert_close(total[3], loss.sum() / 10)
    torch.testing.assert_close(total[4], loss.sum() / 10)
    # outside any strategy: one replica, the plain mean; a 2-d loss sums every entry
    two_d = torch.rand(4, 3)
    torch.testing.assert_close(cr.nn.compute_average_loss(two_d), two_d.sum() / 4)
    assert cr.nn.compute_average_loss(loss.double()).dtype == torch.float64


def test_compute_average_loss_rejects_bad_input():
    x = torch.rand(4)
    with pytest.raises(ValueError, match="per_example_loss must have rank >= 1.*reduction='none'"):
        cr.nn.compute_average_loss(x.mean())
    with pytest.raises(TypeError, match="per_example_loss must be a floating-point tensor"):
        cr.nn.compute_average_loss(torch.arange(4))
    for bad in (2.5, 0, -3, True, torch.tensor(4.0), torch.tensor([4])):
        with pytest.raises(ValueError, match="global_batch_size must be"):
            cr.nn.compute_average_loss(x, global_batch_size=bad)
    with pytest.raises(ValueError, match=r"sample_weight of shape \[3\] does not broadcast to per_example_loss "
                                         r"of shape \[4\]"):
        cr.nn.compute_average_loss(x, sample_weight=torch.ones(3))
    with pytest.raises(ValueError, match="empty per_example_loss.*global_batch_size="):
        cr.nn.compute_average_loss(torch.zeros(0))
    with cr.MirroredStrategy(2).scope():
        with pytest.raises(cr.ReplicaContextError, match="compute_average_loss was called in cross-replica"):
            cr.nn.compute_average_loss(x)
        torch.testing.assert_close(cr.nn.compute_average_loss(x, global_batch_size=8), x.sum() / 8)


def test_scale_regularization_loss():
    s = cr.MirroredStrategy(4)
    reg = torch.tensor([1.0, 2.0, 5.0])
    out = s.experimental_local_results(s.run(
        lambda: (cr.nn.scale_regularization_loss(reg), cr.nn.scale_regularization_loss([reg[0], reg[1:]]))))
    for a, b in out:
        torch.testing.assert_close(a, reg.sum() / 4)
        torch.testing.assert_close(b, reg.sum() / 4)
    torch.testing.assert_close(cr.nn.scale_regularization_loss(reg), reg.sum())  # default strategy
    assert float(cr.nn.scale_regularization_loss(3)) == 3.0
    with pytest.raises(TypeError, match=r"regularization_loss\[1\] must be a floating-point tensor"):
        cr.nn.scale_regularization_loss([reg, "x"])
    with pytest.raises(ValueError, match="empty list"):
        cr.nn.scale_regularization_loss([])
    with s.scope(), pytest.raises(cr.ReplicaContextError, match="scale_regularization_loss was called in cross"):
        cr.nn.scale_regularization_loss(reg)


WEIGHT_DECAY = 0.01


def _train_tf_tutorial(strategy) -> list[list[torch.Tensor]]:
    """TF's custom-training loop: per-example loss, compute_average_loss, scaled L2, summed gradients."""
    with strategy.scope():
        model = strategy.mirror(_fresh_model())
        opt = strategy.run(lambda: cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=LR), "sum"))

    def step(x, y):
        opt.zero_grad()
        per_example = ((model(x) - y) ** 2).squeeze(1)
        loss = cr.nn.compute_average_loss(per_example, global_batch_size=ROWS)
        loss = loss + cr.nn.scale_regularization_loss(WEIGHT_DECAY * model.weight.pow(2).sum())
        loss.backward()
        opt.step()
        return loss.detach()

    for x, y in strategy.experimental_distribute_dataset(_batches()):
        strategy.run(step, args=(x, y))
    return _params(strategy, model)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tf_tutorial_loop_trains_like_plain_torch(layout):
    expected = _plain_torch(WEIGHT_DECAY)
    for worker in run_main(_train_tf_tutorial, layout):
        for got in worker:
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e)


# ------------------------------------------------------------------ 5. torch.compile of a mirrored model


def _compile_available() -> bool:
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means no torch.compile here
        return False
    return hasattr(torch, "compile")


@pytest.mark.skipif(not _compile_available(), reason="torch.compile (torch._dynamo) is not available")
def test_torch_compile_of_a_mirrored_model_matches_eager():
    torch._dynamo.reset()
    s = cr.MirroredStrategy(2)
    model = s.mirror(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))
    xs = s.experimental_distribute_values_from_function(
        lambda ctx: torch.randn(5, 3, generator=torch.Generator().manual_seed(ctx.replica_id_in_sync_group)))

    def inner(x):  # compiling the model the replica function calls, inside it
        return torch.compile(model, backend="eager")(x)

    compiled_step = torch.compile(lambda x: model(x).sum(), backend="eager", fullgraph=True)  # no graph break
    eager = s.experimental_local_results(s.run(lambda x: model(x), args=(xs,)))
    for fn in (inner, compiled_step):
        got = s.experimental_local_results(s.run(fn, args=(xs,)))
        want = eager if fn is inner else tuple(e.sum() for e in eager)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    # each replica used its own copy: change one copy and the compiled call follows
    with torch.no_grad():
        model.values[1][0].bias.add_(1.0)
    for fn in (inner, compiled_step):
        got = s.experimental_local_results(s.run(fn, args=(xs,)))
        want = [model.values[i](xs.values[i]) for i in range(2)]
        want = want if fn is inner else [w.sum() for w in want]
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        assert not torch.allclose(got[1], eager[1] if fn is inner else eager[1].sum())
