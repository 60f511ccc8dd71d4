"""Group assignments (both spellings, contiguous and strided groups) and Mesh axes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import crossreplica as cr


# ------------------------------------------------------------------ valid spellings

@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_none_is_one_group_of_everyone(n):
    assert cr.canonical_groups(None, n) == (tuple(range(n)),)


@pytest.mark.parametrize("ga, expected", [
    ([[0, 1], [2, 3]], ((0, 1), (2, 3))),
    ([[3, 1], [2, 0]], ((3, 1), (2, 0))),  # member order is kept (gather order)
    ([[0], [1], [2], [3]], ((0,), (1,), (2,), (3,))),
    (((0, 2), (1, 3)), ((0, 2), (1, 3))),
    ([(0, 1, 2, 3)], ((0, 1, 2, 3),)),
    (np.array([[0, 1], [2, 3]]), ((0, 1), (2, 3))),
    (torch.tensor([[1, 0], [3, 2]]), ((1, 0), (3, 2))),
    ([np.int64(0), np.int64(0), np.int64(1), np.int64(1)], ((0, 1), (2, 3))),
])
def test_two_d_form(ga, expected):
    groups = cr.canonical_groups(ga, 4)
    assert groups == expected
    assert type(groups) is tuple and all(type(g) is tuple and all(type(r) is int for r in g) for g in groups)


@pytest.mark.parametrize("flat, expected", [
    ([0, 0, 1, 1], ((0, 1), (2, 3))),
    ([0, 1, 0, 1], ((0, 2), (1, 3))),
    ([1, 0, 0, 1], ((1, 2), (0, 3))),
    ([0, 0, 0, 0], ((0, 1, 2, 3),)),
    ((0, 1, 2, 3), ((0,), (1,), (2,), (3,))),
    (np.array([0, 1, 1, 0]), ((0, 3), (1, 2))),
])
def test_flat_form(flat, expected):
    assert cr.canonical_groups(flat, 4) == expected


def _flat_reference(flat):
    return tuple(tuple(r for r in range(len(flat)) if flat[r] == g) for g in range(max(flat) + 1))


# ------------------------------------------------------------------ invalid spellings

INVALID = [
    ([[0, 0], [1, 2]], r"group_assignment must cover replicas 0\.\.3 exactly once; replica 0 appears in group 0 twice: \[\[0, 0\], \[1, 2\]\]"),
    ([[0, 1], [1, 2]], r"group_assignment must cover replicas 0\.\.3 exactly once; replica 1 appears in groups 0 and 1: \[\[0, 1\], \[1, 2\]\]"),
    ([[0, 1]], r"group_assignment must cover replicas 0\.\.3 exactly once; replicas \[2, 3\] are in no group: \[\[0, 1\]\]"),
    ([[0, 1], [2, 5]], r"group_assignment names replica 5, outside 0\.\.3 \(4 replicas in sync\): \[\[0, 1\], \[2, 5\]\]"),
    ([[0, 1], [-1, 2]], r"group_assignment names replica -1, outside 0\.\.3"),
    ([[0, 1, 2], [3]], r"group_assignment must have groups of equal size; group 0 has 3 replicas, group 1 has 1: \[\[0, 1, 2\], \[3\]\]"),
    ([], r"group_assignment must not be empty; got \[\]"),
    ([[], []], r"group_assignment\[0\] is an empty group; got \[\[\], \[\]\]"),
    ([[0, 1], 2, 3], r"group_assignment mixes group indices and groups: entry 1 is 2; use either \[\[0, 1\], \[2, 3\]\] or \[0, 0, 1, 1\]"),
    ([[True, 1], [2, 3]], r"group_assignment\[0\] must hold integer replica ids; got True in \[\[True, 1\], \[2, 3\]\]"),
    ([True, False, True, False], r"group_assignment\[0\] is the bool True; group indices and replica ids must be ints, not bools"),
    ([[0, 1.0], [2, 3]], r"group_assignment\[0\] must hold integer replica ids; got 1\.0"),
    ([0, 0, 1], r"group_assignment in the flat form needs one group index per replica \(4 replicas in sync\); got 3 entries: \[0, 0, 1\]"),
    ([0, 0, 1, 1, 1], r"needs one group index per replica \(4 replicas in sync\); got 5 entries"),
    ([0, 0, 2, 2], r"group_assignment in the flat form must use group indices 0\.\.G-1 with none skipped; got \[0, 0, 2, 2\]"),
    ([-1, -1, 0, 0], r"must use group indices 0\.\.G-1 with none skipped; got \[-1, -1, 0, 0\]"),
    ([0, 0, 0, 1], r"group_assignment must have groups of equal size; group sizes are \[3, 1\]: \[0, 0, 0, 1\]"),
    ("0011", r"group_assignment must be None, a list of equal-size lists of replica ids .* or one group index per replica .*; got '0011'"),
    (4, r"group_assignment must be None, a list of equal-size lists .*; got 4"),
    ([[0, 1], "23"], r"group_assignment\[1\] must be None, a list of equal-size lists .*; got '23'"),
    (((0, 1), (2, 2)), r"replica 2 appears in group 1 twice: \(\(0, 1\), \(2, 2\)\)"),
]


@pytest.mark.parametrize("ga, match", INVALID)
def test_invalid_group_assignment_is_value_error_naming_arg_value_and_rule(ga, match):
    with pytest.raises(ValueError, match=match):
        cr.canonical_groups(ga, 4)


def test_invalid_message_uses_given_argname():
    with pytest.raises(ValueError, match=r"^groups must not be empty"):
        cr.canonical_groups([], 2, argname="groups")


def _sum_with(x, ga):
    return cr.all_reduce(x, "sum", ga)


@pytest.mark.parametrize("ga, match", INVALID[:6])
def test_invalid_group_assignment_in_collective(run_replicas, ga, match):
    with pytest.raises(ValueError, match=match):
        run_replicas(_sum_with, 4, [torch.ones(2)] * 4, [ga] * 4)


# ------------------------------------------------------------------ contiguous / strided

@pytest.mark.parametrize("n, k", [(4, 2), (6, 3), (4, 1), (4, 4), (8, 2)])
def test_contiguous_and_strided_groups(n, k):
    contiguous = cr.contiguous_groups(n, k)
    assert contiguous == tuple(tuple(range(g * k, g * k + k)) for g in range(n // k))
    strided = cr.strided_groups(n, k)
    assert strided == tuple(tuple(range(g, n, n // k)) for g in range(n // k))
    assert cr.canonical_groups(contiguous, n) == contiguous
    assert cr.canonical_groups(strided, n) == strided


def test_contiguous_groups_divisibility_error():
    # seed 000 (cross_replica_average): "num_replicas: 4 mod num_shards_per_group: 3 should be 0, got 1"
    with pytest.raises(ValueError, match=r"num_replicas: 4 mod num_shards_per_group: 3 should be 0, got 1"):
        cr.contiguous_groups(4, 3)


def test_strided_groups_divisibility_error():
    with pytest.raises(ValueError, match=r"num_replicas: 6 mod group_size: 4 should be 0, got 2"):
        cr.strided_groups(6, 4)


@pytest.mark.parametrize("fn, name", [(cr.contiguous_groups, "num_shards_per_group"), (cr.strided_groups, "group_size")])
@pytest.mark.parametrize("k", [0, -2, True, 1.5])
def test_group_size_must_be_positive_int(fn, name, k):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer; got {k!r}"):
        fn(4, k)


# ------------------------------------------------------------------ Mesh

def _brute_force_groups(sizes, axis_idx):
    """Replicas grouped by their coordinates off the reduced axes (row-major ids)."""
    coords = list(itertools.product(*(range(s) for s in sizes)))  # row-major: index == replica id
    kept = [i for i in range(len(sizes)) if i not in axis_idx]
    groups = {}
    for r, c in enumerate(coords):
        groups.setdefault(tuple(c[i] for i in kept), []).append(r)
    return sorted(tuple(g) for g in groups.values())


mesh_shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(mesh_shapes, st.data())
def test_mesh_group_assignment_matches_brute_force(sizes, data):
    names = ["a", "b", "c"][:len(sizes)]
    mesh = cr.Mesh(dict(zip(names, sizes)))
    chosen = data.draw(st.lists(st.sampled_from(range(len(sizes))), unique=True))
    groups = mesh.group_assignment([names[i] for i in chosen])
    assert sorted(groups) == _brute_force_groups(sizes, chosen)
    assert all(list(g) == sorted(g) for g in groups)  # members row-major over the reduced axes
    assert cr.canonical_groups(groups, mesh.size) == groups


@settings(max_examples=40, deadline=None)
@given(mesh_shapes)
def test_mesh_coordinates_round_trip_row_major(sizes):
    names = ["x", "y", "z"][:len(sizes)]
    mesh = cr.Mesh(dict(zip(names, sizes)))
    assert mesh.size == int(np.prod(sizes))
    for r, c in enumerate(itertools.product(*(range(s) for s in sizes))):
        assert mesh.coordinates(r) == c
        assert mesh.replica(c) == r
        assert mesh.replica(dict(zip(names, c))) == r


def test_mesh_two_by_two_layout():
    mesh = cr.Mesh({"data": 2, "model": 2})
    assert mesh.axis_names == ("data", "model") and mesh.shape == {"data": 2, "model": 2}
    assert mesh.group_assignment(("model",)) == ((0, 1), (2, 3))
    assert mesh.group_assignment("data") == ((0, 2), (1, 3))
    assert mesh.group_assignment(("data", "model")) == ((0, 1, 2, 3),)
    assert mesh.group_assignment(()) == ((0,), (1,), (2,), (3,))


def test_mesh_unknown_axis_lists_valid_names():
    mesh = cr.Mesh({"data": 2, "model": 2})
    with pytest.raises(ValueError, match=r"axes names 'batch', which is not an axis of Mesh\(.*\); valid names: \['data', 'model'\]"):
        mesh.group_assignment(("batch",))


@pytest.mark.parametrize("shape, match", [
    ({}, r"shape must be a non-empty mapping from axis name to size"),
    ([("a", 2)], r"shape must be a non-empty mapping"),
    ({"a": 0}, r"mesh axis 'a' must have a positive integer size; got 0"),
    ({"a": 2.0}, r"mesh axis 'a' must have a positive integer size; got 2\.0"),
    ({1: 2}, r"mesh axis names must be non-empty strings; got 1"),
])
def test_mesh_bad_shape(shape, match):
    with pytest.raises(ValueError, match=match):
        cr.Mesh(shape)


def test_mesh_bad_coordinates():
    mesh = cr.Mesh({"a": 2, "b": 3})
    with pytest.raises(ValueError, match=r"replica must be an int in \[0, 6\)"):
        mesh.coordinates(6)
    with pytest.raises(ValueError, match=r"coordinate for axis 'b' must be in \[0, 3\); got 3"):
        mesh.replica((0, 3))
    with pytest.raises(ValueError, match=r"coords must have one index per axis \['a', 'b'\]"):
        mesh.replica((0,))
    with pytest.raises(ValueError, match=r"axes must not repeat a name"):
        mesh.group_assignment(("a", "a"))


def _mesh_reduce(x, mesh, axes):
    return cr.all_reduce(x, "sum", mesh=mesh, axes=axes)


def test_mesh_size_must_equal_replica_count(run_replicas):
    mesh = cr.Mesh({"data": 2, "model": 2})
    with pytest.raises(ValueError, match=r"mesh Mesh\(.*\) has 4 devices but 2 replicas are in sync"):
        run_replicas(_mesh_reduce, 2, [torch.ones(1)] * 2, [mesh] * 2, [("model",)] * 2)


def _mesh_and_groups(x, mesh, ga):
    return cr.all_reduce(x, "sum", group_assignment=ga, mesh=mesh, axes="model")


def test_group_assignment_with_mesh_groups_positions_within_the_axes(run_replicas):
    # Mesh 2 x 4: the model rows are [0..3] and [4..7]; [[0, 2], [1, 3]] pairs positions
    # 0/2 and 1/3 within every row: groups [0, 2], [1, 3], [4, 6], [5, 7].
    mesh = cr.Mesh({"data": 2, "model": 4})
    xs = [torch.tensor([float(2 ** r)]) for r in range(8)]
    outs = run_replicas(_mesh_and_groups, 8, xs, [mesh] * 8, [[[0, 2], [1, 3]]] * 8)
    groups = [[0, 2], [1, 3], [4, 6], [5, 7]]
    for g in groups:
        for r in g:
            assert torch.equal(outs[r], xs[g[0]] + xs[g[1]])


def test_group_assignment_with_mesh_is_checked_against_the_axis_size(run_replicas):
    mesh = cr.Mesh({"data": 1, "model": 2})
    with pytest.raises(ValueError, match=r"group_assignment names replica 2, outside 0\.\.1"):
        run_replicas(_mesh_and_groups, 2, [torch.ones(1)] * 2, [mesh] * 2, [[[0, 1, 2]]] * 2)


def _axes_without_mesh(x):
    return cr.all_reduce(x, "sum", axes=("d",))


def test_axes_without_mesh_is_value_error(run_replicas):
    with pytest.raises(ValueError, match=r"axes=\('d',\) needs a mesh"):
        run_replicas(_axes_without_mesh, 2, [torch.ones(1)] * 2)


# ------------------------------------------------------------------ partition property

@st.composite
def _assignments(draw):
    num_groups = draw(st.integers(1, 4))
    size = draw(st.integers(1, 3))
    n = num_groups * size
    perm = draw(st.permutations(range(n)))
    groups = [list(perm[g * size:(g + 1) * size]) for g in range(num_groups)]
    if draw(st.booleans()):
        flat = [0] * n
        for g, members in enumerate(groups):
            for r in members:
                flat[r] = g
        # the flat form numbers groups by first appearance; renumber so none is skipped
        order = {g: i for i, g in enumerate(dict.fromkeys(flat))}
        return n, [order[g] for g in flat], "flat"
    return n, groups, "2d"


@settings(max_examples=100, deadline=None)
@given(_assignments())
def test_canonical_groups_partition_the_replicas(case):
    n, ga, form = case
    groups = cr.canonical_groups(ga, n)
    members = [r for g in groups for r in g]
    assert sorted(members) == list(range(n))
    assert len({len(g) for g in groups}) == 1
    if form == "2d":
        assert groups == tuple(tuple(g) for g in ga)
    else:
        assert groups == _flat_reference(ga)


@pytest.mark.parametrize("axes, groups", [(None, [[0, 1, 2, 3, 4, 5]]), ("model", [[0, 1, 2], [3, 4, 5]]),
                                          (["data"], [[0, 3], [1, 4], [2, 5]])])
def test_mesh_reduction_in_collective(run_replicas, axes, groups):
    mesh = cr.Mesh({"data": 2, "model": 3})
    xs = [torch.tensor([float(2 ** r)]) for r in range(6)]  # every subset has a distinct sum
    outs = run_replicas(_mesh_reduce, 6, xs, [mesh] * 6, [axes] * 6)
    for g in groups:
        for r in g:
            assert torch.equal(outs[r], sum(xs[m] for m in g))
