"""A GPT-style DistributedDataParallel training script, ported to crossreplica.

The DDP original is the shape of nanoGPT's ``train.py``: a small causal transformer,
``DDP(model)``, gradient accumulation with ``no_sync``, gradient clipping, a warm-up +
cosine learning-rate schedule set on ``optimizer.param_groups``, ``torch.compile``, and
checkpoints written by the master process and resumed from, per-rank seeds (for dropout).
Each of those habits has a crossreplica counterpart (docs/ddp_porting.md); the comments marked ``DDP:`` say what the
line replaces.

Run it (the data are random tokens from a fixed Markov chain, so the loss falls towards
log 2 ~ 0.69 and nothing is downloaded)::

    python examples/ddp_script.py                                   # 2 in-process replicas
    python examples/ddp_script.py --replicas 4 --compile
    python examples/ddp_script.py --out-dir /tmp/gpt --max-iters 10            # checkpoints
    python examples/ddp_script.py --out-dir /tmp/gpt --max-iters 20 --resume   # continues
    torchrun --standalone --nproc-per-node=2 examples/ddp_script.py --strategy multi_worker

``reference(args)`` trains the same model on one device with plain PyTorch on the whole
global batches; ``--compare`` prints the largest parameter difference against it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import crossreplica as cr

# ---------------------------------------------------------------------------- the model


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = False  # nanoGPT's default: no biases in Linear and LayerNorm
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def configure_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """nanoGPT's AdamW: weight decay on matrices and embeddings, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95))


def get_lr(it: int, args: argparse.Namespace) -> float:
    """nanoGPT's schedule: linear warm-up, cosine decay to min_lr at lr_decay_iters."""
    decay_iters = args.lr_decay_iters or args.max_iters
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / max(1, decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr)


# ---------------------------------------------------------------------------- the data


def make_tokens(args: argparse.Namespace, length: int = 4096) -> torch.Tensor:
    """A token stream from a random Markov chain: each token has two equally likely successors."""
    g = torch.Generator().manual_seed(args.seed)
    successors = torch.randint(args.vocab_size, (args.vocab_size, 2), generator=g)
    coins = torch.randint(2, (length,), generator=g)
    tokens = torch.empty(length, dtype=torch.long)
    tokens[0] = 0
    for i in range(1, length):
        tokens[i] = successors[tokens[i - 1], coins[i]]
    return tokens


def get_batch(tokens: torch.Tensor, it: int, micro: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Global micro-batch ``micro`` of iteration ``it``: the same on every worker and after a resume."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + it * 101 + micro)
    ix = torch.randint(len(tokens) - args.block_size - 1, (args.batch_size,), generator=g)
    x = torch.stack([tokens[i:i + args.block_size] for i in ix.tolist()])
    y = torch.stack([tokens[i + 1:i + 1 + args.block_size] for i in ix.tolist()])
    return x, y


def iterations(tokens: torch.Tensor, start: int, args: argparse.Namespace):
    """Per iteration, its grad_accum global micro-batches (one nest: every tensor is split
    along dim 0 between the replicas by distribute_dataset)."""
    for it in range(start, args.max_iters):
        yield [get_batch(tokens, it, m, args) for m in range(args.grad_accum)]


# ---------------------------------------------------------------------------- training


def train_step(model: nn.Module, opt: cr.CrossShardOptimizer, micro_batches: list, lr: float,
               grad_clip: float) -> torch.Tensor:
    """One iteration on this replica's rows of each micro-batch."""
    for group in opt.param_groups:  # DDP: the same loop over the one optimizer's groups
        group["lr"] = lr
    accum = len(micro_batches)
    total = torch.zeros(())
    for i, (x, y) in enumerate(micro_batches):
        last = i == accum - 1
        # DDP: model.no_sync() (or require_backward_grad_sync). With overlap=True the
        # optimizer reduces buckets during backward, so every backward but the last skips it.
        with contextlib.nullcontext() if last else opt.no_sync():
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)) / accum
            loss.backward()
        total += loss.detach()
    if grad_clip:
        opt.synchronize()  # no-op work with overlap=True; makes the clip see the global gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def make_strategy(args: argparse.Namespace) -> cr.Strategy:
    if args.strategy == "mirrored":
        return cr.MirroredStrategy(args.replicas or 2)
    if args.strategy == "multi_worker":  # DDP: dist.init_process_group(...) from torchrun's environment
        return cr.MultiWorkerMirroredStrategy(replicas_per_worker=args.replicas or 1)
    return cr.OneDeviceStrategy()


def main(argv: list[str] | None = None, strategy: cr.Strategy | None = None) -> dict[str, Any]:
    """Trains; returns {"params": the final state dict, "losses": one global loss per iteration
    run here, "start": the iteration it started from}. ``strategy``: use this one instead of
    ``--strategy`` (a test's worker processes pass theirs)."""
    args = parse_args(argv)
    strategy = strategy or make_strategy(args)
    chief = strategy.extended.is_chief  # DDP: master_process = rank == 0
    # DDP: torch.manual_seed(1337 + rank). Once is enough: each replica draws (dropout) from its
    # own stream, derived from this seed and its replica id (docs/fidelity.md, "Random numbers").
    torch.manual_seed(args.seed)
    cfg = GPTConfig(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, args.bias, args.dropout)
    with strategy.scope():
        model = strategy.mirror(GPT(cfg))  # DDP: DDP(model): one copy per replica, replica 0's values
        opts = strategy.run(lambda m: cr.CrossShardOptimizer(configure_optimizer(m, args), overlap=args.overlap),
                            args=(model,))
        # The caller's generator too: each strategy.run draws the replicas' random base from it,
        # so a resumed run draws the dropout masks the uninterrupted one would.
        state = {"model": model, "opt": opts, "rng": torch.default_generator, "iter": 0}
        path = os.path.join(args.out_dir, "ckpt.pt") if args.out_dir else None
        start = 0
        if args.resume:  # DDP: torch.load + load_state_dict; cr.load is a collective: every worker
            start = cr.load(path, into=state)["iter"]
        step_model = model
        if args.compile:  # DDP: model = torch.compile(model) before DDP(...)
            step_model = strategy.run(lambda m: torch.compile(m, backend=args.compile_backend), args=(model,))
        tokens = make_tokens(args)
        losses = []
        batches = strategy.distribute_dataset(iterations(tokens, start, args))
        for it, micro_batches in enumerate(batches, start=start):
            per_replica = strategy.run(train_step, args=(step_model, opts, micro_batches, get_lr(it, args),
                                                         args.grad_clip))
            loss = strategy.reduce("mean", per_replica).item()  # every worker (a collective)
            losses.append(loss)
            if chief and not args.quiet and (it % args.log_interval == 0 or it == args.max_iters - 1):
                print(f"iter {it}: loss {loss:.4f}, lr {get_lr(it, args):.2e}")
            if path and ((it + 1) % args.save_interval == 0 or it + 1 == args.max_iters):
                os.makedirs(args.out_dir, exist_ok=True)
                cr.save(path, {**state, "iter": it + 1})  # DDP: `if master_process: torch.save(...)`
    params = {k: v.detach().clone() for k, v in strategy.experimental_local_results(model)[0].state_dict().items()}
    result = {"params": params, "losses": losses, "start": start}
    if args.save_params and chief:
        torch.save(result, args.save_params)
    if args.compare and chief:
        ref = reference(args)
        diff = max((params[k] - ref["params"][k]).abs().max().item() for k in params)
        print(f"largest parameter difference against plain PyTorch on one device: {diff:.3g}")
    return result


def worker_main(strategy: cr.Strategy, argv: list[str]) -> dict[str, Any]:
    """``main`` on a worker process's strategy (crossreplica.testing.WorkerPool's ``mode="main"``)."""
    return main(argv, strategy=strategy)


def reference(args: argparse.Namespace | list[str] | None = None, num_replicas: int | None = None
              ) -> dict[str, Any]:
    """The same training on one device with plain PyTorch (from iteration 0, without
    checkpoints or compilation).

    Without dropout, on the whole global micro-batches. With ``--dropout``, the masks must be
    those the replicas draw, so each replica's rows run on their own: replica ``r``'s rows of an
    iteration after ``torch.manual_seed(base + r)``, where ``base`` is the one number each
    ``strategy.run`` draws from the caller's generator (docs/fidelity.md, "Random numbers").
    ``num_replicas``: default ``--replicas`` (2) for mirrored, 1 for one_device."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    if num_replicas is None:
        num_replicas = 1 if args.strategy == "one_device" else args.replicas or 2
    torch.manual_seed(args.seed)
    cfg = GPTConfig(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, args.bias, args.dropout)
    model = GPT(cfg)
    opt = configure_optimizer(model, args)
    caller = torch.get_rng_state()

    def run_draw() -> int:  # what one strategy.run takes from the caller's generator
        nonlocal caller
        torch.set_rng_state(caller)
        base = int(torch.randint(0, 2**63 - 1, ()).item())
        caller = torch.get_rng_state()
        return base

    run_draw()  # main's strategy.run that builds the optimizers
    if args.compile:
        run_draw()  # and the one that compiles (the reference itself does not compile)
    tokens = make_tokens(args)
    losses = []
    for it, micro_batches in enumerate(iterations(tokens, 0, args)):
        for group in opt.param_groups:
            group["lr"] = get_lr(it, args)
        total = torch.zeros(())
        if args.dropout:  # each replica's rows on the replica's random stream
            base = run_draw()
            for r in range(num_replicas):
                torch.manual_seed(base + r)
                for x, y in micro_batches:
                    xr, yr = x.tensor_split(num_replicas)[r], y.tensor_split(num_replicas)[r]
                    logits = model(xr)
                    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), yr.view(-1)) / args.grad_accum
                    (loss / num_replicas).backward()  # CrossShardOptimizer's mean over the replicas
                    total += loss.detach() / num_replicas
        else:
            for x, y in micro_batches:
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)) / args.grad_accum
                loss.backward()
                total += loss.detach()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses, "start": 0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=["mirrored", "multi_worker", "one_device"], default="mirrored")
    p.add_argument("--replicas", type=int, default=None,
                   help="mirrored: in-process replicas (default 2); multi_worker: replicas per process (default 1)")
    p.add_argument("--max-iters", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="rows of one global micro-batch")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--min-lr", type=float, default=1e-3)
    p.add_argument("--warmup-iters", type=int, default=5)
    p.add_argument("--lr-decay-iters", type=int, default=None, help="default: --max-iters")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--overlap", action="store_true", help="reduce gradient buckets during backward, as DDP does")
    p.add_argument("--vocab-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--bias", action="store_true",
                   help="biases in Linear and LayerNorm, as GPT-2 (the attention's key bias then has a zero "
                        "gradient, whose rounding noise AdamW amplifies: replicas and one device drift apart there)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out-dir", default=None, help="checkpoint directory (ckpt.pt); none: no checkpoints")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt")
    p.add_argument("--compile", action="store_true", help="torch.compile each replica's copy")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend (aot_eager: no code generation)")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--compare", action="store_true", help="also train on one device with plain PyTorch and compare")
    p.add_argument("--save-params", default=None, help="torch.save the result here (on the chief)")
    args = p.parse_args(argv)
    if args.resume and not args.out_dir:
        p.error("--resume needs --out-dir")
    return args


if __name__ == "__main__":
    main(sys.argv[1:])
