"""The same-host all-reduce through shared memory (engines/torch_dist/shared_memory.py):
CrossShardOptimizer(overlap=True)'s buckets on workers of one host take it, with the
bytes the backend path computes; it leaves no files behind, releases the others when
a worker fails or is late, and steps aside when the workers do not agree to use it."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import crossreplica as cr
from crossreplica.engines.torch_dist import shared_memory
from crossreplica.testing import launch, run_workers

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not (os.path.isdir(shared_memory.SHM_DIR) and os.access(shared_memory.SHM_DIR, os.W_OK)),
                                 reason="no writable /dev/shm: the workers use the backend")]


def _net() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return net


def _train(strategy: cr.Strategy, same_host: bool, dtype: torch.dtype = torch.float32) -> dict:
    """Three steps of momentum SGD with overlap=True and small buckets (several per step,
    one of them a single parameter), the second one accumulated over two backward passes."""
    engine = strategy.extended.engine
    saved = engine.shared_memory
    if not same_host:
        engine.shared_memory = None  # the backend path, for the reference

    def replica_fn() -> dict:
        rid = cr.replica_id()
        model = _net().to(dtype)
        opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     bytes_per_pack=600 * torch.empty((), dtype=dtype).element_size(),
                                     overlap=True)
        grads = []
        for step in range(3):
            opt.zero_grad()
            for k in range(2 if step == 1 else 1):
                g = torch.Generator().manual_seed(100 * step + 10 * k + rid)
                x, y = torch.randn(5, 6, generator=g).to(dtype), torch.randint(0, 3, (5,), generator=g)
                if k == 0 and step == 1:
                    with opt.no_sync():
                        F.cross_entropy(model(x), y).backward()
                else:
                    F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        return {"params": [p.detach().clone() for p in model.parameters()], "grads": grads}

    try:
        out = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    finally:
        engine.shared_memory = saved
    reducer = engine.shared_memory
    out["enabled"] = reducer is not None and reducer.enabled and same_host
    out["buffers"] = len(reducer._segments) if reducer is not None else 0
    return out


def _both_paths(strategy: cr.Strategy, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    return _train(strategy, True, dtype), _train(strategy, False, dtype)


@pytest.mark.parametrize("workers", [2, 3])
def test_same_host_path_is_bitwise_the_backend_path(workers):
    results = run_workers(_both_paths, workers)
    for shm, backend in results:
        assert shm["enabled"] and shm["buffers"] >= 3
        for a, b in zip(shm["grads"] + [shm["params"]], backend["grads"] + [backend["params"]]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    first = results[0][0]
    for shm, _ in results[1:]:  # every worker holds the same reduced gradients
        for a, b in zip(first["grads"], shm["grads"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def _float16_takes_the_backend(strategy: cr.Strategy) -> tuple[dict, dict]:
    return _both_paths(strategy, torch.float16)


def test_dtypes_reduced_through_float32_take_the_backend():
    for shm, backend in run_workers(_float16_takes_the_backend, 2):
        assert shm["buffers"] == 0
        for x, y in zip(shm["params"], backend["params"]):
            assert torch.equal(x, y)


def _no_files_named(strategy: cr.Strategy) -> list[str]:
    _train(strategy, True)
    reducer = strategy.extended.engine.shared_memory
    mine = f"crossreplica-{reducer._tokens[strategy.extended.engine.rank]}-"
    return [f for f in os.listdir(shared_memory.SHM_DIR) if f.startswith(mine)]


def test_no_files_left_in_dev_shm():
    assert run_workers(_no_files_named, 2) == [[], []]


def _refuse_on_rank1(strategy: cr.Strategy) -> dict:
    if strategy.extended.engine.rank == 1:  # as a worker on another host: it cannot read the probes
        shared_memory.reads = lambda path, token: False
    shm, backend = _both_paths(strategy)
    shm["reference"] = backend["params"]
    shm["probed"] = strategy.extended.engine.shared_memory._enabled
    return shm


def test_workers_that_cannot_see_each_other_use_the_backend():
    for out in run_workers(_refuse_on_rank1, 2):
        assert out["probed"] is False and out["buffers"] == 0
        for x, y in zip(out["params"], out["reference"]):
            assert torch.equal(x, y)


def _engine_has_it(strategy: cr.Strategy) -> bool:
    return strategy.extended.engine.shared_memory is not None


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("CROSSREPLICA_SHARED_MEMORY", "0")
    assert run_workers(_engine_has_it, 2) == [False, False]
    monkeypatch.setenv("CROSSREPLICA_SHARED_MEMORY", "1")
    assert run_workers(_engine_has_it, 2) == [True, True]


def _late_in_backward(x: torch.Tensor) -> bool:
    model = _net()
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
    F.cross_entropy(model(x), torch.zeros(5, dtype=torch.long)).backward()  # sets the buffers up
    opt.step()
    out = model(x)
    if cr.replica_id() == 1:
        time.sleep(6)  # alive, but its gradients come too late
    F.cross_entropy(out, torch.zeros(5, dtype=torch.long)).backward()
    opt.step()
    return True


def test_late_worker_times_out_naming_it():
    out = launch(_late_in_backward, [torch.ones(5, 6)] * 2, timeout_seconds=2.0)
    survivor = out.failures[0]
    assert survivor.is_instance("CollectiveTimeoutError"), survivor
    assert "same-host shared memory" in survivor.message and "worker ranks [1]" in survivor.message, survivor
    assert survivor.elapsed < 6, survivor


def _fails_in_backward(x: torch.Tensor, how: str) -> bool:
    """Two steps; in the second, replica 1 raises (``how="raise"``) or its process dies
    (``"die"``: no exception, no clean-up) in the middle of backward."""
    model = _net()
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bytes_per_pack=256, overlap=True)
    for step in range(2):
        out = model(x)
        if step == 1 and cr.replica_id() == 1:
            def fail(grad):
                if how == "die":
                    os._exit(3)
                raise RuntimeError("replica failed mid-backward")
            out.register_hook(fail)
        F.cross_entropy(out, torch.zeros(5, dtype=torch.long)).backward()
        opt.step()
    return True


def test_failing_worker_releases_the_other():
    out = launch(_fails_in_backward, [torch.ones(5, 6)] * 2, ["raise"] * 2, timeout_seconds=60.0)
    assert set(out.failures) == {0, 1}, out.log[-3000:]
    survivor = out.failures[0]
    assert "mid-backward" in survivor.message, survivor
    assert survivor.elapsed < 20, survivor


def _full_on_rank1(strategy: cr.Strategy) -> dict:
    if strategy.extended.engine.rank == 1:  # /dev/shm fills up on one worker at the second buffer
        create, calls = shared_memory.create, []

        def failing(path, numel, dtype):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            return create(path, numel, dtype)
        shared_memory.create = failing
    shm, backend = _both_paths(strategy)
    shm["reference"] = backend["params"]
    return shm


def test_a_buffer_one_worker_cannot_create_is_given_up_everywhere():
    for out in run_workers(_full_on_rank1, 2):
        assert out["enabled"] and out["buffers"] == 2  # the other two buckets keep shared memory
        for x, y in zip(out["params"], out["reference"]):
            assert torch.equal(x, y)


def test_dead_worker_fails_the_other_promptly():
    out = launch(_fails_in_backward, [torch.ones(5, 6)] * 2, ["die"] * 2, timeout_seconds=60.0)
    assert out.exitcodes[1] == 3
    survivor = out.failures[0]
    assert survivor.is_instance("WorkerFailedError"), survivor
    assert "worker ranks [1]" in survivor.message and "died" in survivor.message, survivor
    assert survivor.elapsed < 20, survivor


def _collectives(strategy: cr.Strategy, same_host: bool) -> dict:
    engine = strategy.extended.engine
    saved = engine.shared_memory
    if not same_host:
        engine.shared_memory = None

    def replica_fn() -> dict:
        rid = cr.replica_id()
        g = torch.Generator().manual_seed(rid)
        xs = {"small": torch.randn(3, 5, generator=g), "grows the arena": torch.randn(700_000, generator=g),
              "half": torch.randn(33, generator=g).half(), "ints": torch.arange(6) * (rid + 1)}
        kept = {k: v.clone() for k, v in xs.items()}
        out = {f"{k}/{op}": cr.all_reduce(v, op) for k, v in xs.items() for op in ("sum", "mean", "max", "min")
               if not (k == "ints" and op == "mean")}
        out["nest"] = cr.all_reduce({"a": xs["small"], "b": [xs["small"] * 2, torch.ones(4, dtype=torch.float64)]})
        out["untouched"] = all(torch.equal(kept[k], xs[k]) for k in xs)
        return out

    try:
        out = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    finally:
        engine.shared_memory = saved
    out["arenas"] = sorted(str(d) for d in saved._arenas) if saved is not None and same_host else []
    return out


def _collectives_both(strategy: cr.Strategy) -> tuple[dict, dict]:
    return _collectives(strategy, True), _collectives(strategy, False)


@pytest.mark.parametrize("workers", [2, 3])
def test_collectives_through_the_arena_are_bitwise_the_backend(workers):
    for shm, backend in run_workers(_collectives_both, workers):
        assert shm["arenas"] == ["torch.float32", "torch.float64"]  # float16 travels as float32
        assert shm["untouched"] and backend["untouched"]
        for key, ref in backend.items():
            if key in ("untouched", "arenas"):
                continue
            got = shm[key]
            for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref)):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
