"""Collectives under torch's function transforms, on every engine: higher-order
gradients (gradcheck and gradgradcheck), ``torch.vmap`` and
``torch.compile(fullgraph=True)``.

gradcheck needs one function of every replica's input that every replica can
evaluate in lockstep. Each replica evaluates the same global function
``F(flat) = all_gather(collective(x_r))``, where ``x_r`` is replica r's slice of
``all_reduce(flat) / n`` and ``flat`` (every replica's input, concatenated) is the
same on every replica: gradcheck's perturbations then happen everywhere at once,
and the backward's sums over replicas (the all_reduce's and the all_gather's
transposes) make each replica's Jacobian the global one.
"""

from __future__ import annotations

import math
import re
import threading
import warnings

import pytest
import torch

import crossreplica as cr

G4 = [[0, 1], [2, 3]]
G4_REVERSED = [[3, 1], [2, 0]]
MESH = {"data": 2, "model": 2}


def _uneven_a2a(r):
    # group [[0, 1], [2, 3]]; S[i][j] rows member i sends member j
    S = [[1, 2], [0, 3]]
    i = r % 2
    return {"split_dim": 0, "concat_dim": 0, "group_assignment": G4, "input_split_sizes": S[i],
            "output_split_sizes": [S[j][i] for j in range(2)]}


GRAD_CASES = [
    # id, n, shape_of(r), kwargs_of(r) for the named collective
    ("all_reduce-sum", 2, lambda r: (2, 2), "all_reduce", lambda r: {"op": "sum"}),
    ("all_reduce-mean-groups", 4, lambda r: (3,), "all_reduce", lambda r: {"op": "mean", "group_assignment": G4}),
    ("all_reduce-max", 2, lambda r: (4,), "all_reduce", lambda r: {"op": "max"}),
    ("all_reduce-min-mesh", 4, lambda r: (3,), "all_reduce", lambda r: {"op": "min", "mesh": cr.Mesh(MESH),
                                                                         "axes": "model"}),
    ("cross_replica_sum-number-shaped", 2, lambda r: (), "cross_replica_sum", lambda r: {}),
    ("all_gather-uneven-groups", 4, lambda r: (r % 3 + 1, 2), "all_gather",
     lambda r: {"dim": 0, "group_assignment": G4_REVERSED}),
    ("all_gather-untiled", 2, lambda r: (2, 2), "all_gather", lambda r: {"dim": 1, "tiled": False}),
    ("reduce_scatter-sum", 2, lambda r: (4, 1), "reduce_scatter", lambda r: {"op": "sum"}),
    ("reduce_scatter-mean-dim1-groups", 4, lambda r: (1, 4), "reduce_scatter",
     lambda r: {"op": "mean", "dim": 1, "group_assignment": G4_REVERSED}),
    ("all_to_all", 2, lambda r: (4, 1), "all_to_all", lambda r: {"split_dim": 0, "concat_dim": 1}),
    ("all_to_all-uneven-groups", 4, lambda r: (sum(_uneven_a2a(r)["input_split_sizes"]), 2), "all_to_all",
     _uneven_a2a),
    ("broadcast-groups", 4, lambda r: (3,), "broadcast", lambda r: {"source": 1, "group_assignment": G4_REVERSED}),
    ("collective_permute-partial", 4, lambda r: (2,), "collective_permute",
     lambda r: {"source_target_pairs": [(0, 3), (2, 1), (3, 2)]}),
    ("collective_permute-shift", 4, lambda r: (2,), "collective_permute",
     lambda r: {"mesh": cr.Mesh(MESH), "axis": "data", "shift": 1}),
]


def _square_after(name, kwargs):
    """The collective between two non-linear steps, so second derivatives are not zero."""
    def fn(x):
        return getattr(cr, name)(x * x, **kwargs) ** 2
    return fn


def _global_checks(name, kwargs, shapes, flat):
    n, r = len(shapes), cr.replica_id()
    sizes = [math.prod(s) for s in shapes]
    offset = sum(sizes[:r])
    local = _square_after(name, kwargs)

    def F(flat):
        full = cr.all_reduce(flat, "sum") / n
        x = full[offset:offset + sizes[r]].view(shapes[r])
        return cr.all_gather(local(x).reshape(-1), 0)

    gen = torch.Generator().manual_seed(0)  # the same cotangent on every replica
    v = torch.randn(F(flat).shape, generator=gen, dtype=flat.dtype)
    flat = flat.clone().requires_grad_(True)  # gradcheck perturbs it in place
    first = torch.autograd.gradcheck(F, (flat,), eps=1e-6, atol=1e-6, rtol=1e-5)
    second = torch.autograd.gradgradcheck(F, (flat,), (v,), eps=1e-6, atol=1e-6, rtol=1e-5)
    return first, second


@pytest.mark.parametrize("cid, n, shape_of, name, kwargs_of", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradcheck_and_gradgradcheck(run_replicas, cid, n, shape_of, name, kwargs_of):
    shapes = [shape_of(r) for r in range(n)]
    gen = torch.Generator().manual_seed(len(cid))
    flat = torch.randn(sum(math.prod(s) for s in shapes), generator=gen, dtype=torch.float64)
    outs = run_replicas(_global_checks, n, [name] * n, [kwargs_of(r) for r in range(n)], [shapes] * n, [flat.clone() for _ in range(n)])
    assert outs == [(True, True)] * n


def _penalty(x, w):
    """A gradient penalty through collective_permute and all_gather: d/dw of |dL/dx|^2."""
    w = w.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    y = cr.collective_permute(torch.tanh(x * w), [(0, 1), (1, 0)])
    loss = cr.all_gather(y * y, 0).sum()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    (gw,) = torch.autograd.grad((gx * gx).sum(), w)
    return gw


def test_double_backward_through_permute_matches_plain_torch(run_replicas):
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(2)]
    w = torch.randn(3, dtype=torch.float64)
    got = run_replicas(_penalty, 2, xs, [w, w])
    # reference: the global objective in plain torch; each replica's backward sums over every
    # replica's loss (the collectives' transposes), so replica r gets d(sum of penalties)/d w_r
    ws = [w.clone().requires_grad_(True) for _ in range(2)]
    xr = [x.clone().requires_grad_(True) for x in xs]
    received = [torch.tanh(xr[1] * ws[1]), torch.tanh(xr[0] * ws[0])]  # replica r receives from 1 - r
    loss = 2 * torch.cat([y * y for y in received]).sum()  # every replica's loss is the whole gather
    gx = torch.autograd.grad(loss, xr, create_graph=True)
    expected = torch.autograd.grad(sum((g * g).sum() for g in gx), ws)
    for r in range(2):
        assert torch.allclose(got[r], expected[r], rtol=1e-12, atol=1e-12)


def _prod_double(x):
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(cr.all_reduce(x * x, "prod").sum(), x, create_graph=True)
    return g


def test_prod_gradient_is_a_clear_error(run_replicas):
    with pytest.raises(RuntimeError, match=r"the gradient of all_reduce with op=prod is not implemented"):
        run_replicas(_prod_double, 2, [torch.ones(2)] * 2)


# ------------------------------------------------------------------ torch.vmap

VMAP_CASES = [
    ("all_reduce", {"op": "sum"}, 0), ("all_reduce", {"op": "max"}, 1),
    ("cross_replica_mean", {"mesh": cr.Mesh({"a": 2}), "axes": "a"}, 0),
    ("reduce_scatter", {"op": "sum", "dim": 0}, 1), ("reduce_scatter", {"op": "mean", "dim": -1}, 0),
    ("all_gather", {"dim": 0}, 0), ("all_gather", {"dim": 1, "tiled": False}, 1),
    ("all_to_all", {"split_dim": 0, "concat_dim": 1}, 1),
    ("all_to_all", {"split_dim": 0, "concat_dim": 0, "input_split_sizes": [1, 3], "output_split_sizes": [1, 1]}, 0),
    ("broadcast", {"source": 1}, 0), ("collective_permute", {"source_target_pairs": [(0, 1)]}, 1),
]


def _vmapped(name, kwargs, in_dim, x):
    if cr.replica_id() == 1 and "input_split_sizes" in kwargs:  # replica 1 sends [1, 1], expects [3, 1]
        kwargs = {**kwargs, "input_split_sizes": [1, 1], "output_split_sizes": [3, 1]}
        x = x.narrow(1 - in_dim, 0, 2)

    def f(t):
        return getattr(cr, name)(t * 2, **kwargs)

    batched = torch.vmap(f, in_dims=in_dim)(x)
    loop = torch.stack([f(t) for t in x.unbind(in_dim)])
    return batched, loop


@pytest.mark.parametrize("name, kwargs, in_dim", VMAP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(VMAP_CASES)])
def test_vmap_equals_the_loop(run_replicas, name, kwargs, in_dim):
    shape = (3, 4, 2) if in_dim == 0 else (4, 3, 2)
    xs = [torch.randn(shape, dtype=torch.float64) for _ in range(2)]
    for batched, loop in run_replicas(_vmapped, 2, [name] * 2, [kwargs] * 2, [in_dim] * 2, xs):
        assert torch.equal(batched, loop)


def _per_sample_grads(w, x):
    def loss(w, t):
        return cr.all_reduce((torch.tanh(t * w)).sum(), "sum") ** 2

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)
    loop = torch.stack([torch.func.grad(loss)(w, t) for t in x])
    return batched, loop


def test_vmap_of_grad_through_a_collective(run_replicas):
    w = torch.randn(3, dtype=torch.float64)
    xs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(2)]
    for batched, loop in run_replicas(_per_sample_grads, 2, [w, w], xs):
        assert torch.allclose(batched, loop, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ torch.compile

def _loss(w1, w2, x, y):
    h = torch.tanh(x @ w1)
    h = h - cr.cross_replica_mean(h.mean(0))
    out = h @ w2
    penalty = cr.all_gather(out, 0).pow(2).mean() + cr.all_reduce(out.abs().amax(), "max")
    return ((out - y) ** 2).mean() + 1e-3 * penalty


def _update(params, grads):
    grads = cr.all_reduce(grads, "mean")
    return [p - 0.1 * g for p, g in zip(params, grads)]


def _everything(x):
    g = cr.all_gather(x, 0, tiled=False)
    r = cr.reduce_scatter(g.reshape(-1, x.shape[-1]), "sum", 0)
    a = cr.all_to_all(r, 0, 1)
    b = cr.broadcast(a, 1)
    p = cr.collective_permute(b, mesh=cr.Mesh({"a": 2}), axis="a", shift=1)
    return cr.cross_replica_sum({"p": p, "n": 2.0})


_COMPILED: dict[str, object] = {}
_LOCK = threading.Lock()


def _compiled(fn):
    with _LOCK:
        if fn.__name__ not in _COMPILED:
            _COMPILED[fn.__name__] = torch.compile(fn, fullgraph=True)
        return _COMPILED[fn.__name__]


def _train(w1, w2, x, y, compiled):
    loss_fn, update = (_compiled(_loss), _compiled(_update)) if compiled else (_loss, _update)
    params = [w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)]
    losses = []
    for _ in range(3):
        loss = loss_fn(*params, x, y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            params = [p.requires_grad_(True) for p in update([p.detach() for p in params], list(grads))]
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach() for p in params], (_compiled(_everything) if compiled else _everything)(x)


def test_compiled_training_step_matches_eager(run_replicas):
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    w2 = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    xs = [torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randn(6, 2, generator=gen, dtype=torch.float64) for _ in range(2)]
    eager = run_replicas(_train, 2, [w1, w1], [w2, w2], xs, ys, [False, False])
    compiled = run_replicas(_train, 2, [w1, w1], [w2, w2], xs, ys, [True, True])
    for (el, ep, ee), (cl, cp, ce) in zip(eager, compiled):
        assert torch.allclose(el, cl, rtol=1e-12, atol=1e-12)
        for a, b in zip(ep, cp):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
        assert torch.equal(ee["p"], ce["p"]) and torch.equal(ee["n"], ce["n"])
    assert not torch._dynamo.utils.counters["graph_break"]  # threads: compiled here; fullgraph elsewhere


def _compile_warnings(x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(_everything_one, fullgraph=True, backend="eager")(x)
    return [str(w.message) for w in caught]


def _everything_one(x):
    return cr.all_reduce(x, "sum") + cr.all_gather(x, 0, [[0]]) + cr.broadcast(x, 0, mesh=cr.Mesh({"a": 1}), axes="a")


def test_compiling_warns_about_nothing_of_ours():
    strategy = cr.MirroredStrategy(num_replicas=1)
    caught = strategy.run(_compile_warnings, args=(torch.ones(2),))
    assert not [m for m in caught if "lru_cache" in m or "crossreplica" in m], caught


def _uneven_compiled(x):
    return _compiled(_gather_only)(x)


def _gather_only(x):
    return cr.all_gather(x, 0)


def test_compiled_uneven_all_gather_is_a_clear_error():
    strategy = cr.MirroredStrategy(num_replicas=2)
    with pytest.raises(ValueError, match=r"cr\.all_gather under torch\.compile needs the same size along the "
                                         r"gather dim on every member of a group; got sizes \[\[1, 2\]\]"):
        strategy.run(_uneven_compiled, args=(cr.PerReplica([torch.ones(1), torch.ones(2)]),))


# ------------------------------------------------------------------ compiled all_reduce: one constant, few guards

def _crossreplica_guards(fn, *args):
    """The guards of ``fn`` compiled whose source reads a crossreplica module (each one is
    checked again on every call of the compiled code)."""
    return [g.name for g in torch._dynamo.explain(fn)(*args).out_guards if "crossreplica" in g.name]


def _reduce_one(x):
    return cr.all_reduce(x, "sum")


def _reduce_grads(grads):
    return cr.all_reduce(grads, "mean")


def test_compiled_all_reduce_adds_a_few_guards_whatever_the_leaves():
    # Traced line by line, one all_reduce read about 85 of crossreplica's globals (the nest
    # walker, ReduceOp, the group helpers), each a guard every call checks again.
    strategy = cr.MirroredStrategy(num_replicas=1)
    one, six = strategy.run(lambda: (_crossreplica_guards(_reduce_one, torch.ones(3)),
                                     _crossreplica_guards(_reduce_grads, [torch.ones(3)] * 6)))
    assert len(one) <= 20, one  # 13 in torch 2.13
    assert sorted(six) == sorted(one), (one, six)


def _broadcast_one(x):
    return cr.broadcast(x, 0, [[0]])


def test_compiled_collectives_work_out_their_groups_as_one_constant():
    # The group helpers' internals (their caches, canonical forms) are no guards of the
    # compiled code: the groups are worked out once while tracing.
    strategy = cr.MirroredStrategy(num_replicas=1)
    names = strategy.run(lambda: _crossreplica_guards(_broadcast_one, torch.ones(3)))
    assert not [n for n in names if "crossreplica_dot_groups" in n], names


def _compiled_reductions(x, y, z):
    return (_compiled(_reduce_pair)([x, y]), _compiled(_reduce_tuple)((x, z)), _compiled(_reduce_max_pairs)(y),
            _reduce_pair([x, y]), _reduce_tuple((x, z)), _reduce_max_pairs(y))


def _reduce_pair(xs):
    return cr.all_reduce(xs, "mean")


def _reduce_tuple(xs):
    return cr.cross_replica_sum(xs)


def _reduce_max_pairs(x):
    return cr.all_reduce(x, cr.ReduceOp.MAX, [[0, 2], [1, 3]])


def test_compiled_all_reduce_of_tensors_lists_and_tuples_matches_eager():
    strategy = cr.MirroredStrategy(num_replicas=4)
    gen = torch.Generator().manual_seed(3)
    per = [cr.PerReplica([torch.randn(5, generator=gen, dtype=dtype) for _ in range(4)])
           for dtype in (torch.float32, torch.float64, torch.float32)]
    for out in strategy.experimental_local_results(strategy.run(_compiled_reductions, args=tuple(per))):
        pair, tup, most, eager_pair, eager_tup, eager_most = out
        assert type(pair) is list and type(tup) is tuple and isinstance(most, torch.Tensor)
        for a, b in zip([*pair, *tup, most], [*eager_pair, *eager_tup, eager_most]):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _compiled_bad(x, call):
    return torch.compile(call, fullgraph=True)(x)


def _eager_fallback(x, call):
    return torch.compile(call)(x)


@pytest.mark.parametrize("call,x,error,match", [
    (lambda t: cr.all_reduce(t, "bogus"), torch.ones(2), ValueError,
     "op must be a cr.ReduceOp or one of SUM, MEAN, MAX, MIN, PROD"),
    (lambda t: cr.all_reduce(t, "mean"), torch.ones(2, dtype=torch.int32), TypeError,
     "x has dtype torch.int32, but op=mean needs a floating"),
    (lambda t: cr.all_reduce([t, t], "sum", [[0, 5]]), torch.ones(2), ValueError,
     r"group_assignment names replica 5, outside 0..0 (1 replicas in sync)"),
    (lambda t: cr.broadcast(t, 0, [[0, 5]]), torch.ones(2), ValueError,
     r"group_assignment names replica 5, outside 0..0 (1 replicas in sync)"),
], ids=["op", "dtype", "all_reduce-groups", "broadcast-groups"])
def test_compiled_collective_bad_arguments_fail_tracing_with_the_eager_message(call, x, error, match):
    # The constant arguments are worked out in one function while tracing; a bad one still
    # fails as the eager call does.
    strategy = cr.MirroredStrategy(num_replicas=1)
    with pytest.raises(Exception) as info:  # torch wraps it (Unsupported in 2.13)
        strategy.run(_compiled_bad, args=(x, call))
    assert match in str(info.value) + str(info.value.__cause__), info.value
    with pytest.raises(error, match=re.escape(match)):  # without fullgraph Dynamo falls back to the eager call
        strategy.run(_eager_fallback, args=(x, call))
