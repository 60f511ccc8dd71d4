"""Horovod's spellings on CrossShardOptimizer and mirrored models, against plain torch.

* ``opt.skip_synchronize()``: Horovod's ``synchronize(); clip; with skip_synchronize():
  step()`` and its mixed-precision loop (``synchronize(); scaler.unscale_(opt); clip;
  with skip_synchronize(): scaler.step(opt)``) train bitwise as plain torch does with the
  mean of the replicas' gradients; a step inside the context without a synchronize since
  the last step is an error.
* ``backward_passes_per_step=k``: k backward passes accumulate locally, one reduction
  (overlapped buckets start in the k-th pass only), one step; a pass beyond the k-th is
  an error, as in Horovod.
* ``model.train()`` / ``model.eval()`` on a mirrored model in cross-replica context set
  every copy and draw nothing from the random streams.

The plain-torch references compute each replica's gradients on its own rows (a copy of the
model per replica) and combine them as the engine reduces: summed in replica order, then
divided by the replica count; that is what makes the comparisons bitwise.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from plain_torch import replica_mean

import crossreplica as cr
from crossreplica.optim import CrossShardOptimizer
from crossreplica.optim import overlap as overlap_module

ROWS = 4          # rows per replica
STEPS = 3
MAX_NORM = 0.05   # small enough that clipping changes the gradients
SCALER = {"init_scale": 2.0 ** 8, "growth_interval": 2}
INF_STEP = 1      # the AMP tests make one replica's loss inf on this step


def _net() -> nn.Module:
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():  # private generators: replica threads share torch's global one
        for i, p in enumerate(net.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return net


def _batch(rid: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rid)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _set_mean_grads(model: nn.Module, per_replica: list[list[torch.Tensor]]) -> None:
    for p, *gs in zip(model.parameters(), *per_replica):
        p.grad = replica_mean(gs)


def _replica_grads(model: nn.Module, loss_fn) -> list[torch.Tensor]:
    """The gradients one replica computes: ``loss_fn(copy)`` runs its backward passes."""
    c = copy.deepcopy(model)
    loss_fn(c)
    return [p.grad.clone() for p in c.parameters()]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"parameter {i}: largest difference {(a - b).abs().max().item():.3g}"


# ------------------------------------------------------------------------- skip_synchronize


def _clip_loop(overlap: bool, form: str) -> list[list[torch.Tensor]]:
    """Horovod's clipping loop in a replica; ``form``: "skip" (Horovod's), "plain" (step after
    synchronize without the context: crossreplica does not reduce again either)."""
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5), overlap=overlap,
                              bytes_per_pack=256)
    out = []
    for step in range(STEPS):
        x, y = _batch(rid, step)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
        if form == "skip":
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        out.append(_params(m))
    return out


def _clip_reference(n: int) -> list[list[torch.Tensor]]:
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)
    out = []
    for step in range(STEPS):
        def loss(c, r=None, step=step):
            x, y = _batch(r, step)
            F.cross_entropy(c(x), y).backward()
        _set_mean_grads(m, [_replica_grads(m, lambda c, r=r: loss(c, r)) for r in range(n)])
        torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
        opt.step()
        out.append(_params(m))
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
@pytest.mark.parametrize("n", [2, 4])
def test_synchronize_clip_skip_synchronize_step_is_plain_torch(run_replicas, n, overlap):
    out = run_replicas(_clip_loop, n, [overlap] * n, ["skip"] * n)
    ref = _clip_reference(n)
    for records in out:
        for got, want in zip(records, ref):
            _assert_equal(got, want)
    assert not torch.equal(ref[0][0], _params(_net())[0])  # it trained


def test_step_after_synchronize_reduces_once_with_or_without_the_context():
    strategy = cr.MirroredStrategy(2)
    skip, plain = (strategy.experimental_local_results(strategy.run(_clip_loop, args=(False, form)))
                   for form in ("skip", "plain"))
    for a, b in zip(skip[0], plain[0]):
        _assert_equal(a, b)


def _misused_skip(what: str) -> bool:
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5))
    x, y = _batch(cr.replica_id(), 0)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scaler.scale(F.cross_entropy(m(x), y)).backward()  # only the last case steps through the scaler
    if what == "no_synchronize":
        with opt.skip_synchronize():
            opt.step()
    elif what == "second_step":
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
            opt.step()  # no synchronize since the first
    elif what == "after_zero_grad":
        opt.synchronize()
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        with opt.skip_synchronize():
            opt.step()
    elif what == "closure":
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step(lambda: F.cross_entropy(m(x), y))
    elif what == "weight":
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step(weight=x.shape[0])
    elif what == "scaler_no_synchronize":
        with opt.skip_synchronize():
            scaler.step(opt)
    return True


@pytest.mark.parametrize("what, error, match", [
    ("no_synchronize", RuntimeError, r"skip_synchronize\(\) without opt\.synchronize\(\) since the last step"),
    ("second_step", RuntimeError, r"skip_synchronize\(\) without opt\.synchronize\(\) since the last step"),
    ("after_zero_grad", RuntimeError, r"skip_synchronize\(\) without opt\.synchronize\(\)"),
    ("scaler_no_synchronize", RuntimeError, r"skip_synchronize\(\) without opt\.synchronize\(\)"),
    ("closure", ValueError, r"step\(closure\) inside opt\.skip_synchronize\(\).*outside skip_synchronize"),
    ("weight", ValueError, r"step\(weight=4\) inside opt\.skip_synchronize\(\).*synchronize\(weight=\.\.\.\)"),
])
@pytest.mark.parametrize("n", [1, 2])
def test_skip_synchronize_misuse_is_a_clear_error(what, error, match, n):
    """On every replica, and on one replica too (the same script must fail the same way
    before it runs on several)."""
    strategy = cr.MirroredStrategy(n)
    with pytest.raises(error, match=match):
        strategy.run(_misused_skip, args=(what,))


def test_skip_synchronize_restores_itself():
    opt = CrossShardOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1))
    with opt.skip_synchronize():
        with opt.skip_synchronize():
            assert opt._skipping
        assert opt._skipping
        with pytest.raises(KeyError):
            with opt.skip_synchronize():
                raise KeyError("out")
        assert opt._skipping
    assert not opt._skipping
    assert not copy.deepcopy(opt)._skipping


# ------------------------------------------------------------------- the mixed-precision loop


def _amp_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, poisoned: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(m(x), y)
    return loss * float("inf") if poisoned else loss


def _amp_loop(dtype: torch.dtype, scaler_on: bool) -> list[dict]:
    """Horovod's pytorch_mnist mixed-precision loop, with clipping, in a replica."""
    rid, n = cr.replica_id(), cr.num_replicas()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5))
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_on, **SCALER)
    out = []
    for step in range(STEPS + 1):
        x, y = _batch(rid, step)
        opt.zero_grad()
        scaler.scale(_amp_loss(m, x, y, dtype, scaler_on and (step, rid) == (INF_STEP, n - 1))).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        out.append({"params": _params(m), "scale": scaler.get_scale()})
    return out


def _amp_reference(n: int, dtype: torch.dtype, scaler_on: bool) -> list[dict]:
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_on, **SCALER)
    out = []
    for step in range(STEPS + 1):
        def replica(c, r, step=step):
            x, y = _batch(r, step)
            scaler.scale(_amp_loss(c, x, y, dtype, scaler_on and (step, r) == (INF_STEP, n - 1))).backward()
        opt.zero_grad()
        _set_mean_grads(m, [_replica_grads(m, lambda c, r=r: replica(c, r)) for r in range(n)])
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        out.append({"params": _params(m), "scale": scaler.get_scale()})
    return out


@pytest.mark.parametrize("scaler_on", [True, False], ids=["scaler", "scaler_disabled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n", [2, 3])  # 3: a second reduction of the reduced gradients would round differently
def test_horovod_mixed_precision_loop_is_plain_torch(n, dtype, scaler_on):
    strategy = cr.MirroredStrategy(n)
    out = strategy.experimental_local_results(strategy.run(_amp_loop, args=(dtype, scaler_on)))
    ref = _amp_reference(n, dtype, scaler_on)
    for records in out:
        for step, (got, want) in enumerate(zip(records, ref)):
            _assert_equal(got["params"], want["params"])
            assert got["scale"] == want["scale"], step
    if scaler_on:  # the inf on one replica: every replica skipped that step, as the reference did
        _assert_equal(out[0][INF_STEP]["params"], out[0][INF_STEP - 1]["params"])
        assert out[0][INF_STEP]["scale"] == out[0][INF_STEP - 1]["scale"] / 2
    assert not torch.equal(ref[-1]["params"][0], ref[0]["params"][0])  # it trained


# ------------------------------------------------------------------- backward_passes_per_step

PASSES = 3


def _accumulating(overlap: bool, passes_run: int, steps: int) -> dict:
    """``backward_passes_per_step=PASSES``; each step runs ``passes_run`` backward passes."""
    rid = cr.replica_id()
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5), overlap=overlap,
                              bytes_per_pack=256, backward_passes_per_step=PASSES)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes_run):
            x, y = _batch(rid, step, micro)
            (F.cross_entropy(m(x), y) / passes_run).backward()
        opt.step()
    return {"params": _params(m)}


def _accumulating_reference(n: int, passes_run: int, steps: int) -> list[torch.Tensor]:
    """Plain torch: each replica accumulates its passes, then the mean over the replicas."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)
    for step in range(steps):
        def replica(c, r, step=step):
            for micro in range(passes_run):
                x, y = _batch(r, step, micro)
                (F.cross_entropy(c(x), y) / passes_run).backward()
        opt.zero_grad()
        _set_mean_grads(m, [_replica_grads(m, lambda c, r=r: replica(c, r)) for r in range(n)])
        opt.step()
    return _params(m)


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
@pytest.mark.parametrize("n", [2, 4])
def test_backward_passes_per_step_is_plain_torch_accumulation(run_replicas, n, overlap):
    out = run_replicas(_accumulating, n, [overlap] * n, [PASSES] * n, [2] * n)
    ref = _accumulating_reference(n, PASSES, 2)
    for result in out:
        _assert_equal(result["params"], ref)


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_fewer_passes_than_declared_reduce_what_accumulated(overlap):
    """Horovod's step() after fewer passes (an epoch's short tail) reduces what is there."""
    strategy = cr.MirroredStrategy(2)
    out = strategy.experimental_local_results(strategy.run(_accumulating, args=(overlap, PASSES - 1, 1)))
    ref = _accumulating_reference(2, PASSES - 1, 1)
    for result in out:
        _assert_equal(result["params"], ref)


def test_overlapped_buckets_start_in_the_last_pass_only(monkeypatch):
    """Passes before the k-th run as under no_sync: no bucket starts until the k-th pass,
    whose end starts every bucket once (one reduction per step)."""
    starts: list[int] = []
    passes_seen: list[int] = []
    real = overlap_module.start_on_wire

    def counting(*args, **kwargs):
        starts.append(cr.replica_id())
        return real(*args, **kwargs)

    monkeypatch.setattr(overlap_module, "start_on_wire", counting)

    def run(passes_per_step):
        m = _net()
        opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), overlap=True, bytes_per_pack=256,
                                  backward_passes_per_step=passes_per_step)
        buckets = opt._overlapped.num_buckets
        for step in range(2):
            opt.zero_grad()
            for micro in range(PASSES):
                before = len(starts)
                x, y = _batch(cr.replica_id(), step, micro)
                F.cross_entropy(m(x), y).backward()
                passes_seen.append(len(starts) - before)
            opt.step()
        return buckets

    strategy = cr.MirroredStrategy(2)
    buckets = strategy.experimental_local_results(strategy.run(run, args=(PASSES,)))[0]
    assert buckets > 1
    assert len(starts) == 2 * 2 * buckets  # 2 replicas x 2 steps, each bucket once
    starts.clear()
    strategy.run(run, args=(1,))  # the default: every backward pass reduces
    assert len(starts) == 2 * 2 * PASSES * buckets


def _too_many_passes(overlap: bool, reset: str) -> bool:
    m = _net()
    opt = CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), overlap=overlap,
                              backward_passes_per_step=2)
    x, y = _batch(cr.replica_id(), 0)
    F.cross_entropy(m(x), y).backward()
    F.cross_entropy(m(x), y).backward()
    if reset == "zero_grad":
        opt.zero_grad()
    elif reset == "synchronize":
        opt.synchronize()
    elif reset == "step":
        opt.step()
    F.cross_entropy(m(x), y).backward()  # the third since the last reset: an error without one
    return True


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_a_pass_beyond_backward_passes_per_step_is_an_error(overlap):
    strategy = cr.MirroredStrategy(2)
    with pytest.raises(cr.ReplicaError, match=r"backward pass 3 since the last step\(\).*"
                                              r"backward_passes_per_step=2.*raise backward_passes_per_step"):
        strategy.run(_too_many_passes, args=(overlap, "none"))
    for reset in ("zero_grad", "synchronize", "step"):
        assert strategy.run(_too_many_passes, args=(overlap, reset)) is True  # counting started again


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2", None])
def test_backward_passes_per_step_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=rf"backward_passes_per_step must be .*got {value!r}"
                       if not isinstance(value, str) else r"backward_passes_per_step must be .*got '2'"):
        CrossShardOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1), backward_passes_per_step=value)


def test_backward_passes_per_step_survives_copies_and_shows_in_repr():
    opt = CrossShardOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1), backward_passes_per_step=4)
    assert opt.backward_passes_per_step == 4
    assert "backward_passes_per_step=4" in repr(opt)
    assert "backward_passes_per_step" not in repr(CrossShardOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1)))
    assert copy.deepcopy(opt).backward_passes_per_step == 4
    assert pickle.loads(pickle.dumps(opt)).backward_passes_per_step == 4


# ------------------------------------------------------- mode switches of a mirrored model


class _DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _dropout_step(model: nn.Module, opt: CrossShardOptimizer, batch) -> torch.Tensor:
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _evaluate(model: nn.Module, batch) -> torch.Tensor:
    x, _ = batch
    return model(x).detach()


class _Caller:
    """Plain torch's view of the caller's generator: each strategy.run draws one number
    from it (the run's base); replica r then draws as after torch.manual_seed(base + r)."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.state = torch.get_rng_state()

    def run_base(self) -> int:
        torch.set_rng_state(self.state)
        base = int(torch.randint(0, 2**63 - 1, ()).item())
        self.state = torch.get_rng_state()
        return base


def test_train_and_eval_in_cross_replica_context_set_every_copy_and_draw_nothing():
    """Train, evaluate in eval mode, train again: bitwise a plain-torch run whose only random
    draws are each strategy.run's base and each replica's dropout masks."""
    n = 2
    torch.manual_seed(0)
    net = _DropoutNet()
    batches = [(torch.randn(n * ROWS, 6), torch.randint(0, 3, (n * ROWS,))) for _ in range(4)]
    reference = copy.deepcopy(net)

    strategy = cr.MirroredStrategy(n)
    torch.manual_seed(1)
    model = strategy.mirror(net)
    opts = strategy.run(lambda m: CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.5)), args=(model,))
    parts = list(strategy.distribute_dataset(batches))
    strategy.run(_dropout_step, args=(model, opts, parts[0]))
    rng = torch.get_rng_state()
    assert model.eval() is model
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn
    assert not any(m.training for c in model.values for m in c.modules())
    assert model.training is False
    evaluated = strategy.experimental_local_results(strategy.run(_evaluate, args=(model, parts[1])))
    rng = torch.get_rng_state()
    assert model.train() is model
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(m.training for c in model.values for m in c.modules()) and model.training is True
    for part in parts[2:]:
        strategy.run(_dropout_step, args=(model, opts, part))

    caller = _Caller(1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)

    def ref_step(batch) -> None:
        base = caller.run_base()
        grads = []
        for r in range(n):
            torch.manual_seed(base + r)
            x, y = (t.tensor_split(n)[r] for t in batch)
            grads.append(_replica_grads(reference, lambda c, x=x, y=y: F.cross_entropy(c(x), y).backward()))
        _set_mean_grads(reference, grads)
        ref_opt.step()

    caller.run_base()  # the run that built the optimizers
    ref_step(batches[0])
    reference.eval()
    base = caller.run_base()
    for r in range(n):
        torch.manual_seed(base + r)
        assert torch.equal(evaluated[r], reference(batches[1][0].tensor_split(n)[r]).detach())
    reference.train()
    for batch in batches[2:]:
        ref_step(batch)
    for copy_ in model.values:
        _assert_equal(_params(copy_), _params(reference))


def test_a_run_that_switches_modes_draws_a_base_where_the_switch_draws_none():
    """Why the switch belongs in cross-replica context: strategy.run draws the run's base."""
    strategy = cr.MirroredStrategy(2)
    model = strategy.mirror(_DropoutNet())
    torch.manual_seed(3)
    strategy.run(lambda m: m.eval(), args=(model,))
    after_run = torch.randint(0, 1000, (4,))
    torch.manual_seed(3)
    model.eval()
    after_switch = torch.randint(0, 1000, (4,))
    torch.manual_seed(3)
    assert torch.equal(after_switch, torch.randint(0, 1000, (4,)))
    assert not torch.equal(after_run, after_switch)


def test_training_reads_the_copies_common_mode_and_names_a_disagreement():
    strategy = cr.MirroredStrategy(2)
    model = strategy.mirror(_DropoutNet())
    model.values[1].eval()  # one copy switched alone
    with pytest.raises(cr.ReplicaContextError, match=r"different modes \(training: \[True, False\]\).*"
                                                     r"call value\.train\(\) or value\.eval\(\)"):
        model.training  # noqa: B018
    assert getattr(model, "training", "no single mode") == "no single mode"  # an AttributeError too
    model.train(False)
    assert model.training is False
    with pytest.raises(ValueError, match="training mode is expected to be boolean"):
        model.train("yes")  # torch's own check, before any copy changes


def test_mode_switch_of_per_replica_modules_and_inside_a_replica():
    strategy = cr.MirroredStrategy(2)
    model = strategy.mirror(_DropoutNet())
    wrapped = strategy.run(lambda m: nn.Sequential(m), args=(model,))  # a PerReplica of modules
    assert isinstance(wrapped, cr.PerReplica)
    wrapped.eval()
    assert not any(c.training for c in model.values)
    # Inside a replica function the value is the replica's own copy, as before.
    modes = strategy.run(lambda m: m.train(cr.replica_id() == 0).training, args=(model,))
    assert strategy.experimental_local_results(modes) == (True, False)
    assert [c.training for c in model.values] == [True, False]


def test_values_that_are_not_modules_have_no_mode_switch():
    class Runner:
        training = True

        def train(self) -> None:
            raise AssertionError("not called in cross-replica context")

    value = cr.Mirrored([Runner(), Runner()])
    with pytest.raises(cr.ReplicaContextError, match="no single value in cross-replica context"):
        value.train()
    with pytest.raises(cr.ReplicaContextError, match="no single value in cross-replica context"):
        cr.Mirrored([_DropoutNet(), Runner()]).eval()
