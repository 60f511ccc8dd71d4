"""Nests beyond tuples, lists and dicts: types registered with torch's pytree, and dataclasses.

A type registered with ``torch.utils._pytree`` (``register_dataclass`` or
``register_pytree_node``) is taken apart and rebuilt by torch's registry; an
unregistered dataclass by its fields. Collectives, ``strategy.run`` and
``regroup``/``select_replica`` keep the type.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree

import crossreplica as cr
from crossreplica import nest


@dataclasses.dataclass
class Pair:
    """A dataclass registered with torch's pytree."""

    a: torch.Tensor
    b: torch.Tensor | None = None


pytree.register_dataclass(Pair)


class Box:
    """A plain class registered with torch's pytree; ``name`` is static (its context)."""

    def __init__(self, value, name="box"):
        self.value = value
        self.name = name

    def __eq__(self, other):
        return type(other) is Box and self.name == other.name and _equal(self.value, other.value)


pytree.register_pytree_node(
    Box, lambda box: ([box.value], box.name), lambda values, name: Box(values[0], name),
    flatten_with_keys_fn=lambda box: ([(pytree.GetAttrKey("value"), box.value)], box.name))


@dataclasses.dataclass
class Plain:
    """A dataclass nobody registered."""

    x: torch.Tensor
    y: list


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    inits: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.inits.append(1)  # counts (re-)initialisations


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def make_nest(r):
    """Replica ``r``'s input: every kind of new container, nested in builtins."""
    def t(*v):
        return torch.tensor(v, dtype=torch.float32) * (r + 1)
    return {
        "pair": Pair(t(1.0, 2.0), t(3.0)),
        "half": Pair(t(4.0)),  # b is None: in torch's context, not a leaf
        "box": Box([t(5.0), (t(6.0),)], name="static"),
        "plain": Plain(t(7.0), [t(8.0)]),
        "deque": collections.deque([t(9.0)], maxlen=4),
    }


def expected_sum(n):
    return nest.map_structure(lambda x: x * sum(range(1, n + 1)), make_nest(0))


def assert_nest_equal(a, b):
    assert type(a) is type(b)
    if nest.is_container(a):
        assert nest.node_mismatch(a, b) is None
        for x, y in zip(nest.children(a)[1], nest.children(b)[1]):
            assert_nest_equal(x, y)
    else:
        assert _equal(a, b), (a, b)


# ------------------------------------------------------------------ collectives on every engine

def _all_reduce(x):
    return cr.all_reduce(x, "sum")


@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_keeps_pytree_and_dataclass_types(run_replicas, n):
    results = run_replicas(_all_reduce, n, [make_nest(r) for r in range(n)])
    for out in results:
        assert_nest_equal(out, expected_sum(n))
        assert out["half"].b is None and out["box"].name == "static" and out["deque"].maxlen == 4


def _gather_and_mean(x):
    return cr.all_gather(x, 0), cr.cross_replica_mean(x)


def test_all_gather_and_mean(run_replicas):
    n = 2
    results = run_replicas(_gather_and_mean, n, [make_nest(r) for r in range(n)])
    nests = [make_nest(r) for r in range(n)]
    leaves = [nest.flatten(x)[0] for x in nests]
    gathered = nest.unflatten(nest.flatten(nests[0])[1], [torch.cat(col) for col in zip(*leaves)])
    mean = nest.map_structure(lambda x: x * 1.5, nests[0])
    for g, m in results:
        assert_nest_equal(g, gathered)
        assert_nest_equal(m, mean)


def _grad_through(p):
    out = cr.all_reduce(p, "sum")
    (out.a.sum() + out.b.sum()).backward()
    return p.a.grad, p.b.grad


def test_gradients_flow_through_a_registered_dataclass(run_replicas):
    n = 2
    inputs = [Pair(torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)) for _ in range(n)]
    for ga, gb in run_replicas(_grad_through, n, inputs):
        assert torch.equal(ga, torch.full((2,), float(n))) and torch.equal(gb, torch.full((1,), float(n)))


# ------------------------------------------------------------------ strategy.run

STRATEGIES = {
    "one_device": lambda: cr.OneDeviceStrategy("cpu"),
    "mirrored": lambda: cr.MirroredStrategy(2, devices=["cpu"] * 2),
}


def _step(batch, scale):
    return Pair(cr.all_reduce(batch.a * scale, "sum"), batch.a * scale), Plain(batch.a, [scale])


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_strategy_run_args_and_results(strategy_name):
    s = STRATEGIES[strategy_name]()
    n = s.num_replicas_in_sync
    batch = Pair(cr.PerReplica([torch.tensor([float(r)]) for r in range(n)]) if n > 1 else torch.tensor([0.0]))
    scale = 2.0  # the same object on every replica: stays unwrapped
    pair, plain = s.run(_step, args=(batch, scale))
    assert type(pair) is Pair and type(plain) is Plain
    total = torch.tensor([2.0 * sum(range(n))])
    if n == 1:
        assert torch.equal(pair.a, total) and torch.equal(plain.x, torch.tensor([0.0]))
        assert plain.y == [2.0]
        return
    assert isinstance(pair.a, cr.PerReplica) and isinstance(pair.b, cr.PerReplica)
    assert all(torch.equal(v, total) for v in pair.a.values)
    assert [v.item() for v in pair.b.values] == [2.0 * r for r in range(n)]
    assert plain.y == [2.0]  # identical leaves are not wrapped
    assert isinstance(plain.x, cr.PerReplica) and plain.x.values == batch.a.values
    reduced = s.reduce("sum", pair)
    assert type(reduced) is Pair and torch.equal(reduced.a, total * n)


def test_distribute_dataset_splits_a_dataclass_batch():
    s = STRATEGIES["mirrored"]()
    x = torch.arange(6.0).reshape(6, 1)
    (batch,) = list(s.distribute_dataset([Pair(x, x * 10)]))
    assert type(batch) is Pair
    parts = s.experimental_local_results(batch)
    assert [type(p) for p in parts] == [Pair, Pair]
    assert torch.equal(parts[1].a, x[3:]) and torch.equal(parts[1].b, x[3:] * 10)


# ------------------------------------------------------------------ regroup / select_replica

def test_regroup_and_select_replica_round_trip():
    nests = [make_nest(r) for r in range(3)]
    grouped = cr.regroup(nests)
    assert type(grouped["pair"]) is Pair and isinstance(grouped["pair"].a, cr.PerReplica)
    assert grouped["half"].b is None
    assert type(grouped["box"]) is Box and grouped["box"].name == "static"
    assert isinstance(grouped["box"].value[1][0], cr.PerReplica)
    assert type(grouped["plain"]) is Plain and isinstance(grouped["plain"].y[0], cr.PerReplica)
    assert type(grouped["deque"]) is collections.deque and grouped["deque"].maxlen == 4
    for r in range(3):
        assert_nest_equal(cr.select_replica(r, grouped), nests[r])


def test_regroup_keeps_shared_dataclass_and_identity():
    shared = Plain(torch.ones(1), ["config"])
    grouped = cr.regroup([{"cfg": shared, "x": torch.zeros(1)}, {"cfg": shared, "x": torch.ones(1)}])
    assert grouped["cfg"] is shared  # the same object on every replica, as a shared leaf
    assert cr.select_replica(1, grouped)["cfg"].y == ["config"]
    only_leaves = Plain(torch.ones(1), "config")
    assert cr.select_replica(1, {"cfg": only_leaves})["cfg"] is only_leaves  # nothing to select inside
    mirrored = cr.regroup([Pair(torch.ones(1)), Pair(torch.ones(1))], wrap_class=cr.Mirrored)
    assert isinstance(mirrored.a, cr.Mirrored)
    assert torch.equal(cr.select_replica_mirrored(1, mirrored).a, torch.ones(1))


def test_frozen_dataclass_is_rebuilt_without_init():
    frozen = Frozen(torch.ones(1))
    grouped = cr.regroup([frozen, Frozen(torch.zeros(1), frozen.inits)])
    assert type(grouped) is Frozen and isinstance(grouped.x, cr.PerReplica)
    picked = cr.select_replica(0, grouped)
    assert picked.x is frozen.x and frozen.inits == [1, 1]  # the two constructors above only
    with pytest.raises(dataclasses.FrozenInstanceError):
        picked.x = None


@pytest.mark.parametrize("values, match", [
    ([Pair(torch.ones(1), torch.ones(1)), Pair(torch.ones(1))],
     r"at <root>: replica 0 and replica 1 have 2 vs 1 children"),
    ([{"p": Pair(torch.ones(1))}, {"p": Plain(torch.ones(1), [])}],
     r"at \['p'\]: replica 0 has Pair, replica 1 has Plain"),
    ([Box(1, name="a"), Box(2, name="b")], r"at <root>: replica 0 and replica 1 have pytree context 'a' vs 'b'"),
    ([Plain(torch.ones(1), [1, 2]), Plain(torch.ones(1), [1])], r"at \.y: replica 0 and replica 1 have length 2"),
    ([{"b": Box([1, 2])}, {"b": Box([1])}], r"at \['b'\]\.value: replica 0 and replica 1 have length 2 vs 1"),
])
def test_regroup_structure_mismatch_says_where(values, match):
    with pytest.raises(ValueError, match=match):
        cr.regroup(values)


def test_classes_and_unregistered_objects_stay_leaves():
    class Opaque:
        pass

    leaves, _ = nest.flatten([Pair, Opaque(), "s", 3])
    assert len(leaves) == 4 and leaves[0] is Pair


@dataclasses.dataclass(slots=True)
class Slotted:
    x: torch.Tensor
    derived: int = dataclasses.field(init=False)  # never set: not a child


def test_slotted_dataclass_and_unset_fields():
    nests = [Slotted(torch.tensor([1.0])), Slotted(torch.tensor([2.0]))]
    keys, items = nest.children(nests[0])
    assert [k.name for k in keys] == ["x"] and items[0] is nests[0].x
    grouped = cr.regroup(nests)
    assert type(grouped) is Slotted and isinstance(grouped.x, cr.PerReplica)
    assert cr.select_replica(1, grouped).x is nests[1].x
    assert nest.path_str(("a", pytree.GetAttrKey("x"), 0)) == "['a'].x[0]"
