"""OneDeviceStrategy and MirroredStrategy: run, reduce, gather and local results."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import crossreplica as cr

STRATEGIES = {
    "one_device": lambda: cr.OneDeviceStrategy(),
    "mirrored1": lambda: cr.MirroredStrategy(num_replicas=1),
    "mirrored2": lambda: cr.MirroredStrategy(num_replicas=2),
    "mirrored4-devices": lambda: cr.MirroredStrategy(devices=["cpu", torch.device("cpu"), "cpu", "cpu"]),
}


@pytest.fixture(params=list(STRATEGIES))
def strategy(request):
    return STRATEGIES[request.param]()


def local(strategy, value):
    return list(strategy.experimental_local_results(value))


def test_num_replicas_in_sync(strategy):
    n = strategy.num_replicas_in_sync
    assert n == len(strategy.extended.worker_devices)
    assert strategy.run(cr.num_replicas) == n
    assert repr(strategy).startswith(f"{type(strategy).__name__}(num_replicas_in_sync={n}")


def test_mirrored_defaults_to_one_replica_on_cpu_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("the default is one replica per GPU here")
    s = cr.MirroredStrategy()
    assert s.num_replicas_in_sync == 1 and s.extended.worker_devices == (torch.device("cpu"),)


def test_run_passes_args_through_select_replica(strategy):
    n = strategy.num_replicas_in_sync
    shared = torch.ones(2)
    per = cr.PerReplica([torch.full((2,), float(i)) for i in range(n)])
    mirrored = cr.Mirrored([f"m{i}" for i in range(n)])

    def fn(x, s, *, m, nest):
        return (cr.replica_id(), x, s is shared, m, nest["k"][0])

    out = strategy.run(fn, args=(per, shared), kwargs={"m": mirrored, "nest": {"k": [per]}})
    for i, (rid, x, same, m, nested) in enumerate(local(strategy, out)):
        assert rid == i and same and m == f"m{i}"
        assert torch.equal(x, torch.full((2,), float(i))) and nested is x


def test_run_trims_trailing_none_args(strategy):
    def fn(a, b="default-b", c="default-c"):
        return a, b, c

    # TPUStrategy's rule; TF's MirroredStrategy would pass None on, so it is said aloud.
    with pytest.warns(cr.logs.CrossReplicaWarning, match=r"strategy.run drops trailing None args \(TPUStrategy's rule\), "
                      r"so .*fn gets its default for b='default-b', c='default-c', not None; to pass None, pass "
                      r"it by keyword: kwargs=\{'b': None\}"):
        out = strategy.run(fn, args=(1, None, None))
    assert all(r == (1, "default-b", "default-c") for r in local(strategy, out))
    out = strategy.run(fn, args=[1, None, 3])  # a None before a value is kept; a list works too
    assert all(r == (1, None, 3) for r in local(strategy, out))
    out = strategy.run(fn, args=(1,), kwargs={"b": None, "c": None})  # None by keyword reaches fn
    assert all(r == (1, None, None) for r in local(strategy, out))


def test_trailing_none_onto_a_none_default_or_varargs_is_quiet(strategy, recwarn):
    def fn(a, mask=None):
        return a, mask

    out = strategy.run(fn, args=(1, None))
    assert all(r == (1, None) for r in local(strategy, out))
    out = strategy.run(lambda *xs: xs, args=(1, None))  # no parameter to name: the rule alone
    assert all(r == (1,) for r in local(strategy, out))

    def needs(a, d, w=1.0):
        return a, d, w

    out = strategy.run(needs, args=(1, None, None), kwargs={"d": 2, "w": 3.0})  # keywords fill them
    assert all(r == (1, 2, 3.0) for r in local(strategy, out))
    assert not [w for w in recwarn if issubclass(w.category, cr.logs.CrossReplicaWarning)], [str(w.message) for w in recwarn]


def test_trailing_none_onto_a_required_parameter_is_a_clear_error(strategy):
    def fn(a, d):
        return a, d

    with pytest.raises(TypeError, match=r"strategy.run drops trailing None args \(TPUStrategy's rule\), so .*fn's "
                                        r"parameter\(s\) \['d'\] would get no value; to pass None, pass it by "
                                        r"keyword: kwargs=\{'d': None\}"):
        strategy.run(fn, args=(1, None))


def test_run_regroups_results(strategy):
    n = strategy.num_replicas_in_sync
    shared = object()

    def fn():
        return {"id": torch.tensor(cr.replica_id()), "shared": shared}

    out = strategy.run(fn)
    assert type(out) is dict and out["shared"] is shared
    if n == 1:
        assert torch.equal(out["id"], torch.tensor(0))
    else:
        assert type(out["id"]) is cr.PerReplica
        assert [int(v) for v in out["id"].values] == list(range(n))


def test_persistent_replica_threads():
    strategy = cr.MirroredStrategy(num_replicas=3)

    def fn():
        return threading.get_ident()

    first = strategy.run(fn).values
    second = strategy.run(fn).values
    assert first == second
    assert len(set(first)) == 3 and threading.get_ident() not in first


def test_one_device_runs_in_calling_thread():
    strategy = cr.OneDeviceStrategy()
    assert strategy.run(threading.get_ident) == threading.get_ident()


# ------------------------------------------------------------------ reduce

def _seq(op, xs):
    fn = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}[op]
    acc = functools.reduce(fn, xs)
    return acc / len(xs) if op == "mean" else acc


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod", cr.ReduceOp.SUM, "MEAN"])
def test_reduce_without_axis(strategy, op):
    n = strategy.num_replicas_in_sync
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    result = strategy.reduce(op, cr.PerReplica(xs))
    name = cr.ReduceOp.from_any(op).name.lower()
    assert torch.equal(result, _seq(name, xs))


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_reduce_with_axis(strategy, op):
    n = strategy.num_replicas_in_sync
    xs = [torch.randn(2 + i, 3, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    local_op = {"sum": torch.sum, "max": torch.amax, "min": torch.amin, "prod": torch.prod}[op]
    result = strategy.reduce(op, cr.PerReplica(xs), axis=0)
    assert torch.equal(result, _seq(op, [local_op(x, 0) for x in xs]))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_reduce_mean_with_axis_and_uneven_batches_is_the_global_mean(strategy, axis):
    n = strategy.num_replicas_in_sync
    # replica i holds i + 1 rows (dim 0) or i + 2 columns (dim 1): uneven per-replica batches
    shape = (lambda i: (i + 1, 3)) if axis == 0 else (lambda i: (3, i + 2))
    xs = [torch.randint(-50, 50, shape(i), generator=torch.Generator().manual_seed(i)).double() for i in range(n)]
    result = strategy.reduce("mean", cr.PerReplica(xs), axis=axis)
    everything = torch.cat(xs, axis)
    # integer-valued float64: the sum is exact, so the mean is the exact global mean
    assert torch.equal(result, everything.sum(axis) / everything.shape[axis])
    assert torch.allclose(result, everything.mean(axis))
    # not the mean of per-replica means (which weights small batches up)
    if n > 1:
        assert not torch.allclose(result, torch.stack([x.mean(axis) for x in xs]).mean(0))


def test_reduce_nest_and_python_numbers(strategy):
    n = strategy.num_replicas_in_sync
    value = {"a": cr.PerReplica([torch.tensor(float(i)) for i in range(n)]),
             "b": [cr.PerReplica(list(range(n)))]}
    result = strategy.reduce("sum", value)
    assert torch.equal(result["a"], torch.tensor(float(sum(range(n)))))
    assert torch.equal(result["b"][0], torch.tensor(sum(range(n))))


def test_reduce_non_distributed_value(strategy):
    n = strategy.num_replicas_in_sync
    x = torch.arange(3.0)
    assert torch.equal(strategy.reduce("mean", x), x)
    assert torch.equal(strategy.reduce("max", x), x)
    if n == 1:
        assert torch.equal(strategy.reduce("sum", x), x)
    else:
        with pytest.raises(ValueError, match=rf"a non-distributed value tensor\(\[0\., 1\., 2\.\]\) cannot be reduced "
                                             rf"with op=sum over {n} replicas; pass a cr\.PerReplica"):
            strategy.reduce("sum", x)


def test_reduce_bad_arguments(strategy):
    n = strategy.num_replicas_in_sync
    v = cr.PerReplica([torch.ones(2, 3)] * n)
    with pytest.raises(ValueError, match=r"axis=2 is out of range for a per-replica value of shape \[2, 3\]"):
        strategy.reduce("sum", v, axis=2)
    with pytest.raises(TypeError, match=r"axis must be an int or None; got 0\.5"):
        strategy.reduce("sum", v, axis=0.5)
    with pytest.raises(TypeError, match=r"value has dtype torch\.int64, but op=mean needs a floating-point"):
        strategy.reduce("mean", cr.PerReplica([torch.ones(2, dtype=torch.int64)] * n))


# ------------------------------------------------------------------ gather

@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_uneven(strategy, axis):
    n = strategy.num_replicas_in_sync
    shape = (lambda i: (i + 1, 3)) if axis == 0 else (lambda i: (3, i + 1))
    xs = [torch.randn(shape(i)) for i in range(n)]
    assert torch.equal(strategy.gather(cr.PerReplica(xs), axis), torch.cat(xs, axis))


def test_gather_nest_scalars_and_plain_values(strategy):
    n = strategy.num_replicas_in_sync
    result = strategy.gather({"s": cr.PerReplica([torch.tensor(float(i)) for i in range(n)]),
                              "plain": torch.ones(2)}, 0)
    assert torch.equal(result["s"], torch.arange(float(n)))
    assert torch.equal(result["plain"], torch.ones(2 * n))  # one copy per replica


def test_gather_bad_axis(strategy):
    n = strategy.num_replicas_in_sync
    with pytest.raises(ValueError, match=r"axis=2 is out of range for a per-replica value of shape \[2, 3\]"):
        strategy.gather(cr.PerReplica([torch.ones(2, 3)] * n), 2)
    with pytest.raises(TypeError, match=r"axis must be an int; got None"):
        strategy.gather(cr.PerReplica([torch.ones(2, 3)] * n), None)


# ------------------------------------------------------------------ local results

def test_experimental_local_results(strategy):
    n = strategy.num_replicas_in_sync
    per = cr.PerReplica(list(range(n)))
    assert strategy.experimental_local_results(per) == tuple(range(n))
    assert strategy.experimental_local_results(7) == (7,)
    nested = strategy.experimental_local_results({"a": per, "b": "x"})
    assert nested == tuple({"a": i, "b": "x"} for i in range(n))


# ------------------------------------------------------------------ bad arguments

def test_per_replica_of_wrong_length():
    strategy = cr.MirroredStrategy(num_replicas=2)
    with pytest.raises(ValueError, match=r"args holds a PerReplica with 3 values, but MirroredStrategy has 2 local "
                                         r"replicas; build it with one value per replica"):
        strategy.run(lambda x: x, args=(cr.PerReplica([1, 2, 3]),))
    with pytest.raises(ValueError, match=r"kwargs holds a Mirrored with 1 values, but MirroredStrategy has 2"):
        strategy.run(lambda x: x, kwargs={"x": cr.Mirrored([1])})


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"fn": 3}, TypeError, r"fn must be callable; got 3"),
    ({"fn": print, "args": 3}, TypeError, r"args must be a tuple or list of positional arguments; got 3"),
    ({"fn": print, "args": "ab"}, TypeError, r"args must be a tuple or list of positional arguments; got 'ab'"),
    ({"fn": print, "kwargs": [1]}, TypeError, r"kwargs must be a dict or None; got \[1\]"),
])
def test_run_bad_arguments(strategy, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        strategy.run(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_replicas": 0}, r"num_replicas must be a positive int or None; got 0"),
    ({"num_replicas": -2}, r"num_replicas must be a positive int or None; got -2"),
    ({"num_replicas": True}, r"num_replicas must be a positive int or None; got True"),
    ({"num_replicas": "2"}, r"num_replicas must be a positive int or None; got '2'"),
    ({"devices": []}, r"devices must be a non-empty list with one device per replica, e\.g\. \['cpu', 'cpu'\]; got \[\]"),
    ({"devices": "cpu"}, r"devices must be a non-empty list with one device per replica.*; got 'cpu'"),
    ({"devices": ["cpu", "nope"]}, r"devices\[1\] must be a device such as 'cpu', 'cuda:0' or a torch\.device; got 'nope'"),
    ({"devices": ["cpu", 3.5]}, r"devices\[1\] must be a device such as 'cpu'.*; got 3\.5"),
    ({"num_replicas": 3, "devices": ["cpu", "cpu"]}, r"num_replicas=3 does not match the 2 devices given"),
    ({"timeout_seconds": 0}, r"timeout_seconds must be a positive number of seconds, at most 604800 \(one week\); got 0"),
])
def test_mirrored_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cr.MirroredStrategy(**kwargs)


def test_cuda_device_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=r"devices\[0\]='cuda:0' names a CUDA device, but CUDA is not available here"):
        cr.MirroredStrategy(devices=["cuda:0"])
    with pytest.raises(ValueError, match=r"device='cuda' names a CUDA device, but CUDA is not available"):
        cr.OneDeviceStrategy("cuda")


def test_one_device_bad_device():
    with pytest.raises(ValueError, match=r"device must be a device such as 'cpu', 'cuda:0' or a torch\.device; got 'bogus'"):
        cr.OneDeviceStrategy("bogus")


@pytest.mark.parametrize("api", ["reduce", "gather"])
def test_cross_replica_apis_reject_per_replica_of_wrong_length(api):
    strategy = cr.MirroredStrategy(num_replicas=2)
    value = {"x": cr.PerReplica([torch.ones(1)] * 3)}
    call = (lambda: strategy.reduce("sum", value)) if api == "reduce" else (lambda: strategy.gather(value, 0))
    with pytest.raises(ValueError, match=r"value holds a PerReplica with 3 values, but MirroredStrategy has 2 local replicas"):
        call()
