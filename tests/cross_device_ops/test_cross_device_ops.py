"""Cross-device ops and the strategy's reduce_to / batch_reduce_to / broadcast_to / update."""

import pytest
import torch

import crossreplica as cr

OPS = [cr.ReductionToOneDevice, cr.AllReduceCrossDeviceOps]


def strategy(n, cdo=None):
    return cr.MirroredStrategy(n, devices=["cpu"] * n, cross_device_ops=cdo)


def sequential(op, xs):
    """The reference: left to right in replica order."""
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum,
               "prod": torch.mul}[op](acc, x)
    return acc / len(xs) if op == "mean" else acc


def per_replica(n, shape=(3, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    return cr.PerReplica([torch.randn(*shape, generator=g) for _ in range(n)])


@pytest.mark.parametrize("cls", OPS)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("n", [1, 3])
def test_reduce_matches_sequential_reference(cls, op, n):
    s = strategy(n)
    value = per_replica(n)
    with s.scope():
        out = cls().reduce(op, value, "cpu")
    assert isinstance(out, cr.Mirrored) and len(out.values) == 1
    assert torch.equal(out.values[0], sequential(op, list(value.values)))


@pytest.mark.parametrize("cls", OPS)
def test_destinations_spellings(cls):
    s = strategy(2)
    value = per_replica(2)
    expected = value.values[0] + value.values[1]
    with s.scope():
        for dest in ["cpu", torch.device("cpu"), torch.zeros(1), value, cr.Mirrored([torch.nn.Linear(1, 1)] * 2)]:
            out = cls().reduce(cr.ReduceOp.SUM, value, dest)
            n_dest = len(dest.values) if isinstance(dest, cr.DistributedValues) else 1
            assert isinstance(out, cr.Mirrored) and len(out.values) == n_dest
            for v in out.values:
                assert torch.equal(v, expected)
    # every destination holds a copy of its own
    out = cls().reduce("sum", value, value)
    assert out.values[0] is not out.values[1]
    out.values[0].add_(1)
    assert torch.equal(out.values[1], expected)


def test_reduce_non_distributed_value():
    s = strategy(4)
    t = torch.tensor([1.0, 2.0])
    with s.scope():
        out = cr.AllReduceCrossDeviceOps().reduce("mean", t, "cpu")
        assert torch.equal(out.values[0], t) and out.values[0] is not t
        with pytest.raises(ValueError, match="cannot be reduced with op=sum over 4 replicas"):
            cr.AllReduceCrossDeviceOps().reduce("sum", t, "cpu")
    with cr.OneDeviceStrategy().scope():
        assert torch.equal(cr.ReductionToOneDevice().reduce("sum", t, "cpu").values[0], t)


def test_reduction_to_one_device_accumulation_fn():
    calls = []

    def acc(xs):
        calls.append(len(xs))
        return torch.stack(xs).sum(0)

    s = strategy(3)
    value = per_replica(3)
    with s.scope():
        out = cr.ReductionToOneDevice(reduce_to_device="cpu", accumulation_fn=acc).reduce("mean", value, "cpu")
        torch.testing.assert_close(out.values[0], sequential("mean", list(value.values)))
        cr.ReductionToOneDevice(accumulation_fn=acc).reduce("max", value, "cpu")  # not a sum: no fn
    assert calls == [3]


@pytest.mark.parametrize("bytes_per_pack", [0, 16, 1 << 20])
@pytest.mark.parametrize("cls", OPS)
def test_batch_reduce_is_bitwise_the_same_as_one_by_one(cls, bytes_per_pack):
    n = 3
    s = strategy(n)
    shapes = [(3,), (2, 2), (5,), (1,), (4, 3), (7,)]
    values = [per_replica(n, shape, seed=i) for i, shape in enumerate(shapes)]
    values.append(cr.PerReplica([torch.arange(4) + i for i in range(n)]))  # an int64 pack of its own
    pairs = [(v, "cpu") for v in values]
    options = cr.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    with s.scope():
        out = cls().batch_reduce("sum", pairs, options)
        single = [cls().reduce("sum", v, "cpu") for v in values]
    assert len(out) == len(values)
    for o, r, v in zip(out, single, values):
        assert isinstance(o, cr.Mirrored)
        assert torch.equal(o.values[0], r.values[0])
        assert torch.equal(o.values[0], sequential("sum", list(v.values)))
        assert o.values[0].shape == v.values[0].shape


def test_batch_reduce_mixed_and_empty():
    s = strategy(2)
    value = per_replica(2)
    with s.scope():
        assert cr.AllReduceCrossDeviceOps().batch_reduce("sum", []) == []
        out = cr.AllReduceCrossDeviceOps().batch_reduce("mean", [(value, value), (torch.ones(2), "cpu")])
    assert len(out[0].values) == 2 and torch.equal(out[1].values[0], torch.ones(2))


@pytest.mark.parametrize("cls", OPS)
def test_broadcast(cls):
    strategy(3)
    dest = per_replica(3)
    out = cls().broadcast(torch.tensor([1.0, 2.0]), dest)
    assert isinstance(out, cr.Mirrored) and len(out.values) == 3
    assert all(torch.equal(v, torch.tensor([1.0, 2.0])) for v in out.values)
    assert len({id(v) for v in out.values}) == 3
    t = torch.ones(2)
    assert cls().broadcast(t, "cpu").values[0] is not t  # never the caller's own tensor
    assert torch.equal(cls().broadcast(3.0, "cpu").values[0], torch.tensor(3.0))


# ------------------------------------------------------------------ strategy.extended

@pytest.mark.parametrize("cdo", [None, cr.ReductionToOneDevice(), cr.AllReduceCrossDeviceOps()])
def test_extended_reduce_to_and_batch_reduce_to(cdo):
    s = strategy(4, cdo)
    out = s.run(lambda: torch.full((2,), float(cr.replica_id())))
    r = s.extended.reduce_to("sum", out, out)
    assert isinstance(r, cr.Mirrored) and len(r.values) == 4
    assert all(torch.equal(v, torch.full((2,), 6.0)) for v in r.values)
    b = s.extended.batch_reduce_to(cr.ReduceOp.MEAN, [(out, "cpu"), (out, out)])
    assert torch.equal(b[0].values[0], torch.full((2,), 1.5)) and len(b[1].values) == 4
    c = s.extended.broadcast_to(torch.ones(1), out)
    assert len(c.values) == 4


def test_default_cross_device_ops_is_all_reduce():
    s = strategy(2)
    s.extended.reduce_to("mean", per_replica(2), "cpu")
    assert isinstance(s.extended.cross_device_ops, cr.AllReduceCrossDeviceOps)


def test_extended_update():
    s = strategy(3)
    var = s.mirror(torch.zeros(2, requires_grad=True))
    delta = s.mirror(torch.ones(2))
    out = s.extended.update(var, lambda v, d, scale=1.0: v.add_(d * scale), args=(delta,), kwargs={"scale": 2.0})
    assert isinstance(out, cr.Mirrored)
    assert all(torch.equal(v, torch.full((2,), 2.0)) for v in var.values)
    assert all(v.requires_grad for v in var.values)  # updated under no_grad, still leaves
    ungrouped = s.extended.update(var, lambda v: v.sum().item(), group=False)
    assert ungrouped == (4.0, 4.0, 4.0)
    # a plain (non-distributed) value is updated once
    t = torch.zeros(1)
    s.extended.update(t, lambda v: v.add_(1))
    assert t.item() == 1.0


def test_update_rejects_per_replica_args():
    s = strategy(2)
    var = s.mirror(torch.zeros(2))
    with pytest.raises(TypeError, match="every distributed leaf to be cr.Mirrored"):
        s.extended.update(var, lambda v, d: v.add_(d), args=(per_replica(2, (2,)),))
    with pytest.raises(TypeError, match=r"fn must be callable as fn\(var, \*args, \*\*kwargs\); got 3"):
        s.extended.update(var, 3)
    with pytest.raises(TypeError, match="group must be True or False; got 1"):
        s.extended.update(var, lambda v: v, group=1)


def test_extended_apis_need_cross_replica_context():
    s = strategy(2)

    def body():
        s.extended.reduce_to("sum", torch.ones(1), "cpu")

    with pytest.raises(cr.ReplicaContextError, match="reduce_to must be called in cross-replica context"):
        s.run(body)


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("dest,match", [
    (3, "destinations must be a device string"),
    ("", "destinations must not be empty"),
    ("gpu:x", "destinations must be a device such as"),
    (cr.PerReplica(["a", "b"]), "whose value 0 is str, which has no device"),
])
def test_bad_destinations(dest, match):
    with strategy(2).scope():
        with pytest.raises(ValueError, match=match):
            cr.AllReduceCrossDeviceOps().reduce("sum", per_replica(2), dest)


def test_bad_op_and_options():
    value = per_replica(2)
    with pytest.raises(ValueError, match="reduce_op must be a cr.ReduceOp or one of"):
        cr.AllReduceCrossDeviceOps().reduce("avg", value, "cpu")
    with pytest.raises(ValueError, match="options must be a cr.CommunicationOptions"):
        cr.AllReduceCrossDeviceOps().reduce("sum", value, "cpu", options={"bytes_per_pack": 1})
    with pytest.raises(ValueError, match="bytes_per_pack must be a non-negative int"):
        cr.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="timeout_seconds must be a positive number of seconds"):
        cr.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(TypeError, match="op=mean needs a floating-point"):
        cr.AllReduceCrossDeviceOps().reduce("mean", cr.PerReplica([torch.ones(1, dtype=torch.int64)] * 2), "cpu")


def test_bad_values():
    ops = cr.ReductionToOneDevice()
    with pytest.raises(ValueError, match="must hold tensors of one shape and dtype"):
        ops.reduce("sum", cr.PerReplica([torch.ones(2), torch.ones(3)]), "cpu")
    with pytest.raises(ValueError, match=r"per_replica_value.values\[1\] must hold tensors"):
        ops.reduce("sum", cr.PerReplica([torch.ones(2), "x"]), "cpu")
    with pytest.raises(ValueError, match="per_replica_value must hold tensors"):
        ops.reduce("sum", object(), "cpu")


@pytest.mark.parametrize("pairs,match", [
    ("ab", "value_destination_pairs must be a list of"),
    ([(per_replica(2),)], r"value_destination_pairs\[0\] must be a \(value, destinations\) tuple"),
    ([(per_replica(2), 5)], r"value_destination_pairs\[0\]\[1\] must be a device string"),
    ([(per_replica(2), "cpu"), (per_replica(3), "cpu")], "has 3 values but the first distributed value has 2"),
])
def test_bad_value_destination_pairs(pairs, match):
    with pytest.raises(ValueError, match=match):
        cr.AllReduceCrossDeviceOps().batch_reduce("sum", pairs)


def test_bad_reduction_to_one_device_arguments():
    with pytest.raises(ValueError, match="accumulation_fn must be callable"):
        cr.ReductionToOneDevice(accumulation_fn=3)
    with pytest.raises(ValueError, match="reduce_to_device must be a device"):
        cr.ReductionToOneDevice(reduce_to_device="nowhere")


def test_strategy_rejects_bad_cross_device_ops():
    with pytest.raises(ValueError, match="cross_device_ops must be a cr.CrossDeviceOps"):
        cr.MirroredStrategy(2, cross_device_ops="nccl")


class _Returns(cr.CrossDeviceOps):
    """An implementation that returns whatever it is given to return."""

    def __init__(self, result):
        self.result = result

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self.result(per_replica_value)


def test_an_implementations_tensor_or_distributed_result_becomes_a_mirrored():
    value = per_replica(2)
    expected = value.values[0] + value.values[1]
    cases = {"tensor": lambda v: v.values[0] + v.values[1],
             "one value": lambda v: cr.PerReplica([v.values[0] + v.values[1]]),
             "the caller's tensor": lambda v: v.values[0]}
    for name, result in cases.items():
        s = strategy(2, _Returns(result))
        out = s.extended.reduce_to("sum", value, value)
        assert isinstance(out, cr.Mirrored) and len(out.values) == 2, name
        assert out.values[0] is not out.values[1], name
        assert all(v is not x for v in out.values for x in value.values), name  # never the caller's tensor
        want = value.values[0] if name == "the caller's tensor" else expected
        assert all(torch.equal(v, want) for v in out.values), name
        assert torch.equal(s.reduce("sum", value, axis=None), want), name


@pytest.mark.parametrize("result,match", [
    (lambda v: None, r"_Returns.reduce_implementation must return a tensor or a cr.DistributedValues \(one value "
                     r"per destination device\); it returned NoneType"),
    (lambda v: cr.PerReplica([torch.zeros(3, 2)] * 3),
     r"_Returns.reduce_implementation returned a PerReplica of 3 values for 2 destination device\(s\)"),
])
def test_an_implementations_unusable_result_is_named(result, match):
    s = strategy(2, _Returns(result))
    value = per_replica(2)
    with pytest.raises(ValueError, match=match):
        s.extended.reduce_to("sum", value, value)
    with pytest.raises(ValueError, match=match):  # the base class's batch: one reduce_implementation per pair
        s.extended.batch_reduce_to("sum", [(value, value)])


class _BatchReturns(cr.CrossDeviceOps):
    """A batch implementation (TF's signature) that returns whatever it is given to return."""

    def __init__(self, result):
        self.result = result

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self.result


@pytest.mark.parametrize("result,match", [
    (torch.zeros(1), r"_BatchReturns.batch_reduce_implementation must return a list of one result per "
                     r"\(value, destinations\) pair \(2\); it returned tensor"),
    ([torch.zeros(1), None], r"_BatchReturns.batch_reduce_implementation \(pair 1\) must return a tensor or a "
                             r"cr.DistributedValues"),
])
def test_a_batch_implementations_unusable_result_is_named(result, match):
    s = strategy(2, _BatchReturns(result))
    value = per_replica(2)
    with pytest.raises(ValueError, match=match):
        s.extended.batch_reduce_to("sum", [(value, "cpu"), (value, value)])
