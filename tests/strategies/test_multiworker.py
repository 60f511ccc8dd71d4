"""Collectives, values and strategy APIs on real processes, against plain-torch references.

One replica function exercises many collectives on worker processes
(crossreplica.testing) and the test compares each against a reference
computed here. Layouts: 2 workers x 1 replica (the flat engine) and 2 workers x
2 replicas (the hierarchical engine: local reduction, then one cross-process
collective per worker); each on this host and across 2 simulated hosts (the
``hosts`` fixture), where no same-host shortcut (shared memory, loopback)
reaches the other host.
"""

from __future__ import annotations

import functools
import socket

import pytest
import torch

import crossreplica as cr
from crossreplica.testing import run_replicas, run_workers

pytestmark = pytest.mark.multiprocess

LAYOUTS = [pytest.param((2, 1), id="2x1"), pytest.param((4, 2), id="2x2")]
# the 2x2 collective run also has check_collectives on: checking must not change any result;
# 4x1 makes groups of some workers only, so it exercises process subgroups
CHECKED_LAYOUTS = [pytest.param((2, 1, False), id="2x1"), pytest.param((4, 2, True), id="2x2-checked"),
                   pytest.param((4, 1, False), id="4x1")]


def _inputs(n: int) -> dict[str, list]:
    g = torch.Generator().manual_seed(1234)
    return {
        "x": [torch.randn(2 * n, 3, generator=g) for _ in range(n)],
        "xi": [torch.randint(-50, 50, (5,), generator=g) for _ in range(n)],
        "xb": [torch.rand(6, generator=g) > 0.5 for _ in range(n)],
        "ragged": [torch.randn(r + 1, 2, generator=g) for r in range(n)],
    }


def collective_suite(x: torch.Tensor, xi: torch.Tensor, xb: torch.Tensor, ragged: torch.Tensor) -> dict:
    """Runs in every replica: one of everything, results in a dict."""
    n, rid = cr.num_replicas(), cr.replica_id()
    out = {"rid": rid, "n": n}
    for op in ("sum", "mean", "max", "min", "prod"):
        out[f"f_{op}"] = cr.all_reduce(x, op)
    out["i_sum"] = cr.all_reduce(xi, "sum")
    out["i_max"] = cr.all_reduce(xi, "MAX")
    out["i_prod"] = cr.all_reduce(xi % 3 + 1, "prod")
    out["b_sum"] = cr.all_reduce(xb, "sum")
    out["b_min"] = cr.all_reduce(xb, "min")
    out["nest"] = cr.all_reduce({"a": x, "b": [xi, x.double() * 2], "c": None}, "sum")
    out["strided"] = cr.all_reduce(x, "mean", [list(range(s, n, 2)) for s in range(2)])
    out["contig"] = cr.all_reduce(x, "sum", [list(range(s, s + 2)) for s in range(0, n, 2)])
    out["flat_form"] = cr.all_reduce(xi, "sum", [r % 2 for r in range(n)])
    out["gather"] = cr.all_gather(ragged, 0)
    out["gather1"] = cr.all_gather({"x": x, "i": xi.view(1, -1)}, 1)
    out["gather_grp"] = cr.all_gather(ragged, 0, [list(range(s, n, 2)) for s in range(2)])
    out["rs"] = cr.reduce_scatter(x, "sum", 0)
    out["rs_grp"] = cr.reduce_scatter(x, "max", 0, [list(range(s, n, 2)) for s in range(2)])
    out["a2a"] = cr.all_to_all(x, 0, 1)
    out["a2a_grp"] = cr.all_to_all(xi.float()[:4], 0, 0, [list(range(s, n, 2)) for s in range(2)])
    out["bcast"] = cr.broadcast({"x": x, "b": xb}, source=1)
    out["bcast_grp"] = cr.broadcast(xi, n // 2 - 1, [list(range(s, n, 2)) for s in range(2)])
    out["perm"] = cr.collective_permute(x, [[i, i + 1] for i in range(n - 1)])
    out["perm_rev"] = cr.collective_permute(xi, [[i, n - 1 - i] for i in range(n)])
    # gradients flow through the dual collectives
    y = x.clone().requires_grad_()
    (cr.all_reduce(y, "sum") * (rid + 1)).sum().backward()
    out["grad_sum"] = y.grad
    z = ragged.clone().requires_grad_()
    (cr.all_gather(z, 0) * (rid + 1)).sum().backward()
    out["grad_gather"] = z.grad
    # parameters that differ between groups: uneven sizes per group, a group-dependent source
    rev = [[3, 1], [2, 0]] if n == 4 else [[1, 0]]
    z2 = ragged.clone().requires_grad_()
    (cr.all_gather(z2, 0, rev) * (rid + 1)).sum().backward()
    out["grad_gather_rev"] = z2.grad
    out["bcast_src"] = cr.broadcast(xi, rid % 2 if n == 4 else 0, [list(range(s, n, 2)) for s in range(2)])
    # merge_call: merge_fn runs per worker, strategy.reduce crosses processes
    rctx = cr.get_replica_context()
    out["merge"] = rctx.merge_call(lambda s, v: s.reduce("sum", v), args=(x,))
    out["mesh"] = cr.all_reduce(x, "sum", mesh=cr.Mesh({"data": n // 2, "model": 2}), axes=("data",))
    return out


def _red(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """The sequential reduction in replica-id order: what every engine returns bitwise."""
    if xs[0].dtype == torch.bool:
        st = torch.stack(xs)
        return st.any(0) if op in ("sum", "max") else st.all(0)
    fold = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum,
            "prod": torch.mul}[op]
    acc = functools.reduce(fold, xs)
    return acc / len(xs) if op == "mean" else acc


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    assert torch.equal(got, want), f"{what}: {got} != {want}"  # bitwise: ordered reductions


@pytest.mark.parametrize("layout", CHECKED_LAYOUTS)
def test_collectives_match_plain_torch(layout, hosts):
    n, rpw, check = layout
    inp = _inputs(n)
    res = run_replicas(collective_suite, inp["x"], inp["xi"], inp["xb"], inp["ragged"], engine="processes",
                       replicas_per_worker=rpw, check_collectives=check, hosts=hosts)
    x, xi, xb, rag = inp["x"], inp["xi"], inp["xb"], inp["ragged"]
    strided = [list(range(s, n, 2)) for s in range(2)]
    contig = [list(range(s, s + 2)) for s in range(0, n, 2)]
    def group(groups, r):
        return next(g for g in groups if r in g)
    for r, out in enumerate(res):
        assert (out["rid"], out["n"]) == (r, n)
        for op in ("sum", "mean", "max", "min", "prod"):
            _check(out[f"f_{op}"], _red(op, x), f"replica {r} all_reduce {op}")
        _check(out["i_sum"], _red("sum", xi), "int sum")
        _check(out["i_max"], _red("max", xi), "int max")
        _check(out["i_prod"], _red("prod", [t % 3 + 1 for t in xi]), "int prod")
        _check(out["b_sum"], _red("sum", xb), "bool sum")
        _check(out["b_min"], _red("min", xb), "bool min")
        _check(out["nest"]["a"], _red("sum", x), "nest a")
        _check(out["nest"]["b"][0], _red("sum", xi), "nest b0")
        _check(out["nest"]["b"][1], _red("sum", [t.double() * 2 for t in x]), "nest b1")
        assert out["nest"]["c"] is None
        _check(out["strided"], _red("mean", [x[q] for q in group(strided, r)]), "strided groups")
        _check(out["contig"], _red("sum", [x[q] for q in group(contig, r)]), "contiguous groups")
        _check(out["flat_form"], _red("sum", [xi[q] for q in range(r % 2, n, 2)]), "flat form")
        _check(out["gather"], torch.cat(rag), "ragged all_gather")
        _check(out["gather1"]["x"], torch.cat(x, 1), "all_gather dim 1")
        _check(out["gather1"]["i"], torch.cat([t.view(1, -1) for t in xi], 1), "all_gather int leaf")
        _check(out["gather_grp"], torch.cat([rag[q] for q in group(strided, r)]), "grouped all_gather")
        g_all = list(range(n))
        _check(out["rs"], _red("sum", x).chunk(n)[r], "reduce_scatter")
        gs = group(strided, r)
        _check(out["rs_grp"], _red("max", [x[q] for q in gs]).chunk(len(gs))[gs.index(r)], "grouped reduce_scatter")
        _check(out["a2a"], torch.cat([x[q].chunk(n, 0)[r] for q in g_all], 1), "all_to_all")
        _check(out["a2a_grp"], torch.cat([xi[q].float()[:4].chunk(len(gs), 0)[gs.index(r)] for q in gs], 0),
               "grouped all_to_all")
        _check(out["bcast"]["x"], x[1], "broadcast")
        _check(out["bcast"]["b"], xb[1], "broadcast bool")
        _check(out["bcast_grp"], xi[gs[n // 2 - 1]], "grouped broadcast")
        _check(out["perm"], x[r - 1] if r > 0 else torch.zeros_like(x[0]), "permute")
        _check(out["perm_rev"], xi[n - 1 - r], "permute reversed")
        _check(out["grad_sum"], torch.full_like(x[r], n * (n + 1) / 2), "grad of all_reduce")
        _check(out["grad_gather"], torch.full_like(rag[r], n * (n + 1) / 2), "grad of ragged all_gather")
        rev = [[3, 1], [2, 0]] if n == 4 else [[1, 0]]
        _check(out["grad_gather_rev"], torch.full_like(rag[r], float(sum(q + 1 for q in group(rev, r)))),
               "grad of ragged all_gather, sizes differing per group")
        _check(out["bcast_src"], xi[gs[r % 2 if n == 4 else 0]], "broadcast, source differing per group")
        _check(out["merge"], _red("sum", x), "merge_call + strategy.reduce")
        mesh_groups = cr.Mesh({"data": n // 2, "model": 2}).group_assignment(("data",))
        _check(out["mesh"], _red("sum", [x[q] for q in group(mesh_groups, r)]), "mesh axes")
    # every replica of a group holds the same bytes
    for key in ("f_sum", "f_mean", "f_prod", "nest"):
        first = res[0][key]
        for out in res[1:]:
            a = first if isinstance(first, torch.Tensor) else first["a"]
            b = out[key] if isinstance(out[key], torch.Tensor) else out[key]["a"]
            assert torch.equal(a, b), f"{key}: replicas disagree bitwise"


def strategy_main(strategy: cr.Strategy) -> dict:
    """Runs once per worker in cross-replica context: run / reduce / gather / local results."""
    rank = strategy.extended.worker_rank
    local = strategy.extended.local_replica_ids
    per = cr.PerReplica(tuple(torch.tensor([float(r), 1.0]) for r in local))

    def fn(v):
        return v * 2, cr.replica_id()

    doubled, ids = strategy.run(fn, (per,))
    out = {
        "rank": rank, "local": local, "n": strategy.num_replicas_in_sync, "host": socket.gethostname(),
        "local_results": [t.tolist() for t in strategy.experimental_local_results(doubled)],
        "ids": list(strategy.experimental_local_results(ids)),
        "sum": strategy.reduce("sum", doubled).tolist(),
        "mean": strategy.reduce("mean", doubled).tolist(),
        "max": strategy.reduce(cr.ReduceOp.MAX, doubled).tolist(),
        "axis_mean": strategy.reduce("mean", cr.PerReplica(tuple(torch.ones(r + 1) * r for r in local)),
                                     axis=0).item(),
        "gather": strategy.gather(cr.PerReplica(tuple(torch.full((r + 1,), r) for r in local)), 0).tolist(),
        "chief": strategy.extended.is_chief,
        "bcast": strategy.extended.broadcast_values([torch.tensor([rank * 10.0 + i]) for i in range(len(local))]).item(),
    }
    # every worker starts from the chief's weights, whatever its own initialisation
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    copies = strategy.extended.broadcast_initial_state(
        cr.Mirrored(tuple(model if i == 0 else __import__("copy").deepcopy(model) for i in range(len(local)))))
    out["weights"] = [[t.clone() for t in m.state_dict().values()] for m in copies.values]
    # the backend-ring path (ordered_reductions=False), on the same process group
    ring = cr.MultiWorkerMirroredStrategy(len(local), timeout_seconds=60, ordered_reductions=False)
    vals = cr.PerReplica(tuple(torch.linspace(0, 1, 5) * (r + 1) / 3 for r in local))
    summed = ring.run(lambda v: (cr.all_reduce(v, "sum"), cr.all_reduce(v, "mean")), (vals,))
    out["ring"] = [[t.clone() for t in pair] for pair in zip(*(ring.experimental_local_results(x) for x in summed))]
    strategy.extended.barrier()
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strategy_api_across_workers(layout, hosts):
    n, rpw = layout
    res = run_workers(strategy_main, n // rpw, replicas_per_worker=rpw, hosts=hosts)
    per_host = len(res) // (hosts.n if hosts else 1)
    assert [out["host"] for out in res] == [hosts.hostnames[w // per_host] if hosts else socket.gethostname()
                                            for w in range(len(res))]
    for w, out in enumerate(res):
        local = list(range(w * rpw, (w + 1) * rpw))
        assert out["rank"] == w and list(out["local"]) == local and out["n"] == n
        assert out["local_results"] == [[2.0 * r, 2.0] for r in local]  # run returns LOCAL results
        assert out["ids"] == local
        assert out["sum"] == [2.0 * sum(range(n)), 2.0 * n]
        assert out["mean"] == pytest.approx([2.0 * sum(range(n)) / n, 2.0])
        assert out["max"] == [2.0 * (n - 1), 2.0]
        total = sum(r * (r + 1) for r in range(n))
        assert out["axis_mean"] == pytest.approx(total / sum(r + 1 for r in range(n)))
        assert out["gather"] == [r for r in range(n) for _ in range(r + 1)]
        assert out["chief"] == (w == 0)
        assert out["bcast"] == 0.0
    vals = [torch.linspace(0, 1, 5) * (r + 1) / 3 for r in range(n)]
    for out in res:
        for total, mean in out["ring"]:
            torch.testing.assert_close(total, sum(vals))
            torch.testing.assert_close(mean, sum(vals) / n)
    torch.manual_seed(0)
    chief = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    for out in res:
        for copy in out["weights"]:
            for got, want in zip(copy, chief.state_dict().values()):
                assert torch.equal(got, want)


def _per_row_labels(strategy):
    """Each worker splits the same global batch and keeps its replicas' rows and labels."""
    x = torch.arange(10.0).view(5, 2)
    batch = (x, [f"row{i}" for i in range(5)])
    (dist_batch,) = list(strategy.distribute_dataset([batch]))
    out = strategy.run(lambda b: (b[0].sum(1), "|".join(b[1])), args=(dist_batch,))
    return [(t.tolist(), labels) for t, labels in
            zip(*(strategy.experimental_local_results(v) for v in out))]


@pytest.mark.parametrize("layout", [(2, 1), (2, 2)], ids=["2x1", "2x2"])
def test_per_row_labels_split_with_the_batch_across_workers(layout, hosts):
    """Per-row lists travel with their rows on every worker, as in one process."""
    workers, per_worker = layout
    n = workers * per_worker
    sizes = [5 // n + (1 if i < 5 % n else 0) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    got = [part for worker in run_workers(_per_row_labels, workers, per_worker, hosts=hosts) for part in worker]
    assert len(got) == n
    for r, (sums, labels) in enumerate(got):
        rows = range(starts[r], starts[r] + sizes[r])
        assert sums == [float(4 * i + 1) for i in rows]
        assert labels == "|".join(f"row{i}" for i in rows)
