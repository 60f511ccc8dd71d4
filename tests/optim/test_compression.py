"""Compressed reductions: CrossShardOptimizer(compression=...) and CommunicationOptions(compression=...).

Every result is compared with a plain-PyTorch reference computed here: each replica's
value divided by the power of two 2**k >= n and rounded to the narrow dtype, summed in
ascending replica id with each addition done in float32 and rounded to the narrow dtype
(the transports' order: the in-process fold, the ordered cross-process path, a ring of
two), widened, times 2**k, and divided by n for a mean.
"""

import copy

import pytest
import torch
from torch import nn

import crossreplica as cr
from crossreplica.optim import CrossShardOptimizer

NARROW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _scale(n):
    k = 1
    while k < n:
        k *= 2
    return float(k)


def _reference(values, compression, mean, weights=None):
    """The compressed reduction of ``values`` (one tensor per replica, replica order)."""
    n = len(values)
    scale = _scale(n)
    if weights is not None:
        values = [v * w for v, w in zip(values, weights)]
    narrow = [(v / scale).to(compression) for v in values]
    acc = narrow[0]
    for x in narrow[1:]:
        acc = (acc.float() + x.float()).to(compression)  # one addition, rounded once
    out = acc.to(values[0].dtype) * scale
    if weights is not None:
        return out / sum(float(w) for w in weights)
    return out / n if mean else out


def _net(dtype=torch.float32):
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)
    with torch.no_grad():  # replica threads share torch's global generator: private ones
        for i, p in enumerate(net.parameters()):
            p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return net


def _batch(rid, dtype=torch.float32, size=3.0):
    g = torch.Generator().manual_seed(rid)
    return (size * torch.randn(5, 6, generator=g)).to(dtype), torch.randint(0, 3, (5,), generator=g)


def _loss(net, x, y):
    return nn.functional.cross_entropy(net(x).float(), y) * 100  # gradients with bits below bf16's


def _own_and_reduced(compression, overlap, reduction, dtype=torch.float32, size=3.0):
    """This replica's own gradients (from a copy) and the optimizer's reduced ones."""
    rid = cr.replica_id()
    net = _net(dtype)
    own = copy.deepcopy(net)
    x, y = _batch(rid, dtype, size)
    _loss(own, x, y).backward()
    opt = CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), reduction, bytes_per_pack=512,
                              overlap=overlap, compression=compression)
    _loss(net, x, y).backward()
    opt.synchronize()
    return [p.grad.clone() for p in own.parameters()], [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("compression", NARROW)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
@pytest.mark.parametrize("n", [2, 4])  # processes: 2 workers x 1, and 2 x 2
def test_compressed_gradients_bitwise_the_reference(run_replicas, n, overlap, reduction, compression):
    results = run_replicas(_own_and_reduced, n, [compression] * n, [overlap] * n, [reduction] * n)
    owns = [own for own, _ in results]
    compressed_somewhere = False
    for i in range(len(owns[0])):
        ref = _reference([own[i] for own in owns], compression, reduction == "mean")
        exact = sum(own[i] for own in owns) / (n if reduction == "mean" else 1)
        compressed_somewhere |= not torch.equal(ref, exact)
        for r, (_, reduced) in enumerate(results):
            assert reduced[i].dtype == torch.float32
            assert torch.equal(reduced[i], ref), (r, i, (reduced[i] - ref).abs().max())
    assert compressed_somewhere  # the reference differs from the float32 reduction: the test can fail


def _uncompressed(overlap, reduction, dtype=torch.float32):
    return _own_and_reduced(None, overlap, reduction, dtype)


def test_compressed_and_plain_agree_up_to_the_narrow_rounding():
    n = 4
    strategy = cr.MirroredStrategy(n)
    for compression, u in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
        results = strategy.experimental_local_results(strategy.run(_own_and_reduced, (compression, False, "mean")))
        owns, ours = [own for own, _ in results], results[0][1]
        for i, got in enumerate(ours):
            exact = sum(own[i].double() for own in owns) / n
            magnitude = sum(own[i].double().abs() for own in owns) / n
            # n values rounded once, n - 1 additions rounded once (docs/optimizers.md, "Compression")
            assert ((got.double() - exact).abs() <= (2 * n - 1) * u * magnitude + 1e-30).all(), compression
            assert not torch.equal(got, exact.float())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_float16_large_gradients_do_not_overflow(run_replicas, overlap, reduction):
    n = 4
    # Gradients in the tens of thousands: their sum over 4 replicas is beyond float16's 65504,
    # and so is each replica's, unscaled, after a mean's division on the way.
    results = run_replicas(_own_and_reduced, n, [torch.float16] * n, [overlap] * n, [reduction] * n,
                           [torch.float32] * n, [400.0] * n)
    owns = [own for own, _ in results]
    big = max(sum(own[i] for own in owns).abs().max().item() for i in range(len(owns[0])))
    assert big > 65504  # the plain float16 sum would overflow
    for i in range(len(owns[0])):
        ref = _reference([own[i] for own in owns], torch.float16, reduction == "mean")
        assert torch.isfinite(ref).all()
        for _, reduced in results:
            assert torch.equal(reduced[i], ref)


@pytest.mark.parametrize("dtype,compression", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=["bf16-bf16", "fp16-bf16", "bf16-fp16"])
def test_gradients_as_narrow_are_left_alone(dtype, compression):
    # compressing gradients that are that dtype or narrower is a no-op
    strategy = cr.MirroredStrategy(3)
    ours = strategy.experimental_local_results(strategy.run(_own_and_reduced, (compression, False, "mean", dtype)))
    plain = strategy.experimental_local_results(strategy.run(_uncompressed, (False, "mean", dtype)))
    for (_, a), (_, b) in zip(ours, plain):
        assert all(x.dtype == dtype and torch.equal(x, y) for x, y in zip(a, b))


def _complex_and_real(compression, overlap):
    rid = cr.replica_id()
    g = torch.Generator().manual_seed(rid)
    w = nn.Parameter(torch.ones(8, dtype=torch.complex64))
    b = nn.Parameter(torch.ones(8))
    opt = CrossShardOptimizer(torch.optim.SGD([w, b], lr=0.1), overlap=overlap, compression=compression)
    x = 3 * torch.randn(8, dtype=torch.complex64, generator=g)
    ((w * x).abs().sum() + (b * x.real).sum() * 1.01).backward()
    own = [w.grad.clone(), b.grad.clone()]
    opt.synchronize()
    return own, [w.grad.clone(), b.grad.clone()]


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_complex_gradients_travel_as_they_are(overlap):
    strategy = cr.MirroredStrategy(3)
    ours = strategy.experimental_local_results(strategy.run(_complex_and_real, (torch.bfloat16, overlap)))
    plain = strategy.experimental_local_results(strategy.run(_complex_and_real, (None, overlap)))
    real = _reference([own[1] for own, _ in ours], torch.bfloat16, True)
    for (_, a), (_, b) in zip(ours, plain):
        assert a[0].dtype == torch.complex64 and torch.equal(a[0], b[0])
        assert torch.equal(a[1], real) and not torch.equal(a[1], b[1])


def _weighted(compression, weight):
    rid = cr.replica_id()
    net = _net()
    own = copy.deepcopy(net)
    x, y = _batch(rid)
    _loss(own, x, y).backward()
    opt = CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), compression=compression)
    _loss(net, x, y).backward()
    opt.synchronize(weight=weight)
    return [p.grad.clone() for p in own.parameters()], [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("compression", NARROW)
def test_weighted_mean_compresses_the_gradients_not_the_weights(run_replicas, compression):
    weights = [257.0, 1000.0, 3.0, 513.0]  # not exact in bfloat16: a compressed weight would show
    results = run_replicas(_weighted, 4, [compression] * 4, weights)
    owns = [own for own, _ in results]
    for i in range(len(owns[0])):
        ref = _reference([own[i] for own in owns], compression, True, weights)
        for _, reduced in results:
            assert torch.equal(reduced[i], ref)


def _closure_loss(compression):
    rid = cr.replica_id()
    net = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), compression=compression)
    x, y = _batch(rid)

    def closure():
        opt.zero_grad()
        loss = _loss(net, x, y) / 3  # bits a bfloat16 loss would lose
        loss.backward()
        return loss

    return opt.step(closure)


def test_the_closure_loss_is_not_compressed(run_replicas):
    ours = run_replicas(_closure_loss, 2, [torch.bfloat16] * 2)
    plain = run_replicas(_closure_loss, 2, [None] * 2)
    assert ours[0].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))
    assert not torch.equal(ours[0], ours[0].to(torch.bfloat16).float())


def _mixed(compressions):
    return _own_and_reduced(compressions[cr.replica_id()], False, "mean")


@pytest.mark.parametrize("theirs", [None, torch.float16], ids=["uncompressed", "fp16"])
def test_replicas_that_disagree_on_compression_get_a_mismatch(run_replicas, theirs):
    compressions = [torch.bfloat16, theirs]
    with pytest.raises(cr.CollectiveMismatchError, match="different collective calls"):
        run_replicas(_mixed, 2, [compressions] * 2)


# --------------------------------------------------------------------------- the other entry points

def _values(n, size=3.0):
    return [size * torch.randn(7, 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]


@pytest.mark.parametrize("compression", NARROW)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_to_and_batch_reduce_to_compress(compression, op):
    n = 3
    strategy = cr.MirroredStrategy(n)
    xs, zs = _values(n), _values(n, 0.01)
    options = cr.CommunicationOptions(compression=compression)
    ext = strategy.extended
    out = ext.reduce_to(op, cr.PerReplica(xs), "cpu", options=options)
    ref = _reference(xs, compression, op == "mean")
    assert all(torch.equal(v, ref) for v in strategy.experimental_local_results(out))
    pairs = ext.batch_reduce_to(op, [(cr.PerReplica(xs), "cpu"), (cr.PerReplica(zs), "cpu")], options=options)
    for got, values in zip(pairs, (xs, zs)):
        assert torch.equal(strategy.experimental_local_results(got)[0], _reference(values, compression, op == "mean"))
    plain = strategy.experimental_local_results(ext.reduce_to(op, cr.PerReplica(xs), "cpu"))[0]
    assert not torch.equal(plain, ref)  # without options: not compressed
    ints = [torch.arange(5) * (r + 1) for r in range(n)]  # other dtypes travel as they are
    exact = strategy.experimental_local_results(ext.reduce_to("sum", cr.PerReplica(ints), "cpu", options=options))
    assert torch.equal(exact[0], sum(ints))


def _replica_all_reduce(xs, compression):
    options = cr.CommunicationOptions(compression=compression)
    return cr.get_replica_context().all_reduce("mean", xs[cr.replica_id()], options=options)


@pytest.mark.parametrize("compression", NARROW)
def test_replica_context_all_reduce_with_options_compresses(compression):
    n = 4
    strategy = cr.MirroredStrategy(n)
    xs = _values(n)
    out = strategy.experimental_local_results(strategy.run(_replica_all_reduce, (xs, compression)))
    ref = _reference(xs, compression, True)
    assert all(torch.equal(o, ref) for o in out)


def _through_the_ops(compression):
    """The optimizer's packs through the strategy's cross_device_ops (a timeout takes them there)."""
    rid = cr.replica_id()
    net = _net()
    options = cr.CommunicationOptions(timeout_seconds=60, compression=compression)
    opt = CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), communication_options=options)
    x, y = _batch(rid)
    _loss(net, x, y).backward()
    opt.synchronize()
    return [p.grad.clone() for p in net.parameters()]


def test_optimizer_through_the_cross_device_ops_compresses_the_same():
    strategy = cr.MirroredStrategy(3)
    ours = strategy.experimental_local_results(strategy.run(_through_the_ops, (torch.bfloat16,)))
    ref = strategy.experimental_local_results(strategy.run(_own_and_reduced, (torch.bfloat16, False, "mean")))
    for a, (_, b) in zip(ours, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _workers_reduce_to(strategy, compression):
    xs = _values(strategy.num_replicas_in_sync)
    local = [xs[r] for r in strategy.extended.local_replica_ids]
    options = cr.CommunicationOptions(compression=compression)
    out = strategy.extended.reduce_to("mean", cr.PerReplica(local), "cpu", options=options)
    return strategy.experimental_local_results(out)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("per_worker", [1, 2])
def test_reduce_to_across_workers_compresses(per_worker):
    import crossreplica.testing as crt

    outs = crt.run_workers(_workers_reduce_to, 2, per_worker, args=(torch.bfloat16,))
    ref = _reference(_values(2 * per_worker), torch.bfloat16, True)
    assert all(torch.equal(o, ref) for o in outs)


# --------------------------------------------------------------------------- what is refused

def test_bad_compression_is_named():
    params = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=r"compression must be None, torch.bfloat16 or torch.float16.*got torch.float32"):
        CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), compression=torch.float32)
    with pytest.raises(TypeError, match=r"compression must be None.*got str: 'bf16'; pass the dtype itself: "
                                        r"compression=torch.bfloat16"):
        CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), compression="bf16")
    with pytest.raises(ValueError, match=r"compression must be None.*got torch.int8"):
        cr.CommunicationOptions(compression=torch.int8)
    with pytest.raises(ValueError, match=r"compression=torch.float16 and communication_options.compression="
                                         r"torch.bfloat16 disagree"):
        CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), compression=torch.float16,
                            communication_options=cr.CommunicationOptions(compression=torch.bfloat16))
    with pytest.raises(ValueError, match=r"compression=torch.bfloat16 is not supported with shard_optimizer_state"):
        CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), compression=torch.bfloat16, shard_optimizer_state=True)


def test_options_and_optimizer_say_what_they_compress():
    params = [nn.Parameter(torch.ones(2))]
    options = cr.CommunicationOptions(compression=torch.float16)
    assert options.compression is torch.float16 and "compression=torch.float16" in repr(options)
    assert options.with_compression(None).compression is None and cr.CommunicationOptions().compression is None
    opt = CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), communication_options=options)
    assert opt.compression is torch.float16 and "compression=torch.float16" in repr(opt)
    assert copy.deepcopy(opt).compression is torch.float16
    assert CrossShardOptimizer(torch.optim.SGD(params, lr=0.1)).compression is None


def _invariant_step(net, opt, x):
    net(x).sum().backward()
    opt.step()


def test_the_layout_invariant_mode_refuses_compression():
    strategy = cr.MirroredStrategy(2, layout_invariant=cr.LayoutInvariant(4))
    net = strategy.mirror(nn.Linear(3, 2))
    opts = strategy.run(lambda m: CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                      compression=torch.bfloat16), args=(net,))
    batch = next(iter(strategy.distribute_dataset([torch.randn(8, 3)])))
    with pytest.raises(ValueError, match=r"compression=torch.bfloat16\) cannot take a layout-invariant step"):
        strategy.run(_invariant_step, args=(net, opts, batch))


def test_reduction_to_one_device_with_a_function_refuses_compression():
    strategy = cr.MirroredStrategy(2, cross_device_ops=cr.ReductionToOneDevice(accumulation_fn=sum))
    with pytest.raises(ValueError, match=r"cannot apply to ReductionToOneDevice\(accumulation_fn=...\)"):
        strategy.extended.reduce_to("sum", cr.PerReplica(_values(2)), "cpu",
                                    options=cr.CommunicationOptions(compression=torch.bfloat16))


@pytest.mark.multiprocess
@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_four_workers_one_host_or_two_hosts_the_reference_bits(hosts, overlap):
    # 4 worker processes of one replica: on one host the ordered path (ordered.py), on two
    # simulated hosts the chain of hosts (chain.py); both fold in ascending replica id.
    import crossreplica.testing as crt

    n = 4
    results = crt.run_replicas(_own_reduced_and_hosts, [overlap] * n, engine="processes", replicas_per_worker=1,
                               hosts=hosts)
    assert all(seen == (2 if hosts is not None else 1) for _, _, seen in results)  # 2: the chain across hosts
    owns = [own for own, _, _ in results]
    for i in range(len(owns[0])):
        ref = _reference([own[i] for own in owns], torch.bfloat16, True)
        assert all(torch.equal(reduced[i], ref) for _, reduced, _ in results)


def _own_reduced_and_hosts(overlap):
    own, reduced = _own_and_reduced(torch.bfloat16, overlap, "mean")
    hosts = getattr(cr.get_replica_context().engine, "hosts", None)  # learnt by the chain (chain.host_layout)
    return own, reduced, None if hosts is None else len(hosts)
