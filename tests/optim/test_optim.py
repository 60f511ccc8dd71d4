"""CrossShardOptimizer: N replicas train exactly like one device on the concatenated batch."""

import copy
import functools

import pytest
import torch
from plain_torch import cross_entropy, one_device_training
from torch import nn
from torch.nn import functional as F

import crossreplica as cr
from crossreplica.engines.base import Kind
from crossreplica.optim import CrossShardOptimizer


def strategy(n):
    return cr.MirroredStrategy(n, devices=["cpu"] * n)


def make_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def split(x, n):
    return cr.PerReplica(list(torch.tensor_split(x, n))) if n > 1 else x


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step(weight=x.shape[0])
    return loss.detach()


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_matches_one_device_training(n, opt_name):
    torch.manual_seed(1)
    # 16-row batches divide evenly; the last (10 rows) is uneven over 4 replicas.
    batches = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(4)]
    batches.append((torch.randn(10, 6), torch.randint(0, 3, (10,))))
    net = make_net()
    ref = one_device_training(net, OPTIMIZERS[opt_name], batches, cross_entropy)
    s = strategy(n)
    model = s.mirror(net)
    opts = s.run(lambda m: CrossShardOptimizer(OPTIMIZERS[opt_name](m.parameters())), args=(model,))
    for x, y in batches:
        s.run(train_step, args=(model, opts, split(x, n), split(y, n)))
    copies = s.experimental_local_results(model)
    for p, q in zip(copies[0].parameters(), ref.params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for m in copies[1:]:
        for p, q in zip(copies[0].parameters(), m.parameters()):
            assert torch.equal(p, q)


def _grads_per_replica(n, x, y, net):
    """Runs forward/backward per replica; returns (strategy, models, opts)."""
    s = strategy(n)
    model = s.mirror(net)

    def fwd(m, xs, ys):
        m.zero_grad()
        F.cross_entropy(m(xs), ys).backward()

    s.run(fwd, args=(model, split(x, n), split(y, n)))
    return s, model


@pytest.mark.parametrize("bytes_per_pack", [1, 64, 1000, 1 << 24])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_equals_unfused_bitwise(bytes_per_pack, weighted):
    n = 4
    torch.manual_seed(2)
    x, y = torch.randn(13, 6), torch.randint(0, 3, (13,))
    s, model = _grads_per_replica(n, x, y, make_net())

    def body(m):
        grads = [p.grad.clone() for p in m.parameters()]
        w = float(cr.replica_id() + 1)
        if weighted:
            total = cr.all_reduce(torch.tensor([w], dtype=torch.float64), "sum").item()
            expected = [cr.all_reduce(g * w, "sum") / total for g in grads]
        else:
            expected = [cr.all_reduce(g, "sum") / cr.num_replicas() for g in grads]
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), bytes_per_pack=bytes_per_pack)
        opt.synchronize(weight=w if weighted else None)
        return all(torch.equal(p.grad, e) for p, e in zip(m.parameters(), expected))

    assert all(s.experimental_local_results(s.run(body, args=(model,))))


def test_all_packs_travel_in_one_engine_call(monkeypatch):
    s = strategy(2)
    model = s.mirror(make_net())
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    engine = s.extended.engine
    calls = []
    real = engine.execute

    def counting(replica_id, call, tensors, *a, **k):
        if replica_id == 0:
            calls.append((call.kind, len(tensors)))
        return real(replica_id, call, tensors, *a, **k)

    monkeypatch.setattr(engine, "execute", counting)
    opts = s.run(lambda m: CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), bytes_per_pack=64),
                 args=(model,))
    s.run(train_step, args=(model, opts, split(x, 2), split(y, 2)))
    reduce_calls = [c for c in calls if c[0] is Kind.ALL_REDUCE]
    assert len(reduce_calls) == 1
    assert reduce_calls[0][1] > 1  # several packs (64-byte packs), plus the weight


def test_synchronize_then_step_reduces_once(monkeypatch):
    n = 2
    torch.manual_seed(3)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    net = make_net()
    ref = copy.deepcopy(net)
    s, model = _grads_per_replica(n, x, y, net)
    engine = s.extended.engine
    count = {"n": 0}
    real = engine.execute

    def counting(replica_id, call, tensors, *a, **k):
        if replica_id == 0 and call.kind is Kind.ALL_REDUCE:
            count["n"] += 1
        return real(replica_id, call, tensors, *a, **k)

    monkeypatch.setattr(engine, "execute", counting)

    def body(m):
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5))
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)  # users clip here
        opt.step()

    s.run(body, args=(model,))
    assert count["n"] == 1
    want = one_device_training(ref, functools.partial(torch.optim.SGD, lr=0.5), [(x, y)], cross_entropy).params
    for p, q in zip(model.values[1].parameters(), want):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_synchronize_twice_raises():
    s, model = _grads_per_replica(2, torch.randn(4, 6), torch.randint(0, 3, (4,)), make_net())

    def body(m):
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5))
        opt.synchronize()
        opt.synchronize()

    with pytest.raises(RuntimeError, match="synchronize was called twice"):
        s.run(body, args=(model,))


@pytest.mark.parametrize("reduction", ["sum", "SUM", cr.ReduceOp.SUM])
def test_sum_reduction(reduction):
    torch.manual_seed(4)
    xs = [torch.randn(3, 6) for _ in range(2)]
    y = torch.randint(0, 3, (3,))
    net = make_net()
    expected = []
    for x in xs:
        m = copy.deepcopy(net)
        F.cross_entropy(m(x), y).backward()
        expected.append([p.grad for p in m.parameters()])
    s = strategy(2)
    model = s.mirror(net)

    def body(m, x):
        F.cross_entropy(m(x), y).backward()
        CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), reduction=reduction).synchronize()
        return [p.grad for p in m.parameters()]

    grads = s.run(body, args=(model, cr.PerReplica(xs)))
    for i, g in enumerate(grads):
        torch.testing.assert_close(g.values[0], expected[0][i] + expected[1][i])
        assert torch.equal(g.values[0], g.values[1])


def test_group_assignment_reduces_within_groups():
    torch.manual_seed(5)
    w = [torch.randn(3) for _ in range(4)]
    s = strategy(4)
    params = s.mirror(torch.zeros(3, requires_grad=True))

    def body(p, g):
        p.grad = g.clone()
        CrossShardOptimizer(torch.optim.SGD([p], lr=1.0), group_assignment=[[0, 1], [2, 3]]).synchronize()
        return p.grad

    out = s.run(body, args=(params, cr.PerReplica(w)))
    torch.testing.assert_close(out.values[0], (w[0] + w[1]) / 2)
    torch.testing.assert_close(out.values[3], (w[2] + w[3]) / 2)
    assert torch.equal(out.values[2], out.values[3])


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.out = nn.Linear(4, 3)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sparse_gradients(n):
    torch.manual_seed(7)
    batches = [(torch.randint(0, 20, (8, 3)), torch.randint(0, 3, (8,))) for _ in range(3)]
    batches.append((torch.randint(0, 20, (3, 3)), torch.randint(0, 3, (3,))))  # a replica gets no rows
    net = EmbedNet()
    ref = one_device_training(net, functools.partial(torch.optim.SGD, lr=0.5), batches, cross_entropy)
    s = strategy(n)
    model = s.mirror(net)
    opts = s.run(lambda m: CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5)), args=(model,))

    def step(m, opt, x, y):
        opt.zero_grad()
        (F.cross_entropy(m(x), y, reduction="sum") / max(x.shape[0], 1)).backward()
        opt.step(weight=x.shape[0])
        return m.emb.weight.grad

    for x, y in batches:
        grads = s.run(step, args=(model, opts, split(x, n), split(y, n)))
    g0 = s.experimental_local_results(grads)[0]
    assert g0.is_sparse and (n == 1 or g0.is_coalesced())  # a group of one: untouched, as plain torch
    torch.testing.assert_close(g0.to_dense(), ref.model.emb.weight.grad.to_dense(), rtol=1e-5, atol=1e-6)
    copies = s.experimental_local_results(model)
    for p, q in zip(copies[0].parameters(), ref.params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for m in copies[1:]:
        assert all(torch.equal(p, q) for p, q in zip(copies[0].parameters(), m.parameters()))


def test_sparse_mean_divides_by_group_size():
    s = strategy(2)
    emb = s.mirror(nn.Embedding(5, 2, sparse=True))

    def body(e, idx):
        e(idx).sum().backward()
        CrossShardOptimizer(torch.optim.SGD(e.parameters(), lr=1.0)).synchronize()
        return e.weight.grad.to_dense()

    out = s.run(body, args=(emb, cr.PerReplica([torch.tensor([0, 1, 1]), torch.tensor([1, 4])])))
    expected = torch.zeros(5, 2)
    expected[0] = 0.5
    expected[1] = 1.5
    expected[4] = 0.5
    torch.testing.assert_close(out.values[0], expected)
    assert torch.equal(out.values[0], out.values[1])


def test_weighted_mean_is_global_mean_with_empty_replica():
    # 3 rows over 4 replicas: replica 3 gets none.
    torch.manual_seed(8)
    x, y = torch.randn(3, 6), torch.randint(0, 3, (3,))
    net = make_net()
    ref = copy.deepcopy(net)
    F.cross_entropy(ref(x), y).backward()
    s = strategy(4)
    model = s.mirror(net)
    ds = s.distribute_dataset([(x, y)])

    def body(m, batch):
        xb, yb = batch
        (F.cross_entropy(m(xb), yb, reduction="sum") / max(xb.shape[0], 1)).backward()
        CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=1.0)).synchronize(weight=xb.shape[0])
        return [p.grad for p in m.parameters()]

    for batch in ds:
        grads = s.run(body, args=(model, batch))
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g.values[3], p.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ torch.optim.Optimizer contract

def test_is_an_optimizer_that_delegates():
    net = make_net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt = CrossShardOptimizer(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state
    assert opt.defaults is inner.defaults
    extra = torch.zeros(2, requires_grad=True)
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert inner.param_groups[-1]["params"] == [extra]
    opt.param_groups[0]["lr"] = 0.2
    assert inner.param_groups[0]["lr"] == 0.2
    sd = opt.state_dict()
    assert sd == inner.state_dict() or sd.keys() == inner.state_dict().keys()
    opt.load_state_dict(sd)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    assert "CrossShardOptimizer(" in repr(opt)
    clone = copy.deepcopy(opt)
    assert clone.optimizer is not inner and len(clone.param_groups) == 2
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert sched.get_last_lr()[0] == pytest.approx(0.2)


def test_closure_scheduler_and_state_dict_in_replicas():
    s = strategy(2)
    model = s.mirror(make_net())
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))

    def body(m, xb, yb):
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(m(xb), yb)
            loss.backward()
            return loss

        loss = opt.step(closure)
        sched.step()
        return loss, opt.param_groups[0]["lr"], len(opt.state_dict()["state"])

    loss, lr, nstate = s.run(body, args=(model, split(x, 2), split(y, 2)))
    assert isinstance(loss.values[0], torch.Tensor)
    assert s.experimental_local_results(lr) == (0.05, 0.05)
    assert set(s.experimental_local_results(nstate)) == {6}


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("reduction", ["max", "min", "prod", "avg", 3])
def test_bad_reduction(reduction):
    with pytest.raises(ValueError, match=r"reduction must be one of 'mean', 'sum'.*got"):
        CrossShardOptimizer(torch.optim.SGD(make_net().parameters(), lr=0.1), reduction=reduction)


def test_not_an_optimizer():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        CrossShardOptimizer(make_net())


def test_wrapping_twice():
    opt = CrossShardOptimizer(torch.optim.SGD(make_net().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already a cr.CrossShardOptimizer"):
        CrossShardOptimizer(opt)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4MB"])
def test_bad_bytes_per_pack(bad):
    with pytest.raises(ValueError, match=r"bytes_per_pack must be a positive int.*got"):
        CrossShardOptimizer(torch.optim.SGD(make_net().parameters(), lr=0.1), bytes_per_pack=bad)


def test_step_outside_replica_context():
    net = make_net()
    opt = CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(cr.ReplicaContextError, match="CrossShardOptimizer.step must be called inside a replica"):
        opt.step()
    with strategy(2).scope():
        with pytest.raises(cr.ReplicaContextError, match="cross-replica context"):
            opt.step()
    with pytest.raises(cr.ReplicaContextError, match="CrossShardOptimizer.synchronize"):
        opt.synchronize()


@pytest.mark.parametrize("weight,match", [(-1, "weight must be a finite number >= 0"),
                                          (float("nan"), "weight must be a finite number"),
                                          ("3", "weight must be a finite number"),
                                          (torch.ones(2), "weight must be a number")])
def test_bad_weight(weight, match):
    s = strategy(1)
    model = s.mirror(make_net())

    def body(m):
        F.cross_entropy(m(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
        CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)).step(weight=weight)

    with pytest.raises(ValueError, match=match):
        s.run(body, args=(model,))


def test_weight_with_sum_reduction():
    s = strategy(1)
    model = s.mirror(make_net())

    def body(m):
        F.cross_entropy(m(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
        CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), reduction="sum").step(weight=2)

    with pytest.raises(ValueError, match="only used with reduction='mean'"):
        s.run(body, args=(model,))


def test_all_weights_zero():
    s = strategy(2)
    model = s.mirror(make_net())

    def body(m):
        F.cross_entropy(m(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
        CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)).step(weight=0)

    with pytest.raises(ValueError, match="sum to 0.0"):
        s.run(body, args=(model,))


def test_bad_group_assignment_at_step():
    s = strategy(2)
    model = s.mirror(make_net())

    def body(m):
        F.cross_entropy(m(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
        CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), group_assignment=[[0, 1, 2]]).step()

    with pytest.raises(ValueError, match="group_assignment"):
        s.run(body, args=(model,))


# ------------------------------------------------------------------ packing

@pytest.mark.parametrize("bytes_per_pack", [1, 4096, 1 << 20])
def test_packed_buffers_roundtrip(bytes_per_pack):
    from crossreplica.packing import PackedBuffers
    torch.manual_seed(9)
    tensors = [torch.randn(40_000), torch.randn(3, 5), torch.randn(20_000, 2).t(), torch.randn(7),
               torch.randn(2, dtype=torch.float64), torch.randn(30_000)]
    packed = PackedBuffers(tensors, bytes_per_pack)
    flats = packed.pack(tensors)
    assert sum(f.numel() for f in flats) == sum(t.numel() for t in tensors)
    # results as a fresh tensor (the engine's output) and as the buffer itself
    for results in ([f * 2 for f in flats], [f.mul_(2) if b is not None else f * 2
                                            for f, b in zip(flats, packed.buffers)]):
        outs = [torch.empty_like(t) for t in tensors]
        packed.unpack_(results, outs)
        for o, t in zip(outs, tensors):
            assert torch.equal(o, t * 2)


def test_dtype_change_rebuilds_the_packs():
    s = strategy(2)
    model = s.mirror(make_net())

    def step(m, x):
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
        for dtype in (torch.float32, torch.float64):
            m.to(dtype)
            opt.zero_grad()
            m(x.to(dtype)).sum().backward()
            opt.synchronize()
            opt.step()
        return [p.grad.dtype for p in m.parameters()]

    out = s.run(step, args=(model, cr.PerReplica([torch.randn(2, 6), torch.randn(2, 6)])))
    assert all(d is torch.float64 for d in out)  # the same object on both replicas: not wrapped
    a, b = model.values
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_bad_group_assignment_at_construction_in_scope():
    with strategy(4).scope():
        with pytest.raises(ValueError, match="must cover replicas 0..3 exactly once"):
            CrossShardOptimizer(torch.optim.SGD(make_net().parameters(), lr=0.1), group_assignment=[[0, 1], [1, 2]])


def test_one_optimizer_shared_by_replicas_is_an_error():
    s = strategy(2)
    net = make_net()
    shared = CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))

    def body(opt):
        opt.step()

    with pytest.raises(ValueError, match="stepped by replica . and replica .; every replica needs its own"):
        s.run(body, args=(shared,))


def test_mismatched_gradients_across_replicas_raise_not_hang():
    s = strategy(2)
    model = s.mirror(make_net())

    def body(m):
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
        if cr.replica_id() == 0:  # replica 1 has no gradients at all
            m(torch.randn(2, 6)).sum().backward()
        opt.step()

    with pytest.raises(cr.CollectiveMismatchError):
        s.run(body, args=(model,))


def _resume_step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def test_one_loaded_state_dict_in_every_replica_is_not_shared():
    """The DDP resume idiom: one state dict loaded into each replica's optimizer trains
    like one AdamW resumed from it on the whole batch (no shared moments or counters)."""
    torch.manual_seed(3)
    net = make_net()
    warm = torch.optim.AdamW(net.parameters(), lr=0.01)
    x0, y0 = torch.randn(8, 6), torch.randint(0, 3, (8,))
    F.cross_entropy(net(x0), y0).backward()
    warm.step()
    saved = warm.state_dict()
    ref = copy.deepcopy(net)
    s = strategy(2)
    model = s.mirror(net)

    def build(m):
        opt = CrossShardOptimizer(torch.optim.AdamW(m.parameters(), lr=0.01))
        opt.load_state_dict(saved)
        return opt

    opts = s.run(build, args=(model,))
    batches = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]
    for x, y in batches:
        s.run(_resume_step, args=(model, opts, split(x, 2), split(y, 2)))

    def resumed(params):
        opt = torch.optim.AdamW(params, lr=0.01)
        opt.load_state_dict(copy.deepcopy(saved))
        return opt

    want = one_device_training(ref, resumed, batches, cross_entropy)
    local_opts = s.experimental_local_results(opts)
    ref_steps = [float(st["step"]) for st in want.optimizer.state.values()]
    for opt in local_opts:
        assert [float(st["step"]) for st in opt.state.values()] == ref_steps
    a, b = (list(o.state.values()) for o in local_opts)
    assert all(sa["exp_avg"].data_ptr() != sb["exp_avg"].data_ptr() for sa, sb in zip(a, b))
    for m in s.experimental_local_results(model):
        for p, q in zip(m.parameters(), want.params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
