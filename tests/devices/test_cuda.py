"""The CUDA suite: collectives, training and state on replicas placed on GPUs.

Every test runs the same replica function with its replicas on CUDA devices and
compares with the CPU run or with plain PyTorch computed here. Elementwise
reductions in replica order give the same bits on a GPU as on the CPU, so those
comparisons are exact; training compares within float tolerance (GPU matrix
products round differently from CPU ones). Several replicas share a GPU where
there are fewer GPUs than replicas. Worker processes use NCCL when each has a
GPU of its own, else gloo on the CUDA tensors (``crossreplica.testing``).

The layout-invariant mode and fault tolerance compare layouts with each other bitwise, on
one GPU under ``torch.use_deterministic_algorithms(True)``, and with plain PyTorch on the GPU
within float tolerance; their bodies take the device, and pass on the CPU too.

Skipped, with the reason, where no CUDA device is visible.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from plain_torch import cross_entropy, one_device_training

import crossreplica as cr
import crossreplica.testing as crt
from crossreplica.micro_batches import check_layout, micro_batch_sizes
from crossreplica.optim import CrossShardOptimizer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]

# cuBLAS gives the same bits run to run only with a fixed workspace configuration, read when a
# process first uses cuBLAS (and torch's deterministic mode refuses cuBLAS without it): set here,
# at collection, before any test touches cuBLAS; worker processes inherit it (their forkserver
# starts later). It sizes cuBLAS's workspace and changes nothing else.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs (one per NCCL process); {GPUS} visible")

# engine -> (run_replicas engine, replicas_per_worker): in-process threads, one replica per
# process, and the hierarchical engine (two local replicas per process).
LAYOUTS = {
    "threads": ("threads", None),
    "processes": ("processes", 1),
    "hierarchical": ("processes", 2),
}


@pytest.fixture(params=[pytest.param(name, marks=() if name == "threads" else pytest.mark.multiprocess)
                        for name in LAYOUTS])
def layout(request) -> str:
    return request.param


def run_on(layout: str, fn, num_replicas: int, *args, device: str = "cuda", **opts) -> list:
    engine, rpw = LAYOUTS[layout]
    if engine == "processes":
        opts.setdefault("replicas_per_worker", rpw)
    return crt.run_replicas(fn, *args, num_replicas=num_replicas, engine=engine, device=device, **opts)


def _here(x: torch.Tensor) -> torch.Tensor:
    """``x`` on this replica's device, checked to be a GPU when the run is on CUDA."""
    return x.to(cr.get_replica_context().device)


def _out(y, device_type: str):
    """A result back to the CPU for comparison, after checking it stayed on the replica's device."""
    if isinstance(y, torch.Tensor):
        assert y.device == cr.get_replica_context().device, (y.device, cr.get_replica_context().device)
        assert y.device.type == device_type
        return y.cpu()
    return type(y)(_out(v, device_type) for v in y)


# ---------------------------------------------------------------------- collectives


def _collectives(x: torch.Tensor, device_type: str):
    x = _here(x)
    rid = cr.replica_id()
    n = cr.num_replicas()
    uneven = x[: 1 + rid % 2]  # uneven all_gather: sizes travel as a leaf on the replica's device
    results = (
        cr.all_reduce(x, "sum"),
        cr.all_reduce(x, "mean"),
        cr.all_reduce(x, "max"),
        cr.all_reduce(x.to(torch.float16), "sum"),
        cr.all_reduce(x.to(torch.int64), "sum"),
        cr.all_reduce(x, "sum", group_assignment=[[r for r in range(n) if r % 2 == p] for p in range(2)]),
        cr.all_gather(x, 0),
        cr.all_gather(uneven, 0),
        cr.reduce_scatter(x, "sum", 0),
        cr.all_to_all(x, 0, 0),
        cr.broadcast(x, source=1),
        cr.collective_permute(x, [(r, (r + 1) % n) for r in range(n)]),
        cr.cross_replica_sum(x),
    )
    return _out(results, device_type)


def _inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(4 * n, 3, generator=g) * 100 for _ in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_gives_the_cpu_bytes(layout, n):
    xs = _inputs(n)
    on_cpu = run_on("threads", _collectives, n, xs, ["cpu"] * n, device="cpu")
    on_gpu = run_on(layout, _collectives, n, xs, ["cuda"] * n)
    for cpu_results, gpu_results in zip(on_cpu, on_gpu):
        for a, b in zip(cpu_results, gpu_results):
            assert torch.equal(a, b)


def _gather_nothing(_):
    return cr.all_gather({"a": None, "b": [None]}, 0)  # only the sizes leaf travels


def test_all_gather_of_a_nest_without_tensors(layout):
    assert run_on(layout, _gather_nothing, 2, [0, 1]) == [{"a": None, "b": [None]}] * 2


def _differentiable(x: torch.Tensor):
    x = _here(x).detach().requires_grad_()  # a leaf of its own (threads share the caller's tensors)
    n = cr.num_replicas()
    rid = cr.replica_id()
    w = torch.arange(1.0, x.numel() + 1, device=x.device).view_as(x)
    y = (cr.all_reduce(x, "sum") * w).sum()
    y = y + (cr.all_gather(x[: 1 + rid % 2], 0) ** 2).sum()
    y = y + (cr.reduce_scatter(x, "sum", 0) * 3).sum()
    y = y + (cr.broadcast(x, source=0) * w).sum()
    y = y + (cr.collective_permute(x, [(r, (r + 1) % n) for r in range(n)]) * w).sum()
    y = y + cr.all_to_all(x * w, 0, 0).pow(2).sum()
    y.backward()
    assert x.grad.device == x.device
    return y.detach().cpu(), x.grad.cpu()


@pytest.mark.parametrize("n", [2, 4])
def test_gradients_of_collectives_match_the_cpu(layout, n):
    xs = _inputs(n)
    on_cpu = run_on("threads", _differentiable, n, xs, device="cpu")
    on_gpu = run_on(layout, _differentiable, n, xs)
    for (y0, g0), (y1, g1) in zip(on_cpu, on_gpu):
        torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-3)
        torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-4)


def _compiled_step(x: torch.Tensor):
    x = _here(x)

    def body(t):
        return cr.all_reduce(torch.sin(t), "sum") + cr.all_gather(t * 2, 0).sum(0)

    eager = body(x)
    compiled = torch.compile(body, fullgraph=True, dynamic=False)(x)
    return eager.cpu(), compiled.cpu()


def test_compiled_collectives_on_cuda():
    for eager, compiled in run_on("threads", _compiled_step, 2, _inputs(2)):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-5)


def _on_side_stream(value: float):
    """The input is written on a side stream after a long GPU sleep: the collective must wait
    for it (engines/streams.py), and this replica's later kernels for the collective."""
    device = cr.get_replica_context().device
    side = torch.cuda.Stream(device)
    x = torch.zeros(1 << 16, device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time before the fill
        x.fill_(value)
        total = cr.all_reduce(x, "sum")
        gathered = cr.all_gather(x[:2], 0)
        doubled = total * 2  # queued on the side stream, after the collective's result
    torch.cuda.current_stream(device).wait_stream(side)
    return total.cpu(), gathered.cpu(), doubled.cpu()


def test_collectives_follow_the_replica_stream():
    outs = run_on("threads", _on_side_stream, 2, [1.0, 2.0])
    for total, gathered, doubled in outs:
        assert torch.equal(total, torch.full((1 << 16,), 3.0))
        assert torch.equal(gathered, torch.tensor([1.0, 1.0, 2.0, 2.0]))
        assert torch.equal(doubled, torch.full((1 << 16,), 6.0))


def _backward_threads(_):
    """Where this replica's backward runs: the threads of a hook on a GPU gradient and of
    a collective's backward, against the replica's own thread."""
    seen = []
    x = torch.ones(8, device=cr.get_replica_context().device, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(threading.get_ident()))
    (cr.all_reduce(y, "sum") * 3).sum().backward()
    return seen == [threading.get_ident()], x.grad.cpu()


def test_each_replica_runs_its_backward_on_its_own_thread():
    """Autograd's one engine thread per GPU would run every replica's backward work on a
    shared GPU; a collective's backward waiting for its peers there could never finish."""
    for here, grad in run_on("threads", _backward_threads, 2, [0, 1]):
        assert here
        assert torch.equal(grad, torch.full((8,), 12.0))  # 3 x sum over 2 replicas x 2


def _sync_bn(x: torch.Tensor):
    """SyncBatchNorm's forward and backward (its backward all-reduces) on this replica."""
    layer = cr.nn.SyncBatchNorm(3).to(cr.get_replica_context().device)
    with torch.no_grad():  # weights from a private generator: the same in every replica and run
        layer.weight.copy_(torch.rand(3, generator=torch.Generator().manual_seed(0)) + 0.5)
    x = _here(x).detach().requires_grad_()
    out = layer(x)
    (out * torch.arange(1.0, out.numel() + 1, device=out.device).view_as(out)).sum().backward()
    return out.detach().cpu(), x.grad.cpu(), layer.weight.grad.cpu(), layer.running_var.cpu()


def test_sync_batch_norm_trains_on_cuda_as_on_the_cpu(layout):
    n = 2 if layout != "hierarchical" else 4
    xs = [x[:, :3] for x in _inputs(n)]
    on_cpu = run_on("threads", _sync_bn, n, xs, device="cpu")
    on_gpu = run_on(layout, _sync_bn, n, xs)
    for cpu_parts, gpu_parts in zip(on_cpu, on_gpu):
        for a, b in zip(cpu_parts, gpu_parts):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------- training


def _seeded(net: torch.nn.Module) -> torch.nn.Module:
    """Initial weights from a private generator: the same in every replica, worker and run
    (``torch.manual_seed`` inside a replica seeds only that replica's own stream)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return net


def _net() -> torch.nn.Module:
    return _seeded(torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)))


def _data(rows: int = 32, steps: int = 3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)) for _ in range(steps)]


def _train(steps, overlap: bool, sharded: bool, weighted: bool):
    device = cr.get_replica_context().device
    rid, n = cr.replica_id(), cr.num_replicas()
    model = _net().to(device)
    opt = CrossShardOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), overlap=overlap,
                              shard_optimizer_state=sharded)
    for x, y in steps:
        rows = x.shape[0] // n
        x, y = x[rid * rows:(rid + 1) * rows].to(device), y[rid * rows:(rid + 1) * rows].to(device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if overlap:  # the buckets were reduced during backward, not left to step()
            assert len(opt._overlapped.reduced) == len(list(model.parameters()))
        if weighted:
            opt.step(weight=x.shape[0])
        else:
            opt.step()
    assert all(p.device == device for p in model.parameters())
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("overlap,sharded,weighted", [(False, False, False), (True, False, False),
                                                      (False, True, False), (True, True, False),
                                                      (False, False, True)])
def test_cross_shard_optimizer_trains_as_one_gpu(layout, overlap, sharded, weighted):
    steps = _data()
    n = 2 if layout != "hierarchical" else 4
    outs = run_on(layout, _train, n, [steps] * n, [overlap] * n, [sharded] * n, [weighted] * n)
    for params in outs[1:]:  # replicas bitwise identical
        for p, q in zip(outs[0], params):
            assert torch.equal(p, q)
    # plain torch on one GPU, the global batch at once
    reference = one_device_training(_net(), functools.partial(torch.optim.Adam, lr=1e-2), steps, cross_entropy,
                                    device="cuda").params
    for p, r in zip(outs[0], (t.cpu() for t in reference)):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-4)


def _amp_train(steps):
    device = cr.get_replica_context().device
    rid, n = cr.replica_id(), cr.num_replicas()
    model = _net().to(device)
    opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16)
    scales = []
    for x, y in steps:
        rows = x.shape[0] // n
        x, y = x[rid * rows:(rid + 1) * rows].to(device), y[rid * rows:(rid + 1) * rows].to(device)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().cpu() for p in model.parameters()], scales


def test_grad_scaler_on_cuda_keeps_replicas_identical(layout):
    steps = _data(steps=4)
    n = 2 if layout != "hierarchical" else 4
    outs = run_on(layout, _amp_train, n, [steps] * n)
    params0, scales0 = outs[0]
    for params, scales in outs[1:]:
        assert scales == scales0
        for p, q in zip(params0, params):
            assert torch.equal(p, q)
    assert all(torch.isfinite(p).all() for p in params0)


# ---------------------------------------------------------------------- random streams


def _draws(device_type: str):
    device = cr.get_replica_context().device
    x = torch.ones(4096, device=device)
    masked = F.dropout(x, 0.5, training=True)  # the fused dropout kernel on CUDA
    return torch.rand(8, device=device).cpu(), masked.cpu(), device.type == device_type


def _plain_draws(seed: int):
    torch.manual_seed(seed)
    x = torch.ones(4096, device="cuda")
    masked = F.dropout(x, 0.5, training=True)
    return torch.rand(8, device="cuda").cpu(), masked.cpu()


def test_replica_random_streams_on_cuda_follow_the_seed_rule():
    strategy = cr.MirroredStrategy(devices=[f"cuda:{i % GPUS}" for i in range(2)])
    torch.manual_seed(11)
    outs = strategy.experimental_local_results(strategy.run(_draws, args=("cuda",)))
    torch.manual_seed(11)
    base = int(torch.randint(0, 2**63 - 1, (), device="cpu").item())
    for i, (rand, masked, on_gpu) in enumerate(outs):
        assert on_gpu
        want_rand, want_masked = _plain_draws(base + i)
        assert torch.equal(rand, want_rand)
        assert torch.equal(masked, want_masked)
    assert not torch.equal(outs[0][0], outs[1][0])


# ---------------------------------------------------------------------- buffers and checkpoints


def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 2))


@pytest.mark.parametrize("sync_buffers", ["broadcast", "mean"])
def test_mirrored_buffers_agree_on_cuda(sync_buffers):
    strategy = cr.MirroredStrategy(devices=[f"cuda:{i % GPUS}" for i in range(2)])
    torch.manual_seed(0)
    model = strategy.mirror(_bn_net(), sync_buffers=sync_buffers)
    xs = cr.PerReplica([torch.randn(16, 6, device=f"cuda:{i % GPUS}") + i for i in range(2)])

    def step(m, x):
        return m(x).sum().detach()

    strategy.run(step, args=(model, xs))
    copies = strategy.experimental_local_results(model)
    for b0, b1 in zip(copies[0].buffers(), copies[1].buffers()):
        assert b0.is_cuda and b1.is_cuda
        assert torch.equal(b0.cpu(), b1.cpu())
    mean0 = copies[0][1].running_mean.cpu()
    assert not torch.equal(mean0, torch.zeros(8))  # the statistics moved


def test_checkpoint_saved_on_gpu_loads_on_cpu_and_back(tmp_path):
    path = tmp_path / "ck.pt"
    gpu = cr.MirroredStrategy(devices=[f"cuda:{i % GPUS}" for i in range(2)])
    with gpu.scope():
        torch.manual_seed(0)
        model = gpu.mirror(_net())
        opts = gpu.run(lambda m: CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2)), args=(model,))
        steps = _data(steps=2)

        def step(m, opt, x, y):
            rid = cr.replica_id()
            x, y = x[rid * 16:(rid + 1) * 16].to(cr.get_replica_context().device), \
                y[rid * 16:(rid + 1) * 16].to(cr.get_replica_context().device)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

        for x, y in steps:
            gpu.run(step, args=(model, opts, x, y))
        cr.save(path, {"model": model, "opt": opts})
        saved = [p.detach().cpu() for p in gpu.experimental_local_results(model)[0].parameters()]

    cpu = cr.MirroredStrategy(devices=["cpu", "cpu"])
    with cpu.scope():
        torch.manual_seed(1)
        cpu_model = cpu.mirror(_net())
        cpu_opts = cpu.run(lambda m: CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2)),
                           args=(cpu_model,))
        cr.load(path, into={"model": cpu_model, "opt": cpu_opts})
        for copy_ in cpu.experimental_local_results(cpu_model):
            for p, s in zip(copy_.parameters(), saved):
                assert p.device.type == "cpu" and torch.equal(p.detach(), s)
        state = cpu.experimental_local_results(cpu_opts)[0].state_dict()["state"]
        assert all(t.device.type == "cpu" for entry in state.values() for t in entry.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)
        cr.save(tmp_path / "back.pt", {"model": cpu_model, "opt": cpu_opts})

    with gpu.scope():
        torch.manual_seed(2)
        back = gpu.mirror(_net())
        back_opts = gpu.run(lambda m: CrossShardOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2)),
                            args=(back,))
        cr.load(tmp_path / "back.pt", into={"model": back, "opt": back_opts})
        for i, copy_ in enumerate(gpu.experimental_local_results(back)):
            for p, s in zip(copy_.parameters(), saved):
                assert p.device == torch.device("cuda", i % GPUS) and torch.equal(p.detach().cpu(), s)
        state = gpu.experimental_local_results(back_opts)[0].state_dict()["state"]
        assert all(t.is_cuda for entry in state.values() for t in entry.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)


# ---------------------------------------------------------------------- strategy-level values


def test_strategy_reduce_and_gather_of_cuda_values():
    strategy = cr.MirroredStrategy(devices=[f"cuda:{i % GPUS}" for i in range(2)])
    values = cr.PerReplica([torch.arange(6.0, device=f"cuda:{i % GPUS}").view(2, 3) * (i + 1) for i in range(2)])
    total = strategy.reduce("sum", values, axis=None)
    assert total.is_cuda and torch.equal(total.cpu(), torch.arange(6.0).view(2, 3) * 3)
    mean = strategy.reduce("mean", values, axis=0)
    assert mean.is_cuda
    torch.testing.assert_close(mean.cpu(), torch.cat([torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3) * 2]).mean(0))
    gathered = strategy.gather(values, 0)
    assert gathered.is_cuda and gathered.shape == (4, 3)


def _reduce_in_main(strategy):
    values = cr.PerReplica([torch.full((3,), float(r + 1), device=d) for r, d in
                            zip(strategy.extended.local_replica_ids, strategy.extended.worker_devices)])
    total = strategy.reduce("sum", values, axis=None)
    mean = strategy.reduce("mean", values, axis=0)
    gathered = strategy.run(lambda: cr.all_gather(torch.full((2,), float(cr.replica_id()),
                                                             device=cr.get_replica_context().device), 0).cpu())
    return (total.device.type, total.cpu(), mean.cpu(), strategy.extended.engine.backend,
            strategy.experimental_local_results(gathered))


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers,replicas_per_worker", [(1, 2), (2, 1), (2, 2)])
def test_multiworker_strategy_reduce_of_cuda_values(workers, replicas_per_worker):
    """One worker has a GPU of its own on any GPU machine, so (1, 2) runs NCCL (with its two
    local replicas on that GPU); two workers run NCCL where there are two GPUs, else gloo."""
    outs = crt.run_workers(_reduce_in_main, workers, replicas_per_worker, device="cuda")
    n = workers * replicas_per_worker
    every_replica = torch.arange(n, dtype=torch.float32).repeat_interleave(2)
    for kind, total, mean, backend, gathered in outs:
        assert kind == "cuda"
        assert backend == ("nccl" if workers <= GPUS else "gloo")
        assert torch.equal(total, torch.full((3,), float(n * (n + 1) // 2)))
        torch.testing.assert_close(mean, torch.tensor((n + 1) / 2))
        assert all(torch.equal(g, every_replica) for g in gathered)


# ---------------------------------------------------------------------- failures


def _fail_on_replica_one(x):
    x = _here(x)
    if cr.replica_id() == 1:
        raise RuntimeError("replica 1 fails")
    return cr.all_reduce(x, "sum").cpu()


def test_failing_replica_releases_the_others_on_cuda(layout):
    n = 2 if layout != "hierarchical" else 4
    with pytest.raises(RuntimeError, match="replica 1 fails"):
        run_on(layout, _fail_on_replica_one, n, _inputs(n), timeout_seconds=20)


def _die_on_worker_one(strategy):
    x = torch.ones(4, device=strategy.extended.worker_devices[0])
    if strategy.extended.worker_rank == 1:
        os._exit(3)
    return strategy.run(lambda t: cr.all_reduce(t, "sum").cpu(), args=(x,))


@pytest.mark.multiprocess
@needs_two_gpus
def test_dead_worker_under_nccl_releases_the_other():
    with crt.WorkerPool(2, 1, timeout_seconds=20, device="cuda") as pool:
        assert pool.backend == "nccl"
        out = pool.run(_die_on_worker_one, mode="main")
    assert not out.ok
    assert out.exitcodes.get(1) == 3
    assert 0 in out.failures  # rank 0 reported a failure instead of hanging


# ---------------------------------------------------------------------- the layout-invariant mode
#
# Each check is a function of the device ("cuda" here; the same body passes with "cpu"), run under
# torch.use_deterministic_algorithms(True): the mode's own work (the cut into micro-batches, the
# tree sums, the buffer means) is elementwise additions, copies and concatenations, which have a
# deterministic form on the GPU, and the model's kernels must have one too (docs/layout_invariance.md,
# "On GPUs"). Layouts are compared with each other bitwise on the one GPU; against plain torch on
# the same device within float tolerance (a GPU run and a CPU run differ in the last bits, and
# CUDA's dropout masks are not the CPU's).

INVARIANT = cr.LayoutInvariant(micro_batches=4)  # 1, 2 and 4 replicas


def _first(device: str) -> str:
    """The one device every replica of ``device``'s runs shares."""
    return "cuda:0" if device == "cuda" else "cpu"


@contextlib.contextmanager
def _deterministic():
    """``torch.use_deterministic_algorithms(True)`` inside, as it was after."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _dropout_net() -> torch.nn.Module:
    """Linear layers (matrix products), BatchNorm (buffers: the tree mean over the micro-batches)
    and dropout (each micro-batch's random stream)."""
    return _seeded(torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.25), torch.nn.Linear(32, 5)))


def _invariant_data():
    return _data(rows=30, steps=3)  # 30 rows in 4 micro-batches: 8, 8, 7 and 7 (uneven, and over replicas)


def _invariant_step(model, opt, batch):
    x, y = batch
    assert x.device == cr.get_replica_context().device  # the micro-batch's rows, on the replica's device
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step(weight=x.shape[0])  # the exact mean by rows over the uneven micro-batches


def _invariant_training(strategy, steps, device_type: str) -> dict[str, torch.Tensor]:
    """The steps in ``strategy``'s layout; the final parameters and buffers, on the CPU."""
    model = strategy.mirror(_dropout_net())
    opts = strategy.run(lambda m: CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)),
                        args=(model,))
    torch.manual_seed(5)  # every run draws its streams' base from this (one draw per run)
    for batch in strategy.distribute_dataset(steps):
        strategy.run(_invariant_step, args=(model, opts, batch))
    copies = strategy.experimental_local_results(model)
    for c in copies:
        assert all(p.device.type == device_type for p in c.parameters())
        assert all(torch.equal(a, b) for a, b in zip(copies[0].state_dict().values(), c.state_dict().values()))
    return {k: v.detach().cpu() for k, v in copies[0].state_dict().items()}


def _invariant_reference(steps, device: str) -> dict[str, torch.Tensor]:
    """Plain torch on ``device``, by the mode's rules: micro-batch ``m`` of a step draws its dropout
    masks as after ``torch.manual_seed(base + m)``, ``base`` that step's draw from the caller's
    generator; the gradient is the global batch's mean (by rows)."""
    model = _dropout_net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    caller = torch.Generator().manual_seed(5)
    gpus = list(range(torch.cuda.device_count())) if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=gpus):
        for x, y in steps:
            base = int(torch.randint(0, 2**63 - 1, (), generator=caller))
            opt.zero_grad()
            total, lo = 0, 0
            for m, rows in enumerate(micro_batch_sizes(x.shape[0], INVARIANT.micro_batches)):
                torch.manual_seed(base + m)
                part = slice(lo, lo + rows)
                total = total + F.cross_entropy(model(x[part].to(device)), y[part].to(device), reduction="sum")
                lo += rows
            (total / x.shape[0]).backward()
            opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _assert_bitwise(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    assert not different, different


def check_layout_invariant_training(device: str) -> None:
    """One device, 2 and 4 replicas sharing it: bitwise the same parameters and buffers; the
    parameters plain torch's within float tolerance (its running statistics are updated once per
    micro-batch, the mode's once per step)."""
    steps = _invariant_data()
    with _deterministic():
        one = _invariant_training(cr.OneDeviceStrategy(_first(device), layout_invariant=INVARIANT), steps, device)
        for n in (2, 4):
            strategy = cr.MirroredStrategy(devices=[_first(device)] * n, layout_invariant=INVARIANT)
            _assert_bitwise(one, _invariant_training(strategy, steps, device))
        reference = _invariant_reference(steps, _first(device))
    initial = dict(_dropout_net().named_parameters())
    assert all(not torch.equal(one[k], initial[k]) for k in initial if k.endswith("weight"))  # it trained
    for k in initial:
        torch.testing.assert_close(one[k], reference[k], rtol=1e-4, atol=1e-5)


def test_layout_invariant_training_is_bitwise_on_one_gpu_and_on_2_and_4_replicas_sharing_it():
    check_layout_invariant_training("cuda")


def _invariant_worker(strategy, steps, device_type: str) -> dict[str, torch.Tensor]:
    """A worker's part of the training (``run_workers``); the pool's strategy switched to the mode
    as its constructor argument would."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the pool's workers are fresh: before cuBLAS
    torch.use_deterministic_algorithms(True)
    strategy.extended.layout_invariant = check_layout(INVARIANT, strategy.num_replicas_in_sync)
    return _invariant_training(strategy, steps, device_type)


def check_layout_invariant_training_on_processes(device: str, workers: int, per_worker: int) -> None:
    """``workers`` processes x ``per_worker`` replicas on ``device`` (gloo on the CUDA tensors where
    the workers share a GPU): bitwise the parameters of one device in this process."""
    steps = _invariant_data()
    with _deterministic():
        one = _invariant_training(cr.OneDeviceStrategy(_first(device), layout_invariant=INVARIANT), steps, device)
    outs = crt.run_workers(_invariant_worker, workers, per_worker, args=(steps, device), device=device)
    assert len(outs) == workers
    for got in outs:
        _assert_bitwise(one, got)


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers,per_worker", [(2, 1), (2, 2)], ids=["2x1", "2x2"])
def test_layout_invariant_training_on_processes_is_bitwise_as_on_one_gpu(workers, per_worker):
    check_layout_invariant_training_on_processes("cuda", workers, per_worker)


def _put(x):
    # put_ (accumulate=False) has no deterministic form, on the CPU or on a GPU; on GPUs so
    # have e.g. float cumsum, histc and a 4-d input's NLLLoss (torch.use_deterministic_algorithms)
    return torch.zeros(4, device=x.device).put_(torch.tensor([0], device=x.device), x[:1, 0])


def check_a_kernel_without_a_deterministic_form_fails_the_run(device: str) -> None:
    """The mode does not make a kernel deterministic: torch's error, raised in the replicas,
    is the run's error."""
    with _deterministic():
        strategy = cr.MirroredStrategy(devices=[_first(device)] * 2, layout_invariant=INVARIANT)
        batch = next(iter(strategy.distribute_dataset([torch.randn(8, 3)])))
        with pytest.raises(RuntimeError, match="put_ does not have a deterministic implementation"):
            strategy.run(_put, args=(batch,))


def test_a_kernel_without_a_deterministic_form_fails_the_run_on_cuda():
    check_a_kernel_without_a_deterministic_form_fails_the_run("cuda")


# ---------------------------------------------------------------------- fault tolerance
#
# tests/support/fault_points.py under `crossreplica launch`, as tests/elastic/test_fault_tolerance.py runs
# it, with every worker's replica on the GPUs (three workers share one GPU: gloo carries the CUDA
# tensors; NCCL cannot put two ranks on a GPU), in the layout-invariant mode, with dropout and
# torch.use_deterministic_algorithms(True).


def run_fault_points(out, device: str, how: str = "kill", lose_at_step: int = 0) -> subprocess.CompletedProcess:
    """3 workers of fault_points.py on ``device``; worker 1 lost in the forward pass of step
    ``lose_at_step`` (0: never) by ``how`` ("kill", or "rejoin": killed and started again to join)."""
    from harness import SUPPORT, subprocess_env

    cmd = [sys.executable, "-m", "crossreplica.cli", "launch", "--workers", "3", "--grace-seconds", "3",
           "--max-restarts", "1" if how == "rejoin" else "0", "--",
           sys.executable, os.path.join(SUPPORT, "fault_points.py"), str(out), "invariant",
           "forward" if lose_at_step else "none", how, str(lose_at_step)]
    env = {**subprocess_env(), "CROSSREPLICA_TIMEOUT": "30", "FAULT_POINTS_DEVICE": device,
           "FAULT_POINTS_DETERMINISTIC": "1", "FAULT_POINTS_DROPOUT": "0.2",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    # Its own session: a launcher past its time is killed with its workers (which hold the GPU).
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=80)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, stderr
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def check_a_lost_worker_regroups_and_ends_bitwise(tmp_path, device: str, how: str,
                                                  uninterrupted: dict[str, torch.Tensor]) -> None:
    out = tmp_path / f"{how}.pt"
    done = run_fault_points(out, device, how, lose_at_step=2)
    assert "worker 1 exited" in done.stderr, done.stderr
    assert done.stderr.count("lost workers [1] during step 2") == 2, done.stderr  # both survivors
    assert done.stderr.count("regrouped into 2 workers") == 2, done.stderr
    assert done.stderr.count("redoing step 2 on the survivors") == 2, done.stderr
    if how == "rejoin":  # worker 1, started again, joined as worker 3 and took the live state
        assert done.stderr.count("admitted joining workers [3] as step") == 2, done.stderr
        assert "worker 3: joined the running job as step" in done.stderr, done.stderr
        _assert_bitwise(torch.load(out), torch.load(f"{out}.worker3"))
    for survivor in (0, 2):  # each survivor finished, at the uninterrupted run's bits
        _assert_bitwise(uninterrupted, torch.load(f"{out}.worker{survivor}"))
    _assert_bitwise(uninterrupted, torch.load(out))


@pytest.fixture(scope="module")
def uninterrupted_on_cuda(tmp_path_factory):
    """fault_points.py's final parameters on the GPU when no worker is lost."""
    out = tmp_path_factory.mktemp("ft_cuda") / "uninterrupted.pt"
    run_fault_points(out, "cuda")
    return torch.load(out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["kill", "rejoin"])
def test_a_worker_lost_on_cuda_regroups_on_the_survivors_and_ends_bitwise_at_the_uninterrupted_run(
        tmp_path, uninterrupted_on_cuda, how):
    check_a_lost_worker_regroups_and_ends_bitwise(tmp_path, "cuda", how, uninterrupted_on_cuda)
