"""SyncBatchNorm equals one-device BatchNorm on the concatenated group batch."""

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

from harness import run_layout
from plain_torch import mse, one_device_training

import crossreplica as cr
from crossreplica.engines.base import Kind


def strategy(n):
    return cr.MirroredStrategy(n, devices=["cpu"] * n)


def reference_bn(shape, **kw):
    return (nn.BatchNorm1d if len(shape) <= 3 else nn.BatchNorm2d)(shape[1], **kw)


def run_group(n, xs, upstream, bn_kwargs, steps=2, groups=None):
    """Forward/backward on every replica; returns outputs, input grads, param grads, the layers."""
    s = strategy(n)
    torch.manual_seed(0)
    layer = cr.nn.SyncBatchNorm(xs[0].shape[1], group_assignment=groups, **bn_kwargs)
    if layer.affine:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
    ref = reference_bn(xs[0].shape, **bn_kwargs)
    ref.load_state_dict(layer.state_dict())
    layers = s.mirror(layer)

    def body(m, x, g):
        x = x.clone().requires_grad_(True)
        for _ in range(steps):
            m.zero_grad()
            x.grad = None
            out = m(x)
            (out * g).sum().backward()
        grads = (m.weight.grad, m.bias.grad) if m.affine else (None, None)
        return out.detach(), x.grad, grads

    outs, xgrads, pgrads = s.run(body, args=(layers, cr.PerReplica(xs), cr.PerReplica(upstream)))
    return s, outs, xgrads, pgrads, layers, ref


CASES = [
    ((4, 3), [4, 4, 4, 4]),
    ((4, 3), [5, 0, 2, 3]),         # uneven, one replica without rows
    ((2, 3, 5), [2, 3, 2, 1]),      # (N, C, L)
    ((2, 3, 4, 4), [2, 1, 3, 2]),   # (N, C, H, W)
]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("shape,rows", CASES)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_matches_batch_norm_forward_backward(n, shape, rows, momentum):
    rows = rows[:n] if n < 4 else rows
    if sum(rows) < 2:
        rows = [2] * n
    torch.manual_seed(1)
    xs = [torch.randn(r, *shape[1:]) * 2 + 1 for r in rows]
    ups = [torch.randn(r, *shape[1:]) for r in rows]
    s, outs, xgrads, pgrads, layers, ref = run_group(n, xs, ups, {"momentum": momentum})
    x = torch.cat(xs).requires_grad_(True)
    for _ in range(2):
        ref.zero_grad()
        x.grad = None
        out = ref(x)
        (out * torch.cat(ups)).sum().backward()
    local = s.experimental_local_results
    torch.testing.assert_close(torch.cat(local(outs)), out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(local(xgrads)), x.grad, rtol=1e-5, atol=1e-5)
    # each replica's parameter gradient is its share; their sum is the one-device gradient
    wgrads = [g[0] for g in local(pgrads)] if n > 1 else [pgrads[0]]
    torch.testing.assert_close(sum(wgrads), ref.weight.grad, rtol=1e-5, atol=1e-5)
    for m in local(layers):
        torch.testing.assert_close(m.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
        assert m.num_batches_tracked.item() == 2


def test_groups_normalise_separately():
    torch.manual_seed(2)
    xs = [torch.randn(3, 2) * (i + 1) for i in range(4)]
    for spec in ({"group_assignment": [[0, 1], [2, 3]]}, {"num_shards_per_group": 2}):
        s = strategy(4)
        layers = s.mirror(cr.nn.SyncBatchNorm(2, **spec))
        outs = s.run(lambda m, x: m(x), args=(layers, cr.PerReplica(xs)))
        local = s.experimental_local_results(outs)
        for members in ([0, 1], [2, 3]):
            ref = nn.BatchNorm1d(2)(torch.cat([xs[i] for i in members]))
            torch.testing.assert_close(torch.cat([local[i] for i in members]), ref.detach(), rtol=1e-5, atol=1e-5)


def test_eval_mode_and_outside_replica_context_are_batch_norm():
    torch.manual_seed(3)
    x = torch.randn(6, 4, 3)
    layer, ref = cr.nn.SyncBatchNorm(4), nn.BatchNorm1d(4)
    assert torch.equal(layer(x), ref(x))  # outside any replica context: plain BatchNorm
    assert torch.equal(layer.running_var, ref.running_var)
    layer.eval()
    ref.eval()
    s = strategy(2)
    layers = s.mirror(layer)
    outs = s.run(lambda m, xb: m(xb), args=(layers, cr.PerReplica([x[:3], x[3:]])))
    assert torch.equal(torch.cat(s.experimental_local_results(outs)), ref(x))


def test_no_running_stats_and_no_affine():
    torch.manual_seed(4)
    xs = [torch.randn(3, 2), torch.randn(5, 2)]
    s = strategy(2)
    layers = s.mirror(cr.nn.SyncBatchNorm(2, affine=False, track_running_stats=False))
    outs = s.run(lambda m, x: m(x), args=(layers, cr.PerReplica(xs)))
    ref = nn.BatchNorm1d(2, affine=False, track_running_stats=False)(torch.cat(xs))
    torch.testing.assert_close(torch.cat(s.experimental_local_results(outs)), ref, rtol=1e-5, atol=1e-5)


def test_one_all_reduce_per_forward(monkeypatch):
    s = strategy(2)
    layers = s.mirror(cr.nn.SyncBatchNorm(3))
    kinds = []
    real = s.extended.engine.execute

    def counting(rid, call, tensors, *a, **k):
        if rid == 0:
            kinds.append(call.kind)
        return real(rid, call, tensors, *a, **k)

    monkeypatch.setattr(s.extended.engine, "execute", counting)
    s.run(lambda m, x: m(x), args=(layers, cr.PerReplica([torch.randn(2, 3), torch.randn(2, 3)])))
    assert kinds == [Kind.ALL_REDUCE]


def test_convert_sync_batchnorm():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm1d(4)))
    net[1].running_mean.fill_(0.5)
    out = cr.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net))
    assert isinstance(out[1], cr.nn.SyncBatchNorm) and isinstance(out[2][0], cr.nn.SyncBatchNorm)
    assert torch.equal(out[1].running_mean, net[1].running_mean)
    assert torch.equal(out[0].weight, net[0].weight)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_features must be a positive int"):
        cr.nn.SyncBatchNorm(0)
    with pytest.raises(ValueError, match="pass either group_assignment or num_shards_per_group"):
        cr.nn.SyncBatchNorm(2, group_assignment=[[0, 1]], num_shards_per_group=2)
    with pytest.raises(ValueError, match="num_shards_per_group must be a positive int"):
        cr.nn.SyncBatchNorm(2, num_shards_per_group=0)
    with pytest.raises(ValueError, match="expects an input of shape"):
        cr.nn.SyncBatchNorm(2)(torch.randn(2))
    with pytest.raises(ValueError, match="got an input with 3 channels"):
        cr.nn.SyncBatchNorm(2)(torch.randn(4, 3))


def test_group_size_must_divide_replicas():
    s = strategy(4)
    layers = s.mirror(cr.nn.SyncBatchNorm(2, num_shards_per_group=3))
    with pytest.raises(ValueError, match="num_replicas: 4 mod num_shards_per_group: 3 should be 0"):
        s.run(lambda m: m(torch.randn(2, 2)), args=(layers,))


def test_single_value_per_channel_in_group():
    s = strategy(2)
    layers = s.mirror(cr.nn.SyncBatchNorm(2))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        s.run(lambda m, x: m(x), args=(layers, cr.PerReplica([torch.randn(1, 2), torch.randn(0, 2)])))


# ------------------------------------------------------------------ torch's SyncBatchNorm handed to mirror

LAYOUTS = [
    pytest.param(("threads", 1, 2), id="threads-1x2"),
    pytest.param(("processes", 2, 1), id="processes-2x1", marks=pytest.mark.multiprocess),
    pytest.param(("processes", 2, 2), id="processes-2x2", marks=pytest.mark.multiprocess),
]


def _bn_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def _bn_batches() -> list:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(8, 3, generator=g) * 2 + 1, torch.randn(8, 1, generator=g)) for _ in range(3)]


def _porting_warnings(seen) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, cr.logs.PortingWarning)]


def _torch_sync_bn_main(strategy) -> dict:
    """A DDP script's model (torch's SyncBatchNorm) mirrored and trained on global batches."""
    net = nn.SyncBatchNorm.convert_sync_batchnorm(_bn_net())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = strategy.mirror(net)
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)), args=(model,))

    def step(m, opt, batch):
        x, y = batch
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()

    for batch in strategy.distribute_dataset(_bn_batches()):
        strategy.run(step, args=(model, opts, batch))
    first = strategy.experimental_local_results(model)[0]
    return {"warnings": _porting_warnings(seen), "layer": type(first[1]).__name__,
            "state": {k: v.detach().clone() for k, v in first.state_dict().items()}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_sync_batch_norm_trains_as_whole_batch_norm(layout):
    # plain torch, one device: BatchNorm over each whole global batch
    reference = one_device_training(_bn_net(), functools.partial(torch.optim.SGD, lr=0.1), _bn_batches(), mse).model
    for res in run_layout(_torch_sync_bn_main, layout):
        assert res["layer"] == "SyncBatchNorm" and len(res["warnings"]) == 1
        assert res["warnings"][0].startswith("strategy.mirror replaced 1 torch.nn.SyncBatchNorm layer(s) (['1']) "
                                             "with cr.nn.SyncBatchNorm")
        assert res["state"].keys() == reference.state_dict().keys()
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(res["state"][k], v, msg=k)


def test_mirror_takes_over_torch_sync_batch_norm_tensors_and_settings():
    torch.manual_seed(0)
    shared = nn.SyncBatchNorm(4, eps=1e-3, momentum=None, affine=False)
    net = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4), nn.Sequential(shared, shared),
                        nn.SyncBatchNorm(4, track_running_stats=False), nn.BatchNorm1d(4))
    net[1].running_mean.uniform_()
    net[3].eval()
    before = dict(list(net.named_parameters()) + list(net.named_buffers()))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)  # built before mirror: still over the same tensors
    s = strategy(2)
    with pytest.warns(cr.logs.PortingWarning) as seen:
        model = s.mirror(net)
    assert len(_porting_warnings(seen)) == 1
    assert str(seen[0].message) == (
        "strategy.mirror replaced 3 torch.nn.SyncBatchNorm layer(s) (['1', '2.0', '3']) with cr.nn.SyncBatchNorm: "
        "torch's layer syncs over torch.distributed's ranks, which are processes, so on crossreplica's replicas it "
        "normalises each replica's rows alone (or fails on CPU), while cr.nn.SyncBatchNorm normalises over the global "
        "batch of every replica in sync. The new layers hold the same parameter and buffer tensors (the same state "
        "dict). To silence this, convert before mirroring: model = cr.nn.convert_sync_batchnorm(model) (it makes "
        "every BatchNorm layer cr's)")
    assert seen[0].filename == __file__
    copy0 = model.values[0]
    assert copy0 is net
    assert [type(m).__name__ for m in copy0] == ["Linear", "SyncBatchNorm", "Sequential", "SyncBatchNorm",
                                                 "BatchNorm1d"]
    assert all(isinstance(m, cr.nn.SyncBatchNorm) for m in (copy0[1], copy0[2][0], copy0[3]))
    assert copy0[2][0] is copy0[2][1]  # a shared layer stays one layer
    for old, new in ((shared, copy0[2][0]), (nn.SyncBatchNorm(4), copy0[1])):
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(new, attr) == getattr(old, attr), attr
    assert copy0[3].training is False and copy0[3].running_mean is None
    after = dict(list(copy0.named_parameters()) + list(copy0.named_buffers()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert all(torch.equal(copy0.state_dict()[k], v) for k, v in state.items())
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in copy0.parameters()}
    assert isinstance(model.values[1][1], cr.nn.SyncBatchNorm)


def test_mirror_of_torch_sync_batch_norm_itself_and_of_a_converted_model():
    s = strategy(2)
    layer = nn.SyncBatchNorm(3)
    with pytest.warns(cr.logs.PortingWarning, match=r"replaced 1 torch.nn.SyncBatchNorm layer\(s\) "
                                                    r"\(\['the module itself'\]\)"):
        model = s.mirror({"bn": layer})
    assert isinstance(model.values[0]["bn"], cr.nn.SyncBatchNorm) and model.values[0]["bn"].weight is layer.weight
    converted = cr.nn.convert_sync_batchnorm(nn.SyncBatchNorm.convert_sync_batchnorm(_bn_net()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", cr.logs.PortingWarning)
        s.mirror(converted)  # converted first: nothing to replace, no warning


def test_mirror_refuses_torch_sync_batch_norm_over_a_process_group():
    net = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4, process_group="ranks 0 and 1"))
    with pytest.raises(ValueError, match=r"layer '1' is a torch.nn.SyncBatchNorm with process_group='ranks 0 and "
                                         r"1'; torch.distributed's ranks are processes, not crossreplica's replicas, "
                                         r".* cr.nn.convert_sync_batchnorm\(model, group_assignment=...\), which "
                                         r"takes replica ids"):
        strategy(2).mirror(net)
    assert isinstance(net[1], nn.SyncBatchNorm)  # nothing replaced
