"""CrossShardOptimizer(shard_optimizer_state=True): ZeRO stage 1 on every engine."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import crossreplica as cr
from crossreplica.optim import CrossShardOptimizer
from crossreplica.optim.sharded import state_bytes


def _net():
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 7), nn.ReLU(), nn.Linear(7, 3))
    with torch.no_grad():  # private generators: replica threads share torch's global one
        for i, p in enumerate(net.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return net


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
}


def _train(name, sharded, overlap=False):
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(OPTIMIZERS[name](m.parameters()), shard_optimizer_state=sharded, overlap=overlap,
                              bytes_per_pack=256)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rid)
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    inner = opt._sharded.inner if sharded else opt.optimizer
    return [p.detach().clone() for p in m.parameters()], opt.state_dict(), state_bytes(inner)


# overlap=True with the sharded update: in-process, the shard optimizer steps views of
# each replica's own parameters; across processes, the flat path with reduced gradients.
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("overlap,n", [(False, 2), (True, 2), (True, 4)])
def test_sharded_update_is_bitwise_the_unsharded_one(run_replicas, name, overlap, n):
    ours = run_replicas(_train, n, [name] * n, [True] * n, [overlap] * n)
    ref = run_replicas(_train, n, [name] * n, [False] * n)
    for (p_ours, sd_ours, bytes_ours), (p_ref, sd_ref, bytes_ref) in zip(ours, ref):
        for a, b in zip(p_ours, p_ref):
            assert torch.equal(a, b)
        assert sd_ours["state"].keys() == sd_ref["state"].keys()
        for k in sd_ref["state"]:
            for key, v in sd_ref["state"][k].items():
                assert torch.equal(torch.as_tensor(sd_ours["state"][k][key]), torch.as_tensor(v)), key
        assert sd_ours["param_groups"] == sd_ref["param_groups"]
        # (numel + padding) / n per replica; scalar state (Adam's step) is not sharded
        assert bytes_ours <= bytes_ref // n + 64


def _roundtrip(overlap):
    m = _net()
    full = CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=0.01))
    m(torch.ones(2, 6)).sum().backward()
    full.step()
    sd = full.state_dict()
    sharded = CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=0.01), shard_optimizer_state=True,
                                  overlap=overlap)
    sharded.load_state_dict(sd)
    sharded.zero_grad()
    m(torch.ones(2, 6)).sum().backward()
    sharded.step()
    back = torch.optim.Adam(m.parameters(), lr=0.01)
    back.load_state_dict(sharded.state_dict())
    in_process = sharded._sharded.views is not None
    return int(back.state[next(iter(m.parameters()))]["step"].item()), in_process


@pytest.mark.parametrize("overlap", [False, True])
def test_state_dict_round_trip_between_sharded_and_unsharded(overlap):
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    assert set(s.experimental_local_results(s.run(_roundtrip, args=(overlap,)))) == {(2, overlap)}


def test_sharded_refuses_closure():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)

    def body():
        m = _net()
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), shard_optimizer_state=True)
        opt.step(lambda: m(torch.ones(1, 6)).sum())
    with pytest.raises(Exception, match="closure"):
        s.run(body)


def _synchronized_then_step(sharded):
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), reduction="sum",
                              shard_optimizer_state=sharded)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rid)
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(5, 6, generator=g)), torch.randint(0, 3, (5,), generator=g)).backward()
        opt.synchronize()  # users clip here; the sharded step then takes its slice, not a second reduction
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


def test_sharded_step_after_synchronize_reduces_once(run_replicas):
    ours = run_replicas(_synchronized_then_step, 2, [True] * 2)
    ref = run_replicas(_synchronized_then_step, 2, [False] * 2)
    for a, b in zip(ours, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _storage_replaced():
    """overlap + sharded in-process: a parameter whose storage is replaced between steps
    (p.data = ...) is still updated, with its optimizer state kept."""
    rid = cr.replica_id()
    runs = {}
    for replace in (False, True):
        m = _net()
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), overlap=True,
                                  shard_optimizer_state=True)
        for step in range(3):
            if replace and step == 1:
                for p in m.parameters():
                    p.data = p.data.clone()
            g = torch.Generator().manual_seed(10 * step + rid)
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(5, 6, generator=g)), torch.randint(0, 3, (5,), generator=g)).backward()
            opt.step()
        runs[replace] = [p.detach().clone() for p in m.parameters()]
    return all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


def test_sharded_views_follow_replaced_parameter_storage():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    assert all(s.experimental_local_results(s.run(_storage_replaced)))
