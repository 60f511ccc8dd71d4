"""Workers that make different collective calls get a CollectiveMismatchError at once, on
the default path (no CROSSREPLICA_CHECK_COLLECTIVES), through shared memory and through
gloo, with one and two replicas per worker: never a mix of their data, never a wait until
the timeout (engines/torch_dist/agreement.py)."""

from __future__ import annotations

import pytest
import torch

import crossreplica as cr
from crossreplica.engines.base import Call, Kind
from crossreplica.engines.kinds import AllReduceParams
from crossreplica.engines.torch_dist import agreement
from crossreplica.reduce_op import ReduceOp
from crossreplica.testing import launch

COLLECTIVE_TIMEOUT = 60.0  # a mismatch must be reported long before this
PROMPT = 15.0  # seconds: "at once", with room for a loaded machine


def _worker() -> int:
    return cr.get_replica_context().strategy.extended.worker_rank


def other_shapes(x: torch.Tensor) -> torch.Tensor:
    cr.all_reduce(x, "sum")  # agreed
    return cr.cross_replica_sum(torch.ones(1 + 2 * _worker()))  # [1] on worker 0, [3] on worker 1


def other_ops(x: torch.Tensor) -> torch.Tensor:
    cr.all_reduce(x, "sum")
    return cr.all_reduce(x + cr.replica_id(), "max" if _worker() else "sum")


def other_dtypes(x: torch.Tensor) -> torch.Tensor:
    cr.all_reduce(x, "sum")
    return cr.all_reduce(x.double() if _worker() else x, "sum")


def other_kinds(x: torch.Tensor) -> torch.Tensor:
    cr.all_reduce(x, "sum")
    return cr.all_gather(x, 0) if _worker() else cr.all_reduce(x, "sum")


def chief_only_reduce(x: torch.Tensor) -> torch.Tensor:
    """A DDP habit: the chief reduces the loss to print it, the others go on to the gradients."""
    loss = cr.all_reduce(x.sum(), "sum")
    if _worker() == 0:
        cr.all_reduce(loss, "mean")
    return cr.all_reduce(torch.ones(64), "sum")


CASES = {"shapes": other_shapes, "ops": other_ops, "dtypes": other_dtypes, "kinds": other_kinds,
         "chief_only": chief_only_reduce}


@pytest.fixture(params=["shared_memory", "gloo"])
def transport(request, monkeypatch):
    if request.param == "gloo":
        monkeypatch.setenv("CROSSREPLICA_SHARED_MEMORY", "0")
    return request.param


# gloo aborts a process whose peer sends a payload of another size (before any check of ours
# could read it): there the other worker names the crash and the likely cause.
ABORTED_BY_GLOO = {"shapes", "dtypes", "kinds", "chief_only"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n,rpw", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_different_calls_fail_at_once_on_the_default_path(case, n, rpw, transport):
    out = launch(CASES[case], [torch.arange(3.0)] * n, num_replicas=n, replicas_per_worker=rpw,
                 timeout_seconds=COLLECTIVE_TIMEOUT)
    assert not out.results, out.results  # never a result
    if transport == "gloo" and rpw == 1 and case in ABORTED_BY_GLOO and set(out.failures) != {0, 1}:
        assert any(code != 0 for code in out.exitcodes.values()), out.log[-3000:]
        for err in out.failures.values():
            assert "another collective call" in err.message and "CROSSREPLICA_CHECK_COLLECTIVES" in err.message, err
            assert err.elapsed < PROMPT, err
        return
    assert set(out.failures) == {0, 1}, out.log[-3000:]
    named = [err for err in out.failures.values() if err.is_instance("CollectiveMismatchError")]
    assert named, out.failures  # at least the worker that found it names the mismatch ...
    for err in out.failures.values():  # ... and every worker fails promptly, for that cause
        assert err.is_instance("CollectiveMismatchError") or "different collective calls" in err.message, err
        assert err.elapsed < PROMPT, err


def agreed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every form that carries a stamp, agreed: the results are the reference's."""
    total = cr.all_reduce(x, "sum")
    big = cr.all_reduce(torch.full((100_000,), float(cr.replica_id())), "max")
    ints = cr.all_reduce(torch.tensor([cr.replica_id()], dtype=torch.int8), "sum")
    return total, big[:3], ints


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,rpw", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_agreed_calls_pass_with_the_reference_values(n, rpw, transport):
    out = launch(agreed, [torch.arange(3.0)] * n, num_replicas=n, replicas_per_worker=rpw,
                 timeout_seconds=COLLECTIVE_TIMEOUT)
    assert not out.failures, out.log[-3000:]
    for total, big, ints in out.results.values():
        assert torch.equal(total, torch.arange(3.0) * n)
        assert torch.equal(big, torch.full((3,), float(n - 1)))
        assert torch.equal(ints, torch.tensor([sum(range(n))], dtype=torch.int8))


# ---------------------------------------------------------------------- the stamps themselves


def _call(op: ReduceOp = ReduceOp.SUM, shape=(3,), dtype=torch.float32, groups=((0, 1),)) -> Call:
    return Call(Kind.ALL_REDUCE, groups, AllReduceParams(op), (shape,), (dtype,))


def test_stamps_differ_with_every_field_and_the_sequence_number():
    base = agreement.stamp_of(5, [_call()])
    assert agreement.stamp_of(5, [_call()]) == base
    for other in (agreement.stamp_of(6, [_call()]), agreement.stamp_of(5, [_call(op=ReduceOp.MAX)]),
                  agreement.stamp_of(5, [_call(shape=(4,))]), agreement.stamp_of(5, [_call(dtype=torch.float64)]),
                  agreement.stamp_of(5, [_call(groups=((1, 0),))])):
        assert other.digest != base.digest
    assert 0 <= base.digest < 2 ** 63  # one int64 word
    # over several groups, parameters may differ between groups: only kind and groups are stamped
    a = agreement.stamp_of(1, [_call(groups=((0,), (1,)))])
    b = agreement.stamp_of(1, [_call(op=ReduceOp.MAX, groups=((0,), (1,)))])
    assert a.digest == b.digest


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN])
@pytest.mark.parametrize("dtype", sorted(agreement.CHECKED_DTYPES, key=str))
@pytest.mark.parametrize("workers", [2, 3, 8, 300])
def test_check_elements_reduce_to_the_expected_values_only_when_every_stamp_agrees(op, dtype, workers):
    mine = agreement.stamp_of(7, [_call()])
    other = agreement.stamp_of(7, [_call(op=ReduceOp.MAX)])
    cpu = torch.device("cpu")

    def reduced(stamps):
        rows = torch.stack([agreement.check_elements(s, op, dtype, workers, cpu) for s in stamps])
        if op in (ReduceOp.SUM, ReduceOp.MEAN):
            return rows.sum(0)
        return rows.amax(0) if op is ReduceOp.MAX else rows.amin(0)

    agreement.verify_elements(reduced([mine] * workers), mine, op, workers, "test", 0)
    with pytest.raises(cr.CollectiveMismatchError, match="different collective calls"):
        agreement.verify_elements(reduced([mine] * (workers - 1) + [other]), mine, op, workers, "test", 0)
