"""The CUDA suite: collectives, training and state on replicas placed on GPUs.

Every test runs the same replica function with its replicas on CUDA devices and
compares with the CPU run or with plain PyTorch computed here. Elementwise
reductions in replica order give the same bits on a GPU as on the CPU, so those
comparisons are exact; training compares within float tolerance (GPU matrix
products round differently from CPU ones). Several replicas share a GPU where
there are fewer GPUs than replicas. Worker processes use NCCL when each has a
GPU of its own, else gloo on the CUDA tensors (``crossreplica.testing``).

Skipped, with the reason, where no CUDA device is visible.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F

import crossreplica as cr
import crossreplica.testing as crt
from crossreplica.optim import CrossShardOptimizer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]

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


def _reference(make_opt, steps) -> list[torch.Tensor]:
    """Plain torch on one GPU, the global batch at once."""
    model = _net().cuda()
    opt = make_opt(model.parameters())
    for x, y in steps:
        opt.zero_grad()
        F.cross_entropy(model(x.cuda()), y.cuda()).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


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
    reference = _reference(lambda ps: torch.optim.Adam(ps, lr=1e-2), steps)
    for p, r in zip(outs[0], reference):
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
