"""CrossShardOptimizer behaves like a torch optimizer, for every torch.optim optimizer.

Each case runs on every engine (``run_replicas``) and compares with plain torch
on one device: training on the concatenated batch with the mean loss gives the
parameters that replicas with a mean reduction give. Closures (LBFGS), hooks,
pickling and deep copies, LR schedulers, param groups and ``zero_grad`` are
those of torch.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from plain_torch import cross_entropy, one_device_training
from torch import nn
from torch.nn import functional as F

import crossreplica as cr
from crossreplica.optim import CrossShardOptimizer

STEPS = 3

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "SGD_for_loop_maximize": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, foreach=False, maximize=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "Adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.05, t0=1),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3),
    "LBFGS_strong_wolfe": lambda p: torch.optim.LBFGS(p, lr=1.0, max_iter=4, history_size=3,
                                                      line_search_fn="strong_wolfe"),
}
NEEDS_CLOSURE = {"LBFGS", "LBFGS_strong_wolfe"}
# LBFGS's curvature estimates amplify float rounding (the reduced mean gradient differs from
# the one-device gradient in the last bits) a little more than first-order updates do.
TOLERANCE = {name: {"rtol": 1e-4, "atol": 1e-5} for name in NEEDS_CLOSURE}
# (optimizer, closure): every optimizer with step(closure); those that take no closure also without.
CASES = [(name, True) for name in OPTIMIZERS] + [(name, False) for name in OPTIMIZERS
                                                 if name not in NEEDS_CLOSURE]


def make_net(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_batches(rows, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(steps)]


def split_batches(batches, n):
    """Per replica: its slice of every batch (tensor_split: the first replicas get the extra rows)."""
    parts = [[] for _ in range(n)]
    for x, y in batches:
        for r, (xr, yr) in enumerate(zip(torch.tensor_split(x, n), torch.tensor_split(y, n))):
            parts[r].append((xr, yr))
    return parts


def train(model, opt, batches, use_closure, weighted=False):
    """The training loop a user writes, on each replica (the reference: plain_torch.one_device_training)."""
    losses = []
    for x, y in batches:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        kwargs = {"weight": x.shape[0]} if weighted else {}
        if use_closure:
            losses.append(opt.step(closure, **kwargs).item())
        else:
            closure()
            opt.step(**kwargs)
    return losses


def _replica_train(name, model, batches, use_closure, weighted):
    opt = CrossShardOptimizer(OPTIMIZERS[name](model.parameters()))
    losses = train(model, opt, batches, use_closure, weighted)
    return [p.detach().clone() for p in model.parameters()], losses


def assert_matches(results, expected_params, expected_losses=None, rtol=1e-5, atol=1e-6):
    for params, losses in results:
        for p, q in zip(params, expected_params):
            torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
        if expected_losses is not None:
            assert losses == pytest.approx(expected_losses, rel=rtol, abs=atol)
    for params, losses in results[1:]:  # replicas stay bitwise identical
        assert all(torch.equal(p, q) for p, q in zip(params, results[0][0]))
        assert losses == results[0][1]


@pytest.mark.parametrize("name,use_closure", CASES,
                         ids=[f"{n}-{'closure' if c else 'step'}" for n, c in CASES])
def test_every_torch_optimizer_matches_one_device(run_replicas, name, use_closure):
    n = 2
    batches = make_batches(8)
    net = make_net()
    results = run_replicas(_replica_train, n, [name] * n, [copy.deepcopy(net) for _ in range(n)],
                           split_batches(batches, n), [use_closure] * n, [False] * n)
    ref = one_device_training(net, OPTIMIZERS[name], batches, cross_entropy, closure=use_closure)
    assert_matches(results, ref.params, [loss.item() for loss in ref.losses] if use_closure else None,
                   **TOLERANCE.get(name, {}))


@pytest.mark.parametrize("name", ["LBFGS", "LBFGS_strong_wolfe", "Adam"])
def test_closure_with_uneven_batches_and_weights(run_replicas, name):
    # 10 rows over 4 replicas (3, 3, 2, 2); the weighted closure loss is the global mean.
    n = 4
    batches = make_batches(10)
    net = make_net()
    results = run_replicas(_replica_train, n, [name] * n, [copy.deepcopy(net) for _ in range(n)],
                           split_batches(batches, n), [True] * n, [True] * n)
    ref = one_device_training(net, OPTIMIZERS[name], batches, cross_entropy, closure=True)
    assert_matches(results, ref.params, [loss.item() for loss in ref.losses], **TOLERANCE.get(name, {}))


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(6)
            self.emb = nn.Embedding(20, 4, sparse=True)
            self.out = nn.Linear(4, 3)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


def _train_sparse(model, sparse_opt, dense_opt, batches):
    for x, y in batches:
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sparse_opt.step()
        dense_opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _replica_sparse_adam(model, batches):
    return _train_sparse(model, CrossShardOptimizer(torch.optim.SparseAdam(model.emb.parameters(), lr=0.05)),
                         CrossShardOptimizer(torch.optim.Adam(model.out.parameters(), lr=0.05)), batches)


def test_sparse_adam_matches_one_device(run_replicas):
    n = 2
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(STEPS)]
    net = EmbedNet()
    results = run_replicas(_replica_sparse_adam, n, [copy.deepcopy(net) for _ in range(n)],
                           split_batches(batches, n))
    ref = copy.deepcopy(net)
    expected = _train_sparse(ref, torch.optim.SparseAdam(ref.emb.parameters(), lr=0.05),
                             torch.optim.Adam(ref.out.parameters(), lr=0.05), batches)
    assert_matches([(r, []) for r in results], expected)


# ------------------------------------------------------------------ schedulers

SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=STEPS + 1),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=1),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.9)], milestones=[1]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5,
                                                                               threshold=10.0),
}


def _train_scheduled(model, opt, sched_name, batches):
    sched = SCHEDULERS[sched_name](opt)
    lrs = []
    for x, y in batches:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        loss = opt.step(closure)  # with a CrossShardOptimizer: the global loss
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(loss.item())
        else:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return [p.detach().clone() for p in model.parameters()], lrs


def _replica_scheduled(model, sched_name, batches):
    opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return _train_scheduled(model, opt, sched_name, batches)


@pytest.mark.parametrize("sched_name", sorted(SCHEDULERS))
def test_lr_schedulers_drive_the_wrapper(run_replicas, sched_name):
    n = 2
    batches = make_batches(8, steps=STEPS + 1)
    net = make_net()
    results = run_replicas(_replica_scheduled, n, [copy.deepcopy(net) for _ in range(n)],
                           [sched_name] * n, split_batches(batches, n))
    ref = copy.deepcopy(net)
    expected, lrs = _train_scheduled(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                                     sched_name, batches)
    assert_matches(results, expected, lrs)


# ------------------------------------------------------------------ param groups, zero_grad

class TwoPart(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(4)
            self.a = nn.Linear(6, 8)
            self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train_groups(model, opt, batches, set_to_none):
    """Starts on ``a`` only, adds ``b`` as its own group (another lr) after the first step."""
    grads_after_zero = []
    for i, (x, y) in enumerate(batches):
        if i == 1:
            opt.add_param_group({"params": list(model.b.parameters()), "lr": 0.05})
        opt.zero_grad(set_to_none=set_to_none)
        grads_after_zero.append([None if p.grad is None else float(p.grad.abs().sum())
                                 for p in model.a.parameters()])
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], grads_after_zero


def _replica_groups(model, batches, set_to_none):
    opt = CrossShardOptimizer(torch.optim.Adam(model.a.parameters(), lr=0.01))
    result = _train_groups(model, opt, batches, set_to_none)
    assert len(opt.param_groups) == 2 and opt.param_groups is opt.optimizer.param_groups
    return result


@pytest.mark.parametrize("set_to_none", [True, False])
def test_add_param_group_and_zero_grad(run_replicas, set_to_none):
    n = 2
    batches = make_batches(8)
    net = TwoPart()
    results = run_replicas(_replica_groups, n, [copy.deepcopy(net) for _ in range(n)],
                           split_batches(batches, n), [set_to_none] * n)
    ref = copy.deepcopy(net)
    expected, zeroed = _train_groups(ref, torch.optim.Adam(ref.a.parameters(), lr=0.01), batches, set_to_none)
    assert_matches([(params, []) for params, _ in results], expected)
    assert all(z == zeroed for _, z in results)
    assert zeroed[1] == ([None, None] if set_to_none else [0.0, 0.0])


# ------------------------------------------------------------------ hooks

def _hooked(opt):
    """Registers every kind of optimizer hook; returns the list they append to."""
    fired = []

    def step_pre(o, args, kwargs):
        fired.append(("step_pre", o is opt))

    def step_post(o, args, kwargs):
        fired.append(("step_post", o is opt))

    def sd_pre(o):
        fired.append(("state_dict_pre", o is opt))

    def sd_post(o, sd):
        fired.append(("state_dict_post", o is opt))
        sd = dict(sd)
        sd["extra"] = "from the post hook"
        return sd

    def load_pre(o, sd):
        fired.append(("load_pre", o is opt, sd.get("extra")))
        sd = dict(sd)
        sd.pop("extra", None)
        return sd

    def load_post(o):
        fired.append(("load_post", o is opt))

    opt.register_step_pre_hook(step_pre)
    opt.register_step_post_hook(step_post)
    opt.register_state_dict_pre_hook(sd_pre)
    opt.register_state_dict_post_hook(sd_post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(load_post)
    return fired


def _exercise_hooks(model, opt, x, y):
    fired = _hooked(opt)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    return fired, sd["extra"]


def _replica_hooks(model, x, y):
    return _exercise_hooks(model, CrossShardOptimizer(torch.optim.Adam(model.parameters(), lr=0.01)), x, y)


def test_hooks_registered_on_the_wrapper_fire(run_replicas):
    n = 2
    x, y = make_batches(4, steps=1)[0]
    net = make_net()
    results = run_replicas(_replica_hooks, n, [copy.deepcopy(net) for _ in range(n)],
                           list(torch.tensor_split(x, n)), list(torch.tensor_split(y, n)))
    ref = copy.deepcopy(net)
    expected = _exercise_hooks(ref, torch.optim.Adam(ref.parameters(), lr=0.01), x, y)
    assert expected[0] == [("step_pre", True), ("step_post", True), ("state_dict_pre", True),
                           ("state_dict_post", True), ("load_pre", True, "from the post hook"),
                           ("load_post", True)]
    assert all(r == expected for r in results)


def test_hook_handles_remove():
    opt = CrossShardOptimizer(torch.optim.SGD(make_net().parameters(), lr=0.1))
    fired = []
    handle = opt.register_state_dict_pre_hook(lambda o: fired.append(o))
    opt.state_dict()
    handle.remove()
    opt.state_dict()
    assert fired == [opt]


# ------------------------------------------------------------------ pickling and copies

def _pickle_roundtrip(model, opt, x, y):
    """Steps once, then torch.save/torch.load the optimizer with a scheduler and deep-copies it."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.register_step_pre_hook(lambda o, a, k: None)  # a local function: not pickled (as torch)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt, "sched": sched}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    clone = copy.deepcopy(opt)
    return {
        "type": type(loaded["opt"]).__name__,
        "same_optimizer": loaded["sched"].optimizer is loaded["opt"],
        "sched_state": {k: v for k, v in loaded["sched"].state_dict().items() if k != "_get_lr_called_within_step"},
        "lr": loaded["opt"].param_groups[0]["lr"],
        "state_equal": all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in
                           zip(loaded["opt"].state_dict()["state"].values(), opt.state_dict()["state"].values())),
        "clone_hooks": len(clone._optimizer_step_pre_hooks),
        "clone_params_separate": clone.param_groups[0]["params"][0] is not opt.param_groups[0]["params"][0],
    }


def _replica_pickle(model, x, y):
    opt = CrossShardOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), reduction="mean")
    out = _pickle_roundtrip(model, opt, x, y)
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out["settings"] = (loaded.reduction, loaded.bytes_per_pack)
    return out


def test_torch_save_and_deepcopy_with_a_scheduler(run_replicas):
    n = 2
    x, y = make_batches(4, steps=1)[0]
    net = make_net()
    results = run_replicas(_replica_pickle, n, [copy.deepcopy(net) for _ in range(n)],
                           list(torch.tensor_split(x, n)), list(torch.tensor_split(y, n)))
    ref = copy.deepcopy(net)
    expected = _pickle_roundtrip(ref, torch.optim.Adam(ref.parameters(), lr=0.01), x, y)
    assert expected.pop("type") == "Adam" and expected["clone_hooks"] == 0
    default_pack = CrossShardOptimizer(torch.optim.SGD(make_net().parameters(), lr=0.1)).bytes_per_pack
    for r in results:
        assert r.pop("type") == "CrossShardOptimizer"
        assert r.pop("settings") == (cr.ReduceOp.MEAN, default_pack)
        assert r == expected


def test_a_deep_copy_may_be_stepped_by_another_replica():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    nets = [make_net(), make_net()]
    opts = [CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)) for m in nets]
    s.run(lambda o: o.step(), args=(cr.PerReplica(opts),))  # opts[0] belongs to replica 0 now
    with pytest.raises(ValueError, match="every replica needs its own optimizer"):
        s.run(lambda o: o.step(), args=(cr.PerReplica(opts[::-1]),))
    copies = [copy.deepcopy(o) for o in opts]  # a copy forgets its replica, as it forgets hooks
    s.run(lambda o: o.step(), args=(cr.PerReplica(copies[::-1]),))


def _closure_loss_kept(model, x):
    opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    kept = []

    def closure():
        opt.zero_grad()
        loss = model(x).sum().double()  # float64 on the CPU: the dtype and device of the reduction
        loss.backward()
        kept.append(loss)
        return loss

    reduced = opt.step(closure)
    return kept[0].item(), reduced.item()


def test_the_closure_loss_itself_is_not_overwritten(run_replicas):
    n = 2
    net = nn.Linear(3, 1)
    xs = [torch.full((1, 3), float(r + 1)) for r in range(n)]
    results = run_replicas(_closure_loss_kept, n, [copy.deepcopy(net) for _ in range(n)], xs)
    own = [net(x).sum().item() for x in xs]
    for r, (kept, reduced) in enumerate(results):
        assert kept == pytest.approx(own[r])  # this replica's loss, as the closure returned it
        assert reduced == pytest.approx(sum(own) / n)
