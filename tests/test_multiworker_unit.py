"""MultiWorkerMirroredStrategy in this process: argument checking and the single-worker fallback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import crossreplica as cr


@pytest.mark.parametrize("kwargs,match", [
    ({"replicas_per_worker": 0}, "replicas_per_worker must be a positive int; got 0"),
    ({"replicas_per_worker": True}, "replicas_per_worker must be a positive int; got True"),
    ({"backend": "mpi"}, r"backend must be one of \['gloo', 'nccl'\] or None \(automatic\); got 'mpi'"),
    ({"timeout_seconds": 0}, r"timeout_seconds must be a positive number of seconds, at most 604800 \(one week\); got 0"),
    ({"replicas_per_worker": 2, "devices": ["cpu"]}, "devices must be a list with one device per local replica"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cr.MultiWorkerMirroredStrategy(**kwargs)


def test_nccl_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="backend='nccl' needs the replicas on CUDA devices"):
        cr.MultiWorkerMirroredStrategy(backend="nccl")


def test_partial_launcher_environment_is_a_clear_error(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=r"\['MASTER_ADDR', 'MASTER_PORT'\] are not set; launch with `torchrun"):
        cr.MultiWorkerMirroredStrategy()


def _double(x):
    return cr.all_reduce(x, "sum") * cr.num_replicas()


def test_without_launcher_runs_as_one_worker(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    strategy = cr.MultiWorkerMirroredStrategy(replicas_per_worker=2)
    try:
        assert strategy.num_replicas_in_sync == 2 and strategy.extended.is_chief
        out = strategy.run(_double, (cr.PerReplica((torch.ones(2), 2 * torch.ones(2))),))
        assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[6.0, 6.0]] * 2
        assert strategy.reduce("sum", out).tolist() == [12.0, 12.0]
    finally:
        strategy.close()
    assert not dist.is_initialized()


def test_check_collectives_from_environment(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CROSSREPLICA_CHECK_COLLECTIVES", "1")
    strategy = cr.MultiWorkerMirroredStrategy()
    try:
        assert strategy.extended.engine.check_collectives
        out = strategy.run(_double, (torch.ones(1),))
        assert strategy.experimental_local_results(out)[0].item() == 1.0
    finally:
        strategy.close()
    monkeypatch.setenv("CROSSREPLICA_CHECK_COLLECTIVES", "0")
    strategy = cr.MultiWorkerMirroredStrategy(check_collectives=None)
    try:
        assert not strategy.extended.engine.check_collectives
    finally:
        strategy.close()
