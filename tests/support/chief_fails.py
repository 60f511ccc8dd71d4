"""A chief that fails while the other worker waits in the next step's collective, and leaves.

Usage (launched by hand: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, so rank 0 serves
the store, which goes when it exits): chief_fails.py HOW REPLICAS_PER_WORKER DIRECTORY
HOW: save (the chief alone calls ``cr.save`` after step 2, DDP's ``if rank == 0:``
habit) or raise (the chief's own code raises after step 2, outside any collective);
DIRECTORY: where the checkpoint would go.
The chief's error is left uncaught, as a script's would be; the other worker prints
``worker <rank> failed after <seconds>s: <type>: <message>`` on stderr and exits 1.
"""

import os
import sys
import time

import torch

import crossreplica as cr


def main() -> None:
    how, per_worker, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    strategy = cr.MultiWorkerMirroredStrategy(per_worker)
    chief = strategy.extended.is_chief
    path = os.path.join(directory, "ckpt.pt")
    with strategy.scope():
        model = strategy.mirror(torch.nn.Linear(4, 2))
        opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)),
                            args=(model,))

    def step(m: torch.nn.Module, opt: cr.CrossShardOptimizer) -> torch.Tensor:
        opt.zero_grad()
        loss = m(torch.ones(3, 4)).sum()
        loss.backward()
        opt.step()
        return cr.all_reduce(loss.detach(), "sum")

    started = time.monotonic()
    try:
        for i in range(1, 5):
            strategy.run(step, args=(model, opts))
            if chief and i == 2:
                if how == "save":
                    cr.save(path, {"model": model}, strategy=strategy)
                else:
                    raise ValueError("the chief's own bug between steps")
    except Exception as e:
        if chief:
            raise  # uncaught: the process leaves on it
        print(f"worker {strategy.extended.worker_rank} failed after {time.monotonic() - started:.2f}s: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
