"""ReduceOp spellings and the error hierarchy."""

from __future__ import annotations

import pytest
import torch

import crossreplica as cr
from crossreplica.reduce_op import all_finite


@pytest.mark.parametrize("op", list(cr.ReduceOp))
@pytest.mark.parametrize("spell", [str.lower, str.upper, str.capitalize, lambda s: s], ids=["lower", "upper", "capital", "same"])
def test_reduce_op_accepts_enum_and_any_case(op, spell):
    assert cr.ReduceOp.from_any(op) is op
    assert cr.ReduceOp.from_any(spell(op.name)) is op


@pytest.mark.parametrize("bad", ["average", "", "su m", 3, None, 3.5, cr.ReduceOp])
def test_unknown_reduce_op_lists_valid_names(bad):
    with pytest.raises(ValueError, match=r"op must be a cr\.ReduceOp or one of SUM, MEAN, MAX, MIN, PROD") as info:
        cr.ReduceOp.from_any(bad)
    assert repr(bad) in str(info.value)


def _reduce_in_replica(x):
    return cr.all_reduce(x, op="avg")


def test_unknown_op_in_collective_is_value_error(run_replicas):
    with pytest.raises(ValueError, match=r"op must be a cr\.ReduceOp or one of SUM, MEAN, MAX, MIN, PROD \(any case\); got 'avg'"):
        run_replicas(_reduce_in_replica, 2, [torch.ones(2)] * 2)


def test_strategy_reduce_names_reduce_op_argument():
    strategy = cr.OneDeviceStrategy()
    with pytest.raises(ValueError, match=r"reduce_op must be a cr\.ReduceOp .*got 'median'"):
        strategy.reduce("median", torch.ones(2))


# ---------------------------------------------------------------------- errors

@pytest.mark.parametrize("name", ["ReplicaContextError", "CollectiveMismatchError",
                                  "CollectiveTimeoutError", "ReplicaError"])
def test_public_errors_exist_and_are_reexported(name):
    cls = getattr(cr.errors, name)
    assert isinstance(cls, type) and issubclass(cls, Exception)
    assert getattr(cr, name) is cls
    assert issubclass(cls, cr.errors.CrossReplicaError)


def test_error_builtin_bases():
    assert issubclass(cr.CollectiveMismatchError, RuntimeError)
    assert issubclass(cr.CollectiveTimeoutError, TimeoutError)
    assert issubclass(cr.ReplicaContextError, RuntimeError)
    err = cr.CollectiveTimeoutError("late", missing=[3, 1])
    assert err.missing == (3, 1)


def test_replica_error_from_value_error_is_also_value_error():
    original = ValueError("bad shape")
    err = cr.errors.replica_error(2, original)
    assert isinstance(err, cr.ReplicaError)
    assert isinstance(err, ValueError)
    assert err.replica_id == 2
    assert err.original is original
    assert err.__cause__ is original
    assert "replica 2 raised ValueError: bad shape" in str(err)


def test_replica_error_of_unsubclassable_type_is_plain_replica_error():
    # OSError has its own C layout; the wrapper falls back to ReplicaError.
    original = OSError(5, "io")
    err = cr.errors.replica_error(0, original)
    assert isinstance(err, cr.ReplicaError)
    assert err.original is original and err.__cause__ is original


def test_replica_error_plain_constructor():
    original = KeyError("k")
    err = cr.ReplicaError(1, original)
    assert err.replica_id == 1 and err.__cause__ is original
    with pytest.raises(cr.ReplicaError, match=r"replica 1 raised KeyError"):
        raise err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64], ids=str)
def test_all_finite_is_decided_per_element(dtype):
    big = torch.finfo(torch.float32 if dtype is torch.complex64 else dtype).max
    assert all_finite(torch.randn(10).to(dtype)) and all_finite(torch.empty(0, dtype=dtype))
    assert all_finite(torch.full((6,), 0.2 * big, dtype=torch.float64).to(dtype))  # finite; their sum overflows
    for bad in (float("inf"), float("-inf"), float("nan")):
        assert not all_finite(torch.tensor([1.0, bad]).to(dtype))
    assert not all_finite(torch.tensor([float("inf"), float("-inf")]).to(dtype))  # a nan sum
