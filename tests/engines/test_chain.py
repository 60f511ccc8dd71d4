"""The ordered all-reduce along a chain of hosts (engines/torch_dist/chain.py), on one
host with the host layout set by hand: bitwise the left fold in replica order of plain
PyTorch, for uneven hosts, sizes that do not divide, several dtypes and ops, in pieces."""

from __future__ import annotations

import pytest
import torch

import crossreplica as cr
from crossreplica.reduce_op import ReduceOp, wire_dtype
from crossreplica.testing import run_workers

pytestmark = pytest.mark.multiprocess

# (shape, dtype) of each leaf: sizes that do not divide by the slices or the pieces
LEAVES = [((1001,), torch.float32), ((7,), torch.float64), ((3, 5), torch.float32), ((33,), torch.bfloat16),
          ((5,), torch.complex64), ((1,), torch.float32), ((9,), torch.float16)]
OPS = ("sum", "mean", "max")


def _value(rid: int, leaf: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rid + leaf)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    x = torch.randn(shape, generator=g, dtype=wide) * torch.exp(3 * torch.randn(shape, generator=g)).to(wide)
    return x.to(dtype)


def _leaves(op: str) -> list[int]:
    return [i for i, (_, dtype) in enumerate(LEAVES) if not (op == "max" and dtype.is_complex)]


def _reference(op: str, leaf: int, replicas: int) -> torch.Tensor:
    """The left fold in ascending replica id, in the dtype the reduction is carried in."""
    shape, dtype = LEAVES[leaf]
    rop = ReduceOp(op.upper()) if not isinstance(op, ReduceOp) else op
    wire = wire_dtype(rop, dtype)
    xs = [_value(rid, leaf, shape, dtype).to(wire) for rid in range(replicas)]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = torch.maximum(acc, x) if op == "max" else acc + x
    if op == "mean":
        acc = acc / replicas
    return acc.to(dtype)


def _reduce_on_layouts(strategy: cr.Strategy, layouts: list) -> list:
    from crossreplica.engines.torch_dist import all_reduce, chain

    eng = strategy.extended.engine
    used = []
    real = all_reduce.chain_all_reduce

    def counted(*args, **kwargs):
        used.append(1)
        return real(*args, **kwargs)

    saved = eng.shared_memory
    eng.shared_memory, all_reduce.chain_all_reduce, chain.PIECE_BYTES = None, counted, 24
    out = []
    try:
        for hosts in layouts:
            eng.hosts = [tuple(h) for h in hosts]
            for op in OPS:
                def fn(op=op):
                    rid = cr.get_replica_context().replica_id_in_sync_group
                    return cr.all_reduce([_value(rid, i, *LEAVES[i]) for i in _leaves(op)], op)
                before = len(used)
                results = strategy.experimental_local_results(strategy.run(fn))
                out.append((tuple(hosts), op, len(used) > before, strategy.num_replicas_in_sync,
                            [list(r) for r in results]))
    finally:
        eng.shared_memory, all_reduce.chain_all_reduce, eng.hosts = saved, real, None
    return out


def _check(per_worker: list) -> None:
    for results in per_worker:
        for hosts, op, used, replicas, rows in results:
            assert used, f"{hosts}: the chain was not taken"
            for row in rows:
                for leaf, got in zip(_leaves(op), row):
                    want = _reference(op, leaf, replicas)
                    assert got.dtype == want.dtype and torch.equal(got, want), (hosts, op, LEAVES[leaf])


def test_chain_is_the_left_fold_on_four_workers():
    _check(run_workers(_reduce_on_layouts, 4, args=([[[0, 1], [2, 3]], [[0], [1, 2, 3]], [[0, 1], [2], [3]],
                                                       [[0, 1, 2], [3]]],)))


def test_chain_is_the_left_fold_with_two_replicas_per_worker():
    _check(run_workers(_reduce_on_layouts, 2, 2, args=([[[0], [1]]],)))


def test_chain_is_the_left_fold_on_three_workers():
    _check(run_workers(_reduce_on_layouts, 3, args=([[[0, 1], [2]], [[0], [1, 2]]],)))


def _mismatched_on_the_chain(strategy: cr.Strategy, hosts: list) -> tuple[str, str]:
    """Replica 1 takes the max where the others sum: what each worker raised."""
    from crossreplica.engines.torch_dist import chain

    eng = strategy.extended.engine
    eng.shared_memory, eng.hosts, chain.PIECE_BYTES = None, [tuple(h) for h in hosts], 24

    def fn():
        rid = cr.get_replica_context().replica_id_in_sync_group
        return cr.all_reduce(torch.ones(100) * rid, "max" if rid == 1 else "sum")
    try:
        strategy.run(fn)
    except Exception as e:  # noqa: BLE001 - what the worker raised is the result
        return type(e).__name__, str(e)
    return "no error", ""


def test_different_calls_along_the_chain_fail_before_the_data_moves():
    """Each worker swaps its call's stamp with the peers it exchanges data with, before any
    data: the neighbours of the worker whose call differs name it, and the others are
    released, none waiting for the timeout."""
    import time

    start = time.monotonic()
    got = run_workers(_mismatched_on_the_chain, 4, args=([[0, 1], [2, 3]],), timeout_seconds=60)
    assert time.monotonic() - start < 45, got
    assert all(kind != "no error" for kind, _ in got), got
    named = [msg for kind, msg in got if kind == "CollectiveMismatchError"]
    assert any("found by the chain of hosts before the data moved" in m for m in named), got


def _train_overlapped(strategy: cr.Strategy, hosts: list, chain_on: bool) -> dict:
    """A few steps of CrossShardOptimizer(overlap=True) (buckets of 8 KiB): along the chain,
    on its thread during backward, or through ordered.py, run now."""
    from torch import nn

    from crossreplica.engines.torch_dist import all_reduce, chain

    eng = strategy.extended.engine
    started, real = [], all_reduce.start_chain

    def counted(*args, **kwargs):
        started.append(1)
        return real(*args, **kwargs)

    saved = eng.shared_memory
    eng.shared_memory, eng.hosts, eng.chain_reductions = None, [tuple(h) for h in hosts], chain_on
    all_reduce.start_chain, chain.PIECE_BYTES = counted, 4096
    try:
        with strategy.scope():
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
            opt = cr.CrossShardOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), overlap=True,
                                         bytes_per_pack=8 << 10)

        def step(i: int) -> torch.Tensor:
            rid = cr.get_replica_context().replica_id_in_sync_group
            g = torch.Generator().manual_seed(100 * i + rid)
            x, y = torch.randn(8, 32, generator=g) * (rid + 1), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            return cr.all_reduce(loss.detach(), "mean")  # a synchronous call after the chains
        losses = [strategy.experimental_local_results(strategy.run(step, (i,)))[0] for i in range(3)]
        return {"params": [p.detach().clone() for p in net.parameters()], "losses": losses,
                "started": len(started)}
    finally:
        eng.shared_memory, eng.hosts, eng.chain_reductions = saved, None, True
        all_reduce.start_chain = real


def _both_ways(strategy: cr.Strategy, hosts: list) -> tuple[dict, dict]:
    return _train_overlapped(strategy, hosts, True), _train_overlapped(strategy, hosts, False)


def test_overlapped_buckets_along_the_chain_are_the_ordered_bytes():
    for on_chain, ordered in run_workers(_both_ways, 4, args=([[0, 1], [2, 3]],)):
        assert on_chain["started"] >= 6 and ordered["started"] == 0
        for a, b in zip(on_chain["params"] + on_chain["losses"], ordered["params"] + ordered["losses"]):
            assert torch.equal(a, b)
