"""The training state of a fault-tolerant job (crossreplica/elastic/state.py): put back as it
was at a step's start, and handed to a joining worker as tensors and plain values."""

from __future__ import annotations

import io
import os

import pytest
import torch

import crossreplica as cr
from crossreplica.elastic import TrainingState


class Position:
    """A data position of the user's own, with state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.epoch, self.index = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


def _job(seed: int = 0):
    """A model, its optimizer, an LR scheduler, a GradScaler, a generator and a position."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
    gen = torch.Generator().manual_seed(seed + 1)
    return model, opt, sched, scaler, gen, Position()


def _step(job) -> torch.Tensor:
    model, opt, sched, scaler, gen, pos = job
    x = torch.randn(6, 4, generator=gen)
    loss = model(x).square().mean() + torch.rand(()) * 0  # draws from the default stream too
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    pos.index += 6
    return loss.detach()


def _local(leaf):
    return [leaf]


def _fingerprint(job) -> list:
    model, opt, sched, scaler, gen, pos = job
    tensors = [*(t.clone() for t in model.state_dict().values()),
               *(v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)),
               gen.get_state(), torch.get_rng_state()]
    return [tensors, opt.param_groups[0]["lr"], sched.state_dict(), scaler.state_dict(), pos.state_dict()]


def _same(a: list, b: list) -> bool:
    return (len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:])


def test_a_failed_step_is_undone_for_every_kind_of_object():
    job = _job()
    state = TrainingState(_local, job)
    for _ in range(3):
        _step(job)
    state.snapshot()
    before = _fingerprint(job)
    _step(job)
    _step(job)  # the LR halves, the scaler grows, the generators and the position move
    assert not _same(before, _fingerprint(job))
    state.rollback()
    assert _same(before, _fingerprint(job))
    assert all(p.grad is None for p in job[0].parameters())


def test_a_joining_worker_takes_the_live_state_and_then_trains_bitwise_as_the_chief():
    chief, joiner = _job(0), _job(7)
    sent = TrainingState(_local, chief)
    for _ in range(3):
        _step(chief)
    rng = torch.get_rng_state()
    data = sent.serialize(3, {"loss": torch.tensor(0.5), "epoch": 1})
    torch.manual_seed(99)  # the joiner's own default stream, which the hand-over replaces
    completed, result = TrainingState(_local, joiner).load(data, "worker 0 (rank 0)")
    assert completed == 3 and result["epoch"] == 1 and torch.equal(result["loss"], torch.tensor(0.5))
    assert torch.equal(torch.get_rng_state(), rng)
    assert _same(_fingerprint(chief), _fingerprint(joiner))
    torch.set_rng_state(rng)
    a = [_step(chief) for _ in range(3)]
    torch.set_rng_state(rng)
    b = [_step(joiner) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert _same(_fingerprint(chief), _fingerprint(joiner))


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bytes_from_a_peer_never_run_code(tmp_path):
    """A crafted hand-over (a pickle that opens a file when unpickled) is refused unread."""
    marker = str(tmp_path / "ran")
    buf = io.BytesIO()
    torch.save({"format": "crossreplica.elastic.state/1", "states": [_Payload(marker)]}, buf)
    with pytest.raises(cr.errors.CheckpointError, match="handed over by worker 0 .* not tensors and plain values"):
        TrainingState(_local, _job()).load(buf.getvalue(), "worker 0 (rank 0)")
    assert not os.path.exists(marker)


def test_workers_whose_states_differ_are_told_so():
    data = TrainingState(_local, _job()).serialize(0, None)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(cr.errors.CheckpointError, match="every worker must pass FaultTolerance the same state"):
        TrainingState(_local, (model, torch.optim.SGD(model.parameters(), lr=0.1))).load(data, "worker 0")


class _Opaque:
    def state_dict(self):
        return {"fn": lambda: 0}

    def load_state_dict(self, state):
        pass


def test_what_cannot_cross_safely_is_refused_when_the_job_starts():
    with pytest.raises(TypeError, match=r"object 0 of the state .* holds another value at state_dict\(\)\['fn'\]"):
        TrainingState(_local, [_Opaque()])
    with pytest.raises(TypeError, match="state must hold modules, optimizers, torch.Generators and objects with "
                                        "state_dict"):
        TrainingState(_local, [object()])
    state = TrainingState(_local, [torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="the step's result"):
        state.serialize(1, {"f": _Opaque()})
