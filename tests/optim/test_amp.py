"""Mixed precision: torch.autocast and torch.amp.GradScaler with CrossShardOptimizer, on every engine.

The replicas train with float16 autocast on CPU and the standard recipe
(``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``, and with
clipping ``synchronize(); unscale_(); clip_grad_norm_()``), one replica's loss
made inf on one step. The reference is plain torch on one process: the same
global batch (the replicas' batches concatenated) with the mean loss, its own
GradScaler, the inf on the same step. Replicas agree with each other bitwise
(parameters, scale, growth tracker); with the reference, scales and skipped
steps are exact and parameters agree within TOL: the half-batch float16
matmuls and the mean of two half-batch gradients round differently from one
float16 matmul over the whole batch. A group of one is bitwise plain torch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import crossreplica as cr
from crossreplica.optim import CrossShardOptimizer
from crossreplica.testing import run_workers

STEPS = 5
INF_STEP, INF_REPLICA = 1, 1    # the step on which one replica's loss is inf
ROWS = 4                        # rows per replica
MAX_NORM = 0.05                 # small enough that clipping changes the gradients
TOL = {"rtol": 2e-3, "atol": 2e-4}
SCALER = {"init_scale": 2.0 ** 8, "growth_interval": 2}  # no float16 overflow; the scale grows twice


def _net():
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():  # private generators: replica threads share torch's global one
        for i, p in enumerate(net.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return net


def _batch(rid, step):
    g = torch.Generator().manual_seed(1000 * step + rid)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def _global_batch(step, n):
    xs, ys = zip(*(_batch(r, step) for r in range(n)))
    return torch.cat(xs), torch.cat(ys)


def _loss(m, x, y, poisoned):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(m(x), y)
    return loss * float("inf") if poisoned else loss


def _same(a, b):
    """Equal, or both nan (the gradient norm of the step with an inf)."""
    return a == b or (a != a and b != b)


def _record(m, scaler, norm):
    return {"params": [p.detach().clone() for p in m.parameters()], "scale": scaler.get_scale(),
            "tracker": scaler._get_growth_tracker(), "norm": norm}


def _train(mode, clip):
    """The recipe in a replica; one record per step."""
    rid, n = cr.replica_id(), cr.num_replicas()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5),
                              overlap=mode in ("overlap", "overlap_sharded"),
                              shard_optimizer_state=mode in ("sharded", "overlap_sharded"),
                              bytes_per_pack=256)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    records = []
    for step in range(STEPS):
        x, y = _batch(rid, step)
        opt.zero_grad()
        scaler.scale(_loss(m, x, y, (step, rid) == (INF_STEP, INF_REPLICA % n))).backward()
        norm = None
        if clip:
            if mode not in ("overlap", "overlap_sharded", "no_synchronize"):  # overlap reduced them in backward
                opt.synchronize()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM).item()
        scaler.step(opt)
        scaler.update()
        records.append(_record(m, scaler, norm))
    return records


def _reference(n, clip):
    """Plain torch on one process: the global batch, the mean loss, one GradScaler."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    records = []
    for step in range(STEPS):
        x, y = _global_batch(step, n)
        opt.zero_grad()
        scaler.scale(_loss(m, x, y, step == INF_STEP)).backward()
        norm = None
        if clip:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM).item()
        scaler.step(opt)
        scaler.update()
        records.append(_record(m, scaler, norm))
    return records


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip"])
@pytest.mark.parametrize("mode", ["plain", "overlap", "sharded", "overlap_sharded"])
def test_grad_scaler_recipe_matches_one_process(run_replicas, mode, clip):
    n = 2
    out = run_replicas(_train, n, [mode] * n, [clip] * n)
    ref = _reference(n, clip)
    for records in out[1:]:  # replicas agree bitwise, step by step
        for a, b in zip(records, out[0]):
            assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
            assert (a["scale"], a["tracker"]) == (b["scale"], b["tracker"])
            assert _same(a["norm"], b["norm"])
    before = [p.detach().clone() for p in _net().parameters()]
    for step, (got, want) in enumerate(zip(out[0], ref)):
        assert (got["scale"], got["tracker"]) == (want["scale"], want["tracker"]), step
        for p, q in zip(got["params"], want["params"]):
            torch.testing.assert_close(p, q, **TOL)
        if clip and step != INF_STEP:
            assert got["norm"] == pytest.approx(want["norm"], rel=TOL["rtol"])
            assert got["norm"] > MAX_NORM  # the clip changed the gradients
        if step == INF_STEP:  # every replica skipped: parameters unchanged, scale halved
            assert all(torch.equal(p, q) for p, q in zip(got["params"], before))
            assert got["scale"] == out[0][step - 1]["scale"] / 2 and got["tracker"] == 0
        before = got["params"]
    scales = [r["scale"] for r in out[0]]
    assert scales == [2.0 ** 8, 2.0 ** 7, 2.0 ** 7, 2.0 ** 8, 2.0 ** 8]  # halved, then grown


@pytest.mark.parametrize("mode, clip", [("plain", False), ("plain", True), ("no_synchronize", True)],
                         ids=["step", "unscale_clip", "unscale_clip_as_plain_torch"])
def test_group_of_one_is_bitwise_plain_torch(mode, clip):
    strategy = cr.OneDeviceStrategy()
    (got,) = strategy.experimental_local_results(strategy.run(_train, args=(mode, clip)))
    ref = _reference(1, clip)
    for a, b in zip(got, ref):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
        assert (a["scale"], a["tracker"]) == (b["scale"], b["tracker"])
        assert _same(a["norm"], b["norm"])


def _groups_of_two():
    """Two groups of two; only replica 1 (group 0) sees an inf."""
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5), group_assignment=[[0, 1], [2, 3]])
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    x, y = _batch(rid, 0)
    scaler.scale(_loss(m, x, y, rid == 1)).backward()
    scaler.step(opt)
    scaler.update()
    return _record(m, scaler, None)


def test_groups_skip_on_their_own(run_replicas):
    out = run_replicas(_groups_of_two, 4)
    initial = list(_net().parameters())
    assert [r["scale"] for r in out] == [2.0 ** 7, 2.0 ** 7, 2.0 ** 8, 2.0 ** 8]
    assert all(torch.equal(p, q) for r in out[:2] for p, q in zip(r["params"], initial))
    assert all(torch.equal(p, q) for p, q in zip(out[2]["params"], out[3]["params"]))
    assert not torch.equal(out[2]["params"][0], initial[0])


def _misuse(what):
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5))
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    x, y = _batch(cr.replica_id(), 0)
    scaler.scale(_loss(m, x, y, False)).backward()
    if what == "unscale_unreduced":
        scaler.unscale_(opt)  # without opt.synchronize() first
        scaler.step(opt)
    elif what == "closure":
        scaler.step(opt, lambda: None)
    else:
        scaler.step(opt, weight=x.shape[0])
    return True


@pytest.mark.parametrize("what, match", [("unscale_unreduced", r"synchronize\(\) before scaler.unscale_"),
                                         ("weight", r"opt.synchronize\(weight="),
                                         ("closure", "closure cannot be used with torch.amp.GradScaler")])
def test_misuse_is_a_clear_error_on_every_replica(run_replicas, what, match):
    with pytest.raises(Exception, match=match):
        run_replicas(_misuse, 2, [what] * 2)


def _weighted():
    """Uneven batches: the weight goes to synchronize, before the scaler reads the gradients."""
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5))
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    x, y = _batch(rid, 0)
    x, y = x[:rid + 1], y[:rid + 1]
    scaler.scale(_loss(m, x, y, False)).backward()
    opt.synchronize(weight=x.shape[0])
    scaler.step(opt)
    scaler.update()
    return [p.detach().clone() for p in m.parameters()]


def test_weight_through_synchronize(run_replicas):
    out = run_replicas(_weighted, 2)
    m = _net()
    x, y = _global_batch(0, 2)
    rows = torch.tensor([0, 4, 5])  # replica 0's first row, replica 1's first two
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scaler.scale(_loss(m, x[rows], y[rows], False)).backward()
    scaler.step(opt)
    scaler.update()
    for got in out:
        for p, q in zip(got, m.parameters()):
            torch.testing.assert_close(p, q.detach(), **TOL)


# ---------------------------------------------------------------- autocast around strategy.run

def _forward(m, x):
    y = m(x)
    return y.dtype, torch.is_autocast_enabled("cpu"), y.detach().float()


def _autocast_main(strategy):
    """In cross-replica context: autocast entered around strategy.run reaches every replica."""
    m = strategy.mirror(_net())
    x = torch.randn(2 * strategy.num_replicas_in_sync, 6, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16):
        around = strategy.experimental_local_results(strategy.run(_forward, args=(m, x)))
        ref = [_forward(_net(), x)]
    plain = strategy.experimental_local_results(strategy.run(_forward, args=(m, x)))
    return around, plain, ref


def _check_autocast(around, plain, ref):
    assert all(r[:2] == (torch.float16, True) for r in around)
    assert all(r[:2] == (torch.float32, False) for r in plain)
    assert all(torch.equal(r[2], ref[0][2]) for r in around)  # the same float16 arithmetic


def test_autocast_around_run_threads():
    _check_autocast(*_autocast_main(cr.MirroredStrategy(2, devices=["cpu"] * 2)))


@pytest.mark.multiprocess
def test_autocast_around_run_processes():
    for worker in run_workers(_autocast_main, 2):
        _check_autocast(*worker)


def _documented_step(model, opt, scaler, batch):
    x, y = batch
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def test_documented_recipe_with_a_scaler_per_replica():
    """The README / docs/optimizers.md pattern: scalers made by strategy.run, batches split."""
    strategy = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    model = strategy.mirror(_net())
    opts = strategy.run(lambda m: CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5)), args=(model,))
    scalers = strategy.run(lambda: torch.amp.GradScaler("cpu", **SCALER))
    assert len({id(s) for s in strategy.experimental_local_results(scalers)}) == 2
    for batch in strategy.distribute_dataset([_global_batch(step, 2) for step in range(3)]):
        strategy.run(_documented_step, args=(model, opts, scalers, batch))
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    for step in range(3):
        _documented_step(ref, opt, scaler, _global_batch(step, 2))
    for m in strategy.experimental_local_results(model):
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL)
    assert {s.get_scale() for s in strategy.experimental_local_results(scalers)} == {scaler.get_scale()}
