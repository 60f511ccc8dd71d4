"""Sparse COO values: every reduction, on every engine, against the dense computation.

The reference is plain torch on the dense views, left to right in replica
order (MEAN: that sum divided by the count), compared bit for bit. Results
must be coalesced sparse COO tensors, bitwise the same on every replica, and
no path may densify (a value whose dense shape could never be allocated
reduces fine).
"""

import copy

import pytest
import torch
from torch import nn

import crossreplica as cr

# torch's notes on sparse support (CSR is beta; invariant checks off where we build tensors)
pytestmark = pytest.mark.filterwarnings("ignore:Sparse:UserWarning")

OPS = ["sum", "mean", "max", "min", "prod"]
_FOLD = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}
# 10**12 x 4 float32 is 16 TB dense: anything that densifies fails to allocate
HUGE = (10 ** 12, 4)


def dense_reduce(op, xs):
    """The dense computation: left to right in replica order; MEAN divides the sum."""
    acc = xs[0].to_dense().clone()
    for x in xs[1:]:
        acc = _FOLD[op](acc, x.to_dense())
    return acc / len(xs) if op == "mean" else acc


def sparse_value(rid, shape=(40, 4), dtype=torch.float32, seed=0):
    """Replica ``rid``'s value: rows that partly overlap the other replicas' (a hybrid
    COO tensor, as an embedding gradient), one row stored twice (uncoalesced)."""
    g = torch.Generator().manual_seed(1000 * seed + rid)
    rows = torch.randperm(min(shape[0], 40), generator=g)[:6 + rid]
    rows = torch.cat([rows, rows[:1]]) * (shape[0] // min(shape[0], 40))
    values = torch.randn(len(rows), *shape[1:], generator=g).to(dtype)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, check_invariants=True)


def bits(t):
    """A tensor's bytes, so -0.0 != 0.0 and nan == nan."""
    t = t.to_dense() if t.layout is not torch.strided else t
    return t.contiguous().view(torch.uint8)


def check_result(out, ref):
    """``out`` is coalesced sparse and holds ``ref`` (dense) bit for bit: its stored values
    are ref's there (-0.0 included, which to_dense() would add away), ref is 0 elsewhere."""
    assert out.layout is torch.sparse_coo and out.is_coalesced()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    where = tuple(out._indices())
    assert torch.equal(bits(out._values()), bits(ref[where]))
    rest = ref.clone()
    rest[where] = 0
    assert torch.equal(bits(rest), bits(torch.zeros_like(ref)))


def check_identical(outs):
    for o in outs[1:]:
        assert torch.equal(o._indices(), outs[0]._indices())
        assert torch.equal(o._values().contiguous().view(torch.uint8),
                           outs[0]._values().contiguous().view(torch.uint8))


# --------------------------------------------------------------------------- in a replica

def _all_reduce(x, op, group_assignment=None):
    return cr.all_reduce(x, op, group_assignment)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_matches_dense(run_replicas, op, n):
    xs = [sparse_value(r) for r in range(n)]
    outs = run_replicas(_all_reduce, n, xs, [op] * n)
    ref = dense_reduce(op, xs)
    for out in outs:
        check_result(out, ref)
    check_identical(outs)


def test_all_reduce_sparse_dims_and_integers(run_replicas):
    # a fully sparse 2-d value (sparse_dim 2) of ints, and an empty one
    n = 3
    xs = [(torch.arange(12).view(3, 4) % (r + 2) == 0).long().mul(r + 1).to_sparse() for r in range(n)]
    empty = [torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (5, 5))] * n
    outs = run_replicas(_all_reduce, n, [{"a": x, "b": e} for x, e in zip(xs, empty)], ["sum"] * n)
    for out in outs:
        check_result(out["a"], dense_reduce("sum", xs))
        check_result(out["b"], torch.zeros(5, 5))
        assert out["b"]._nnz() == 0


def _mixed(x, d):
    return cr.all_reduce({"sparse": x, "dense": d, "number": 2.0}, "mean")


def test_all_reduce_nest_of_sparse_and_dense(run_replicas):
    n = 2
    xs = [sparse_value(r) for r in range(n)]
    ds = [torch.full((3,), float(r)) for r in range(n)]
    for out in run_replicas(_mixed, n, xs, ds):
        check_result(out["sparse"], dense_reduce("mean", xs))
        assert torch.equal(out["dense"], dense_reduce("mean", ds))
        assert out["number"].item() == 2.0


def test_all_reduce_with_groups_reduces_in_replica_order(run_replicas):
    n, groups = 4, [[3, 1], [2, 0]]
    xs = [sparse_value(r, seed=1) for r in range(n)]
    outs = run_replicas(_all_reduce, n, xs, ["sum"] * n, [groups] * n)
    for r, out in enumerate(outs):
        members = sorted(next(g for g in groups if r in g))
        check_result(out, dense_reduce("sum", [xs[m] for m in members]))


def test_all_reduce_half_sums_in_float32(run_replicas):
    n = 4
    xs = [sparse_value(r, dtype=torch.float16) for r in range(n)]
    ref = dense_reduce("sum", [x.float() for x in xs]).half()  # rounded once, as dense float16 sums
    for out in run_replicas(_all_reduce, n, xs, ["sum"] * n):
        check_result(out, ref)


def test_all_reduce_of_an_embedding_sized_gradient(run_replicas):
    # 1e6 x 4: the threads engine's parallel path for a dense tensor this size
    n = 2
    xs = [sparse_value(r, shape=(10 ** 6, 4)) for r in range(n)]
    outs = run_replicas(_all_reduce, n, xs, ["sum"] * n)
    ref = dense_reduce("sum", xs)
    for out in outs:
        check_result(out, ref)
        assert out._nnz() < 30


def _huge(rows, values, op):
    x = torch.sparse_coo_tensor(rows.unsqueeze(0), values, HUGE)
    out = cr.all_reduce(x, op)
    return out._indices(), out._values(), out.is_coalesced()


@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce_never_densifies(run_replicas, op):
    n = 2
    xs = [sparse_value(r) for r in range(n)]
    # the same entries at far-apart rows of a value that cannot exist densely
    far = 10 ** 10
    rows = [x._indices()[0] * far for x in xs]
    outs = run_replicas(_huge, n, rows, [x._values() for x in xs], [op] * n)
    ref = dense_reduce(op, xs)
    for indices, values, coalesced in outs:
        assert coalesced
        # the union of the stored rows, with the dense computation's values there
        dense_rows = ref[indices[0] // far]
        assert torch.equal(bits(values), bits(dense_rows))
        assert set(indices[0].tolist()) == {int(r) for x in rows for r in x}


# --------------------------------------------------------------------------- cross-replica

def _cross_replica(x, d, op):
    """Every cross-replica reduction of the sparse ``x`` (and a dense ``d`` batched beside it)."""
    def merge_fn(strategy, v, dv):
        ext = strategy.extended
        return {
            "reduce": strategy.reduce(op, v, axis=None),
            "reduce_to": ext.reduce_to(op, v, "cpu").values[0],
            "batch": [m.values[0] for m in ext.batch_reduce_to(op, [(v, "cpu"), (dv, "cpu"), (v, "cpu")])],
            "one_device": cr.ReductionToOneDevice().reduce(op, v, "cpu").values[0],
            "one_device_batch": cr.ReductionToOneDevice().batch_reduce(op, [(v, "cpu")])[0].values[0],
            "all_reduce": cr.AllReduceCrossDeviceOps().reduce(op, v, "cpu").values[0],
            "all_reduce_batch": [m.values[0] for m in cr.AllReduceCrossDeviceOps().batch_reduce(
                op, [(v, "cpu"), (dv, "cpu")], cr.CommunicationOptions(bytes_per_pack=1 << 20))],
        }
    return cr.get_replica_context().merge_call(merge_fn, args=(x, d))


@pytest.mark.parametrize("op,n", [(op, 4) for op in OPS] + [("sum", 2), ("mean", 3)])
def test_cross_replica_reductions_match_dense(run_replicas, op, n):
    xs = [sparse_value(r, seed=2) for r in range(n)]
    ds = [torch.randn(3, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    ref, dense_ref = dense_reduce(op, xs), dense_reduce(op, ds)
    for out in run_replicas(_cross_replica, n, xs, ds, [op] * n):
        for key in ("reduce", "reduce_to", "one_device", "one_device_batch", "all_reduce"):
            check_result(out[key], ref)
        check_result(out["batch"][0], ref)
        check_result(out["batch"][2], ref)
        assert torch.equal(out["batch"][1], dense_ref)
        check_result(out["all_reduce_batch"][0], ref)
        assert torch.equal(out["all_reduce_batch"][1], dense_ref)


def test_mirrored_strategy_reduce_of_an_embedding_sized_value():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    value = s.run(lambda: sparse_value(cr.replica_id(), shape=(10 ** 6, 4)))
    xs = list(value.values)
    for op in ("sum", "mean"):
        check_result(s.reduce(op, value, axis=None), dense_reduce(op, xs))
        for cdo in (cr.ReductionToOneDevice(), cr.AllReduceCrossDeviceOps()):
            with s.scope():
                check_result(cdo.reduce(op, value, "cpu").values[0], dense_reduce(op, xs))


def test_cross_replica_results_are_coalesced_copies_per_destination():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    value = cr.PerReplica([sparse_value(0), sparse_value(1)])
    out = s.extended.reduce_to("sum", value, value)  # one copy per replica's device
    assert out.values[0] is not out.values[1]
    for v in out.values:
        check_result(v, dense_reduce("sum", list(value.values)))


def test_cross_replica_never_densifies():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    value = cr.PerReplica([torch.sparse_coo_tensor(torch.tensor([[r, 10 ** 11]]), torch.ones(2, 4), HUGE)
                           for r in range(2)])
    out = s.extended.batch_reduce_to("sum", [(value, "cpu")])[0].values[0]
    assert out.is_coalesced() and out._indices().tolist() == [[0, 1, 10 ** 11]]
    assert out._values().tolist() == [[1.0] * 4, [1.0] * 4, [2.0] * 4]


# --------------------------------------------------------------------------- bad input

def _csr(n):
    return cr.all_reduce(torch.eye(3).to_sparse_csr())


def _wrong_shape(rid):
    return cr.all_reduce(torch.zeros(4 + rid, 2).to_sparse())


def _needs_grad(rid):
    x = torch.ones(3, 2).to_sparse().requires_grad_()
    return cr.all_reduce(x)


def _gather_sparse(n):
    return cr.all_gather({"x": torch.eye(3).to_sparse()})


def test_other_collectives_take_dense_tensors_only(run_replicas):
    with pytest.raises(TypeError, match=r"cr.all_gather takes dense \(strided\) tensors; got a torch.sparse_coo"):
        run_replicas(_gather_sparse, 2, [0, 1])


def test_other_layouts_are_rejected(run_replicas):
    with pytest.raises(TypeError, match="layout torch.sparse_csr; only strided"):
        run_replicas(_csr, 2, [0, 1])


def test_sparse_requiring_grad_is_rejected(run_replicas):
    with pytest.raises(TypeError, match="not differentiable; reduce x.detach"):
        run_replicas(_needs_grad, 2, [0, 1])


@pytest.mark.detects_mismatch
def test_shapes_must_agree(run_replicas):
    with pytest.raises(cr.CollectiveMismatchError, match="must pass the same shapes"):
        run_replicas(_wrong_shape, 2, [0, 1])


def test_cross_replica_bad_input():
    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    sparse = sparse_value(0)
    mixed = cr.PerReplica([sparse, sparse.to_dense()])
    with s.scope():
        with pytest.raises(ValueError, match="must hold tensors of one layout"):
            cr.AllReduceCrossDeviceOps().reduce("sum", mixed, "cpu")
        csr = cr.PerReplica([torch.eye(3).to_sparse_csr()] * 2)
        with pytest.raises(TypeError, match=r"per_replica_value.values\[0\] has layout torch.sparse_csr"):
            cr.ReductionToOneDevice().reduce("sum", csr, "cpu")
    with pytest.raises(TypeError, match="axis=0 is not supported for a sparse value"):
        s.reduce("sum", cr.PerReplica([sparse, sparse]), axis=0)


# --------------------------------------------------------------------------- CrossShardOptimizer

class Bag(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=sparse)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(50, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids):
        return self.emb(ids).pow(2).sum()


def _ids(r, step):
    # each id at most twice per replica: the local sum of duplicates is order-free
    g = torch.Generator().manual_seed(10 * r + step)
    ids = torch.randperm(50, generator=g)[:8]
    return torch.cat([ids, ids[:3]])


def _train(model, reduction, weight, overlap):
    rid = cr.replica_id()
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reduction=reduction,
                                 overlap=overlap)
    grads = []
    for step in range(3):
        opt.zero_grad()
        model(_ids(rid, step)).backward()
        opt.synchronize(weight=weight)
        g = model.emb.weight.grad
        grads.append((g.layout, g.is_coalesced() if g.is_sparse else True, g.to_dense()))
        opt.step()
    return grads, model.emb.weight.detach().clone()


@pytest.mark.parametrize("reduction,weighted,overlap", [
    ("mean", False, False), ("sum", False, False), ("mean", True, False), ("mean", False, True)])
def test_cross_shard_optimizer_sparse_matches_dense(run_replicas, reduction, weighted, overlap):
    # overlap=True: the dense model's gradient is reduced during backward, the sparse one at step
    n = 4
    weights = [float(r + 1) for r in range(n)] if weighted else [None] * n
    sparse = run_replicas(_train, n, [Bag(True) for _ in range(n)], [reduction] * n, weights, [overlap] * n)
    dense = run_replicas(_train, n, [Bag(False) for _ in range(n)], [reduction] * n, weights, [overlap] * n)
    # plain torch: each replica's dense gradient, reduced in replica order
    ref = Bag(False)
    for step in range(3):
        grads = []
        for r in range(n):
            m = copy.deepcopy(ref)
            m(_ids(r, step)).backward()
            g = m.emb.weight.grad
            grads.append(g * weights[r] if weighted else g)
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        total = total / (sum(weights) if weighted else n) if reduction == "mean" else total
        for (s_grads, _), (d_grads, _) in zip(sparse, dense):
            layout, coalesced, g = s_grads[step]
            assert layout is torch.sparse_coo and coalesced
            assert torch.equal(bits(g), bits(total)) and torch.equal(bits(d_grads[step][2]), bits(total))
        with torch.no_grad():
            ref.emb.weight.add_(total, alpha=-0.1)
    for (_, s_weight), (_, d_weight) in zip(sparse, dense):
        assert torch.equal(s_weight, d_weight) and torch.equal(s_weight, ref.emb.weight)


def _sharded_step(model):
    opt = cr.CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer_state=True)
    model(torch.tensor([1, 2])).backward()
    opt.step()


def test_sharded_update_rejects_sparse_gradients(run_replicas):
    with pytest.raises(ValueError, match=r"does not support sparse gradients; parameter 0 of param group 0 "
                                         r"\(shape \[50, 4\]\) has a torch.sparse_coo gradient"):
        run_replicas(_sharded_step, 2, [Bag(True) for _ in range(2)])
