"""DistributedValues, regroup and select_replica."""

from __future__ import annotations

import collections
from collections import abc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import crossreplica as cr
from nests import Point, leaves, nest_equal, nests, same_structure


def _is_per_replica(x, expected, cls=cr.PerReplica):
    assert type(x) is cls
    assert isinstance(x.values, tuple)
    assert list(x.values) == list(expected)


# ------------------------------------------------------------------ DistributedValues

@pytest.mark.parametrize("cls", [cr.DistributedValues, cr.PerReplica, cr.Mirrored])
def test_values_is_a_tuple_and_repr_lists_replicas(cls):
    v = cls([1, "b"])
    assert v.values == (1, "b") and isinstance(v.values, tuple)
    assert len(v) == 2
    assert repr(v) == f"{cls.__name__}({{0: 1, 1: 'b'}})"


def test_per_replica_and_mirrored_are_distributed_values():
    assert issubclass(cr.PerReplica, cr.DistributedValues)
    assert issubclass(cr.Mirrored, cr.DistributedValues)
    assert not issubclass(cr.Mirrored, cr.PerReplica)


@pytest.mark.parametrize("bad", [[], (), "ab", 3, None])
def test_distributed_values_needs_non_empty_sequence(bad):
    with pytest.raises(ValueError, match=r"values must be a non-empty sequence with one value per replica"):
        cr.PerReplica(bad)


# ------------------------------------------------------------------ regroup

def test_regroup_tuples_and_lists():
    result = cr.regroup([(1, [2, 3]), (4, [5, 6])])
    assert type(result) is tuple and type(result[1]) is list
    _is_per_replica(result[0], [1, 4])
    _is_per_replica(result[1][0], [2, 5])
    _is_per_replica(result[1][1], [3, 6])


def test_regroup_namedtuple_kept_as_class():
    result = cr.regroup([Point(1, 2), Point(3, 4)])
    assert type(result) is Point
    _is_per_replica(result.x, [1, 3])
    _is_per_replica(result.y, [2, 4])


class _Scaffold:
    pass


class EstimatorSpec(collections.namedtuple("EstimatorSpec", ["mode", "loss", "train_op", "scaffold"])):
    """Seed 002's toy EstimatorSpec: a namedtuple subclass whose __new__ fills a default."""

    def __new__(cls, mode, loss, train_op, scaffold=None):
        return super().__new__(cls, mode=mode, loss=loss, train_op=train_op,
                               scaffold=scaffold or _Scaffold())


def test_regroup_namedtuple_with_custom_new():
    specs = [EstimatorSpec(mode="train", loss=torch.tensor(i / 2), train_op=torch.tensor(i)) for i in range(3)]
    merged = cr.regroup(specs)
    assert isinstance(merged, EstimatorSpec)
    assert merged.mode == "train"
    for i in range(3):
        assert merged.loss.values[i] is specs[i].loss
        assert merged.train_op.values[i] is specs[i].train_op
        assert merged.scaffold.values[i] is specs[i].scaffold
        assert isinstance(specs[i].scaffold, _Scaffold)
        selected = cr.select_replica(i, merged)
        assert type(selected) is EstimatorSpec
        assert all(a is b for a, b in zip(selected, specs[i]))


def test_regroup_dict_and_dict_subclasses():
    od = cr.regroup([collections.OrderedDict(a=1, b=2), collections.OrderedDict(a=3, b=4)])
    assert type(od) is collections.OrderedDict and list(od) == ["a", "b"]
    _is_per_replica(od["a"], [1, 3])

    dd = cr.regroup([collections.defaultdict(list, a=1), collections.defaultdict(list, a=2)])
    assert type(dd) is collections.defaultdict and dd.default_factory is list
    _is_per_replica(dd["a"], [1, 2])

    plain = cr.regroup([{"b": 1, "a": 2}, {"a": 4, "b": 3}])
    assert type(plain) is dict and list(plain) == ["b", "a"]  # keys in replica 0's order
    _is_per_replica(plain["a"], [2, 4])
    _is_per_replica(plain["b"], [1, 3])


class CollectionsMappingBasedClass(abc.Mapping):
    """Seed 002's custom Mapping."""

    def __init__(self, *args, **kwargs):
        self._d = dict(*args, **kwargs)

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def test_regroup_custom_mapping_kept_as_class():
    result = cr.regroup((CollectionsMappingBasedClass(a="a1", b="b1"), CollectionsMappingBasedClass(a="a2", b="b2")))
    assert isinstance(result, CollectionsMappingBasedClass)
    _is_per_replica(result["a"], ["a1", "a2"])
    _is_per_replica(result["b"], ["b1", "b2"])
    back = cr.select_replica(1, result)
    assert isinstance(back, CollectionsMappingBasedClass) and dict(back) == {"a": "a2", "b": "b2"}


def test_regroup_same_id_stays_unwrapped():
    # seed 002 testSameId
    foo = object()
    result = cr.regroup((("a", foo), ("b", foo)))
    assert isinstance(result, tuple) and len(result) == 2
    _is_per_replica(result[0], ["a", "b"])
    assert result[1] is foo
    for i, expected in enumerate("ab"):
        r = cr.select_replica(i, result)
        assert isinstance(r, tuple) and r[0] == expected and r[1] is foo


def test_regroup_equal_but_distinct_objects_are_wrapped():
    a, b = torch.zeros(2), torch.zeros(2)
    result = cr.regroup([a, b])
    _is_per_replica(result, [a, b])


@pytest.mark.parametrize("value", [torch.ones(2), (1, {"a": [2]}), Point(1, 2)], ids=["tensor", "nest", "namedtuple"])
def test_regroup_one_replica_is_identity(value):
    result = cr.regroup([value])
    assert nest_equal(result, value)
    if isinstance(value, torch.Tensor):
        assert result is value


def test_regroup_one_replica_always_wrap():
    value = {"a": 1, "b": (2,)}
    result = cr.regroup([value], always_wrap=True)
    _is_per_replica(result["a"], [1])
    _is_per_replica(result["b"][0], [2])


def test_regroup_always_wrap_wraps_same_object():
    foo = object()
    result = cr.regroup([foo, foo], always_wrap=True)
    _is_per_replica(result, [foo, foo])


def test_regroup_wrap_class_mirrored():
    result = cr.regroup([{"w": 1}, {"w": 2}], wrap_class=cr.Mirrored)
    _is_per_replica(result["w"], [1, 2], cls=cr.Mirrored)


@pytest.mark.parametrize("values, match", [
    ([(1, 2), (1, 2, 3)], r"regroup: replicas disagree in structure at <root>: replica 0 and replica 1 have length 2 vs 3"),
    ([{"a": 1}, {"b": 1}], r"at <root>: replica 0 and replica 1 have keys \[\"'a'\"\] vs \[\"'b'\"\]"),
    ([{"a": [1, 2]}, {"a": [1]}], r"at \['a'\]: replica 0 and replica 1 have length 2 vs 1"),
    ([{"a": (1, [2])}, {"a": (1, 5)}, {"a": (1, [3])}], r"at \['a'\]\[1\]: replica 0 has list, replica 1 has int"),
    ([[1], [2], 3], r"at <root>: replica 0 has list, replica 2 has int"),
    ([(1,), {"a": 1}], r"at <root>: replica 0 has tuple, replica 1 has dict"),
    ([{"p": Point(1, 2)}, {"p": (1, 2)}], r"at \['p'\]: replica 0 has Point, replica 1 has tuple"),
    ([(1, 2), Point(1, 2)], r"at <root>: replica 0 has tuple, replica 1 has Point"),
])
def test_regroup_structure_mismatch_says_where(values, match):
    with pytest.raises(ValueError, match=match):
        cr.regroup(values)


@pytest.mark.parametrize("values, match", [
    ([], r"values must be a non-empty sequence with one nest per replica; got \[\]"),
    ("ab", r"values must be a non-empty sequence with one nest per replica; got 'ab'"),
])
def test_regroup_bad_values(values, match):
    with pytest.raises(ValueError, match=match):
        cr.regroup(values)


def test_regroup_bad_wrap_class():
    with pytest.raises(ValueError, match=r"wrap_class must be a subclass of cr\.DistributedValues; got <class 'list'>"):
        cr.regroup([1, 2], wrap_class=list)


# ------------------------------------------------------------------ select_replica

def test_select_replica_is_inverse_and_passes_plain_leaves():
    foo = object()
    value = {"a": cr.PerReplica([1, 2]), "b": foo, "c": [cr.Mirrored(["x", "y"]), 7]}
    assert cr.select_replica(0, value) == {"a": 1, "b": foo, "c": ["x", 7]}
    r1 = cr.select_replica(1, value)
    assert r1 == {"a": 2, "b": foo, "c": ["y", 7]} and r1["b"] is foo
    assert cr.select_replica(1, 5) == 5


def test_select_replica_mirrored():
    value = (cr.Mirrored([1, 2]), 3)
    assert cr.select_replica_mirrored(1, value) == (2, 3)
    with pytest.raises(TypeError, match=r"select_replica_mirrored expects every distributed leaf to be cr\.Mirrored; got PerReplica"):
        cr.select_replica_mirrored(0, (cr.Mirrored([1, 2]), {"k": cr.PerReplica([3, 4])}))


@pytest.mark.parametrize("rid", [2, -1, True, "0"])
def test_select_replica_bad_id(rid):
    with pytest.raises(ValueError, match=r"replica_id must be an int in \[0, 2\) for PerReplica with 2 values"):
        cr.select_replica(rid, cr.PerReplica([1, 2]))


# ------------------------------------------------------------------ properties

@st.composite
def _replica_nests(draw):
    template = draw(nests)
    n = draw(st.integers(1, 4))
    return [template] + [draw(same_structure(template, leaves)) for _ in range(n - 1)]


@settings(max_examples=100, deadline=None)
@given(_replica_nests(), st.booleans())
def test_select_replica_inverts_regroup(values, always_wrap):
    grouped = cr.regroup(values, always_wrap=always_wrap)
    for i, v in enumerate(values):
        assert nest_equal(cr.select_replica(i, grouped), v)
