"""Every replica draws from its own random stream: replica i runs as after
``torch.manual_seed(base + i)``, ``base`` being one draw from the caller's generator per run,
on every strategy and engine (docs/fidelity.md, "Random numbers")."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import crossreplica as cr
from crossreplica.testing import run_workers

pytestmark = pytest.mark.fidelity

SEED = 1234


def _draws() -> dict[str, torch.Tensor]:
    """One of every way to a random number; plain torch, so it is also the reference."""
    x = torch.ones(4, 6, 3, 3)
    w = torch.ones(16, requires_grad=True)
    lin = nn.Linear(5, 3)  # kaiming_uniform_ / uniform_ initialisation
    conv = nn.Conv2d(2, 2, 3)
    F.dropout(w * 2, 0.5).sum().backward()
    out = {
        "dropout": F.dropout(x, 0.3),
        "dropout_module": nn.Dropout(0.6)(x),
        "dropout_inplace": F.dropout(x.clone(), 0.4, inplace=True),
        "dropout1d": F.dropout1d(x[0], 0.5),
        "dropout2d": nn.Dropout2d(0.5)(x),
        "dropout3d": F.dropout3d(x.unsqueeze(0), 0.5),
        "alpha_dropout": F.alpha_dropout(x, 0.5, True),
        "feature_alpha_dropout": F.feature_alpha_dropout(x, 0.5, True),
        "native_dropout": torch.native_dropout(x, 0.5, True)[0],
        "dropout_grad": w.grad,
        "rrelu": F.rrelu(-x, training=True),
        "rand": torch.rand(5),
        "randn": torch.randn(2, 3, dtype=torch.float64),
        "randint": torch.randint(0, 1000, (6,)),
        "randperm": torch.randperm(20),
        "bernoulli": torch.bernoulli(torch.full((12,), 0.3)),
        "multinomial": torch.multinomial(torch.ones(10), 4),
        "normal": torch.normal(torch.zeros(4), torch.ones(4)),
        "normal_": torch.empty(5).normal_(),
        "uniform_": torch.empty(5).uniform_(-2, 2),
        "rand_like": torch.rand_like(x[0, 0]),
        "randn_like": torch.randn_like(x[0, 0]),
        "randint_like": torch.randint_like(x[0, 0], 50),
        "linear_weight": lin.weight.detach(),
        "linear_bias": lin.bias.detach(),
        "conv_weight": conv.weight.detach(),
        "gamma": torch.distributions.Gamma(torch.ones(3), torch.ones(3)).sample(),
        "attention": F.scaled_dot_product_attention(x[0], x[0], x[0], dropout_p=0.5),
        # an explicit generator is honoured untouched (and does not advance the replica's stream)
        "explicit": torch.randn(4, generator=torch.Generator().manual_seed(7)),
        "after_explicit": torch.rand(3),
    }
    return out


def _replica() -> tuple[int, dict[str, torch.Tensor]]:
    ctx = cr.get_replica_context()
    return ctx.replica_id_in_sync_group, _draws()


def _base(draw: int = 0) -> int:
    """The ``draw``-th run's base after ``torch.manual_seed(SEED)`` (each run draws one)."""
    torch.manual_seed(SEED)
    for _ in range(draw):
        torch.randint(0, 2**63 - 1, ())
    return torch.randint(0, 2**63 - 1, ()).item()


def _reference(i: int, draw: int = 0) -> dict[str, torch.Tensor]:
    """Replica ``i``'s numbers in plain torch: the documented formula."""
    torch.manual_seed(_base(draw) + i)
    return _draws()


def _run_all(strategy: cr.Strategy) -> dict[str, list[tuple[int, dict[str, torch.Tensor]]]]:
    """Seeded runs, as a user would write them; local results per scenario."""
    results = {}
    torch.manual_seed(SEED)
    results["first"] = list(strategy.experimental_local_results(strategy.run(_replica)))
    results["second"] = list(strategy.experimental_local_results(strategy.run(_replica)))  # not re-seeded
    torch.manual_seed(SEED)
    results["again"] = list(strategy.experimental_local_results(strategy.run(_replica)))
    return results


def _check(results: dict[str, list[tuple[int, dict[str, torch.Tensor]]]], expected_ids: list[int]) -> None:
    for scenario, draw in (("first", 0), ("second", 1), ("again", 0)):
        got = dict(results[scenario])
        assert sorted(got) == expected_ids
        for i, values in got.items():
            ref = _reference(i, draw)
            assert sorted(values) == sorted(ref)
            for name in ref:
                assert torch.equal(values[name], ref[name]), (scenario, i, name)


def test_formula_threads():
    _check(_run_all(cr.MirroredStrategy(num_replicas=4)), [0, 1, 2, 3])


def test_formula_one_device_is_replica_0():
    _check(_run_all(cr.OneDeviceStrategy()), [0])
    _check(_run_all(cr.MirroredStrategy(num_replicas=1)), [0])


def _worker_main(strategy):
    return _run_all(strategy)


def _merge(results_per_worker):
    return {k: [r for w in results_per_worker for r in w[k]] for k in results_per_worker[0]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas_per_worker", [1, 2], ids=["processes", "hierarchical"])
def test_formula_processes(replicas_per_worker):
    """Global replica i gets the same stream as replica i of MirroredStrategy (same formula)."""
    workers = run_workers(_worker_main, 2, replicas_per_worker=replicas_per_worker)
    _check(_merge(workers), list(range(2 * replicas_per_worker)))


def test_replicas_differ_and_runs_repeat():
    strategy = cr.MirroredStrategy(num_replicas=3)
    runs = []
    for _ in range(4):  # the threads would race for one generator: same numbers every time regardless
        torch.manual_seed(SEED)
        runs.append(strategy.experimental_local_results(strategy.run(_replica)))
    for run in runs[1:]:
        for (i, a), (j, b) in zip(runs[0], run):
            assert i == j and all(torch.equal(a[k], b[k]) for k in a)
    first = [values for _, values in runs[0]]
    for name in ("dropout", "rand", "randperm", "linear_weight", "native_dropout", "dropout_grad"):
        assert not torch.equal(first[0][name], first[1][name]), name
        assert not torch.equal(first[1][name], first[2][name]), name
    for values in first[1:]:  # the explicit generator's numbers are the same everywhere
        assert torch.equal(values["explicit"], first[0]["explicit"])


def _merge_draw():
    before = torch.rand(2)
    merged = cr.get_replica_context().merge_call(lambda s: torch.rand(3))
    return before, merged


def _merge_main(strategy):
    torch.manual_seed(SEED)
    out = strategy.experimental_local_results(strategy.run(_merge_draw))
    ids = strategy.extended.local_replica_ids
    return [(i, before, merged) for i, (before, merged) in zip(ids, out)], torch.rand(4)


def _check_merge(results, caller_after):
    """merge_fn runs in cross-replica context: it draws from the caller's generator, right after
    the run's one draw; after the run the caller's stream has advanced by that draw (and merge_fn's)."""
    torch.manual_seed(SEED)
    base = torch.randint(0, 2**63 - 1, ()).item()
    merged, after = torch.rand(3), torch.rand(4)
    for i, before, m in results:
        torch.manual_seed(base + i)
        assert torch.equal(before, torch.rand(2))
        assert torch.equal(m, merged)
    assert torch.equal(caller_after, after)


def test_merge_fn_and_caller_use_the_caller_generator():
    _check_merge(*_merge_main(cr.MirroredStrategy(num_replicas=2)))


@pytest.mark.multiprocess
def test_merge_fn_uses_the_caller_generator_on_every_worker():
    for results, caller_after in run_workers(_merge_main, 2, replicas_per_worker=2):
        _check_merge(results, caller_after)


def test_streams_off_share_the_default_generator():
    strategy = cr.OneDeviceStrategy()
    strategy.extended.random_streams = False
    torch.manual_seed(SEED)
    got = strategy.run(torch.rand, args=(5,))
    torch.manual_seed(SEED)
    assert torch.equal(got, torch.rand(5))


def _save_restore():
    g = cr.replica_generator()
    state = g.get_state()
    a = F.dropout(torch.ones(32), 0.5)
    g.set_state(state)
    return a, F.dropout(torch.ones(32), 0.5), torch.get_rng_state()


def test_replica_generator_saves_and_restores_the_replica_stream():
    strategy = cr.MirroredStrategy(num_replicas=2)
    _base()
    caller_state = torch.get_rng_state()  # the caller's generator after the run's one draw
    torch.manual_seed(SEED)
    out = strategy.experimental_local_results(strategy.run(_save_restore))
    for a, b, default_state in out:
        assert torch.equal(a, b)
        assert torch.equal(default_state, caller_state)  # replicas do not draw from it...
    assert cr.replica_generator() is torch.default_generator  # ...and outside a replica it is the default
    with pytest.raises(ValueError, match="device must be a device with a random generator"):
        cr.replica_generator("meta")
    with pytest.raises(ValueError, match="device must be a torch.device or a device string"):
        cr.replica_generator("gpu7")


@torch.compile
def _compiled_step(x):
    return F.dropout(x * 2, 0.5) + torch.rand_like(x)


def _compiled_replica(x):
    return _compiled_step(x)


def test_compiled_replica_function():
    """torch.compile'd code draws (inductor's seeds) from the replica's stream: reproducible,
    different per replica, and replica i equals the compiled function after manual_seed(base + i)."""
    strategy = cr.MirroredStrategy(num_replicas=2)
    x = torch.ones(16)
    runs = []
    for _ in range(2):
        torch.manual_seed(SEED)
        runs.append(strategy.experimental_local_results(strategy.run(_compiled_replica, args=(x,))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(runs[0][0], runs[0][1])
    base = _base()
    for i, got in enumerate(runs[0]):
        torch.manual_seed(base + i)
        assert torch.equal(got, _compiled_step(x))


def _masked(x):
    return F.dropout(x, 0.5) * x


def _checkpointed(x, context_fn, preserve_rng_state=True):
    x = x.detach().requires_grad_()
    y = checkpoint(_masked, x, use_reentrant=False, context_fn=context_fn, preserve_rng_state=preserve_rng_state)
    y.sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_checkpoint_recomputes_the_replica_draws(preserve_rng_state):
    """With cr.checkpoint_context_fn, a checkpointed dropout recomputes the forward's mask
    (the gradient is zero exactly where y is), and the numbers are the plain-torch formula's,
    whether or not torch also saves and restores its default generators (the docs advise not)."""
    strategy = cr.MirroredStrategy(num_replicas=2)
    x = torch.linspace(1, 2, 64)
    torch.manual_seed(SEED)
    out = strategy.experimental_local_results(strategy.run(
        _checkpointed, args=(x, cr.checkpoint_context_fn, preserve_rng_state)))
    base = _base()
    for i, (y, grad) in enumerate(out):
        assert torch.equal(grad != 0, y != 0)
        torch.manual_seed(base + i)
        ref_y, ref_grad = _checkpointed(x, cr.checkpoint_context_fn)  # outside a replica: torch's own handling
        assert torch.equal(y, ref_y) and torch.equal(grad, ref_grad)
    assert not torch.equal(out[0][0], out[1][0])


def _dropout(x):
    return F.dropout(x, 0.5)


def _compiled_dropout_while_another_replica_compiles(x, started, compiled):
    """Replica 0 compiles three fresh functions while replica 1 draws dropout masks, compiled with
    aot_eager (the graph keeps native_dropout, which takes no generator), until they are done."""
    draw = torch.compile(_dropout, backend="aot_eager", dynamic=False)
    if cr.get_replica_context().replica_id_in_sync_group == 0:
        assert started.wait(60)
        for k in range(3):
            torch.compile(lambda t, k=k: (t.sin() * (k + 2)).cos() + t, backend="aot_eager")(x[: 10 + k])
        compiled.set()
        return x.new_empty(0, *x.shape)
    masks = [draw(x)]
    started.set()
    deadline = time.monotonic() + 60  # a failing replica 0 must not leave this one looping
    while not compiled.is_set() and time.monotonic() < deadline:
        masks.append(draw(x))
    assert compiled.is_set()
    return torch.stack(masks)


def test_compiling_in_one_replica_leaves_the_others_draws_alone():
    """torch.compile saves the default generator when it starts compiling and restores it at the
    end, in the compiling thread; a replica's swap for native_dropout in between used to draw from
    the restored state (its mask sequence diverged for good) or leave its state in the caller's."""
    torch._dynamo.reset()  # which drops torch's compile callbacks: the run registers them again
    strategy = cr.MirroredStrategy(num_replicas=2)
    x = torch.ones(64)
    started, compiled = threading.Event(), threading.Event()
    torch.manual_seed(SEED)
    masks = strategy.experimental_local_results(strategy.run(
        _compiled_dropout_while_another_replica_compiles, args=(x, started, compiled)))[1]
    after = torch.rand(4)  # the caller's generator: one draw (the run's base) from the seed
    _base()
    assert torch.equal(after, torch.rand(4))
    torch.manual_seed(_base() + 1)
    draw = torch.compile(_dropout, backend="aot_eager", dynamic=False)
    want = [draw(x) for _ in masks]
    assert len(masks) > 1
    assert [i for i, (a, b) in enumerate(zip(masks, want)) if not torch.equal(a, b)] == []


def test_a_swap_that_cannot_get_the_default_generator_times_out(monkeypatch):
    """The wait for torch's default generator (held by a compilation in another thread, here by
    the test) has the collective timeout, and its error says what it waited for."""
    from crossreplica import random_streams

    monkeypatch.setenv("CROSSREPLICA_TIMEOUT", "0.3")
    strategy = cr.MirroredStrategy(num_replicas=2)
    assert random_streams._swap_lock.acquire(timeout=5)
    try:
        with pytest.raises(cr.errors.CollectiveTimeoutError,
                           match=r"random op without a generator argument .* waited 0.3 s .* "
                                 r"torch.compile compilation holds.*CROSSREPLICA_TIMEOUT"):
            strategy.run(lambda: torch.native_dropout(torch.ones(8), 0.5, True))
        # the strategy's own timeout bounds it (not the environment's 300 s default)
        monkeypatch.delenv("CROSSREPLICA_TIMEOUT")
        start = time.monotonic()
        with pytest.raises(cr.errors.CollectiveTimeoutError, match=r"waited 0.2 s .*the strategy's timeout_seconds"):
            cr.MirroredStrategy(num_replicas=2, timeout_seconds=0.2).run(
                lambda: torch.native_dropout(torch.ones(8), 0.5, True))
        assert time.monotonic() - start < 5
    finally:
        random_streams._swap_lock.release()
    torch.manual_seed(SEED)  # and the lock works again
    out = strategy.experimental_local_results(strategy.run(lambda: torch.native_dropout(torch.ones(8), 0.5, True)[0]))
    torch.manual_seed(_base() + 1)
    assert torch.equal(out[1], torch.native_dropout(torch.ones(8), 0.5, True)[0])
