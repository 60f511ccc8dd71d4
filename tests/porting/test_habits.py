"""Habits from DDP and single-process code that used to train wrong without a word.

Each is now correct or a warning/error naming the cause and the fix, on in-process
replicas (MirroredStrategy) and on worker processes (crossreplica.testing.run_workers):

* a plain torch optimizer stepping mirrored copies (CrossShardOptimizer forgotten);
* DDP's ``backward; clip_grad_norm_; step`` with the default CrossShardOptimizer;
* ``cr.save`` of mirrored copies that differ, across workers too;
* ``cr.save`` / ``cr.load`` called on the chief only (``if master_process:``);
* intra-op threads: each replica computes with an equal share of the caller's.
"""

from __future__ import annotations

import functools
import time
import warnings

import pytest
import torch

from harness import run_layout as run_main
from plain_torch import mse, one_device_training

import crossreplica as cr
from crossreplica.logs import ReplicasDivergeWarning
from crossreplica.testing import run_workers

LAYOUTS = [
    pytest.param(("threads", 1, 2), id="threads-1x2"),
    pytest.param(("processes", 2, 1), id="processes-2x1", marks=pytest.mark.multiprocess),
]


def _data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 2)


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _caught(fn):
    """``fn()``'s result and the messages of the ReplicasDivergeWarnings it issued (any thread)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen if issubclass(w.category, ReplicasDivergeWarning)]


# ------------------------------------------------------------------ a plain optimizer


def _plain_optimizer(strategy, reduce_first: bool, steps: int = 1):
    model = strategy.mirror(_model())
    opts = strategy.run(lambda m: torch.optim.SGD(m.parameters(), lr=0.5), args=(model,))
    batches = strategy.distribute_dataset([_data()] * steps)

    def step(m, opt, batch):
        opt.zero_grad()
        _loss(m, batch).backward()
        if reduce_first:
            for p, g in zip(m.parameters(), cr.all_reduce([p.grad for p in m.parameters()], "mean")):
                p.grad = g
        opt.step()

    _, messages = _caught(lambda: [strategy.run(step, args=(model, opts, b)) for b in batches])
    weight = strategy.experimental_local_results(model)[0].weight.detach().clone()
    return messages, weight


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plain_optimizer_on_mirrored_copies_warns(layout):
    for messages, _ in run_main(_plain_optimizer, layout, False):
        assert len(messages) == layout[2], messages  # once per replica's optimizer, not every step
        assert "SGD.step() ran in a replica of 2 with no cross-replica reduction" in messages[0]
        assert "cr.CrossShardOptimizer(SGD(...))" in messages[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plain_optimizer_after_reducing_the_gradients_is_fine(layout):
    # Several runs with the same number of collectives each: a later run's replica context
    # must not pass for the earlier one's (their ids may coincide).
    results = run_main(_plain_optimizer, layout, True, 3)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        _loss(model, _data()).backward()
        opt.step()
    expected = model.weight.detach()
    for messages, weight in results:
        assert messages == []
        torch.testing.assert_close(weight, expected)


def test_one_replica_never_warns():
    for strategy in (cr.OneDeviceStrategy(), cr.MirroredStrategy(1)):
        messages, _ = _plain_optimizer(strategy, False)
        assert messages == []


# ------------------------------------------------------------------ DDP's clipping idiom


def _clipped(strategy, mode: str):
    model = strategy.mirror(_model())
    overlap = mode == "overlap"
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5), overlap=overlap),
                        args=(model,))
    (batch,) = strategy.distribute_dataset([_data()])

    def step(m, opt, batch):
        opt.zero_grad()
        _loss(m, batch).backward()
        if mode == "synchronize":
            opt.synchronize()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        opt.step()

    _, messages = _caught(lambda: strategy.run(step, args=(model, opts, batch)))
    return messages, [p.detach().clone() for p in strategy.experimental_local_results(model)[0].parameters()]


def _clipped_reference() -> list[torch.Tensor]:
    """DDP's numbers: the mean gradient of the whole batch, clipped, then one SGD step."""
    return one_device_training(_model(), functools.partial(torch.optim.SGD, lr=0.5), [_data()], mse,
                               before_step=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)).params


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clipping_unreduced_gradients_warns(layout):
    for messages, params in run_main(_clipped, layout, "ddp"):
        assert len(messages) == layout[2] and "clip_grad_norm_" in messages[0] and "opt.synchronize()" in messages[0]
        # what it warns about: the replicas clipped their own gradients, not the mean
        assert not all(torch.allclose(a, b) for a, b in zip(params, _clipped_reference()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["synchronize", "overlap"])
def test_clipping_reduced_gradients_gives_ddps_numbers(layout, mode):
    expected = _clipped_reference()
    for messages, params in run_main(_clipped, layout, mode):
        assert messages == []
        for a, b in zip(params, expected):
            torch.testing.assert_close(a, b)


def test_overlap_and_synchronize_clip_the_same_bits():
    strategy = cr.MirroredStrategy(2)
    (_, a), (_, b) = _clipped(strategy, "synchronize"), _clipped(strategy, "overlap")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ cr.save of copies that differ


def _save_diverged(strategy, directory: str, apart: bool):
    model = strategy.mirror(_model())
    if apart:  # every replica's copy trained on its own shard
        opts = strategy.run(lambda m: torch.optim.SGD(m.parameters(), lr=0.5), args=(model,))
        batches = strategy.distribute_dataset([_data()])

        def step(m, opt, batch):
            _loss(m, batch).backward()
            opt.step()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplicasDivergeWarning)
            for b in batches:
                strategy.run(step, args=(model, opts, b))
    _, saved = _caught(lambda: cr.save(f"{directory}/ckpt.pt", {"model": model}, strategy=strategy))
    return saved


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saving_copies_that_differ_warns_on_every_worker(layout, tmp_path):
    for messages in run_main(_save_diverged, layout, str(tmp_path), True):
        assert len(messages) == 1, messages
        assert "the copies of the Mirrored at state['model'] differ" in messages[0]
        assert "CrossShardOptimizer" in messages[0]
    for messages in run_main(_save_diverged, layout, str(tmp_path), False):
        assert messages == []


# ------------------------------------------------------------------ cr.save on the chief only


def _chief_only(strategy, api: str, directory: str):
    model = strategy.mirror(_model())
    path = f"{directory}/ckpt.pt"
    cr.save(path, {"model": model}, strategy=strategy)  # every worker: fine
    start = time.monotonic()
    try:
        if strategy.extended.is_chief:
            if api == "save":
                cr.save(path, {"model": model}, strategy=strategy)
            else:
                cr.load(path, into={"model": model}, strategy=strategy)
        strategy.run(lambda: cr.all_reduce(torch.ones(3), "sum"))  # the next step
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e}"
    return outcome, time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.parametrize("api", ["save", "load"])
@pytest.mark.parametrize("per_worker", [1, 2], ids=["2x1", "2x2"])
def test_a_checkpoint_on_the_chief_only_fails_fast_on_every_worker(api, per_worker, tmp_path):
    timeout = 60.0
    (chief, chief_s), (other, other_s) = run_workers(_chief_only, 2, per_worker, args=(api, str(tmp_path)),
                                                    timeout_seconds=timeout)
    assert chief.startswith("CollectiveMismatchError"), chief
    assert f"cr.{api} was called on worker rank 0, but worker ranks [1]" in chief
    assert "every worker must call it" in chief and "if master_process:" in chief
    assert f"cr.{api}" in other and "every worker must call it" in other, other
    assert max(chief_s, other_s) < timeout / 4, (chief_s, other_s)


# ------------------------------------------------------------------ intra-op threads


def _threads_of(strategy, caller: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(caller)
    try:
        inside = strategy.experimental_local_results(strategy.run(lambda: torch.tensor(torch.get_num_threads())))
        return [int(t) for t in inside], torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("replicas, caller, share", [(2, 2, 1), (2, 4, 2), (4, 2, 1), (1, 3, 3)])
def test_replicas_share_the_callers_intra_op_threads(replicas, caller, share):
    inside, after = _threads_of(cr.MirroredStrategy(replicas), caller)
    assert inside == [share] * replicas
    assert after == caller  # the caller's own count is left as it was


def test_the_layout_invariant_mode_sets_its_own_thread_count():
    strategy = cr.MirroredStrategy(2, layout_invariant=cr.LayoutInvariant(micro_batches=2, intra_op_threads=3))
    inside, after = _threads_of(strategy, 4)
    assert inside == [3, 3] and after == 4


@pytest.mark.multiprocess
def test_replicas_of_a_worker_share_its_threads():
    """torchrun gives each worker OMP_NUM_THREADS=1 (crossreplica.testing's workers too): each
    of its replicas computes with one thread."""
    for inside, after in run_workers(_threads_of, 1, 2, args=(1,)):
        assert inside == [1, 1] and after == 1
