"""The collective kinds' specs (engines/kinds.py): every kind has one, ``Call.describe``
keeps its wording (workers hash it to compare their calls), and the compiled operators'
parameter strings round-trip every record."""

import pytest
import torch

from crossreplica.collectives import compiled
from crossreplica.engines.base import BARRIER, FINISHED, MERGE_CALL, Call, Kind
from crossreplica.engines.kinds import (SPECS, AllGatherParams, AllReduceParams, AllToAllParams, BroadcastParams,
                                        PermuteParams, ReduceScatterParams)
from crossreplica.reduce_op import ReduceOp

X = torch.ones(4, 6)
G = ((0, 1), (2, 3))

DESCRIBED = [
    (Call.of(Kind.ALL_REDUCE, G, AllReduceParams(ReduceOp.SUM), [X]),
     "all_reduce(op=sum, groups=[[0, 1], [2, 3]], shapes=[[4, 6]], dtypes=['float32'])"),
    (Call.of(Kind.ALL_REDUCE, G, AllReduceParams(ReduceOp.MEAN, inplace=True), [X, X[0].half()]),
     "all_reduce(op=mean, groups=[[0, 1], [2, 3]], shapes=[[4, 6], [6]], dtypes=['float32', 'float16'])"),
    (Call.of(Kind.ALL_GATHER, G, AllGatherParams((0, 1)), [X, X]),
     "all_gather(dim=[0, 1], groups=[[0, 1], [2, 3]], shapes=[[4, 6], [4, 6]], dtypes=['float32', 'float32'])"),
    (Call.of(Kind.REDUCE_SCATTER, G, ReduceScatterParams(ReduceOp.MAX, (1,), ((1, 2),)), [X]),
     "reduce_scatter(op=max, dim=[1], groups=[[0, 1], [2, 3]], shapes=[[4, 6]], dtypes=['float32'])"),
    (Call.of(Kind.ALL_TO_ALL, G, AllToAllParams((0,), (0,), (1, 3), (2, 2)), [X]),
     "all_to_all(split_dim=[0], concat_dim=[0], input_split_sizes=[1, 3], output_split_sizes=[2, 2], "
     "groups=[[0, 1], [2, 3]], shapes=[[4, 6]], dtypes=['float32'])"),
    (Call.of(Kind.BROADCAST, G, BroadcastParams(1), [X]),
     "broadcast(source=1, groups=[[0, 1], [2, 3]], shapes=[[4, 6]], dtypes=['float32'])"),
    (Call.of(Kind.PERMUTE, ((0, 1, 2, 3),), PermuteParams(((0, 1), (1, 0))), [X]),
     "permute(pairs=[[0, 1], [1, 0]], shapes=[[4, 6]], dtypes=['float32'])"),
    (MERGE_CALL, "merge_call()"),
    (BARRIER, "barrier(groups=[], shapes=[], dtypes=[])"),
    (FINISHED, "<returned from the replica function>"),
]


def test_every_kind_has_a_spec():
    assert set(SPECS) == set(Kind)
    assert all(spec.kind is kind for kind, spec in SPECS.items())


@pytest.mark.parametrize("call, text", DESCRIBED, ids=[c.kind.value for c, _ in DESCRIBED])
def test_describe_keeps_its_wording(call, text):
    assert call.describe() == text


@pytest.mark.parametrize("params", [
    AllReduceParams(ReduceOp.SUM), AllReduceParams(ReduceOp.MEAN, inplace=True), AllGatherParams((0, 2)),
    ReduceScatterParams(ReduceOp.SUM, (0,), ((1, 3),)), AllToAllParams((0,), (1,)),
    AllToAllParams((0,), (0,), (1, 3), (2, 2)), BroadcastParams(3), PermuteParams(((0, 1), (1, 0)))])
def test_compiled_parameter_strings_round_trip(params):
    kind = next(k for k, spec in SPECS.items() if spec.record is type(params))
    assert compiled._params(kind, compiled.encode(params)) == params


def test_the_signature_workers_compare_masks_only_the_sizes_that_may_differ():
    # all_gather: members may bring uneven parts along the gather dim; nothing else may differ.
    a = Call.of(Kind.ALL_GATHER, G, AllGatherParams((0, 1)), [X, X])
    b = Call.of(Kind.ALL_GATHER, G, AllGatherParams((0, 1)), [torch.ones(2, 6), torch.ones(4, 3)])
    assert SPECS[Kind.ALL_GATHER].signature(a) == SPECS[Kind.ALL_GATHER].signature(b) == (
        "all_gather(dim=[0, 1], groups=[[0, 1], [2, 3]], shapes=[[-1, 6], [4, -1]], dtypes=['float32', 'float32'])")
    c = Call.of(Kind.ALL_GATHER, G, AllGatherParams((0, 1)), [torch.ones(4, 5), X])
    assert SPECS[Kind.ALL_GATHER].signature(a) != SPECS[Kind.ALL_GATHER].signature(c)
    for call, text in DESCRIBED:
        if call.kind is not Kind.ALL_GATHER:
            assert SPECS[call.kind].signature(call) == text


def test_only_grouped_calls_are_checked_within_a_workers_part_of_each_group():
    local = {kind for kind, spec in SPECS.items() if spec.compared_locally}
    assert local == {Kind.ALL_REDUCE, Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.BROADCAST}
