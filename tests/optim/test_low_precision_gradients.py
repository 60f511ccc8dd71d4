"""CrossShardOptimizer reduces low-precision gradients in float32 on every path
(fused packs, overlapped buckets, the sharded update), as cr.all_reduce does."""

from __future__ import annotations

import pytest
import torch

import crossreplica as cr

pytestmark = [pytest.mark.usefixtures("engine"), pytest.mark.fidelity]

N = 4
CASES = ["packed", "overlap", "sharded"]


def _step(value, mode):
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    inner = torch.optim.SGD([p], lr=1.0)
    if mode == "overlap":
        opt = cr.CrossShardOptimizer(inner, overlap=True)
    elif mode == "sharded":
        opt = cr.CrossShardOptimizer(inner, shard_optimizer_state=True)
    else:
        opt = cr.CrossShardOptimizer(inner)
    (p.float() * torch.full((8,), value, dtype=torch.float32)).sum().backward()
    opt.step()
    return p.detach().clone()


@pytest.mark.parametrize("mode", CASES)
def test_float16_mean_of_large_gradients_does_not_overflow(run_replicas, mode):
    # Each replica's gradient is 40000 (representable in float16); their sum is not.
    outs = run_replicas(_step, N, [40000.0] * N, [mode] * N)
    expected = torch.full((8,), -40000.0, dtype=torch.float16)
    for out in outs:
        assert torch.isfinite(out).all(), out
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", CASES)
def test_float16_mean_matches_float32_then_rounded(run_replicas, mode):
    values = [1.0009765625, 3.0009765625, 0.0009765625, 7.0]
    outs = run_replicas(_step, N, values, [mode] * N)
    grads = [torch.full((8,), v, dtype=torch.float32).to(torch.float16).float() for v in values]
    mean = (((grads[0] + grads[1]) + grads[2]) + grads[3]) / N
    expected = (-mean).to(torch.float16)
    for out in outs:
        assert torch.equal(out, expected), (out, expected)
