"""cr.Variable: TF's synchronization and aggregation, on threads and across processes, against
plain-PyTorch references; checkpoints through cr.save / cr.load; the tensor behaviour; bad input."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import pytest
import torch

import crossreplica as cr
from crossreplica import nest
from crossreplica.errors import ReplicaContextError
from crossreplica.testing import run_workers

ON_WRITE, ON_READ = cr.VariableSynchronization.ON_WRITE, cr.VariableSynchronization.ON_READ
SUM, MEAN = cr.VariableAggregation.SUM, cr.VariableAggregation.MEAN
FIRST, NONE = cr.VariableAggregation.ONLY_FIRST_REPLICA, cr.VariableAggregation.NONE
AGGS = {"sum": SUM, "mean": MEAN, "first": FIRST}


def _x(r):
    """Replica r's value."""
    return torch.linspace(0, 1, 3) * (r + 1) + r


def _local(strategy, var):
    """The local copies (clones), in local order."""
    return [c.detach().clone() for c in var.values]


def _on_write_step(vs):
    r = cr.replica_id()
    x = _x(r).to(vs["sum"].device)  # the replica's device
    for v in vs.values():
        v.assign_add(x)
    seen = {k: v.value().detach().clone() for k, v in vs.items()}
    for v in vs.values():
        v.assign_sub(2 * x)
    for v in vs.values():
        v.assign(v.value().detach() + x * 0.5)
    return seen


def _on_read_step(ms):
    r = cr.replica_id()
    for m in ms.values():
        m.assign_add(_x(r).sum() if m.dtype.is_floating_point else r + 1)
        m.assign_add(_x(r).sum() if m.dtype.is_floating_point else r + 1)
    return {k: m.value().clone() for k, m in ms.items()}


def _sgd_step(v, lr):
    """Data-parallel SGD on a variable: each replica's gradient, MEAN-aggregated update."""
    x = _x(cr.replica_id()).to(v.device)
    loss = ((v * x).sum() - 1.0) ** 2
    loss.backward()
    grad = v.value().grad.clone()
    v.value().grad = None
    v.assign_sub(lr * grad)
    return grad


def _same_none(v):
    v.assign(torch.full((3,), 4.0))
    return v.value().detach().clone()


def _differing_none(v):
    v.assign(_x(cr.replica_id()))


def variables_main(strategy):
    """The whole scenario in one strategy; returns what every worker saw (checked by _check)."""
    out = {"ids": list(strategy.extended.local_replica_ids), "n": strategy.num_replicas_in_sync}
    with strategy.scope():
        vs = {k: cr.Variable(torch.arange(3.0), aggregation=a, name=k) for k, a in AGGS.items()}
        ms = {k: cr.Variable(torch.zeros(()), synchronization=ON_READ, aggregation=a) for k, a in AGGS.items()}
        ms["count"] = cr.Variable(0, synchronization="on_read", aggregation="sum")
        w = cr.Variable(torch.full((3,), 0.1), aggregation=MEAN)
        none = cr.Variable(torch.zeros(3))
    seen = strategy.run(_on_write_step, args=(vs,))
    out["on_write_seen"] = {k: [t.clone() for t in strategy.experimental_local_results(seen[k])] for k in vs}
    out["on_write"] = {k: _local(strategy, v) for k, v in vs.items()}
    with strategy.scope():
        out["on_write_read"] = {k: v.value().detach().clone() for k, v in vs.items()}
        vs["sum"].assign(torch.tensor([1.0, 2.0, 3.0]))
        vs["mean"].assign_add(1.0)
        out["cross_assign"] = {k: _local(strategy, vs[k]) for k in ("sum", "mean")}
    local = strategy.run(_on_read_step, args=(ms,))
    out["on_read_local"] = {k: [t.clone() for t in strategy.experimental_local_results(local[k])] for k in ms}
    with strategy.scope():
        out["on_read"] = {k: m.value().clone() for k, m in ms.items()}
        try:
            ms["sum"].assign_add(1.0)
        except ValueError as e:
            out["sum_add_error"] = str(e)
        ms["sum"].assign(6.0)
        ms["count"].assign(7)
        ms["mean"].assign_add(0.5)
        out["on_read_assigned"] = {k: (m.value().clone(), _local(strategy, m)) for k, m in ms.items()}
    out["grads"] = []
    for _ in range(3):
        g = strategy.run(_sgd_step, args=(w, 0.1))
        out["grads"].append([t.clone() for t in strategy.experimental_local_results(g)])
    out["w"] = _local(strategy, w)
    # checkpoints: the chief writes, every worker loads the chief's copy
    path = os.path.join(tempfile.mkdtemp(prefix="crvars-"), "vars.pt")
    with strategy.scope():
        cr.save(path, {k: v.state_dict() for k, v in {**vs, **ms, "w": w}.items()})
        saved = {k: v.value().detach().clone() for k, v in {**vs, **ms, "w": w}.items()}
        for v in (*vs.values(), *ms.values(), w):
            v.assign(torch.full(v.shape, 9.0) if v.dtype.is_floating_point else 9)
        state = cr.load(path)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        for k, v in {**vs, **ms, "w": w}.items():
            v.load_state_dict(state[k])
        out["restored"] = {k: (saved[k], v.value().detach().clone()) for k, v in {**vs, **ms, "w": w}.items()}
    out["none_same"] = [t.clone() for t in strategy.experimental_local_results(strategy.run(_same_none, (none,)))]
    try:  # last: a replica that raises ends the job's collectives on some engines
        strategy.run(_differing_none, args=(none,))
    except ValueError as e:
        out["none_error"] = str(e)
    return out


def _check(res, n):
    """Compares every worker's results with the plain-PyTorch reference for ``n`` replicas."""
    xs = [_x(r) for r in range(n)]
    base = torch.arange(3.0)
    combine = {"sum": lambda ts: sum(ts), "mean": lambda ts: sum(ts) / n, "first": lambda ts: ts[0]}
    for out in res:
        assert out["n"] == n
        for k, agg in combine.items():
            after_add = base + agg(xs)
            after_sub = after_add - agg([2 * x for x in xs])
            final = after_sub + agg([x * 0.5 for x in xs]) if k != "sum" else None
            for got in out["on_write_seen"][k]:
                torch.testing.assert_close(got, after_add)
            if k == "sum":  # SUM of n equal assigned values, each plus its own half
                final = sum(after_sub + x * 0.5 for x in xs)
            for got in out["on_write"][k]:
                torch.testing.assert_close(got, final)
            torch.testing.assert_close(out["on_write_read"][k], final)
        for got in out["cross_assign"]["sum"]:
            assert torch.equal(got, torch.tensor([1.0, 2.0, 3.0]))
        for got in out["cross_assign"]["mean"]:
            torch.testing.assert_close(got, out["on_write_read"]["mean"] + 1.0)
        # ON_READ: local updates, aggregated reads
        for r, got in zip(out["ids"], out["on_read_local"]["sum"]):
            torch.testing.assert_close(got, 2 * xs[r].sum())
        for r, got in zip(out["ids"], out["on_read_local"]["count"]):
            assert int(got) == 2 * (r + 1)
        totals = [2 * x.sum() for x in xs]
        torch.testing.assert_close(out["on_read"]["sum"], sum(totals))
        torch.testing.assert_close(out["on_read"]["mean"], sum(totals) / n)
        torch.testing.assert_close(out["on_read"]["first"], totals[0])
        assert int(out["on_read"]["count"]) == sum(2 * (r + 1) for r in range(n))
        assert "assign_add in cross-replica context is not supported" in out["sum_add_error"]
        value, copies = out["on_read_assigned"]["sum"]
        torch.testing.assert_close(value, torch.tensor(6.0))
        assert all(torch.equal(c, torch.tensor(6.0) / n) for c in copies)  # TF: divided by the replicas
        value, copies = out["on_read_assigned"]["count"]
        assert int(value) == 7
        assert [int(c) for c in copies] == [7 if r == 0 else 0 for r in out["ids"]]  # exact
        value, copies = out["on_read_assigned"]["mean"]
        assert all(torch.equal(c, t + 0.5) for c, t in zip(copies, out["on_read_local"]["mean"]))
        # data-parallel SGD on a MEAN variable
        w = torch.full((3,), 0.1, requires_grad=True)
        for step in range(3):
            grads = []
            for r in range(n):
                w.grad = None
                (((w * xs[r]).sum() - 1.0) ** 2).backward()
                grads.append(w.grad.clone())
            for r, got in zip(out["ids"], out["grads"][step]):
                torch.testing.assert_close(got, grads[r])
            with torch.no_grad():
                w -= 0.1 * sum(grads) / n
        for got in out["w"]:
            torch.testing.assert_close(got, w.detach())
        for k, (saved, restored) in out["restored"].items():
            torch.testing.assert_close(restored, saved, msg=k)
        assert all(torch.equal(t, torch.full((3,), 4.0)) for t in out["none_same"])
        if n > 1:
            assert "aggregation NONE" in out["none_error"] and "differ from replica 0" in out["none_error"]
        else:
            assert "none_error" not in out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_variables_on_threads(n):
    _check([variables_main(cr.MirroredStrategy(n))], n)


def test_variables_on_one_device():
    _check([variables_main(cr.OneDeviceStrategy())], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_variables_on_a_gpu():
    out = variables_main(cr.MirroredStrategy(devices=["cuda:0", "cuda:0"]))
    assert out["on_write"]["sum"][0].device.type == "cuda"
    _check([nest.map_structure(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)], 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers, rpw", [(2, 1), (2, 2)])
def test_variables_across_workers(workers, rpw):
    _check(run_workers(variables_main, workers, rpw), workers * rpw)


# ---------------------------------------------------------------- tensor behaviour and bad input


def _tensor_like(v):
    return {"add": v + 1, "radd": 1 + v, "mul": v * v, "torch": torch.sum(v), "cat": torch.cat([v, v]),
            "neg": -v, "item": v[0], "lt": v < 2, "device": v.device, "float": float(v[1:2].detach()),
            "len": len(v), "shape": v.shape, "matmul": v @ torch.ones(3), "tadd": torch.ones(3) + v}


def test_acts_as_a_tensor():
    s = cr.MirroredStrategy(2)
    with s.scope():
        v = cr.Variable([1.0, 2.0, 3.0], name="v")
        assert v.synchronization is ON_WRITE and v.aggregation is NONE and v.trainable
        assert v.dtype == torch.float32 and v.shape == (3,) and v.name == "v" and v.distribute_strategy is s
        t = torch.tensor([1.0, 2.0, 3.0])
        got = _tensor_like(v)
        ref = {"add": t + 1, "radd": 1 + t, "mul": t * t, "torch": t.sum(), "cat": torch.cat([t, t]),
               "neg": -t, "item": t[0], "lt": t < 2, "device": t.device, "float": 2.0, "len": 3,
               "shape": t.shape, "matmul": t @ torch.ones(3), "tadd": torch.ones(3) + t}
        for k in ref:
            assert (torch.equal(got[k], ref[k]) if isinstance(ref[k], torch.Tensor) else got[k] == ref[k]), k
        assert (v.numpy() == t.numpy()).all() and torch.equal(v.read_value(), t)
        sc = cr.Variable(2.5)
        assert float(sc) == 2.5 and int(sc) == 2 and bool(sc) and sc.dim() == 0 and sc.size() == ()
        snapshot = v.read_value()
        v.assign_add(1.0)
        assert torch.equal(snapshot, t) and torch.equal(v.value(), t + 1)
        assert v.assign(t, read_value=False) is None and v.assign(t) is v
        assert "synchronization=ON_WRITE" in repr(v) and "aggregation=NONE" in repr(v)
    per = s.run(_tensor_like, args=(v,))
    for k in ("add", "torch", "cat"):
        assert all(torch.equal(a, b) for a, b in zip(s.experimental_local_results(per[k]), (ref[k],) * 2))


def _bad_assigns(v):
    errors = []
    for value in (torch.ones(2), torch.ones(3, dtype=torch.float64).to(torch.complex64), "x"):
        try:
            v.assign(value)
        except (TypeError, ValueError) as e:
            errors.append(type(e).__name__)
    return errors


def test_bad_input_is_a_clear_error():
    s = cr.MirroredStrategy(2)
    with s.scope():
        with pytest.raises(ValueError, match="ON_READ needs an aggregation"):
            cr.Variable(0.0, synchronization=ON_READ)
        with pytest.raises(ValueError, match="not trainable"):
            cr.Variable(0.0, synchronization=ON_READ, aggregation=SUM, trainable=True)
        with pytest.raises(ValueError, match="synchronization=NONE is not supported"):
            cr.Variable(0.0, synchronization="none")
        with pytest.raises(TypeError, match="op=mean needs a floating-point"):
            cr.Variable(0, aggregation=MEAN)
        with pytest.raises(ValueError, match="synchronization must be a cr.VariableSynchronization"):
            cr.Variable(0.0, synchronization="sometimes")
        with pytest.raises(ValueError, match="aggregation must be a cr.VariableAggregation"):
            cr.Variable(0.0, aggregation=3)
        with pytest.raises(TypeError, match="initial_value must be a tensor"):
            cr.Variable(object())
        with pytest.raises(TypeError, match="initial_value must be a plain tensor"):
            cr.Variable(cr.PerReplica((torch.ones(1), torch.ones(1))))
        with pytest.raises(TypeError, match="name must be a str"):
            cr.Variable(0.0, name=3)
        v = cr.Variable(torch.zeros(3), aggregation=SUM)
        i = cr.Variable(torch.zeros(3, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"has shape \[2\], which does not fit the variable's shape \[3\]"):
            v.assign(torch.ones(2))
        with pytest.raises(TypeError, match="does not convert safely"):
            i.assign(torch.ones(3))
        with pytest.raises(TypeError, match="PerReplica"):
            v.assign(cr.PerReplica((torch.ones(3), torch.ones(3))))
        v.assign(cr.Mirrored((torch.ones(3), torch.ones(3))))
        assert all(torch.equal(c, torch.ones(3)) for c in v.values)
        v.assign(2)  # a number broadcasts
        assert all(torch.equal(c, torch.full((3,), 2.0)) for c in v.values)
        with pytest.raises(ValueError, match="expects {'value': tensor}"):
            v.load_state_dict({"weights": torch.ones(3)})
        with pytest.raises(ValueError, match=r"a tensor of shape \[3\]"):
            v.load_state_dict({"value": torch.ones(4)})
    errors = s.experimental_local_results(s.run(_bad_assigns, args=(v,)))
    assert list(errors) == [["ValueError", "TypeError", "TypeError"]] * 2
    other = cr.MirroredStrategy(2)
    with pytest.raises(ValueError, match="belongs to"):
        other.run(lambda: v.value())
    with other.scope(), pytest.raises(ValueError, match="belongs to"):
        v.assign(1.0)
    with pytest.raises(ReplicaContextError, match="state_dict"):
        s.run(lambda: v.state_dict())


def test_auto_is_on_write_and_names_are_accepted():
    s = cr.MirroredStrategy(2)
    with s.scope():
        v = cr.Variable(1.0, synchronization="AUTO", aggregation="only_first_replica")
        m = cr.Variable(1.0, synchronization=ON_READ, aggregation="sum")
    assert v.synchronization is ON_WRITE and v.aggregation is FIRST
    assert not m.trainable and not m.values[0].requires_grad
    with s.scope():
        # TF: every copy starts from the initial value, so the SUM read counts it once per replica
        assert torch.equal(m.value(), torch.tensor(2.0))
    outside = cr.Variable(torch.ones(2))  # outside any scope: the default one-replica strategy
    assert outside.distribute_strategy is cr.get_strategy() and len(outside.values) == 1


def test_porting_guide_example_matches_plain_torch():
    strategy = cr.MirroredStrategy(4)
    with strategy.scope():
        w = cr.Variable(torch.zeros(3), aggregation=cr.VariableAggregation.MEAN)
        seen = cr.Variable(0, synchronization=cr.VariableSynchronization.ON_READ,
                           aggregation=cr.VariableAggregation.SUM)

    def step(x):
        loss = ((w * x).sum() - 1.0) ** 2
        loss.backward()
        grad = w.value().grad
        w.value().grad = None
        w.assign_sub(0.1 * grad)
        seen.assign_add(x.shape[0])
        return loss

    batches = [torch.linspace(-1, 1, 6).reshape(2, 3) * (r + 1) for r in range(4)]
    strategy.run(step, args=(cr.PerReplica(batches),))
    ref = torch.zeros(3, requires_grad=True)
    grads = [torch.autograd.grad(((ref * x).sum() - 1.0) ** 2, ref)[0] for x in batches]
    with strategy.scope():
        assert int(seen.value()) == 8
        torch.testing.assert_close(torch.as_tensor(np.asarray(w)), (ref - 0.1 * sum(grads) / 4).detach())
    assert w == w and w != seen and len({w, seen}) == 2  # identity, hashable


def _one_bad(v):
    v.assign(torch.ones(2) if cr.replica_id() == 1 else torch.ones(3))


def test_one_replica_with_a_bad_value_releases_the_others():
    s = cr.MirroredStrategy(3, timeout_seconds=60)
    with s.scope():
        v = cr.Variable(torch.zeros(3), aggregation="sum")
    start = time.monotonic()
    with pytest.raises(ValueError, match="does not fit") as info:
        s.run(_one_bad, args=(v,))
    assert info.value.replica_id == 1 and time.monotonic() - start < 30  # not the 60 s timeout
    assert all(torch.equal(c, torch.zeros(3)) for c in v.values)  # nothing was applied
    s.run(lambda: v.assign_add(torch.ones(3)))  # the strategy still works
    assert all(torch.equal(c, torch.full((3,), 3.0)) for c in v.values)
