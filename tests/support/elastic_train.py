"""A tiny training run for the restart test: checkpoints every step, optionally dies once.

Usage (under torchrun): elastic_train.py OUT_DIR TOTAL_STEPS KILL_AT_STEP
On its first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1 kills itself in the
middle of step KILL_AT_STEP (before the gradient all-reduce); torchrun
--max-restarts restarts every worker, which resume from the last checkpoint.
"""

import os
import sys

import torch

import crossreplica as cr


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True) + 0.5


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def reference(total: int, replicas: int) -> dict:
    """The uninterrupted run, in plain torch: mean of the replicas' gradients, then SGD."""
    model, opt = make_model()
    for step in range(total):
        grads = []
        for r in range(replicas):
            model.zero_grad()
            x, y = batch(step, r)
            ((model(x) - y) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).sum(0) / replicas
        opt.step()
    return model.state_dict()


def main() -> None:
    out_dir, total, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    strategy = cr.MultiWorkerMirroredStrategy(timeout_seconds=30)
    rank = strategy.extended.worker_rank
    model, opt = make_model()
    ckpt = os.path.join(out_dir, "ckpt.pt")
    step = 0
    try:
        state = cr.load(ckpt, strategy=strategy)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    except FileNotFoundError:
        pass
    log = open(os.path.join(out_dir, f"log{rank}.txt"), "a")
    log.write(f"attempt {attempt} starts at step {step}\n")
    log.flush()

    def train_step(step: int) -> torch.Tensor:
        x, y = batch(step, cr.replica_id())
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if attempt == 0 and step == kill_at and cr.replica_id() == 1:
            os._exit(17)  # a crash in the middle of a step
        for p in model.parameters():
            p.grad = cr.all_reduce(p.grad, "mean")
        opt.step()
        return loss.detach()

    while step < total:
        strategy.run(train_step, (step,))
        step += 1
        cr.save(ckpt, {"model": model, "opt": opt, "step": step})  # outside any scope: still chief-only
        log.write(f"attempt {attempt} finished step {step - 1}\n")
        log.flush()
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, "final.pt"))
    log.close()
    strategy.close()


if __name__ == "__main__":
    main()
