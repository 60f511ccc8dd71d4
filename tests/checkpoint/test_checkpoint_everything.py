"""Checkpoints of a whole training state: a model, CrossShardOptimizer(Adam), scheduler,
GradScaler, random streams and cr.Variables saved in one call, restored into fresh objects
with cr.load(into=...), resumed on the same and on other replica / worker counts."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import crossreplica as cr
from crossreplica.errors import CheckpointError

import checkpoint_training as job  # tests/support/

TOTAL, STOP = 6, 3


def _assert_same(a: dict, b: dict, bitwise: bool = True) -> None:
    assert (a["seen"], a["steps"], a["lr"], a["scale"]) == (b["seen"], b["steps"], b["lr"], b["scale"])
    for p, q in zip(a["params"], b["params"]):
        if bitwise:
            assert torch.equal(p, q), (p - q).abs().max()
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.fixture(params=["threads", pytest.param("processes", marks=pytest.mark.multiprocess),
                        pytest.param("2-hosts", marks=[pytest.mark.multiprocess, pytest.mark.hosts])])
def engine(request):
    """Threads; processes on this host; processes on 2 simulated hosts, each with its own
    /tmp (no shared file system: every worker saves and loads what it needs on its host)."""
    return request.param


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_resume_continues_bitwise_like_the_uninterrupted_run(tmp_path, engine, replicas, request):
    path = str(tmp_path / "ck.pt")
    if engine == "threads":
        straight, resumed = job.job_uninterrupted_and_resumed(cr.MirroredStrategy(replicas), path, TOTAL, STOP)
    else:
        if replicas == 1:
            pytest.skip("one replica is one process: the threads engine covers it")
        from crossreplica.testing import run_workers
        hosts = request.getfixturevalue("simulated_hosts") if engine == "2-hosts" else None
        straight, resumed = run_workers(job.job_uninterrupted_and_resumed, 2, replicas // 2,
                                        args=(path, TOTAL, STOP), hosts=hosts)[0]
        # on hosts the files lie in each host's own /tmp: nothing shared, nothing here
        assert os.path.exists(path) == (hosts is None)
    _assert_same(straight, resumed)  # bitwise: the restore missed nothing
    _assert_same(straight, job.reference([replicas] * TOTAL), bitwise=False)


def test_on_read_variable_saves_its_aggregate_and_per_replica_state_differs(tmp_path):
    strategy = cr.MirroredStrategy(2)
    state = job.build(strategy, 0)
    job.train(strategy, state, 2)
    path = tmp_path / "ck.pt"
    cr.save(path, state, strategy=strategy)
    with pytest.raises(CheckpointError, match=r"entry \['noise'\] holds per-replica state .* not on 1"):
        cr.load(path)  # outside the scope: the default strategy has one replica
    with strategy.scope():
        plain = cr.load(path)
    assert int(plain["seen"]["value"]) == 2 * job.ROWS  # the sum over both replicas' copies
    assert plain["epoch"] == 0 and "state" in plain["opt"] and "scale" in plain["scaler"]
    gens = plain["noise"]  # one state per replica: they were seeded differently
    assert isinstance(gens, cr.PerReplica) and not torch.equal(gens.values[0], gens.values[1])
    assert torch.equal(gens.values[1], strategy.experimental_local_results(state["noise"])[1].get_state())
    assert isinstance(plain["opt"], dict)  # the replicas' optimizers agree: saved once


@pytest.mark.parametrize("before, after", [(2, 4), (4, 1)])
def test_resume_on_another_replica_count(tmp_path, before, after):
    path, again = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    job.job_train_and_save(cr.MirroredStrategy(before), path, None, STOP)
    out = job.job_train_and_save(cr.MirroredStrategy(after), again, path, TOTAL - STOP)
    want = job.reference([before] * STOP + [after] * (TOTAL - STOP), noise=False)
    _assert_same(out, want, bitwise=False)


@pytest.mark.multiprocess
def test_resume_on_another_worker_count(tmp_path):
    """2 workers x 1 replica -> 2 workers x 2 replicas -> one process with one replica."""
    from crossreplica.testing import run_workers

    a, b, c = (str(tmp_path / f"{k}.pt") for k in "abc")
    run_workers(job.job_train_and_save, 2, 1, args=(a, None, 2))
    run_workers(job.job_train_and_save, 2, 2, args=(b, a, 2))
    out = job.job_train_and_save(cr.OneDeviceStrategy(), c, b, 2)
    _assert_same(out, job.reference([2, 2, 4, 4, 1, 1], noise=False), bitwise=False)


def test_per_replica_state_that_differs_restores_only_on_the_same_count(tmp_path):
    path = tmp_path / "ck.pt"
    s2 = cr.MirroredStrategy(2)
    with s2.scope():
        cr.save(path, {"noise": s2.run(job._make_noise)})
    s4 = cr.MirroredStrategy(4)
    fresh = {"noise": s4.run(job._make_noise)}
    with s4.scope():
        with pytest.raises(CheckpointError, match=r"into\['noise'\] holds per-replica state that differs "
                                                  r"between the 2 replicas .* not on 4"):
            cr.load(path, into=fresh)
        with pytest.raises(CheckpointError, match=r"entry \['noise'\] holds per-replica state"):
            cr.load(path)
    with s2.scope():
        with pytest.raises(CheckpointError, match=r"into\['noise'\] is a Mirrored \(identical copies\)"):
            cr.load(path, into={"noise": cr.Mirrored([torch.Generator(), torch.Generator()])})
        restored = s2.run(job._make_noise)
        for g in restored.values:
            g.manual_seed(0)
        cr.load(path, into={"noise": restored})
        assert [g.initial_seed() for g in restored.values] == [100, 101]


def test_random_streams_of_every_kind_round_trip(tmp_path):
    path = tmp_path / "ck.pt"
    gen, np_rng, py_rng = torch.Generator().manual_seed(3), np.random.RandomState(4), random.Random(5)
    torch.manual_seed(6)
    streams = {"gen": gen, "numpy": np_rng, "python": py_rng, "cpu": torch.default_generator}
    cr.save(path, streams)
    want = (torch.rand(3, generator=gen), np_rng.rand(3), py_rng.random(), torch.rand(3))
    fresh = {"gen": torch.Generator(), "numpy": np.random.RandomState(0), "python": random.Random(0),
             "cpu": torch.default_generator}
    torch.manual_seed(0)
    cr.load(path, into=fresh)
    got = (torch.rand(3, generator=fresh["gen"]), fresh["numpy"].rand(3), fresh["python"].random(), torch.rand(3))
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
    assert torch.equal(got[3], want[3])


def test_mirrored_tensors_and_plain_tensors_restore_in_place(tmp_path):
    path = tmp_path / "ck.pt"
    s = cr.MirroredStrategy(2)
    with s.scope():
        cr.save(path, {"m": s.mirror(torch.arange(3.0)), "t": torch.ones(2), "n": 5})
    s4 = cr.MirroredStrategy(4)
    target = {"m": s4.mirror(torch.zeros(3)), "t": torch.zeros(2), "n": 0}
    with s4.scope():
        out = cr.load(path, into=target)
    assert all(torch.equal(v, torch.arange(3.0)) for v in target["m"].values)
    assert torch.equal(target["t"], torch.ones(2)) and target["n"] == 0 and out["n"] == 5


def test_sharded_optimizer_state_is_taken_inside_the_replicas(tmp_path):
    s = cr.MirroredStrategy(2)
    model = s.mirror(job.make_net(0))

    def make(m):
        return cr.CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=0.1), shard_optimizer_state=True)

    def step(m, opt, x):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()

    opts = s.run(make, args=(model,))
    x = cr.PerReplica([torch.randn(2, job.DIM), torch.randn(2, job.DIM)])
    s.run(step, args=(model, opts, x))
    path = tmp_path / "ck.pt"
    with s.scope():
        cr.save(path, {"opt": opts})
        saved = cr.load(path)["opt"]
    want = s.experimental_local_results(s.run(lambda o: o.state_dict(), args=(opts,)))[0]
    assert set(saved["state"]) == set(want["state"])
    for k, v in want["state"][0].items():
        assert torch.equal(saved["state"][0][k], v)


# ---------------------------------------------------------------- bad inputs


class NoState:
    pass


def test_errors_name_the_entry(tmp_path):
    path = tmp_path / "ck.pt"
    model = torch.nn.Linear(3, 2)
    sched_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cr.save(path, {"model": model, "opt": sched_opt, "t": torch.ones(2)})
    with pytest.raises(TypeError, match=r"into\['x'\] is a NoState, which cannot be restored in place"):
        cr.load(path, into={"x": NoState()})
    with pytest.raises(CheckpointError, match=r"no entry for into\['sched'\] \(its keys there: "):
        cr.load(path, into={"sched": torch.optim.lr_scheduler.StepLR(sched_opt, 1)})
    with pytest.raises(CheckpointError, match=r"(?s)cannot restore into\['model'\] \(a Linear\).*size mismatch"):
        cr.load(path, into={"model": torch.nn.Linear(4, 2)})
    with pytest.raises(CheckpointError, match=r"into\['t'\] has shape \[3\], but the checkpoint's tensor"):
        cr.load(path, into={"t": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"into\['t'\] is a container, but the checkpoint holds"):
        cr.load(path, into={"t": {"a": torch.zeros(2)}})


def test_a_per_replica_value_needs_its_strategy(tmp_path):
    s = cr.MirroredStrategy(2)
    opts = s.run(lambda: torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"state\['opts'\] is a PerReplica of 2 values, but the strategy "
                                         r"OneDeviceStrategy has 1 local replicas"):
        cr.save(tmp_path / "ck.pt", {"opts": opts})
    with s.scope():
        cr.save(tmp_path / "ck.pt", {"opts": opts})
        with pytest.raises(ValueError, match=r"into\['opts'\] is a PerReplica of 2 values, but the strategy "
                                             r"MirroredStrategy has 4"):
            cr.load(tmp_path / "ck.pt", into={"opts": opts}, strategy=cr.MirroredStrategy(4))
