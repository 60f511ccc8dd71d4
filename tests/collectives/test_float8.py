"""float8 reductions follow the documented rule on every engine: SUM, MEAN and PROD are
computed in float32, left to right in replica order, and rounded once to the float8 dtype
(docs/collectives.md, "float8"); a fold that rounds to float8 after every step differs.

A seeded fuzz of a few hundred cases against that fold, computed here in plain torch. The
tensors cross the worker boundary as their uint8 bits (float8 tensors do not pickle there).
"""

from __future__ import annotations

import pytest
import torch

import crossreplica as cr

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                      "float8_e8m0fnu") if hasattr(torch, n)]
N = 4
CASES = 300


def _values(g: torch.Generator, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """float8 values of several kinds: small integers and halves (whose products round now
    and then), and normal values over a wide range of exponents, signs and zeros."""
    kind = int(torch.randint(0, 3, (), generator=g))
    if kind == 0:
        x = torch.randint(-8, 9, (numel,), generator=g) * 0.5
    elif kind == 1:
        x = torch.randn(numel, generator=g) * 2.0 ** torch.randint(-4, 5, (numel,), generator=g)
    else:
        x = torch.randn(numel, generator=g) * 3
    if dtype == getattr(torch, "float8_e8m0fnu", None):
        x = x.abs() + 2.0 ** -8  # powers of two only, no sign, no zero
    return x.to(dtype)


def _cases() -> list[tuple[str, str, list[torch.Tensor]]]:
    """``(op, dtype name, one uint8 tensor per replica)``: PROD mostly, SUM and MEAN too."""
    g = torch.Generator().manual_seed(8)
    cases = []
    for i in range(CASES):
        dtype = FLOAT8[i % len(FLOAT8)]
        op = "prod" if i % 5 < 3 else ("sum" if i % 5 == 3 else "mean")
        numel = int(torch.randint(1, 40, (), generator=g))
        xs = [_values(g, dtype, numel).view(torch.uint8) for _ in range(N)]
        cases.append((op, str(dtype).removeprefix("torch."), xs))
    return cases


def _reference(op: str, dtype: torch.dtype, xs: list[torch.Tensor]) -> torch.Tensor:
    """Plain torch: the fold in float32, left to right in replica order, rounded once."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc * x.float() if op == "prod" else acc + x.float()
    if op == "mean":
        acc = acc / len(xs)
    return acc.to(dtype)


def _reduce_each(cases: list[tuple[str, str]], bits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every case's all_reduce, on this replica (its uint8 bits in and out)."""
    return [cr.all_reduce(b.view(getattr(torch, name)), op).view(torch.uint8)
            for (op, name), b in zip(cases, bits)]


def test_float8_reductions_are_the_float32_fold_rounded_once(run_replicas, time_bound):
    cases = _cases()
    spec = [(op, name) for op, name, _ in cases]
    per_replica = [[xs[r] for _, _, xs in cases] for r in range(N)]
    outs = run_replicas(_reduce_each, N, [spec] * N, per_replica, timeout_seconds=time_bound(60))
    for i, (op, name, xs) in enumerate(cases):
        dtype = getattr(torch, name)
        want = _reference(op, dtype, [x.view(dtype) for x in xs]).view(torch.uint8)
        for r, out in enumerate(outs):  # the same bits (nan's included) on every replica
            assert torch.equal(out[i], want), (i, op, name, r, out[i].view(dtype), want.view(dtype))


def _one(bits: torch.Tensor) -> torch.Tensor:
    return cr.all_reduce(bits.view(torch.float8_e5m2), "prod").view(torch.uint8)


def test_a_float8_product_rounds_once_not_after_every_step(run_replicas, time_bound):
    # 0.5 * 1.5 * 6 * -5 = -22.5 exactly: rounded once (ties to even) -24; a fold that rounds
    # to float8 after each step gets 4.5 -> 4 at the third value, then -20.
    xs = [torch.tensor([v]).to(torch.float8_e5m2) for v in (0.5, 1.5, 6.0, -5.0)]
    outs = run_replicas(_one, N, [x.view(torch.uint8) for x in xs], timeout_seconds=time_bound(30))
    assert all(o.view(torch.float8_e5m2).float().item() == -24.0 for o in outs)
    stepwise = xs[0]
    for x in xs[1:]:
        stepwise = (stepwise.float() * x.float()).to(torch.float8_e5m2)
    assert stepwise.float().item() == -20.0


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_max_and_min_are_exact(dtype):
    strategy = cr.MirroredStrategy(N)
    g = torch.Generator().manual_seed(1)
    xs = [_values(g, dtype, 16) for _ in range(N)]
    for op, fold in (("max", torch.maximum), ("min", torch.minimum)):
        out = strategy.run(lambda x, op=op: cr.all_reduce(x, op), args=(cr.PerReplica(xs),))
        want = xs[0].float()
        for x in xs[1:]:
            want = fold(want, x.float())
        for o in strategy.experimental_local_results(out):
            assert torch.equal(o.view(torch.uint8), want.to(dtype).view(torch.uint8))
