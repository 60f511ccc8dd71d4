"""Reductions of low-precision floats and of unsigned ints: exact, identical on every engine.

float16 / bfloat16 SUM, MEAN and PROD accumulate in float32 and round once; uint16,
uint32 and uint64 (which torch cannot add or compare) reduce bit for bit as the
integers modulo 2**bits would. Every collective that reduces is checked against a
plain-torch reference computed here: all_reduce, reduce_scatter, strategy.reduce and
the cross-device ops (reduce_to, batch_reduce_to).
"""

from __future__ import annotations

import functools

import pytest
import torch

import crossreplica as cr

pytestmark = pytest.mark.fidelity

N = 4
UNSIGNED = {torch.uint16: 16, torch.uint32: 32, torch.uint64: 64}
LOW = (torch.float16, torch.bfloat16)
DTYPES = [*UNSIGNED, *LOW, torch.uint8, torch.int32, torch.float32]


def ops_for(dtype):
    return ("sum", "mean", "max", "min", "prod") if dtype.is_floating_point else ("sum", "max", "min", "prod")


def values(dtype, r):
    """Replica r's input: 8 elements, with the extremes that used to break."""
    if dtype in UNSIGNED:
        top = (1 << UNSIGNED[dtype]) - 1
        ints = [top - r, r, 7 + r, (top >> 1) + 1 + r, top >> 1, 3, 2 * r + 1, top - 5 * r]
        return torch.tensor([i - (1 << UNSIGNED[dtype]) if i >= 1 << (UNSIGNED[dtype] - 1) else i for i in ints],
                            dtype={16: torch.int16, 32: torch.int32, 64: torch.int64}[UNSIGNED[dtype]]).view(dtype)
    if dtype in LOW:
        big = 40000.0 if dtype is torch.float16 else 3.0e38
        return torch.tensor([big, big * (r + 1) / 8, 0.1 * (r + 1), -1.5 - r, 1.0 + r / 3, 1 / 3, -big / 2, 2.0],
                            dtype=torch.float32).to(dtype)
    return (torch.arange(8) * (r + 1) % 13 + r).to(dtype)


def reference(op, dtype, xs):
    """The plain-torch reduction: exact integers mod 2**bits; float in float32, rounded once."""
    if dtype in UNSIGNED:
        bits = UNSIGNED[dtype]
        cols = [[int(v) % (1 << bits) for v in x.view({16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]).tolist()]
                for x in xs]
        f = {"sum": lambda a, b: (a + b) % (1 << bits), "prod": lambda a, b: (a * b) % (1 << bits),
             "max": max, "min": min}[op]
        out = [functools.reduce(f, col) for col in zip(*cols)]
        signed = [o - (1 << bits) if o >= 1 << (bits - 1) else o for o in out]
        return torch.tensor(signed, dtype={16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]).view(dtype)
    wide = torch.float32 if dtype in LOW else dtype
    # MEAN (but of float16) divides by a power of two 2**k >= n before the sum and multiplies
    # after: the same bits as sum / n where that is finite, and no overflow where it is not
    scale = float(1 << (len(xs) - 1).bit_length()) if op == "mean" and dtype is not torch.float16 else 1.0
    fs = {"sum": torch.add, "mean": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}
    out = functools.reduce(fs[op], [x.to(wide) / scale for x in xs])
    if op == "mean":
        out = out / len(xs) * scale
    return out.to(dtype)


SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _portable(t):
    """Unsigned tensors do not pickle (torch): they cross to worker processes as signed views."""
    return t.view(SIGNED[t.dtype]) if isinstance(t, torch.Tensor) and t.dtype in SIGNED else t


def reference_axis(op, dtype, xs):
    """strategy.reduce(op, v, axis=0) of 1-d values: every element of every replica."""
    if dtype in UNSIGNED:
        return reference(op, dtype, [x[i:i + 1] for x in xs for i in range(len(x))])[0]
    wide = torch.float32 if dtype in LOW else dtype
    local = {"sum": lambda t: t.sum(0), "mean": lambda t: t.sum(0), "prod": lambda t: t.prod(0),
             "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}[op]
    fs = {"sum": torch.add, "mean": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}
    count = sum(len(x) for x in xs)
    # MEAN scales by a power of two 2**k >= the count before the sums (reduce_op.mean_scale)
    scale = float(1 << (count - 1).bit_length()) if op == "mean" else None
    out = functools.reduce(fs[op], [local(x.to(wide) if scale is None else x.to(wide) / scale) for x in xs])
    if op == "mean":
        out = out / count * scale
    # torch's own promotions (an int32 sum is int64) hold for the dtypes torch can reduce
    return out.to(dtype) if dtype in LOW else out


def _reductions(x, name):
    dtype = getattr(torch, name)
    x = x.view(dtype)
    rid = cr.replica_id()
    out = {}
    for op in ops_for(dtype):
        out[("all_reduce", op)] = cr.all_reduce(x, op)
        out[("reduce_scatter", op)] = cr.reduce_scatter(x, op)
    out["cross_replica_mean"] = cr.cross_replica_mean(x) if dtype.is_floating_point else None

    def merge_fn(strategy, v):
        got = {}
        for op in ops_for(dtype):
            got[("strategy.reduce", op)] = strategy.reduce(op, v)
            got[("strategy.reduce axis", op)] = strategy.reduce(op, v, axis=0)
            got[("reduce_to", op)] = strategy.experimental_local_results(
                strategy.extended.reduce_to(op, v, v))[0]
            pair = strategy.extended.batch_reduce_to(op, [(v, v), (v, v)])
            got[("batch_reduce_to", op)] = strategy.experimental_local_results(pair[1])[0]
        return got

    out.update(cr.get_replica_context().merge_call(merge_fn, args=(x,)))
    out["rid"] = rid
    return {k: _portable(v) for k, v in out.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_reductions_exact_on_every_engine(run_replicas, dtype):
    xs = [values(dtype, r) for r in range(N)]
    name = str(dtype).replace("torch.", "")
    results = run_replicas(_reductions, N, [_portable(x) for x in xs], [name] * N)
    results = [{k: v.view(dtype) if isinstance(v, torch.Tensor) and dtype in SIGNED else v
                for k, v in out.items()} for out in results]
    for out in results:
        r = out["rid"]
        for op in ops_for(dtype):
            ref = reference(op, dtype, xs)
            for where in ("all_reduce", "strategy.reduce", "reduce_to", "batch_reduce_to"):
                got = out[(where, op)]
                assert got.dtype == dtype, (where, op)
                assert torch.equal(got, ref), (where, op, got, ref)
            got = out[("strategy.reduce axis", op)]
            ref_axis = reference_axis(op, dtype, xs)
            assert got.dtype == ref_axis.dtype and torch.equal(got, ref_axis), ("axis", op, got, ref_axis)
            part = out[("reduce_scatter", op)]
            assert torch.equal(part, ref.chunk(N)[r]), ("reduce_scatter", op)
        if dtype.is_floating_point:
            assert torch.equal(out["cross_replica_mean"], reference("mean", dtype, xs))
    # the same bits on every replica (reduce_scatter: each its own part, checked above)
    for key in results[0]:
        if key != "rid" and key[0] != "reduce_scatter" and results[0][key] is not None:
            assert all(torch.equal(o[key], results[0][key]) for o in results)


def test_float16_mean_of_40000_does_not_overflow():
    s = cr.MirroredStrategy(num_replicas=4)
    x = torch.full((3,), 40000.0, dtype=torch.float16)
    out = s.run(lambda: cr.cross_replica_mean(x))
    assert all(torch.equal(v, x) for v in out.values)
    assert torch.equal(s.reduce("mean", s.run(lambda: x * 1)), x)


def _moves(x, name):
    dtype = getattr(torch, name)
    x = x.view(dtype)
    out = {"all_gather": cr.all_gather(x), "broadcast": cr.broadcast(x, source=1),
           "all_to_all": cr.all_to_all(x, 0, 0),
           "permute": cr.collective_permute(x, [(r, (r + 1) % N) for r in range(N)])}

    def merge_fn(strategy, v):
        return {"gather": strategy.gather(v, 0)}

    out.update(cr.get_replica_context().merge_call(merge_fn, args=(x,)))
    return {k: _portable(v) for k, v in out.items()}


@pytest.mark.parametrize("dtype", list(UNSIGNED), ids=lambda d: str(d).replace("torch.", ""))
def test_unsigned_data_movement_on_every_engine(run_replicas, dtype):
    xs = [values(dtype, r) for r in range(N)]
    name = str(dtype).replace("torch.", "")
    for r, out in enumerate(run_replicas(_moves, N, [_portable(x) for x in xs], [name] * N)):
        assert torch.equal(out["all_gather"].view(dtype), torch.cat(xs))
        assert torch.equal(out["all_to_all"].view(dtype), torch.cat([x.chunk(N)[r] for x in xs]))
        assert torch.equal(out["permute"].view(dtype), xs[(r - 1) % N])
        assert torch.equal(out["broadcast"].view(dtype), xs[1])
        assert torch.equal(out["gather"].view(dtype), torch.cat(xs))


def _grad_fp16(x):
    x = x.clone().requires_grad_(True)
    y = cr.cross_replica_mean(x * 1000)
    y.sum().backward()
    return y.detach(), x.grad


def test_float16_mean_is_differentiable_on_every_engine(run_replicas):
    xs = [torch.full((4,), 40.0 + r, dtype=torch.float16) for r in range(N)]
    ref = reference("mean", torch.float16, [(x * 1000) for x in xs])
    for y, g in run_replicas(_grad_fp16, N, xs):
        assert y.dtype == torch.float16 and torch.equal(y, ref)
        assert g.dtype == torch.float16 and torch.equal(g, torch.full((4,), 1000.0, dtype=torch.float16))
