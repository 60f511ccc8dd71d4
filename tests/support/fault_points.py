"""A fault-tolerant run that loses worker 1 at a chosen point inside a step.

Usage (under ``crossreplica launch``): fault_points.py OUT MODE POINT HOW STEP
MODE: invariant (the layout-invariant mode, 6 micro-batches) or default (overlapped
bucket reduction during backward). POINT: none (uninterrupted), forward, reduction
(in backward, with the later layers' buckets already
in flight), optimizer (after the gradients were
reduced, before the update), checkpoint (inside a ``cr.save`` between steps) or
regroup (in forward, and worker 2 dies too as the survivors regroup). HOW:
kill (``os._exit``), freeze (SIGSTOP) or rejoin (killed, then started again by
``crossreplica launch --max-restarts 1``: it joins at a step boundary, while the
survivors pace their steps until it is back). STEP counts from 1. The chief writes
the final parameters to OUT, every worker its own to OUT.workerN (N: its identity).
FAULT_POINTS_LOCAL_REPLICAS (default 1): in-process replicas per worker (the
layout-invariant mode then has 6 micro-batches per local replica).
FAULT_POINTS_DEVICE (default cpu): cpu, or cuda for the replicas on the GPUs, gloo
carrying the CUDA tensors (local replica i of the worker with LOCAL_RANK w on
cuda:(w * local + i) % GPUs; workers may share a GPU, which NCCL cannot).
FAULT_POINTS_DETERMINISTIC=1: ``torch.use_deterministic_algorithms(True)``, which a
bitwise comparison on CUDA needs (with CUBLAS_WORKSPACE_CONFIG=:4096:8 in the
environment, for cuBLAS). The saved parameters are CPU tensors either way.
FAULT_POINTS_SCHEDULER (default none): an LR scheduler per replica's optimizer (StepLR,
halving every 5 steps), part of the fault-tolerant state, stepped "inside" the step function
after the optimizer, or "outside" it, in cross-replica context after each ft.run (what the
layout-invariant mode needs: its step function runs once per micro-batch).
FAULT_POINTS_DROPOUT (default 0): a dropout layer of that probability after the first
hidden layer (in the layout-invariant mode each micro-batch draws its own masks, so
the step redone on fewer workers draws the same ones).
"""

import logging
import os
import signal
import sys
import time

import torch
from torch import nn

import crossreplica as cr

STEPS = 12


def lose_worker(ft: cr.FaultTolerance, point: str, how: str, at: str, step: int, lose_step: int) -> None:
    if (point == at or (point, at) == ("regroup", "forward")) and step == lose_step and ft.identity == 1:
        if how in ("kill", "rejoin"):
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    out, mode, point, how, lose_step = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    local = int(os.environ.get("FAULT_POINTS_LOCAL_REPLICAS", "1"))
    device = os.environ.get("FAULT_POINTS_DEVICE", "cpu")
    if os.environ.get("FAULT_POINTS_DETERMINISTIC") == "1":
        torch.use_deterministic_algorithms(True)
    devices = None  # gloo's default: the CPU
    if device == "cuda":
        first = int(os.environ.get("LOCAL_RANK", "0")) * local
        devices = [f"cuda:{(first + i) % torch.cuda.device_count()}" for i in range(local)]
    elif device != "cpu":
        raise ValueError(f"FAULT_POINTS_DEVICE must be cpu or cuda; got {device!r}")
    layout = cr.LayoutInvariant(micro_batches=6 * local, results="sum") if mode == "invariant" else None
    strategy = cr.MultiWorkerMirroredStrategy(local, backend="gloo", devices=devices, layout_invariant=layout)
    torch.manual_seed(0)
    dropout = float(os.environ.get("FAULT_POINTS_DROPOUT", "0"))
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []),
                        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    model = strategy.mirror(net)
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                                         overlap=layout is None, bytes_per_pack=1024),
                        args=(model,))
    scheds, where = None, os.environ.get("FAULT_POINTS_SCHEDULER", "none")
    if where != "none":  # the LR halves every 5 steps
        scheds = strategy.run(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5), args=(opts,))
    ft = cr.FaultTolerance(strategy, (model, opts) if scheds is None else (model, opts, scheds))
    if point == "regroup":
        regroup = type(strategy.extended).regroup

        def regroup_or_die(ext, *args, **kwargs):
            if ft.identity == 2:
                os._exit(1)
            return regroup(ext, *args, **kwargs)

        type(strategy.extended).regroup = regroup_or_die
    step = 0
    for copy in strategy.experimental_local_results(model):
        copy.register_forward_pre_hook(lambda m, args: lose_worker(ft, point, how, "forward", step, lose_step))
        copy[0].weight.register_hook(lambda g: lose_worker(ft, point, how, "reduction", step, lose_step))
    for opt in strategy.experimental_local_results(opts):
        opt.optimizer.register_step_pre_hook(lambda o, a, k: lose_worker(ft, point, how, "optimizer", step, lose_step))

    def train_step(model, opt, *rest):
        *sched, (x, y) = rest
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)  # every replica gets the same number of rows
        loss.backward()
        opt.step()
        for s in sched:
            s.step()
        return loss.detach()

    g = torch.Generator().manual_seed(1)
    deadline = time.monotonic() + 60
    for step in range(1, STEPS + 1):
        batch = (torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g))
        if step <= ft.completed:  # a worker that joined: the job did these steps before it came
            continue
        if how == "rejoin" and step > lose_step and len(ft.members) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)  # time for the restarted worker to start and ask to join
        ft.run(train_step, batch, args=(model, opts, scheds) if where == "inside" else (model, opts), reduce="sum")
        if where == "outside":
            for sched in strategy.experimental_local_results(scheds):
                sched.step()
        if step == 2:
            def save() -> None:
                lose_worker(ft, point, how, "checkpoint", 2, lose_step)
                cr.save(out + ".ckpt", {"model": model, "opt": opts})
            ft.call(save)
    copies = strategy.experimental_local_results(model)
    placed = {p.device.type for c in copies for p in (*c.parameters(), *c.buffers())}
    if placed != {device}:
        raise RuntimeError(f"the model's copies ended on {sorted(placed)}, not on {device}")
    params = {k: v.cpu() for k, v in copies[0].state_dict().items()}
    torch.save(params, f"{out}.worker{ft.identity}")
    if strategy.extended.input_pipeline_id == 0:
        torch.save(params, out)
    strategy.close()


if __name__ == "__main__":
    main()
