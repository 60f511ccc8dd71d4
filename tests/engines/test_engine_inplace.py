"""The engine's in-place all-reduce (used by CrossShardOptimizer for buffers it owns)."""

import functools

import pytest
import torch

import crossreplica as cr
from crossreplica.engines.base import AllReduceParams, Call, Kind
from crossreplica.reduce_op import ReduceOp

_FOLD = {ReduceOp.SUM: torch.add, ReduceOp.MEAN: torch.add, ReduceOp.MAX: torch.maximum}


def _inplace(x, op, groups):
    rctx = cr.get_replica_context()
    y = x.clone()
    out = rctx.engine.execute(rctx.replica_id_in_sync_group, Call.of(Kind.ALL_REDUCE, groups, AllReduceParams(op, inplace=True), [y]), [y])
    return out[0] is y, y, x


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("size", [100, 300_000])  # the leader and the parallel paths
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX])
@pytest.mark.parametrize("grouped", [False, True])
def test_inplace_all_reduce_writes_into_the_inputs(run_replicas, n, size, op, grouped):
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    groups = cr.contiguous_groups(n, 2) if grouped else (tuple(range(n)),)
    results = run_replicas(_inplace, n, xs, [op] * n, [groups] * n)
    for r, (same, y, x) in enumerate(results):
        group = next(g for g in groups if r in g)
        ref = functools.reduce(_FOLD[op], [xs[m] for m in sorted(group)])
        if op is ReduceOp.MEAN:
            ref = ref / len(group)
        assert same  # the outputs are the input tensors themselves
        assert torch.equal(y, ref)
        assert torch.equal(x, xs[r])  # only the tensor handed to the engine changed


def _inplace_strided(x):
    rctx = cr.get_replica_context()
    y = x.t()
    rctx.engine.execute(rctx.replica_id_in_sync_group,
                        Call.of(Kind.ALL_REDUCE, (tuple(range(rctx.num_replicas_in_sync)),), AllReduceParams(ReduceOp.SUM, inplace=True), [y]), [y])


def test_inplace_all_reduce_rejects_non_contiguous_inputs(run_replicas):
    with pytest.raises(ValueError, match="in-place all_reduce needs contiguous tensors"):
        run_replicas(_inplace_strided, 2, [torch.ones(3, 4)] * 2)
