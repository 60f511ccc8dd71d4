"""The forms of the collectives beyond the basic matrix: untiled all_gather, uneven
all_to_all split sizes, mesh/axes on every grouped collective (and group
assignments within mesh axes), permutes by axis shift, Python numbers and 0-d
inputs. Each case runs on every engine through ``run_replicas`` and is compared,
forward and backward, with plain torch computed here.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import crossreplica as cr
from crossreplica.errors import CollectiveMismatchError

# ------------------------------------------------------------------ helpers


def _fwd_bwd(name, kwargs, x, c):
    """Replica function: the collective, and the gradient of ``sum(y * c)`` with respect to x."""
    x = x.clone().requires_grad_(True)
    y = getattr(cr, name)(x, **kwargs)
    (g,) = torch.autograd.grad((y * c).sum(), x)
    return y.detach(), g


def _cotangents(ys, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(y.shape, generator=gen, dtype=y.dtype) for y in ys]


def check(run_replicas, name, kwargs, xs, reference):
    """Runs ``name`` on every replica (``kwargs``: one dict, or one per replica) and compares
    outputs (exactly) and input gradients of the global objective ``sum_r sum(y_r * c_r)``
    with ``reference(xs) -> ys`` in plain torch."""
    n = len(xs)
    per = kwargs if isinstance(kwargs, list) else [kwargs] * n
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    expected = reference(leaves)
    cs = _cotangents(expected)
    outs = run_replicas(_fwd_bwd, n, [name] * n, per, xs, cs)
    live = [(e, c) for e, c in zip(expected, cs) if e.requires_grad]
    grads = torch.autograd.grad([e for e, _ in live], leaves, [c for _, c in live], allow_unused=True)
    for r, ((y, g), e, eg, x) in enumerate(zip(outs, expected, grads, xs)):
        assert y.shape == e.shape and torch.equal(y, e.detach()), f"replica {r}: {y} != {e}"
        eg = torch.zeros_like(x) if eg is None else eg
        assert torch.allclose(g, eg, rtol=1e-12, atol=1e-12), f"replica {r}: grad {g} != {eg}"


def inputs(n, shape_of, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape_of(r), generator=gen, dtype=torch.float64) for r in range(n)]


def per_group(groups, n, fn):
    """reference(xs): ``fn(member inputs, position) -> output`` for each replica."""
    def ref(xs):
        outs = [None] * n
        for g in groups:
            for p, r in enumerate(g):
                outs[r] = fn([xs[m] for m in g], p)
        return outs
    return ref


def mesh_groups(shape, axes, within=None):
    """Brute force: replicas (row-major) that share their coordinates off ``axes``, members
    row-major over ``axes``; ``within`` splits each by position."""
    names, sizes = list(shape), list(shape.values())
    groups = {}
    for r, c in enumerate(itertools.product(*(range(s) for s in sizes))):
        key = tuple(ci for name, ci in zip(names, c) if name not in axes)
        groups.setdefault(key, []).append(r)
    out = list(groups.values())
    if within is not None:
        out = [[g[p] for p in sub] for g in out for sub in within]
    return out


# ------------------------------------------------------------------ 1. all_gather(tiled=False)

GATHER_GROUPS = [(1, None, [[0]]), (2, None, [[0, 1]]), (4, [[2, 0], [3, 1]], [[2, 0], [3, 1]]),
                 (4, [0, 1, 0, 1], [[0, 2], [1, 3]])]


@pytest.mark.parametrize("n, ga, groups", GATHER_GROUPS, ids=[f"n{c[0]}-{c[1]}" for c in GATHER_GROUPS])
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_all_gather_untiled_stacks_a_new_axis(run_replicas, n, ga, groups, dim):
    xs = inputs(n, lambda r: (2, 3))
    check(run_replicas, "all_gather", {"dim": dim, "group_assignment": ga, "tiled": False}, xs,
          per_group(groups, n, lambda ms, p: torch.stack(ms, dim)))


def test_all_gather_untiled_of_0d_is_a_vector(run_replicas):
    xs = inputs(2, lambda r: ())
    check(run_replicas, "all_gather", {"tiled": False}, xs, lambda xs: [torch.stack(xs)] * 2)


def test_all_gather_tiled_is_the_default_and_concatenates(run_replicas):
    xs = inputs(2, lambda r: (r + 1, 2))
    check(run_replicas, "all_gather", {"dim": 0, "tiled": True}, xs, lambda xs: [torch.cat(xs)] * 2)


# ------------------------------------------------------------------ 2. uneven all_to_all

def _split_matrix(k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (k, k), generator=gen).tolist()  # S[i][j]: rows member i sends member j


def _uneven_case(n, groups, shape, dim, seed=0):
    """Per-replica kwargs and inputs for an uneven all_to_all, and its reference."""
    k = len(groups[0])
    S = _split_matrix(k, seed)
    kwargs, shapes = [None] * n, [None] * n
    for g in groups:
        for i, r in enumerate(g):
            s = list(shape)
            s[dim] = sum(S[i])
            shapes[r] = tuple(s)
            kwargs[r] = {"split_dim": dim, "concat_dim": dim, "group_assignment": groups,
                         "input_split_sizes": S[i], "output_split_sizes": [S[j][i] for j in range(k)]}

    def member_ref(ms, p):
        pieces = []
        for i, m in enumerate(ms):
            start = sum(S[i][:p])
            pieces.append(m.narrow(dim, start, S[i][p]))
        return torch.cat(pieces, dim)

    return kwargs, shapes, per_group(groups, n, member_ref)


A2A_GROUPS = [(2, [[0, 1]]), (2, [[1, 0]]), (4, [[0, 1, 2, 3]]), (4, [[0, 1], [2, 3]]), (4, [[3, 1], [2, 0]]),
              (3, [[0, 1, 2]])]


@pytest.mark.parametrize("n, groups", A2A_GROUPS, ids=[f"n{n}-{g}" for n, g in A2A_GROUPS])
@pytest.mark.parametrize("shape, dim", [((0,), 0), ((0, 3, 2), 0), ((2, 0, 3), 1), ((2, 3, 0), -1)],
                         ids=["1d", "3d-dim0", "3d-dim1", "3d-dim-1"])
def test_all_to_all_uneven_split_sizes(run_replicas, n, groups, shape, dim):
    kwargs, shapes, reference = _uneven_case(n, groups, shape, dim % len(shape), seed=n + len(shape))
    xs = inputs(n, lambda r: shapes[r])
    check(run_replicas, "all_to_all", kwargs, xs, reference)


def test_all_to_all_split_sizes_on_one_side(run_replicas):
    # None means equal chunks of this replica's x: replica 0 leaves both out, replica 1 spells them.
    xs = inputs(2, lambda r: (4, 2))
    kwargs = [{"split_dim": 0, "concat_dim": 0},
              {"split_dim": 0, "concat_dim": 0, "input_split_sizes": [2, 2], "output_split_sizes": [2, 2]}]
    check(run_replicas, "all_to_all", kwargs, xs,
          lambda xs: [torch.cat([x.chunk(2)[p] for x in xs]) for p in range(2)])


def _a2a(x, kwargs):
    return cr.all_to_all(x, **kwargs)


@pytest.mark.detects_mismatch
def test_all_to_all_inconsistent_split_sizes_are_a_mismatch(run_replicas, time_bound):
    # both replicas send [1, 3] and expect [1, 3]: replica 1 expects 1 row from replica 0, which sends 3
    kwargs = {"split_dim": 0, "concat_dim": 0, "input_split_sizes": [1, 3], "output_split_sizes": [1, 3]}
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError, match=r"input_split_sizes=\[1, 3\]"):
        run_replicas(_a2a, 2, [torch.ones(4)] * 2, [kwargs] * 2)
    assert time.monotonic() - start < time_bound(20)


# ------------------------------------------------------------------ 3. mesh / axes everywhere

MESH = {"data": 2, "model": 2}
MESH_CASES = [(("model",), None), (("data",), None), (("data", "model"), None), (("model",), [[1, 0]]),
              (("data", "model"), [[0, 3], [1, 2]]), (("data",), [[0], [1]])]
MESH_IDS = [f"{'+'.join(a)}-{w}" for a, w in MESH_CASES]


def _mesh_kwargs(axes, within):
    kw = {"mesh": cr.Mesh(MESH), "axes": axes}
    if within is not None:
        kw["group_assignment"] = within
    return kw


MESH_COLLECTIVES = [
    ("cross_replica_sum", {}, (2, 3), lambda ms, p: sum(ms[1:], ms[0])),
    ("cross_replica_mean", {}, (2, 3), lambda ms, p: sum(ms[1:], ms[0]) / len(ms)),
    ("all_reduce", {"op": "max"}, (5,), lambda ms, p: torch.stack(ms).amax(0)),
    ("all_gather", {"dim": 1}, (2, 3), lambda ms, p: torch.cat(ms, 1)),
    ("all_gather", {"dim": 0, "tiled": False}, (2, 3), lambda ms, p: torch.stack(ms, 0)),
    ("reduce_scatter", {"dim": 0}, (4, 3), lambda ms, p: sum(ms[1:], ms[0]).chunk(len(ms), 0)[p]),
    ("all_to_all", {"split_dim": 0, "concat_dim": 1}, (4, 3),
     lambda ms, p: torch.cat([m.chunk(len(ms), 0)[p] for m in ms], 1)),
    ("broadcast", {"source": 0}, (3,), lambda ms, p: ms[0] + 0),
]


@pytest.mark.parametrize("axes, within", MESH_CASES, ids=MESH_IDS)
@pytest.mark.parametrize("name, kwargs, shape, member_ref", MESH_COLLECTIVES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(MESH_COLLECTIVES)])
def test_mesh_axes_on_every_grouped_collective(run_replicas, name, kwargs, shape, member_ref, axes, within):
    groups = mesh_groups(MESH, axes, within)
    xs = inputs(4, lambda r: shape)
    check(run_replicas, name, {**kwargs, **_mesh_kwargs(axes, within)}, xs, per_group(groups, 4, member_ref))


SHIFTS = [("model", 1), ("model", -1), ("data", 1), ("data", 2), (("data", "model"), 1), (("data", "model"), 3)]


@pytest.mark.parametrize("axis, shift", SHIFTS, ids=[f"{a}-{s}" for a, s in SHIFTS])
def test_collective_permute_by_axis_shift(run_replicas, axis, shift):
    axes = (axis,) if isinstance(axis, str) else axis
    groups = mesh_groups(MESH, axes)
    xs = inputs(4, lambda r: (2,))
    # position p sends to (p + shift) % m: the receiver at q gets position (q - shift) % m
    check(run_replicas, "collective_permute", {"mesh": cr.Mesh(MESH), "axis": axis, "shift": shift}, xs,
          per_group(groups, 4, lambda ms, q: ms[(q - shift) % len(ms)] + 0))


def test_collective_permute_pairs_within_an_axis(run_replicas):
    # positions along "model": 0 -> 1 only; position 0 of every row receives zeros
    groups = mesh_groups(MESH, ("model",))
    xs = inputs(4, lambda r: (3,))
    check(run_replicas, "collective_permute", {"source_target_pairs": [(0, 1)], "mesh": cr.Mesh(MESH),
                                               "axis": "model"}, xs,
          per_group(groups, 4, lambda ms, q: ms[0] + 0 if q == 1 else torch.zeros_like(ms[0])))


# ------------------------------------------------------------------ 4. numbers and 0-d inputs

def _call(name, kwargs, x):
    return getattr(cr, name)(x, **kwargs)


NUMBERS = [
    ("cross_replica_sum", {}, lambda r: 2.0, lambda n, r: torch.tensor(2.0 * n)),
    ("cross_replica_sum", {}, lambda r: r + 1, lambda n, r: torch.tensor(n * (n + 1) // 2)),
    ("cross_replica_sum", {}, lambda r: r == 0, lambda n, r: torch.tensor(True)),
    ("all_reduce", {"op": "max"}, lambda r: float(r), lambda n, r: torch.tensor(float(n - 1))),
    ("all_reduce", {"op": "min"}, lambda r: r == 0, lambda n, r: torch.tensor(n == 1)),
    ("cross_replica_mean", {}, lambda r: float(r), lambda n, r: torch.tensor(sum(range(n)) / n)),
    ("all_gather", {}, lambda r: r, lambda n, r: torch.arange(n)),
    ("all_gather", {"tiled": False}, lambda r: 0.5 * r, lambda n, r: torch.arange(n) * 0.5),
    ("broadcast", {"source": 0}, lambda r: 1.5 + r, lambda n, r: torch.tensor(1.5)),
    ("collective_permute", {"source_target_pairs": [(0, 1), (1, 0)]}, lambda r: r,
     lambda n, r: torch.tensor(1 - r)),
    ("cross_replica_sum", {}, lambda r: {"a": 1, "b": (2.5, None)},
     lambda n, r: {"a": torch.tensor(n), "b": (torch.tensor(2.5 * n), None)}),
    ("cross_replica_sum", {}, lambda r: torch.tensor(r, dtype=torch.float64),
     lambda n, r: torch.tensor(float(sum(range(n))), dtype=torch.float64)),
    ("cross_replica_sum", {}, lambda r: 1 + 1j * r, lambda n, r: torch.tensor(n + 1j * sum(range(n)))),
]


def _same(a, b):
    if isinstance(b, dict):
        assert set(a) == set(b)
        for k in b:
            _same(a[k], b[k])
    elif isinstance(b, tuple):
        assert type(a) is tuple and len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
    elif b is None:
        assert a is None
    else:
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("name, kwargs, value, expected", NUMBERS, ids=[f"{c[0]}-{i}" for i, c in enumerate(NUMBERS)])
def test_python_numbers_and_0d_inputs(run_replicas, name, kwargs, value, expected):
    n = 2
    outs = run_replicas(_call, n, [name] * n, [kwargs] * n, [value(r) for r in range(n)])
    for r, o in enumerate(outs):
        _same(o, expected(n, r))


def test_number_dtypes_follow_torch():
    # float -> the default dtype, int -> int64, bool -> bool, complex -> the default complex dtype
    strategy = cr.MirroredStrategy(num_replicas=1)
    out = strategy.run(lambda: [cr.cross_replica_sum(v) for v in (2.0, 3, True, 1j)])
    assert [o.dtype for o in out] == [torch.get_default_dtype(), torch.int64, torch.bool, torch.complex64]
    assert all(o.dim() == 0 for o in out)


# ------------------------------------------------------------------ bad arguments

BAD = [
    ("all_gather", {"tiled": 1}, (2,), TypeError, r"cr\.all_gather: tiled must be a bool; got 1"),
    ("all_gather", {"tiled": False, "dim": 2}, (2,), ValueError,
     r"cr\.all_gather: dim=2 is out of range for a tensor of shape \[2\] \(expected -2 <= dim < 2\)"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0, "input_split_sizes": [4]}, (4,), ValueError,
     r"cr\.all_to_all: input_split_sizes must be None or 2 non-negative ints, one per member of the group "
     r"\(group size 2\); got \[4\]"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0, "output_split_sizes": [5, -1]}, (4,), ValueError,
     r"cr\.all_to_all: output_split_sizes must be None or 2 non-negative ints.*got \[5, -1\]"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0, "input_split_sizes": [1, "a"]}, (4,), ValueError,
     r"input_split_sizes must be None or 2 non-negative ints.*got \[1, 'a'\]"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0, "input_split_sizes": [1, 2], "output_split_sizes": [2, 2]},
     (4,), ValueError, r"cr\.all_to_all: input_split_sizes=\[1, 2\] must add up to x\.shape\[0\]=4 \(shape \[4\]\)"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 1, "input_split_sizes": [1, 3], "output_split_sizes": [1, 3]},
     (4, 2), ValueError, r"cr\.all_to_all: split sizes need split_dim == concat_dim.*got split_dim=0, concat_dim=1"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0, "input_split_sizes": [1, 2]}, (3,), ValueError,
     r"cr\.all_to_all: x\.shape\[0\]=3 \(shape \[3\]\) must be divisible by the group size 2, or pass "
     r"input_split_sizes and output_split_sizes"),
    ("collective_permute", {"source_target_pairs": [(0, 1)], "shift": 1}, (2,), ValueError,
     r"cr\.collective_permute: axis=None and shift=1 need a mesh; pass mesh=cr\.Mesh\(\.\.\.\) as well"),
    ("collective_permute", {}, (2,), ValueError,
     r"cr\.collective_permute: pass source_target_pairs, e\.g\. \[\[0, 1\], \[1, 0\]\], or mesh, axis and shift"),
    ("collective_permute", {"mesh": cr.Mesh({"m": 2}), "shift": 1}, (2,), ValueError,
     r"cr\.collective_permute: mesh=Mesh\(\{'m': 2\}\) needs axis, the axis to permute along; got axis=None"),
    ("collective_permute", {"mesh": cr.Mesh({"m": 2}), "axis": "m"}, (2,), ValueError,
     r"with a mesh pass exactly one of source_target_pairs \(positions along 'm'\) and shift; "
     r"got source_target_pairs=None and shift=None"),
    ("collective_permute", {"mesh": cr.Mesh({"m": 2}), "axis": "m", "shift": 0.5}, (2,), ValueError,
     r"cr\.collective_permute: shift must be an int; got 0\.5"),
    ("collective_permute", {"mesh": cr.Mesh({"m": 2}), "axis": "x", "shift": 1}, (2,), ValueError,
     r"axes names 'x', which is not an axis of Mesh\(\{'m': 2\}\); valid names: \['m'\]"),
    ("collective_permute", {"mesh": cr.Mesh({"m": 2}), "axis": "m", "source_target_pairs": [(0, 2)]}, (2,),
     ValueError, r"source_target_pairs names a replica outside 0\.\.1 in \(0, 2\)"),
    ("broadcast", {"mesh": cr.Mesh({"m": 2}), "axes": "m", "source": 2}, (2,), ValueError,
     r"cr\.broadcast: source must be a position in the group, an int in \[0, 2\); got 2"),
    ("all_gather", {"mesh": "m"}, (2,), ValueError, r"mesh must be a cr\.Mesh; got 'm'"),
    ("reduce_scatter", {"mesh": cr.Mesh({"a": 4})}, (4,), ValueError,
     r"mesh Mesh\(\{'a': 4\}\) has 4 devices but 2 replicas are in sync"),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0, "axes": "m"}, (2,), ValueError, r"axes='m' needs a mesh"),
]


@pytest.mark.parametrize("name, kwargs, shape, exc, match", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)])
def test_bad_arguments(run_replicas, time_bound, name, kwargs, shape, exc, match):
    start = time.monotonic()
    with pytest.raises(exc, match=match):
        run_replicas(_call, 2, [name] * 2, [kwargs] * 2, [torch.ones(shape)] * 2)
    assert time.monotonic() - start < time_bound(5)  # a local check: nobody waits for a peer
