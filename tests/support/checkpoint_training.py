"""A small training job whose whole state goes through cr.save / cr.load: shared by
test_checkpoint_everything.py and the worker processes it starts (module-level functions).

The state: a mirrored model, a CrossShardOptimizer(Adam), a StepLR scheduler and a
GradScaler per replica (PerReplica of each, from strategy.run), per-replica noise
generators (optional), a data generator and torch's CPU generator (which draw the
batches in cross-replica context), an ON_READ SUM cr.Variable counting the examples
every replica saw, an ON_WRITE cr.Variable counting steps, and a plain number.
"""

from __future__ import annotations

from typing import Any

import torch
from plain_torch import replica_mean

import crossreplica as cr

ROWS, DIM = 8, 6  # a global batch divides evenly over 1, 2 and 4 replicas
LR, INIT_SCALE = 0.05, 2.0 ** 4


def make_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _make_opt(model: torch.nn.Module) -> cr.CrossShardOptimizer:
    return cr.CrossShardOptimizer(torch.optim.Adam(model.parameters(), lr=LR))


def _make_sched(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def make_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)


def make_noise(replica: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + replica)


def _make_noise() -> torch.Generator:
    return make_noise(cr.replica_id())


def build(strategy: Any, seed: int, noise: bool = True) -> dict[str, Any]:
    """A fresh training state under ``strategy`` (``seed`` sets the initial weights and every
    generator, so a state built with another seed differs everywhere until restored)."""
    with strategy.scope():
        model = strategy.mirror(make_net(seed))
        opts = strategy.run(_make_opt, args=(model,))
        state = {
            "model": model, "opt": opts, "sched": strategy.run(_make_sched, args=(opts,)),
            "scaler": strategy.run(make_scaler),
            "data": torch.Generator().manual_seed(7 + seed), "cpu_rng": torch.default_generator,
            "seen": cr.Variable(0, synchronization="ON_READ", aggregation="SUM"),
            "steps": cr.Variable(0), "epoch": seed,
        }
        if noise:
            state["noise"] = strategy.run(_make_noise)
    torch.manual_seed(1000 + seed)
    return state


def batch(state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The next global batch: from the data generator and torch's CPU generator."""
    x = torch.randn(ROWS, DIM, generator=state["data"]) * (1 + torch.rand(()))
    y = torch.randn(ROWS, 2, generator=state["data"])
    return x, y


def _replica_step(model: Any, opt: Any, sched: Any, scaler: Any, seen: Any, noise: Any, x: Any, y: Any) -> None:
    if noise is not None:
        x = x + 0.01 * torch.randn(x.shape, generator=noise)
    opt.zero_grad()
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    seen.assign_add(x.shape[0])


def _local_parts(strategy: Any, t: torch.Tensor) -> Any:
    ext = strategy.extended
    parts = torch.tensor_split(t, ext.num_replicas_in_sync)
    local = [parts[g] for g in ext.local_replica_ids]
    return cr.PerReplica(local) if len(local) > 1 or ext.always_wrap else local[0]


def train(strategy: Any, state: dict[str, Any], steps: int) -> None:
    with strategy.scope():
        for _ in range(steps):
            x, y = batch(state)
            strategy.run(_replica_step, args=(state["model"], state["opt"], state["sched"], state["scaler"],
                                              state["seen"], state.get("noise"), _local_parts(strategy, x),
                                              _local_parts(strategy, y)))
            state["steps"].assign_add(1)


def summary(strategy: Any, state: dict[str, Any]) -> dict[str, Any]:
    """What a run ends with (replica 0's copy of the weights; read on every worker)."""
    with strategy.scope():
        model = strategy.experimental_local_results(state["model"])[0]
        sched = strategy.experimental_local_results(state["sched"])[0]
        scaler = strategy.experimental_local_results(state["scaler"])[0]
        return {"params": [p.detach().clone() for p in model.parameters()],
                "seen": int(state["seen"].value()), "steps": int(state["steps"].value()),
                "lr": sched.get_last_lr()[0], "scale": scaler.get_scale()}


# ---------------------------------------------------------------- jobs run by worker processes

def job_uninterrupted_and_resumed(strategy: Any, path: str, total: int, stop: int) -> tuple[dict, dict]:
    """The same job run straight through, and stopped after ``stop`` steps, saved, restored
    into a fresh state and finished."""
    straight = build(strategy, 0)
    train(strategy, straight, total)
    first = build(strategy, 0)
    train(strategy, first, stop)
    cr.save(path, first, strategy=strategy)
    fresh = build(strategy, 1)
    with strategy.scope():
        cr.load(path, into=fresh)
    train(strategy, fresh, total - stop)
    return summary(strategy, straight), summary(strategy, fresh)


def job_train_and_save(strategy: Any, path: str, load_from: str | None, steps: int) -> dict:
    """Restores ``load_from`` (if given) into a fresh state without per-replica noise, trains
    ``steps`` steps and saves to ``path``."""
    state = build(strategy, 0 if load_from is None else 1, noise=False)
    if load_from is not None:
        with strategy.scope():
            cr.load(load_from, into=state)
    train(strategy, state, steps)
    cr.save(path, state, strategy=strategy)
    return summary(strategy, state)


# ---------------------------------------------------------------- the plain-torch reference

def reference(schedule: list[int], noise: bool = True) -> dict[str, Any]:
    """The job in plain torch: ``schedule[i]`` replicas at step i, each replica's scaled
    gradients averaged in replica order, then the scaler's step of one Adam."""
    model = make_net(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sched = _make_sched(opt)
    scaler = make_scaler()
    gens = [make_noise(r) for r in range(4)]
    state = {"data": torch.Generator().manual_seed(7)}
    torch.manual_seed(1000)
    for n in schedule:
        x, y = batch(state)
        # strategy.run's one draw from the caller's generator (the replicas' stream base,
        # docs/fidelity.md "Random numbers"): the next batch's torch.rand sees it.
        torch.randint(0, 2**63 - 1, ())
        grads = []
        for r, (xr, yr) in enumerate(zip(torch.tensor_split(x, n), torch.tensor_split(y, n))):
            if noise:
                xr = xr + 0.01 * torch.randn(xr.shape, generator=gens[r])
            model.zero_grad()
            scaler.scale(((model(xr) - yr) ** 2).mean()).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_replica in zip(model.parameters(), *grads):
            p.grad = replica_mean(per_replica)
        scaler.step(opt)
        scaler.update()
        sched.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "seen": ROWS * len(schedule),
            "steps": len(schedule), "lr": sched.get_last_lr()[0], "scale": scaler.get_scale()}
