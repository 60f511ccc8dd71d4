"""Arguments that used to pass validation and fail later are refused at the boundary."""

from __future__ import annotations

import time

import pytest
import torch

import crossreplica as cr
from crossreplica.errors import summarize
from crossreplica.groups import canonical_groups

pytestmark = pytest.mark.reliability


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e10, -1.0, 0])
@pytest.mark.parametrize("make", [
    lambda t: cr.MirroredStrategy(2, timeout_seconds=t),
    lambda t: cr.MultiWorkerMirroredStrategy(timeout_seconds=t),
    lambda t: cr.CommunicationOptions(timeout_seconds=t),
], ids=["mirrored", "multi_worker", "communication_options"])
def test_timeout_out_of_range_is_value_error_with_range(make, value):
    with pytest.raises(ValueError, match=r"timeout_seconds must be a positive number of seconds, at most "
                                         r"604800 \(one week\); got " + str(value).replace(".", r"\.")):
        make(value)


@pytest.mark.parametrize("value", ["5", None.__class__, True])
def test_timeout_of_wrong_type_is_type_error(value):
    with pytest.raises(TypeError, match="timeout_seconds must be a positive number of seconds"):
        cr.MirroredStrategy(2, timeout_seconds=value)


def test_largest_timeout_works():
    strategy = cr.MirroredStrategy(2, timeout_seconds=7 * 24 * 3600)
    out = strategy.run(lambda: cr.all_reduce(torch.ones(2)))
    assert torch.equal(out.values[1], torch.full((2,), 2.0))


def test_meta_device_is_refused():
    with pytest.raises(ValueError, match=r"devices\[1\]='meta' is the meta device, whose tensors hold no data"):
        cr.MirroredStrategy(devices=["cpu", "meta"])
    with pytest.raises(ValueError, match="device='meta' is the meta device"):
        cr.OneDeviceStrategy("meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a second device type")
def test_tensor_on_another_device_is_blamed_on_its_replica():
    strategy = cr.MirroredStrategy(devices=["cpu", "cuda:0"])

    def fn():
        return cr.all_reduce(torch.ones(2))  # created on the CPU in both replicas

    with pytest.raises(ValueError, match=r"tensor 0 \(shape \[2\]\) is on cpu, but replica 1 runs on cuda:0") as info:
        strategy.run(fn)
    assert info.value.replica_id == 1


def test_tensor_on_meta_device_is_blamed_on_its_replica():
    strategy = cr.MirroredStrategy(2)

    def fn():
        x = torch.ones(2, device="meta") if cr.replica_id() == 1 else torch.ones(2)
        return cr.all_reduce(x)

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"cr.all_reduce: tensor 0 \(shape \[2\]\) is on meta, but replica 1 "
                                         r"runs on cpu") as info:
        strategy.run(fn)
    assert info.value.replica_id == 1 and time.monotonic() - start < 5


@pytest.mark.parametrize("ga", [
    [[i] for i in range(10 ** 6)],
    [0] * 10 ** 6,
    [[0, 1]] * 10 ** 6,
    [list(range(10 ** 6))],
    [[0, 1], [2, 10 ** 12]],
    [0, 0, 1, 10 ** 12],
])
def test_huge_group_assignment_is_rejected_fast_with_a_short_message(ga):
    start = time.monotonic()
    with pytest.raises(ValueError, match="group_assignment") as info:
        canonical_groups(ga, 4)
    assert time.monotonic() - start < 1.0
    assert len(str(info.value)) < 600, str(info.value)


def test_huge_permutation_is_rejected_fast():
    strategy = cr.MirroredStrategy(2)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"source_target_pairs has 1000000 pairs") as info:
        strategy.run(lambda: cr.collective_permute(torch.ones(1), [(0, 1)] * 10 ** 6))
    assert time.monotonic() - start < 5 and len(str(info.value)) < 600


def test_summarize_is_bounded():
    assert summarize(list(range(10 ** 6))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...] (1000000 items)"
    assert len(summarize("x" * 10 ** 6, limit=50)) <= 50
    assert summarize(3.5) == "3.5"

    class Broken:
        def __repr__(self):
            raise RuntimeError("no repr")

    assert summarize(Broken()).startswith("<Broken ")


HUGE = list(range(10 ** 6))


@pytest.mark.parametrize("call", [
    lambda: cr.MirroredStrategy(num_replicas=HUGE),
    lambda: cr.MirroredStrategy(2).run(lambda: None, args="x" * 10 ** 6),
    lambda: cr.MirroredStrategy(2).reduce("sum", torch.ones(1), axis=HUGE),
    lambda: cr.CommunicationOptions(bytes_per_pack=HUGE),
    lambda: cr.ReduceOp.from_any("x" * 10 ** 6),
    lambda: cr.CrossShardOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                                   reduction="y" * 10 ** 6),
], ids=["num_replicas", "run-args", "reduce-axis", "bytes_per_pack", "reduce_op", "optimizer-reduction"])
def test_messages_that_print_user_values_stay_short(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert len(str(info.value)) < 800, str(info.value)[:1000]
