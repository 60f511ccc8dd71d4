"""The collectives matrix: every collective x op x dtype x
group form x replica count, against a plain-torch reference computed here.

Every case runs through the ``run_replicas`` fixture, so it runs on every
engine in ``conftest.ENGINES``.
"""

from __future__ import annotations

import functools
import itertools
import re
import time

import numpy as np
import pytest
import torch

import crossreplica as cr

OPS = ["sum", "mean", "max", "min", "prod"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool]
INEXACT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
REF_OP = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}

SMALL = (8, 124)        # ~1000 elements: the leader-only path
LARGE = (8, 25_000)     # 200_000 float32 = 800 KB per replica: the parallel path (>= 256 KiB)


# ------------------------------------------------------------------ group forms

def _mesh_groups(shape, axes):
    """Brute force: replicas (row-major ids) sharing their coordinates off ``axes``."""
    names, sizes = list(shape), list(shape.values())
    groups = {}
    for r, c in enumerate(itertools.product(*(range(s) for s in sizes))):
        key = tuple(ci for name, ci in zip(names, c) if name not in axes)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


class GroupCase:
    """One spelling of a group assignment and the groups it means (computed here)."""

    def __init__(self, n, kind, value):
        self.n, self.kind, self.value = n, kind, value
        if kind == "none":
            self.groups = [list(range(n))]
        elif kind == "2d":
            self.groups = [list(g) for g in value]
        elif kind == "flat":
            self.groups = [[r for r in range(n) if value[r] == g] for g in range(max(value) + 1)]
        else:
            self.groups = _mesh_groups(*value)
        self.id = f"n{n}-{kind}-{value}"

    def group_of(self, r):
        return next(g for g in self.groups if r in g)

    def kwargs(self, mesh_ok=False):
        """How to spell these groups to a collective."""
        if self.kind == "mesh":
            if mesh_ok:
                return {"mesh": cr.Mesh(self.value[0]), "axes": self.value[1]}
            return {"group_assignment": [list(g) for g in self.groups]}
        return {"group_assignment": self.value}


GROUP_CASES = [
    GroupCase(1, "none", None), GroupCase(1, "2d", [[0]]), GroupCase(1, "flat", [0]),
    GroupCase(2, "none", None), GroupCase(2, "2d", [[1, 0]]), GroupCase(2, "2d", [[0], [1]]),
    GroupCase(2, "flat", [0, 0]),
    GroupCase(4, "none", None), GroupCase(4, "2d", [[0, 1], [2, 3]]), GroupCase(4, "2d", [[2, 0], [3, 1]]),
    GroupCase(4, "flat", [1, 0, 0, 1]), GroupCase(4, "flat", [0, 1, 2, 3]),
    GroupCase(4, "mesh", ({"data": 2, "model": 2}, ("model",))),
    GroupCase(4, "mesh", ({"data": 2, "model": 2}, ("data",))),
    GroupCase(4, "mesh", ({"data": 2, "model": 2}, ("data", "model"))),
]
GC_IDS = [g.id for g in GROUP_CASES]
MULTI = [g for g in GROUP_CASES if g.n > 1]
# Every spelling and replica count, for the dtype matrices beyond float32 (keeps the suite fast).
CORE_CASES = [GROUP_CASES[i] for i in (0, 4, 9, 10, 12)]


def with_cases(combos, full=lambda *c: c[-1] == torch.float32):
    """``combos x group cases``: every group case where ``full(*combo)``, CORE_CASES otherwise."""
    out = []
    for combo in combos:
        for case in (GROUP_CASES if full(*combo) else CORE_CASES):
            out.append(pytest.param(*combo, case, id="-".join([*(str(c).replace("torch.", "") for c in combo), case.id])))
    return out


# ------------------------------------------------------------------ data and checks

def make_inputs(n, shape, dtype, op="sum", seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if dtype == torch.bool:
            x = torch.rand(shape, generator=g) > 0.5
        elif dtype.is_floating_point:
            if op == "prod":
                x = (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
            else:
                x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        else:
            hi = 4 if op == "prod" else 100
            x = torch.randint(-hi, hi + 1, shape, generator=g, dtype=dtype)
        out.append(x)
    return out


def reference_reduce(op, xs):
    """The sequential reduction in replica-id order, as plain torch; float16 / bfloat16
    sums, means and products accumulate in float32 and round once (docs/fidelity.md)."""
    dtype = xs[0].dtype
    wide = str(op).lower() in ("sum", "mean", "prod") and dtype in (torch.float16, torch.bfloat16)
    if wide:
        xs = [x.float() for x in xs]
    acc = functools.reduce(REF_OP[op], xs)
    acc = acc / len(xs) if op == "mean" else acc
    return acc.to(dtype) if wide else acc


def assert_same(actual, expected):
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected)


def assert_bitwise_within_groups(case, outs):
    for g in case.groups:
        for r in g[1:]:
            assert torch.equal(outs[g[0]], outs[r])


def _call(name, kwargs, x):
    """The replica function: one collective, by name."""
    return getattr(cr, name)(x, **kwargs)


def run_collective(run_replicas, name, kwargs, xs):
    n = len(xs)
    return run_replicas(_call, n, [name] * n, [kwargs] * n, xs)


# ------------------------------------------------------------------ all_reduce

def _valid(op, dtype):
    return not (op == "mean" and not dtype.is_floating_point)


# MEAN of an integer tensor is a TypeError (test_mean_of_integers_is_type_error).
OP_DTYPES = [(op, dt) for op in OPS for dt in DTYPES if _valid(op, dt)]
# Small payloads in every dtype; the large (parallel) path with float32.
SIZE_DTYPES = [(SMALL, dt) for dt in DTYPES] + [(LARGE, torch.float32)]
SIZE_DTYPE_IDS = [f"{'small' if s == SMALL else 'large'}-{str(dt)[6:]}" for s, dt in SIZE_DTYPES]


@pytest.mark.parametrize("op, dtype, case", with_cases(OP_DTYPES))
def test_all_reduce(run_replicas, op, dtype, case):
    xs = make_inputs(case.n, SMALL, dtype, op)
    outs = run_collective(run_replicas, "all_reduce", {"op": op, **case.kwargs(mesh_ok=True)}, xs)
    for r in range(case.n):
        assert_same(outs[r], reference_reduce(op, [xs[m] for m in sorted(case.group_of(r))]))
    assert_bitwise_within_groups(case, outs)


@pytest.mark.parametrize("case", [g for g in GROUP_CASES if g.n == 4], ids=lambda g: g.id)
@pytest.mark.parametrize("op, dtype", [("sum", torch.float32), ("mean", torch.float32), ("max", torch.float32),
                                       ("prod", torch.float64), ("sum", torch.int64), ("min", torch.bfloat16)],
                         ids=str)
def test_all_reduce_large_parallel_path(run_replicas, op, dtype, case):
    xs = make_inputs(case.n, LARGE, dtype, op, seed=1)
    outs = run_collective(run_replicas, "all_reduce", {"op": op, **case.kwargs(mesh_ok=True)}, xs)
    for r in range(case.n):
        assert_same(outs[r], reference_reduce(op, [xs[m] for m in sorted(case.group_of(r))]))
    assert_bitwise_within_groups(case, outs)


@pytest.mark.parametrize("op", [cr.ReduceOp.SUM, "SUM", "Max", cr.ReduceOp.MEAN])
def test_all_reduce_op_spellings(run_replicas, op):
    xs = make_inputs(2, (5,), torch.float32)
    outs = run_collective(run_replicas, "all_reduce", {"op": op}, xs)
    name = cr.ReduceOp.from_any(op).name.lower()
    assert_same(outs[1], reference_reduce(name, xs))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("name, kwargs", [("all_reduce", {"op": "mean"}), ("cross_replica_mean", {}),
                                          ("reduce_scatter", {"op": "mean"}),
                                          ("cross_replica_average", {"num_shards_per_group": 1})])
def test_mean_of_integers_is_type_error(run_replicas, name, kwargs, dtype):
    xs = [torch.ones(4, dtype=dtype)] * 2
    with pytest.raises(TypeError, match=rf"x has dtype {dtype}, but op=mean needs a floating-point"):
        run_collective(run_replicas, name, kwargs, xs)


def test_all_reduce_default_op_is_sum(run_replicas):
    xs = make_inputs(4, (3, 3), torch.float64)
    outs = run_collective(run_replicas, "all_reduce", {}, xs)
    assert_same(outs[3], reference_reduce("sum", xs))


def test_zero_d_and_empty_tensors(run_replicas):
    xs = [{"s": torch.tensor(float(i)), "e": torch.zeros(0, 3)} for i in range(4)]
    outs = run_collective(run_replicas, "all_reduce", {"op": "max"}, xs)
    for o in outs:
        assert_same(o["s"], torch.tensor(3.0))
        assert_same(o["e"], torch.zeros(0, 3))


# ------------------------------------------------------------------ sum / mean / average wrappers

@pytest.mark.parametrize("case", GROUP_CASES, ids=GC_IDS)
@pytest.mark.parametrize("name, op, dtype", [
    ("cross_replica_sum", "sum", torch.float32), ("cross_replica_sum", "sum", torch.float16),
    ("cross_replica_sum", "sum", torch.int64), ("cross_replica_mean", "mean", torch.float32),
    ("cross_replica_mean", "mean", torch.bfloat16), ("cross_replica_mean", "mean", torch.float64)], ids=str)
def test_cross_replica_sum_and_mean(run_replicas, name, op, dtype, case):
    xs = make_inputs(case.n, SMALL, dtype)
    outs = run_collective(run_replicas, name, case.kwargs(), xs)
    for r in range(case.n):
        assert_same(outs[r], reference_reduce(op, [xs[m] for m in sorted(case.group_of(r))]))
    assert_bitwise_within_groups(case, outs)


@pytest.mark.parametrize("n, k", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_cross_replica_average(run_replicas, n, k):
    xs = make_inputs(n, (6, 7), torch.float32)
    outs = run_collective(run_replicas, "cross_replica_average", {"num_shards_per_group": k}, xs)
    for r in range(n):
        start = r // k * k
        assert_same(outs[r], reference_reduce("mean", xs[start:start + k]))


def test_cross_replica_average_indivisible(run_replicas):
    xs = make_inputs(4, (2,), torch.float32)
    with pytest.raises(ValueError, match=r"num_replicas: 4 mod num_shards_per_group: 3 should be 0, got 1"):
        run_collective(run_replicas, "cross_replica_average", {"num_shards_per_group": 3}, xs)


# ------------------------------------------------------------------ all_gather

@pytest.mark.parametrize("dim, dtype, case", with_cases([(d, dt) for d in (0, 1, -1) for dt in DTYPES]))
def test_all_gather(run_replicas, dim, dtype, case):
    xs = make_inputs(case.n, SMALL, dtype)
    outs = run_collective(run_replicas, "all_gather", {"dim": dim, **case.kwargs()}, xs)
    for r in range(case.n):
        assert_same(outs[r], torch.cat([xs[m] for m in case.group_of(r)], dim))
    assert_bitwise_within_groups(case, outs)


@pytest.mark.parametrize("case", MULTI, ids=lambda g: g.id)
@pytest.mark.parametrize("size", ["small", "large"])
def test_all_gather_uneven_dim0(run_replicas, case, size):
    # replica r holds r + 1 rows: an uneven last batch
    cols = {"small": 100, "large": 80_000}[size]  # large: replica 0 alone sends 320 KB
    xs = [torch.randn(r + 1, cols, generator=torch.Generator().manual_seed(r)) for r in range(case.n)]
    outs = run_collective(run_replicas, "all_gather", {"dim": 0, **case.kwargs()}, xs)
    for r in range(case.n):
        assert_same(outs[r], torch.cat([xs[m] for m in case.group_of(r)], 0))


def test_all_gather_uneven_middle_dim(run_replicas):
    xs = [torch.randn(2, r + 1, 3) for r in range(4)]
    outs = run_collective(run_replicas, "all_gather", {"dim": 1}, xs)
    for o in outs:
        assert_same(o, torch.cat(xs, 1))


def test_all_gather_zero_d_stacks(run_replicas):
    xs = [torch.tensor(float(r)) for r in range(4)]
    outs = run_collective(run_replicas, "all_gather", {}, xs)
    for o in outs:
        assert_same(o, torch.stack(xs))


@pytest.mark.parametrize("case", [g for g in GROUP_CASES if g.n == 4], ids=lambda g: g.id)
def test_all_gather_large_parallel_path(run_replicas, case):
    xs = make_inputs(4, LARGE, torch.float32, seed=2)
    outs = run_collective(run_replicas, "all_gather", {"dim": 1, **case.kwargs()}, xs)
    for r in range(4):
        assert_same(outs[r], torch.cat([xs[m] for m in case.group_of(r)], 1))


# ------------------------------------------------------------------ reduce_scatter

def _reduce_scatter_reference(op, xs, case, r, dim):
    g = case.group_of(r)
    full = reference_reduce(op, [xs[m] for m in sorted(g)])
    return full.chunk(len(g), dim)[g.index(r)]


@pytest.mark.parametrize("op, dtype, case", with_cases(OP_DTYPES))
def test_reduce_scatter(run_replicas, op, dtype, case):
    xs = make_inputs(case.n, SMALL, dtype, op)
    outs = run_collective(run_replicas, "reduce_scatter", {"op": op, "dim": 0, **case.kwargs()}, xs)
    for r in range(case.n):
        assert_same(outs[r], _reduce_scatter_reference(op, xs, case, r, 0))


@pytest.mark.parametrize("case", [g for g in GROUP_CASES if g.n == 4], ids=lambda g: g.id)
@pytest.mark.parametrize("size", [(4, 100), LARGE], ids=["small", "large"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter_dims_and_sizes(run_replicas, dim, size, case):
    xs = make_inputs(4, size, torch.float32, seed=3)
    outs = run_collective(run_replicas, "reduce_scatter", {"op": "sum", "dim": dim, **case.kwargs()}, xs)
    for r in range(4):
        assert_same(outs[r], _reduce_scatter_reference("sum", xs, case, r, dim))


# ------------------------------------------------------------------ all_to_all

@pytest.mark.parametrize("split_dim, concat_dim, size, dtype, case", with_cases(
    [(sd, cd, size, dt) for sd, cd in [(0, 0), (0, 1), (1, 0), (-1, -2)] for size, dt in SIZE_DTYPES],
    full=lambda sd, cd, size, dt: dt == torch.float32 and size == SMALL))
def test_all_to_all(run_replicas, size, dtype, split_dim, concat_dim, case):
    xs = make_inputs(case.n, size, dtype, seed=4)
    outs = run_collective(run_replicas, "all_to_all",
                          {"split_dim": split_dim, "concat_dim": concat_dim, **case.kwargs()}, xs)
    for r in range(case.n):
        g = case.group_of(r)
        pos = g.index(r)
        expected = torch.cat([xs[m].chunk(len(g), split_dim)[pos] for m in g], concat_dim)
        assert_same(outs[r], expected)


# ------------------------------------------------------------------ broadcast

CASE_SOURCES = [(c, s) for c in GROUP_CASES for s in (0, 1, 3) if s < len(c.groups[0])]


@pytest.mark.parametrize("case, source", CASE_SOURCES, ids=[f"{c.id}-src{s}" for c, s in CASE_SOURCES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(run_replicas, source, dtype, case):
    xs = make_inputs(case.n, SMALL, dtype)
    outs = run_collective(run_replicas, "broadcast", {"source": source, **case.kwargs()}, xs)
    for r in range(case.n):
        assert_same(outs[r], xs[case.group_of(r)[source]])
    assert_bitwise_within_groups(case, outs)


@pytest.mark.parametrize("source", [0, 2])
def test_broadcast_large_parallel_path(run_replicas, source):
    xs = make_inputs(4, LARGE, torch.float32, seed=5)
    outs = run_collective(run_replicas, "broadcast", {"source": source}, xs)
    for o in outs:
        assert_same(o, xs[source])


# ------------------------------------------------------------------ collective_permute

PERMUTES = [
    (1, [(0, 0)]), (1, []),
    (2, [(0, 1), (1, 0)]), (2, [(1, 0)]), (2, [(0, 0), (1, 1)]),
    (4, [(0, 1), (1, 2), (2, 3), (3, 0)]), (4, [(0, 2)]), (4, [(3, 0), (0, 3)]), (4, [[2, 1], [1, 2], [0, 0]]),
]


@pytest.mark.parametrize("n, pairs", PERMUTES, ids=str)
@pytest.mark.parametrize("size, dtype", SIZE_DTYPES, ids=SIZE_DTYPE_IDS)
def test_collective_permute(run_replicas, size, dtype, n, pairs):
    xs = make_inputs(n, size, dtype, seed=6)
    outs = run_collective(run_replicas, "collective_permute", {"source_target_pairs": pairs}, xs)
    sources = {t: s for s, t in pairs}
    for r in range(n):
        expected = xs[sources[r]] if r in sources else torch.zeros_like(xs[r])
        assert_same(outs[r], expected)


# ------------------------------------------------------------------ replica_id / num_replicas

def _ids(_):
    ctx = cr.get_replica_context()
    return cr.replica_id(), cr.num_replicas(), ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync


@pytest.mark.parametrize("n", [1, 2, 4])
def test_replica_id_and_num_replicas(run_replicas, n):
    assert run_replicas(_ids, n, [None] * n) == [(r, n, r, n) for r in range(n)]


# ------------------------------------------------------------------ nests

def _nest_inputs(n, dtype=torch.float32, shape=(4, 6)):
    return [{"a": x, "b": (None, 2 * x), "c": [x[:, :2].contiguous()], "d": None}
            for x in make_inputs(n, shape, dtype, seed=7)]


def _map_nest(fn, nests):
    """Applies ``fn`` to the per-replica tensors at each leaf position."""
    return {"a": fn([t["a"] for t in nests]), "b": (None, fn([t["b"][1] for t in nests])),
            "c": [fn([t["c"][0] for t in nests])], "d": None}


def _assert_nest(actual, expected):
    assert type(actual) is dict and set(actual) == {"a", "b", "c", "d"}
    assert type(actual["b"]) is tuple and actual["b"][0] is None and actual["d"] is None
    assert type(actual["c"]) is list and len(actual["c"]) == 1
    assert_same(actual["a"], expected["a"])
    assert_same(actual["b"][1], expected["b"][1])
    assert_same(actual["c"][0], expected["c"][0])


NEST_CASES = [
    ("all_reduce", {"op": "sum"}, lambda xs, r: reference_reduce("sum", xs)),
    ("all_reduce", {"op": "max", "group_assignment": [0, 1, 0, 1]},
     lambda xs, r: reference_reduce("max", [xs[m] for m in range(r % 2, 4, 2)])),
    ("cross_replica_mean", {}, lambda xs, r: reference_reduce("mean", xs)),
    ("all_gather", {"dim": 1}, lambda xs, r: torch.cat(xs, 1)),
    ("reduce_scatter", {"op": "sum", "dim": 0}, lambda xs, r: reference_reduce("sum", xs).chunk(4, 0)[r]),
    ("all_to_all", {"split_dim": 0, "concat_dim": 1}, lambda xs, r: torch.cat([x.chunk(4, 0)[r] for x in xs], 1)),
    ("broadcast", {"source": 2}, lambda xs, r: xs[2]),
    ("collective_permute", {"source_target_pairs": [(0, 1), (1, 0)]},
     lambda xs, r: xs[1 - r] if r < 2 else torch.zeros_like(xs[r])),
]


@pytest.mark.parametrize("name, kwargs, ref", NEST_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(NEST_CASES)])
@pytest.mark.parametrize("shape", [(4, 6), (4, 30_000)], ids=["small", "large"])
def test_nests_keep_structure(run_replicas, name, kwargs, ref, shape):
    nests = _nest_inputs(4, shape=shape)
    outs = run_collective(run_replicas, name, kwargs, nests)
    for r in range(4):
        _assert_nest(outs[r], _map_nest(lambda xs, r=r: ref(xs, r), nests))


@pytest.mark.parametrize("name, kwargs", [("all_reduce", {}), ("all_gather", {}), ("broadcast", {})])
def test_nest_of_only_none(run_replicas, name, kwargs):
    outs = run_collective(run_replicas, name, kwargs, [(None, {"k": None})] * 2)
    assert outs == [(None, {"k": None})] * 2


def test_nest_mixed_dtypes_in_one_call(run_replicas):
    xs = [(torch.full((3,), r, dtype=torch.int32), torch.full((2,), r + 0.5, dtype=torch.float16)) for r in range(4)]
    outs = run_collective(run_replicas, "all_reduce", {"op": "sum"}, xs)
    for o in outs:
        assert_same(o[0], reference_reduce("sum", [x[0] for x in xs]))
        assert_same(o[1], reference_reduce("sum", [x[1] for x in xs]))


# ------------------------------------------------------------------ outside a replica context

OUTSIDE = [
    ("cr.all_reduce", lambda: cr.all_reduce(torch.ones(1))),
    ("cr.all_reduce", lambda: cr.cross_replica_sum(torch.ones(1))),
    ("cr.all_reduce", lambda: cr.cross_replica_mean(torch.ones(1))),
    ("cr.cross_replica_average", lambda: cr.cross_replica_average(torch.ones(1), 1)),
    ("cr.all_gather", lambda: cr.all_gather(torch.ones(1))),
    ("cr.reduce_scatter", lambda: cr.reduce_scatter(torch.ones(2))),
    ("cr.all_to_all", lambda: cr.all_to_all(torch.ones(2), 0, 0)),
    ("cr.broadcast", lambda: cr.broadcast(torch.ones(1))),
    ("cr.collective_permute", lambda: cr.collective_permute(torch.ones(1), [(0, 0)])),
    ("cr.replica_id", cr.replica_id),
    ("cr.num_replicas", cr.num_replicas),
]


@pytest.mark.parametrize("api, call", OUTSIDE, ids=[f"{a}-{i}" for i, (a, _) in enumerate(OUTSIDE)])
@pytest.mark.parametrize("where", ["no-strategy", "scope"])
def test_collective_outside_replica_context(api, call, where):
    strategy = cr.MirroredStrategy(num_replicas=2)
    expected_where = ("in cross-replica context" if where == "scope" else "outside any strategy")
    match = (rf"{api} must be called inside a replica function, but was called {expected_where}.*; "
             rf"run it as strategy\.run\(fn, args=\.\.\.\) where fn calls {api}")
    if where == "scope":
        with strategy.scope(), pytest.raises(cr.ReplicaContextError, match=match):
            call()
    else:
        with pytest.raises(cr.ReplicaContextError, match=match):
            call()


# ------------------------------------------------------------------ bad arguments

BAD_ARGS = [
    ("all_gather", {"dim": 2}, (3, 4), ValueError,
     r"cr\.all_gather: dim=2 is out of range for a tensor of shape \[3, 4\] \(expected -2 <= dim < 2\)"),
    ("all_gather", {"dim": -3}, (3, 4), ValueError, r"cr\.all_gather: dim=-3 is out of range"),
    ("all_gather", {"dim": 0.5}, (3, 4), TypeError, r"cr\.all_gather: dim must be an int; got 0\.5"),
    ("reduce_scatter", {"dim": 5}, (4, 4), ValueError, r"cr\.reduce_scatter: dim=5 is out of range"),
    ("reduce_scatter", {"dim": 1}, (4, 3), ValueError,
     r"cr\.reduce_scatter: x\.shape\[1\]=3 \(shape \[4, 3\]\) must be divisible by the group size 2"),
    ("reduce_scatter", {}, (), ValueError, r"cr\.reduce_scatter needs tensors with at least one dimension"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0}, (3, 4), ValueError,
     r"cr\.all_to_all: x\.shape\[0\]=3 \(shape \[3, 4\]\) must be divisible by the group size 2"),
    ("all_to_all", {"split_dim": 2, "concat_dim": 0}, (4, 4), ValueError, r"cr\.all_to_all: split_dim=2 is out of range"),
    ("all_to_all", {"split_dim": 0, "concat_dim": -3}, (4, 4), ValueError, r"cr\.all_to_all: concat_dim=-3 is out of range"),
    ("broadcast", {"source": 2}, (2,), ValueError,
     r"cr\.broadcast: source must be a position in the group, an int in \[0, 2\); got 2"),
    ("broadcast", {"source": -1}, (2,), ValueError, r"source must be a position in the group.*got -1"),
    ("broadcast", {"source": True}, (2,), ValueError, r"source must be a position in the group.*got True"),
    ("collective_permute", {"source_target_pairs": [(0, 2)]}, (2,), ValueError,
     r"source_target_pairs names a replica outside 0\.\.1 in \(0, 2\)"),
    ("collective_permute", {"source_target_pairs": [(0, 1), (0, 0)]}, (2,), ValueError,
     r"source_target_pairs uses replicas \[0\] more than once as a source"),
    ("collective_permute", {"source_target_pairs": [(0, 1), (1, 1)]}, (2,), ValueError,
     r"source_target_pairs uses replicas \[1\] more than once as a target"),
    ("collective_permute", {"source_target_pairs": [0, 1]}, (2,), ValueError,
     r"source_target_pairs must be a list of \(source, target\) replica id pairs"),
    ("collective_permute", {"source_target_pairs": [(0, 1, 2)]}, (2,), ValueError,
     r"source_target_pairs must be a list of \(source, target\) replica id pairs"),
    ("collective_permute", {"source_target_pairs": [(True, 0)]}, (2,), ValueError,
     r"source_target_pairs must be a list of \(source, target\) replica id pairs, e\.g\. \[\[0, 1\], \[1, 0\]\]; "
     r"got \[\(True, 0\)\]"),
    ("all_reduce", {"op": "sum", "group_assignment": [[0, 1, 2]]}, (2,), ValueError,
     r"group_assignment names replica 2, outside 0\.\.1"),
]


@pytest.mark.parametrize("name, kwargs, shape, exc, match", BAD_ARGS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_ARGS)])
def test_bad_arguments(run_replicas, time_bound, name, kwargs, shape, exc, match):
    xs = [torch.ones(shape)] * 2
    start = time.monotonic()
    with pytest.raises(exc, match=match):
        run_collective(run_replicas, name, kwargs, xs)
    assert time.monotonic() - start < time_bound(5)  # a local check: nobody waits for a peer


@pytest.mark.parametrize("name, kwargs", [("all_reduce", {}), ("all_gather", {}), ("reduce_scatter", {}),
                                          ("all_to_all", {"split_dim": 0, "concat_dim": 0}), ("broadcast", {}),
                                          ("collective_permute", {"source_target_pairs": [(0, 1)]}),
                                          ("cross_replica_sum", {})])
@pytest.mark.parametrize("leaf", ["x", b"y"], ids=["str", "bytes"])
def test_non_tensor_leaves_are_type_errors(run_replicas, name, kwargs, leaf):
    api = "all_reduce" if name == "cross_replica_sum" else name
    x = {"ok": torch.ones(2), "bad": leaf}
    with pytest.raises(TypeError, match=rf"cr\.{api}: every leaf of x must be a torch\.Tensor, a Python number \(bool, int, float, complex\) or None; leaf \d is"):
        run_collective(run_replicas, name, kwargs, [x, x])


# ------------------------------------------------------------------ groups that differ from each other

def _per_group_call(plan, x):
    """Replica function: the members of each group agree, the groups differ."""
    name, kwargs = plan
    return getattr(cr, name)(x, **kwargs)


@pytest.mark.parametrize("size", [(6,), LARGE], ids=["small", "large"])
def test_groups_may_use_different_ops(run_replicas, size):
    groups = [[0, 1], [2, 3]]
    ops = ["sum", "sum", "max", "max"]
    xs = make_inputs(4, size, torch.float32, seed=8)
    outs = run_replicas(_per_group_call, 4, [("all_reduce", {"op": op, "group_assignment": groups}) for op in ops], xs)
    for r in range(4):
        g = groups[r // 2]
        assert_same(outs[r], reference_reduce(ops[r], [xs[m] for m in g]))


def test_groups_may_gather_different_sizes(run_replicas):
    groups = [[0, 1], [2, 3]]
    xs = [torch.randn(1, 2), torch.randn(1, 2), torch.randn(3, 5), torch.randn(3, 5)]
    outs = run_replicas(_per_group_call, 4, [("all_gather", {"group_assignment": groups})] * 4, xs)
    for r in range(4):
        assert_same(outs[r], torch.cat([xs[m] for m in groups[r // 2]], 0))


def test_groups_may_broadcast_from_different_sources(run_replicas):
    groups = [[0, 1], [2, 3]]
    plans = [("broadcast", {"source": s, "group_assignment": groups}) for s in (0, 0, 1, 1)]
    xs = make_inputs(4, LARGE, torch.float32, seed=9)
    outs = run_replicas(_per_group_call, 4, plans, xs)
    for r, src in enumerate([0, 0, 3, 3]):
        assert_same(outs[r], xs[src])


@pytest.mark.parametrize("source", [np.int64(1), torch.tensor(1)], ids=["numpy", "torch"])
def test_broadcast_source_accepts_integer_types(run_replicas, source):
    xs = make_inputs(2, (3,), torch.float32)
    outs = run_collective(run_replicas, "broadcast", {"source": source}, xs)
    assert all(torch.equal(o, xs[1]) for o in outs)


@pytest.mark.parametrize("source", ["1", 1.0, None])
def test_broadcast_source_rejects_non_integers(run_replicas, source):
    with pytest.raises(ValueError, match=rf"cr\.broadcast: source must be a position in the group, an int in \[0, 2\); got {re.escape(repr(source))}"):
        run_collective(run_replicas, "broadcast", {"source": source}, [torch.ones(2)] * 2)


# ------------------------------------------------------------------ outputs are fresh tensors

def _scribble(name, kwargs, x):
    """Overwrites the collective's output in place; returns what every replica then holds."""
    y = getattr(cr, name)(x, **kwargs)
    y.fill_(float(cr.replica_id()))
    cr.all_reduce(torch.zeros(1))  # every replica has scribbled before anyone returns
    return y


ALIAS_CASES = [("all_reduce", {}), ("all_reduce", {"group_assignment": [[0], [1], [2], [3]]}),
               ("all_gather", {}), ("reduce_scatter", {}), ("all_to_all", {"split_dim": 0, "concat_dim": 0}),
               ("broadcast", {"source": 1}), ("collective_permute", {"source_target_pairs": [(0, 1), (1, 0), (2, 2)]})]


@pytest.mark.parametrize("name, kwargs", ALIAS_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(ALIAS_CASES)])
@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["small", "large"])
def test_outputs_alias_neither_inputs_nor_each_other(run_replicas, name, kwargs, size):
    xs = make_inputs(4, size, torch.float32, seed=10)
    originals = [x.clone() for x in xs]
    outs = run_replicas(_scribble, 4, [name] * 4, [kwargs] * 4, xs)
    for r in range(4):
        assert torch.equal(xs[r], originals[r])
        assert torch.equal(outs[r], torch.full_like(outs[r], float(r)))


@pytest.mark.parametrize("name, kwargs, ref", [
    ("all_reduce", {}, lambda xs, r: reference_reduce("sum", xs)),
    ("all_gather", {"dim": 1}, lambda xs, r: torch.cat(xs, 1)),
    ("reduce_scatter", {"dim": 0}, lambda xs, r: reference_reduce("sum", xs).chunk(4, 0)[r]),
    ("broadcast", {"source": 3}, lambda xs, r: xs[3]),
])
@pytest.mark.parametrize("size", [(124, 8), (25_000, 8)], ids=["small", "large"])
def test_non_contiguous_inputs(run_replicas, name, kwargs, ref, size):
    xs = [x.t() for x in make_inputs(4, size, torch.float32, seed=11)]  # transposed views
    assert not xs[0].is_contiguous()
    outs = run_collective(run_replicas, name, kwargs, xs)
    for r in range(4):
        assert_same(outs[r], ref(xs, r))
