"""strategy.mirror: one identical copy per replica, replica 0's value wins."""

import pytest
import torch
from torch import nn

import crossreplica as cr


def strategy(n):
    return cr.MirroredStrategy(n, devices=["cpu"] * n) if n > 1 else cr.OneDeviceStrategy()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_module_copies(n):
    s = strategy(n)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    m = s.mirror(net)
    assert isinstance(m, cr.Mirrored) and len(m.values) == n
    assert m.values[0] is net  # replica 0 keeps the original
    assert len({id(v) for v in m.values}) == n
    for copy_ in m.values[1:]:
        for (k, a), (_, b) in zip(net.state_dict().items(), copy_.state_dict().items()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), k


def test_each_replica_sees_its_own_copy():
    s = strategy(4)
    m = s.mirror(nn.Linear(2, 2))

    def body(model):
        with torch.no_grad():
            model.bias.add_(cr.replica_id())
        return model

    seen = s.run(body, args=(m,))
    assert s.experimental_local_results(seen) == m.values
    base = m.values[0].bias - 0
    for i, copy_ in enumerate(m.values):
        torch.testing.assert_close(copy_.bias, base + i)


def test_tensor_and_nest():
    s = strategy(3)
    t = torch.arange(3.0, requires_grad=True)
    m = s.mirror(t)
    assert m.values[0] is t
    assert all(torch.equal(v, t) and v.requires_grad and v.is_leaf for v in m.values)
    nest = {"w": torch.ones(2), "cfg": ("name", 3), "layer": nn.Linear(1, 1)}
    mn = s.mirror(nest)
    assert isinstance(mn, cr.Mirrored)
    for v in mn.values:
        assert v["cfg"] == ("name", 3) and torch.equal(v["w"], torch.ones(2))
    assert mn.values[1]["w"] is not nest["w"] and mn.values[1]["layer"] is not nest["layer"]
    got = s.run(lambda x: (x["w"].sum() + x["layer"].weight.sum() * 0).detach(), args=(mn,))
    assert all(float(v) == 2.0 for v in s.experimental_local_results(got))


def test_model_and_optimizer_stay_linked():
    s = strategy(2)
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pair = s.mirror((net, opt))
    for model, optimizer in pair.values:
        assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_mirror_then_train_keeps_replicas_identical():
    s = strategy(2)
    models = s.mirror(nn.Linear(3, 1))
    opts = s.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)), args=(models,))

    def step(m, o, x):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()

    s.run(step, args=(models, opts, cr.PerReplica([torch.randn(4, 3), torch.randn(4, 3)])))
    a, b = models.values
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_broadcast_initial_state_hook(monkeypatch):
    s = strategy(2)
    seen = []

    def hook(mirrored):
        seen.append(mirrored)
        return mirrored

    monkeypatch.setattr(s.extended, "broadcast_initial_state", hook)
    out = s.mirror(torch.zeros(1))
    assert seen == [out]


def test_mirror_errors():
    s = strategy(2)
    with pytest.raises(ValueError, match="obj is already distributed"):
        s.mirror(cr.PerReplica([torch.zeros(1), torch.zeros(1)]))
    with pytest.raises(ValueError, match="obj is already distributed"):
        s.mirror([cr.Mirrored([torch.zeros(1), torch.zeros(1)])])
    with pytest.raises(cr.ReplicaContextError, match="strategy.mirror must be called in cross-replica context"):
        s.run(lambda: s.mirror(torch.zeros(1)))
