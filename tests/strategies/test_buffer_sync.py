"""Mirrored buffers agree after every run (strategy.mirror's sync_buffers), on every engine.

A plain ``torch.nn.BatchNorm`` updates its running statistics from its own
replica's batch. With ``sync_buffers="broadcast"`` every copy ends each step
with replica 0's update, with ``"mean"`` with the mean of every replica's
update, bitwise; with None each replica keeps its own and a warning says so.
Each case is checked against plain torch on one device.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import os
import tempfile
import warnings
import weakref

import pytest
import torch
from torch import nn

import crossreplica as cr
from crossreplica.engines.base import Kind
from crossreplica.testing import run_workers

pytestmark = pytest.mark.fidelity

N = 4  # replicas: 4 threads, or 2 workers x 2
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2),
                         nn.BatchNorm1d(2, momentum=None))


def _batch(step: int, replica: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(5, 3, generator=g) * (replica + 1) + replica


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_buffers()}


def _forward(m, x):
    m.train()
    return m(x)


def _train(strategy, policy):
    """Mirrors the model with ``policy``, runs STEPS steps; per step, the buffers of each local
    copy; the warnings; and the buffers cr.save stored after the last step."""
    models = strategy.mirror(_model(), sync_buffers=policy)
    ids = strategy.extended.local_replica_ids
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(STEPS):
            strategy.run(_forward, args=(models, cr.PerReplica([_batch(k, r) for r in ids])))
            steps.append([_buffers(m) for m in models.values])
    path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")  # the chief's path is the one written and read
    with strategy.scope():
        cr.save(path, {"model": models})
        saved = cr.load(path)["model"]
    return {"ids": ids, "steps": steps, "threads": _replica_threads(strategy), "saved": {k: saved[k] for k in steps[-1][0]},
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


def _replica_threads(strategy) -> int:
    """The intra-op threads replica 0 computes with (an equal share of the caller's)."""
    return int(strategy.experimental_local_results(strategy.run(lambda: torch.tensor(torch.get_num_threads())))[0])


def _train_broadcast(strategy):
    return _train(strategy, "broadcast")


def _train_mean(strategy):
    return _train(strategy, "mean")


def _train_none(strategy):
    return _train(strategy, None)


MAINS = {"broadcast": _train_broadcast, "mean": _train_mean, None: _train_none}


def _through_collectives(strategy):
    """``strategy`` syncing buffers with collectives inside the replicas, as it does when
    some replicas run in other processes (in one process it syncs after the run)."""
    buffers = strategy.extended.mirrored_buffers
    for_run = buffers.for_run
    buffers.for_run = lambda num_replicas, num_local: for_run(num_replicas, 0)
    return strategy


def _gathered(engine, policy):
    """Per step, the buffers of every replica (replica-id order); every worker's result."""
    main = MAINS[policy]
    if engine == "threads":
        workers = [main(cr.MirroredStrategy(N, devices=["cpu"] * N))]
        # the path processes take (collectives inside the replicas) gives the same bytes
        for got, want in zip(main(_through_collectives(cr.MirroredStrategy(N, devices=["cpu"] * N)))["steps"],
                             workers[0]["steps"]):
            for g, w in zip(got, want):
                _assert_equal(g, w, "collectives path vs in-process path")
    else:
        workers = run_workers(main, 2, replicas_per_worker=N // 2)
    steps = []
    for k in range(STEPS):
        by_id = {r: w["steps"][k][i] for w in workers for i, r in enumerate(w["ids"])}
        steps.append([by_id[r] for r in range(N)])
    return steps, workers


@contextlib.contextmanager
def _intra_op_threads(n):
    """Plain torch with the replicas' intra-op thread count (it decides how a batch's
    statistics are summed, so the bits)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _reference(policy, workers):
    """Plain torch: each replica's update from the agreed buffers, combined as the policy says."""
    with _intra_op_threads(workers[0]["threads"]):
        return _reference_steps(policy)


def _reference_steps(policy):
    base = _model()
    chains = [copy.deepcopy(base) for _ in range(N)]  # policy None: each replica on its own
    out = []
    for k in range(STEPS):
        if policy is None:
            for r, m in enumerate(chains):
                m.train()(_batch(k, r))
            out.append([_buffers(m) for m in chains])
            continue
        updates = []
        for r in range(N):
            m = copy.deepcopy(base).train()
            m(_batch(k, r))
            updates.append(_buffers(m))
        agreed = dict(updates[0])
        if policy == "mean":  # the sum in replica order, divided by the count
            for name, v in agreed.items():
                if v.is_floating_point():
                    agreed[name] = functools.reduce(torch.add, [u[name] for u in updates]) / N
        for name, v in base.named_buffers():
            v.copy_(agreed[name])
        out.append([agreed] * N)
    return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name}\n{got[name]}\n{want[name]}"


@pytest.mark.parametrize("policy", ["broadcast", "mean"])
def test_synced_buffers_agree_bitwise_after_every_step(engine, policy):
    steps, workers = _gathered(engine, policy)
    ref = _reference(policy, workers)
    for k in range(STEPS):
        for r in range(N):
            _assert_equal(steps[k][r], steps[k][0], f"step {k}, replica {r} vs replica 0")
            _assert_equal(steps[k][r], ref[k][r], f"step {k}, replica {r} vs plain torch")
    for w in workers:
        _assert_equal(w["saved"], ref[-1][0], "cr.save after the last step")
        assert w["warnings"] == []


def test_unsynced_buffers_differ_and_warn_once(engine):
    steps, workers = _gathered(engine, None)
    ref = _reference(None, workers)
    for k in range(STEPS):
        for r in range(N):
            _assert_equal(steps[k][r], ref[k][r], f"step {k}, replica {r} vs its own plain-torch chain")
        assert not torch.equal(steps[k][1]["1.running_mean"], steps[k][0]["1.running_mean"])
    for w in workers:
        assert len(w["warnings"]) == 1, w["warnings"]  # once per module, not once per step
        assert "hold different buffers" in w["warnings"][0]
        assert "sync_buffers='broadcast' or 'mean'" in w["warnings"][0]
        _assert_equal(w["saved"], ref[-1][0], "cr.save keeps replica 0's")


def _count_calls(strategy, monkeypatch):
    calls = []
    real = strategy.extended.engine.execute

    def counting(rid, call, tensors, *a, **k):
        if rid == 0:
            calls.append((call.kind, [t.dtype for t in tensors]))
        return real(rid, call, tensors, *a, **k)

    monkeypatch.setattr(strategy.extended.engine, "execute", counting)
    return calls


@pytest.mark.parametrize("policy,expected", [
    ("broadcast", [(Kind.BROADCAST, [torch.float32, torch.int64])]),
    ("mean", [(Kind.ALL_REDUCE, [torch.float32]), (Kind.BROADCAST, [torch.int64])]),
    (None, []),
])
def test_one_packed_call_per_policy(monkeypatch, policy, expected):
    xs = cr.PerReplica([_batch(0, 0), _batch(0, 1)])
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    models = s.mirror(_model(), sync_buffers=policy)
    calls = _count_calls(s, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.run(_forward, args=(models, xs))
    assert calls == []  # every replica in this process: synced after the run, no rendezvous
    if policy is not None:
        assert all(torch.equal(a, b) for a, b in zip(models.values[0].buffers(), models.values[1].buffers()))
    s = _through_collectives(cr.MirroredStrategy(2, devices=["cpu"] * 2))
    models = s.mirror(_model(), sync_buffers=policy)
    calls = _count_calls(s, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.run(_forward, args=(models, xs))
    assert calls == expected


def test_copies_that_changed_different_buffers_are_an_error():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    models = s.mirror(_model())
    models.values[1].eval()
    with pytest.raises(RuntimeError, match="replica 0 and replica 1 changed different buffers"):
        s.run(lambda m, x: m(x), args=(models, cr.PerReplica([_batch(0, 0), _batch(0, 1)])))


def test_eval_mode_and_sync_batch_norm_cost_nothing(monkeypatch):
    s = _through_collectives(cr.MirroredStrategy(2, devices=["cpu"] * 2))
    models = s.mirror(_model())
    synced = s.mirror(cr.nn.convert_sync_batchnorm(_model()))
    calls = _count_calls(s, monkeypatch)
    xs = cr.PerReplica([_batch(0, 0), _batch(0, 1)])
    s.run(lambda m, x: m.eval()(x), args=(models, xs))
    assert calls == []
    s.run(_forward, args=(synced, xs))  # one all-reduce per SyncBatchNorm, no buffer sync
    assert [kind for kind, _ in calls] == [Kind.ALL_REDUCE, Kind.ALL_REDUCE]
    a, b = synced.values
    _assert_equal(_buffers(a), _buffers(b), "SyncBatchNorm copies")


def test_closure_and_nest_are_synced():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    pair = s.mirror((_model(), torch.zeros(1)))
    s.run(lambda p, x: p[0](x), args=(pair, cr.PerReplica([_batch(0, 0), _batch(0, 1)])))
    a, b = (p[0] for p in pair.values)
    _assert_equal(_buffers(b), _buffers(a), "a module inside a mirrored tuple")


def test_one_device_and_single_replica_need_no_sync(monkeypatch):
    s = cr.OneDeviceStrategy()
    model = s.mirror(_model())
    calls = _count_calls(s, monkeypatch)
    s.run(_forward, args=(model, _batch(0, 0)))
    assert calls == []
    ref = _model().train()
    ref(_batch(0, 0))
    _assert_equal(_buffers(s.experimental_local_results(model)[0]), _buffers(ref), "one device")


@pytest.mark.parametrize("bad", ["avg", "Broadcast", True, 0, ["mean"]])
def test_bad_sync_buffers(bad):
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"sync_buffers must be one of 'broadcast' .*, 'mean' .* or None .*; got"):
        s.mirror(_model(), sync_buffers=bad)


# ---------------------------------------------------------------------- convert_sync_batchnorm

def _without_bias(layer: nn.Module) -> nn.Module:
    """A BatchNorm layer as ``bias=False`` makes it (torch 2.12 on), built so on older torch too."""
    layer.register_parameter("bias", None)
    return layer


def _bn_zoo() -> nn.Module:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Sequential(
        nn.BatchNorm2d(3, affine=False), nn.BatchNorm2d(3, track_running_stats=False),
        _without_bias(nn.BatchNorm2d(3, momentum=None, eps=1e-3))))
    net[1].weight.requires_grad_(False)
    net[2][0].eval()
    net[1].running_mean.uniform_()
    return net


def test_convert_sync_batchnorm_as_torch_does():
    ours, theirs = _bn_zoo(), _bn_zoo()
    before = dict(ours.named_modules())
    tensors = {k: v for k, v in list(ours.named_parameters()) + list(ours.named_buffers())}
    converted = cr.nn.convert_sync_batchnorm(ours)
    expected = nn.SyncBatchNorm.convert_sync_batchnorm(theirs)
    assert converted is ours  # the container itself, its children replaced
    pairs = list(zip(converted.named_modules(), expected.named_modules()))
    assert len(pairs) == len(list(expected.named_modules()))
    for (name, got), (ename, want) in pairs:
        assert name == ename
        assert isinstance(got, cr.nn.SyncBatchNorm) == isinstance(want, nn.SyncBatchNorm), name
        assert got.training == want.training, name
        if isinstance(want, nn.SyncBatchNorm):
            assert got is not before[name]
            for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
                assert getattr(got, attr) == getattr(want, attr), (name, attr)
    # the same tensors as before (requires_grad, device, values kept), as torch keeps them
    after = dict(list(converted.named_parameters()) + list(converted.named_buffers()))
    assert after.keys() == tensors.keys()
    assert all(after[k] is tensors[k] for k in tensors)
    assert not converted[1].weight.requires_grad and converted[1].bias.requires_grad
    assert converted[2][2].bias is None and converted[2][0].weight is None
    assert converted[2][1].running_mean is None
    assert converted.state_dict().keys() == expected.state_dict().keys()


def test_convert_sync_batchnorm_round_trip():
    plain = _bn_zoo()
    converted = cr.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
    x = torch.randn(4, 2, 3, 3)
    # one device: exactly the layers it replaced, in training and in eval
    for mode in (True, False):
        torch.testing.assert_close(converted.train(mode)(x), plain.train(mode)(x), rtol=0, atol=0)
    # its state loads back into the plain model, and the plain model's into it
    restored = _bn_zoo()
    restored.load_state_dict(converted.state_dict())
    _assert_equal(dict(restored.state_dict()), dict(plain.state_dict()), "round trip")
    # a BatchNorm layer itself comes back as a new SyncBatchNorm
    bn = nn.BatchNorm1d(3)
    out = cr.nn.convert_sync_batchnorm(bn, [[0, 1]])
    assert isinstance(out, cr.nn.SyncBatchNorm) and out.group_assignment == [[0, 1]]
    assert out.weight is bn.weight
    assert cr.nn.convert_sync_batchnorm(out) is out  # already synced: kept
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        cr.nn.convert_sync_batchnorm("model")


def test_strategy_holds_mirrored_modules_weakly():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    models = s.mirror(_model())
    refs = [weakref.ref(m) for m in models.values]
    del models
    gc.collect()
    assert all(r() is None for r in refs)
    s.run(lambda: None)  # forgotten modules are dropped, nothing to sync


def test_sync_batch_norm_without_bias_matches_batch_norm():
    xs = [_batch(0, r)[:, :2] for r in range(2)]
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    layers = s.mirror(cr.nn.SyncBatchNorm(2, bias=False))
    ref = _without_bias(nn.BatchNorm1d(2))
    assert layers.values[0].bias is None
    outs = s.run(lambda m, x: m(x), args=(layers, cr.PerReplica(xs)))
    torch.testing.assert_close(torch.cat(s.experimental_local_results(outs)), ref(torch.cat(xs)),
                               rtol=1e-5, atol=1e-5)
    for m in layers.values:
        torch.testing.assert_close(m.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
