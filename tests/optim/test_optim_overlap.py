"""CrossShardOptimizer(overlap=True): buckets reduced during backward, on every engine."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import crossreplica as cr
from crossreplica.optim import CrossShardOptimizer


def _seeded(*modules):
    # Replica threads share torch's global generator: initialise from private ones.
    with torch.no_grad():
        for i, p in enumerate(q for m in modules for q in m.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))


def _net():
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    _seeded(net)
    return net


def _batch(rid, k=0):
    g = torch.Generator().manual_seed(100 * k + rid)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _grads(overlap, accumulate, bucket_bytes):
    """Gradients after reduction: several buckets (small bucket_bytes), optional accumulation."""
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), bytes_per_pack=bucket_bytes,
                              overlap=overlap)
    for k in range(accumulate - 1):
        with opt.no_sync():
            x, y = _batch(rid, k)
            F.cross_entropy(m(x), y).backward()
    x, y = _batch(rid, accumulate)
    F.cross_entropy(m(x), y).backward()
    opt.synchronize()
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
@pytest.mark.parametrize("n", [2, 4])  # processes: 2 workers x 1, and 2 x 2 (the hierarchical engine)
def test_overlap_gradients_bitwise_equal(run_replicas, accumulate, bucket_bytes, n):
    ours = run_replicas(_grads, n, [True] * n, [accumulate] * n, [bucket_bytes] * n)
    ref = run_replicas(_grads, n, [False] * n, [accumulate] * n, [bucket_bytes] * n)
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert all(torch.equal(x, y) for r in range(1, n) for x, y in zip(ours[0], ours[r]))


def _train_with_unused_and_sparse(overlap):
    rid = cr.replica_id()
    emb = nn.Embedding(10, 4, sparse=True)
    lin = nn.Linear(4, 2)
    unused = nn.Linear(3, 3)
    _seeded(emb, lin, unused)
    params = list(emb.parameters()) + list(lin.parameters()) + list(unused.parameters())
    opt = CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), bytes_per_pack=64, overlap=overlap)
    for step in range(2):
        opt.zero_grad()
        idx = torch.tensor([rid, 3 + step, 7])
        lin(emb(idx)).sum().backward()
        opt.step()
    return [p.detach().clone() for p in params]


def test_overlap_with_unused_and_sparse_parameters(run_replicas):
    ours = run_replicas(_train_with_unused_and_sparse, 2, [True] * 2)
    ref = run_replicas(_train_with_unused_and_sparse, 2, [False] * 2)
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _lbfgs(overlap):
    rid = cr.replica_id()
    m = _net()
    x, y = _batch(rid)
    opt = CrossShardOptimizer(torch.optim.LBFGS(m.parameters(), max_iter=4), overlap=overlap)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss
    opt.step(closure)
    return [p.detach().clone() for p in m.parameters()]


def test_overlap_closure_lbfgs():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    ours = s.experimental_local_results(s.run(_lbfgs, args=(True,)))
    ref = s.experimental_local_results(s.run(_lbfgs, args=(False,)))
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _fail_mid_backward(fail_rid):
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), bytes_per_pack=256, overlap=True)
    x, y = _batch(rid)
    out = m(x)
    if rid == fail_rid:
        def boom(grad):
            raise RuntimeError("replica failed mid-backward")
        out.register_hook(boom)
    F.cross_entropy(out, y).backward()
    opt.step()
    return True


@pytest.mark.parametrize("n,fail_rid", [(2, 1), (4, 1), (4, 3)])  # 4: a sibling or the other worker fails
def test_replica_failing_mid_backward_releases_the_others(run_replicas, time_bound, n, fail_rid):
    import time
    t0 = time.monotonic()
    with pytest.raises(Exception, match="mid-backward|failed"):
        run_replicas(_fail_mid_backward, n, [fail_rid] * n)
    assert time.monotonic() - t0 < time_bound(30)


def test_weight_with_overlap_is_an_error():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)

    def body():
        m = _net()
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), overlap=True)
        x, y = _batch(cr.replica_id())
        F.cross_entropy(m(x), y).backward()
        opt.step(weight=5)
    with pytest.raises(Exception, match="overlap=True"):
        s.run(body)


def test_communication_options_set_the_bucket_size():
    opt = CrossShardOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1), overlap=True,
                              communication_options=cr.CommunicationOptions(bytes_per_pack=128))
    assert opt.bytes_per_pack == 128
    assert opt._overlapped.num_buckets > 3
    with pytest.raises(TypeError, match="communication_options"):
        CrossShardOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1), communication_options=128)


def _bucket_sizes():
    net = nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 3))  # a 1.4 MiB weight among small tensors
    opt = CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), overlap=True)
    before = [len(b.params) for b in opt._overlapped._buckets]
    F.cross_entropy(net(torch.ones(2, 600)), torch.zeros(2, dtype=torch.long)).backward()
    opt.step()
    return before, [len(b.params) for b in opt._overlapped._buckets], cr.get_replica_context().engine.own_bucket_bytes


def test_the_engine_decides_which_gradients_get_a_bucket_of_their_own(run_replicas):
    for before, after, own in run_replicas(_bucket_sizes, 2):
        assert before == [4]  # 4 MiB buckets: everything fits in one
        # in-process a large gradient is reduced in place rather than copied into a bucket;
        # across processes the copy costs less than another call
        assert after == ([3, 1] if own is not None else [4])
