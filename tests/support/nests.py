"""Structural equality for nests, and hypothesis strategies that build them."""

from __future__ import annotations

import collections
from collections import abc
from typing import Any

import torch
from hypothesis import strategies as st

Point = collections.namedtuple("Point", ["x", "y"])


def nest_equal(a: Any, b: Any) -> bool:
    """Same container classes, same keys/lengths, equal leaves (tensors: torch.equal + dtype)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, abc.Mapping):
        # Key order is not structure (a dict built in another order is the same nest).
        return set(a.keys()) == set(b.keys()) and all(nest_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(nest_equal(x, y) for x, y in zip(a, b))
    return a == b


leaves = st.one_of(
    st.integers(-5, 5),
    st.text(max_size=3),
    st.lists(st.integers(-100, 100), min_size=0, max_size=4).map(lambda v: torch.tensor(v, dtype=torch.int64)),
    st.floats(-10, 10, allow_nan=False).map(lambda f: torch.tensor([f])),
)


def _containers(children):
    keys = st.text(alphabet="abcdef", min_size=1, max_size=2)
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda t: Point(*t)),
        st.dictionaries(keys, children, max_size=3),
    )


nests = st.recursive(leaves, _containers, max_leaves=8)


def same_structure(nest: Any, leaf_strategy) -> st.SearchStrategy:
    """Strategy for nests with ``nest``'s structure and fresh leaves."""
    if isinstance(nest, abc.Mapping):
        return st.fixed_dictionaries({k: same_structure(v, leaf_strategy) for k, v in nest.items()})
    if isinstance(nest, Point):
        return st.tuples(*(same_structure(v, leaf_strategy) for v in nest)).map(lambda t: Point(*t))
    if isinstance(nest, tuple):
        return st.tuples(*(same_structure(v, leaf_strategy) for v in nest))
    if isinstance(nest, list):
        return st.tuples(*(same_structure(v, leaf_strategy) for v in nest)).map(list)
    return leaf_strategy
