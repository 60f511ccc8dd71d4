"""In-process reductions on GPUs: the fused fold, every member's own copy, the stream order
the leader keeps, and the plan for replicas on several GPUs.

The plan and the fallbacks run on the CPU; the kernels where a GPU is visible (the CUDA
suite, ``-m cuda``), against the engines' chain of binary kernels (``reduction.py``).
"""

from __future__ import annotations

import pytest
import torch

import crossreplica as cr
from crossreplica.engines import cuda_fold, multi_gpu
from crossreplica.engines.reduction import reduced
from crossreplica.reduce_op import ReduceOp

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(not GPUS, reason="needs a CUDA device; none is visible")


def _dev(i: int) -> torch.device:
    return torch.device("cuda", i)


# ---------------------------------------------------------------------- on the CPU


def test_placement_of_members_on_several_gpus():
    plan = multi_gpu.placement([_dev(1), _dev(0), _dev(1), _dev(2), _dev(0)])
    assert plan.home == _dev(1)  # the first member's device: the fold runs there
    assert plan.devices == (_dev(1), _dev(0), _dev(2))  # each device once, home first
    assert plan.first == (True, True, False, True, False)  # later members on a device get copies
    assert not plan.one_per_device
    assert multi_gpu.placement([_dev(0), _dev(1)]).one_per_device


@pytest.mark.parametrize("op,dtype,members,free", [
    (ReduceOp.SUM, torch.float32, 2, True),     # a + b == b + a
    (ReduceOp.MEAN, torch.float32, 2, True),
    (ReduceOp.SUM, torch.float32, 3, False),    # (a + b) + c != a + (b + c)
    (ReduceOp.MAX, torch.float32, 2, False),    # NCCL's max drops NaN
    (ReduceOp.SUM, torch.int64, 8, True),       # integer sums wrap exactly in any order
    (ReduceOp.MAX, torch.int32, 8, True),
    (ReduceOp.PROD, torch.int64, 8, False),
    (ReduceOp.MEAN, torch.int64, 3, False),
    (ReduceOp.SUM, torch.bool, 2, False),
])
def test_nccl_only_where_the_order_cannot_change_the_bytes(op, dtype, members, free):
    assert multi_gpu.order_free(op, dtype, members) is free


def test_fold_of_cpu_tensors_is_the_chain_and_leaves_the_kernel_usable():
    broken = cuda_fold._broken
    xs = [torch.randn(100, dtype=torch.float64) * 10.0 ** k for k in range(5)]
    for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX):
        assert torch.equal(cuda_fold.fold(op, xs), reduced(op, xs))
    assert cuda_fold._broken == broken  # a CPU input never reaches (or disables) the GPU kernel
    assert not cuda_fold.fusable(xs)


# ---------------------------------------------------------------------- on a GPU


def _operands(n: int, dtype: torch.dtype, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:  # magnitudes 1e-6 .. 1e6: every addition rounds
        return [(torch.randn(numel, generator=g, dtype=torch.float64)
                 * 10.0 ** torch.randint(-6, 7, (numel,), generator=g)).to(dtype).to(_dev(0)) for _ in range(n)]
    return [torch.randint(-2 ** 62, 2 ** 62, (numel,), generator=g).to(dtype).to(_dev(0)) for _ in range(n)]


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("numel", [1000, 1 << 18])
@pytest.mark.parametrize("strided", [False, True])
def test_fused_fold_gives_the_chain_bytes(n, dtype, numel, strided):
    xs = _operands(n, dtype, numel, seed=n)
    if strided:
        xs = [x[::2] for x in xs]
    for op in (ReduceOp.SUM, ReduceOp.MEAN) if dtype.is_floating_point else (ReduceOp.SUM,):
        assert torch.equal(cuda_fold.fold(op, xs), reduced(op, xs)), (n, dtype, op)
    assert not cuda_fold._broken, "the fused kernel did not build: the GPU reduces with a kernel per member"


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("numel", [256, 1 << 20])  # rows of one buffer, and an allocation each
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX])
def test_every_member_gets_its_own_copy(n, numel, op):
    xs = _operands(n, torch.float32, numel, seed=7)
    outs = cuda_fold.reduce_column(op, xs)
    want = reduced(op, xs)
    assert len(outs) == n and all(torch.equal(o, want) for o in outs)
    outs[0].add_(1.0)  # one replica changes its result in place: nobody else's changes
    assert all(torch.equal(o, want) for o in outs[1:])


def _rounds(values):
    """Twenty all-reduces; replica 0 queues its inputs behind 10 ms of GPU work on a side
    stream of its own, replica 1 on the default stream, replica 2 on another side stream."""
    rid = cr.replica_id()
    device = cr.get_replica_context().device
    x = torch.zeros(1 << 16, device=device)
    side = torch.cuda.Stream(device) if rid != 1 else torch.cuda.current_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    results = []
    with torch.cuda.stream(side):
        for k in range(20):
            if rid == 0:
                torch.cuda._sleep(2_000_000)  # GPU time before the input is written
            x.fill_(values[rid] + k)
            total = cr.all_reduce(x, "sum")
            results.append(total * 2)  # read on this replica's stream, after the collective
    torch.cuda.current_stream(device).wait_stream(side)
    return [r.cpu() for r in results]


@pytest.mark.cuda
@needs_gpu
def test_leader_orders_replicas_on_different_streams():
    strategy = cr.MirroredStrategy(devices=[_dev(0)] * 3)
    outs = strategy.experimental_local_results(strategy.run(_rounds, args=([1.0, 2.0, 4.0],)))
    for rows in outs:
        for k, r in enumerate(rows):
            assert torch.equal(r, torch.full((1 << 16,), 2 * (7.0 + 3 * k))), k


@pytest.mark.cuda
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs (replicas on several GPUs in one process); {GPUS} visible")
@pytest.mark.parametrize("devices", [[0, 1], [0, 1, 1], [1, 0, 1, 0]])
@pytest.mark.parametrize("op,dtype", [("sum", torch.float32), ("mean", torch.float32), ("max", torch.float32),
                                      ("sum", torch.int64)])
def test_replicas_on_several_gpus_get_the_one_gpu_bytes(devices, op, dtype):
    devs = [_dev(i % GPUS) for i in devices]
    xs = _operands(len(devs), dtype, 4096, seed=len(devs))
    multi = cr.MirroredStrategy(devices=devs)
    one = cr.MirroredStrategy(devices=[_dev(0)] * len(devs))

    def reduce(x):
        return cr.all_reduce(x.to(cr.get_replica_context().device), op)

    got = multi.experimental_local_results(multi.run(reduce, args=(cr.PerReplica(xs),)))
    want = one.experimental_local_results(one.run(reduce, args=(cr.PerReplica(xs),)))
    for g, w, d in zip(got, want, devs):
        assert g.device == d
        assert torch.equal(g.cpu(), w.cpu())
    got[0].add_(1)  # every member's own memory
    assert torch.equal(got[1].cpu(), want[1].cpu())
