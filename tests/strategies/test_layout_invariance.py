"""The layout-invariant mode: the same bits on one device and on any number of replicas.

Every comparison is ``torch.equal`` of the final parameters and buffers against the
same training on ``OneDeviceStrategy`` (which runs every micro-batch itself), with a
control in the default mode showing that the layouts otherwise differ.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from plain_torch import cross_entropy, one_device_training
from torch import nn

import crossreplica as cr
from crossreplica.tree_sum import TreeStack, tree_combine, tree_nodes

# ---------------------------------------------------------------------------- the tree sum


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 24])
def test_every_contiguous_split_gives_the_same_bits(n):
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(257, generator=g) * 10.0 ** torch.randint(-6, 6, (257,), generator=g) for _ in range(n)]
    whole = _split_sum(xs, [n])
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, n), k) for k in range(min(n, 4))):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
        assert torch.equal(_split_sum(xs, sizes), whole), sizes
    # a different order of the same float additions would differ: the tree is what keeps it
    sequential = xs[0].clone()
    for x in xs[1:]:
        sequential += x
    exact = torch.stack(xs).double().sum(0)
    bound = max(1, (n - 1).bit_length()) * 2.0 ** -24 * torch.stack(xs).double().abs().sum(0)
    assert torch.all((whole.double() - exact).abs() <= bound + 1e-300)


def _split_sum(xs, sizes):
    nodes, lo = {}, 0
    for size in sizes:
        stack = TreeStack()
        for i in range(lo, lo + size):
            stack.push(i, [xs[i].clone()])
        assert [node for node, _ in stack.nodes] == tree_nodes(lo, lo + size)
        nodes.update({node: value[0] for node, value in stack.nodes})
        lo += size
    return tree_combine(nodes, len(xs))


def test_tree_nodes_are_aligned_and_few():
    for start in range(0, 40):
        for stop in range(start, 41):
            nodes = tree_nodes(start, stop)
            assert sum(hi - lo for lo, hi in nodes) == stop - start
            assert all((hi - lo) & (hi - lo - 1) == 0 and lo % (hi - lo) == 0 for lo, hi in nodes)
            assert len(nodes) <= 2 * max(1, (stop - start + 1).bit_length())


def test_tree_combine_names_a_missing_summand():
    with pytest.raises(ValueError, match="summand 2 of 4"):
        tree_combine({(0, 2): torch.ones(1), (3, 4): torch.ones(1)}, 4)


# ---------------------------------------------------------------------------- training


class _Net(nn.Module):
    """An MLP with BatchNorm (buffers) and dropout (random streams)."""

    def __init__(self, bn: bool = True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 3)
        self.bn = nn.BatchNorm1d(32) if bn else nn.Identity()
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


MODELS = {"mlp": (_Net, (8,)), "encoder": (_Encoder, (6, 4))}
PLAIN_MLP = {"plain_mlp": (lambda: _Net(bn=False), (8,))}
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-3),
}


def _batches(shape, steps, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * batch, *shape, generator=g)
    y = torch.randint(0, 3, (steps * batch,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]


def _step(model, opt, batch, weighted):
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if weighted:
        opt.step(weight=x.shape[0])
    else:
        opt.step()
    return loss.detach()


def _accumulate(model, batch):
    x, y = batch
    F.cross_entropy(model(x), y).backward()


def _train(strategy, model_name="mlp", optimizer="adamw", steps=6, batch=48, weighted=False, accumulate=1,
           overlap=False, sync_buffers="broadcast", loader=False):
    make, shape = {**MODELS, **PLAIN_MLP}[model_name]
    torch.manual_seed(0)
    model = strategy.mirror(make(), sync_buffers=sync_buffers)
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(OPTIMIZERS[optimizer](m.parameters()), overlap=overlap),
                        args=(model,))
    torch.manual_seed(5)
    losses = []
    source = _batches(shape, steps, batch)
    if loader:  # across workers: sharded by index, each worker collating only its replicas' rows
        x, y = torch.cat([b[0] for b in source]), torch.cat([b[1] for b in source])
        source = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    for i, b in enumerate(strategy.distribute_dataset(source)):
        if (i + 1) % accumulate:
            strategy.run(_accumulate, args=(model, b))
        else:
            losses.append(strategy.run(_step, args=(model, opts, b, weighted)))
    copies = strategy.experimental_local_results(model)
    for c in copies[1:]:  # the replicas agree with each other, buffers included
        assert all(torch.equal(a, b) for a, b in zip(copies[0].state_dict().values(), c.state_dict().values()))
    return {k: v.clone() for k, v in copies[0].state_dict().items()}


def _assert_same(a, b):
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, {k: (a[k].float() - b[k].float()).abs().max().item() for k in different}


LAYOUT = cr.LayoutInvariant(micro_batches=24)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_bitwise_on_one_device_and_on_2_3_4_8_replicas(model_name):
    reference = _train(cr.OneDeviceStrategy(layout_invariant=LAYOUT), model_name)
    for n in (2, 3, 4, 8):
        _assert_same(reference, _train(cr.MirroredStrategy(num_replicas=n, layout_invariant=LAYOUT), model_name))
    if model_name == "mlp":  # the mode combines the buffers itself, whatever the mirror's policy
        for policy in ("mean", None):
            _assert_same(reference, _train(cr.MirroredStrategy(num_replicas=3, layout_invariant=LAYOUT), model_name,
                                           sync_buffers=policy))
    # the control: the default mode's layouts differ in the last bits (so the check above can fail)
    default = [_train(cr.MirroredStrategy(num_replicas=n), model_name) for n in (2, 4)]
    assert any(not torch.equal(default[0][k], default[1][k]) for k in default[0])


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_optimizer_weighted_uneven_batches(optimizer):
    # 50 rows: micro-batches of 3 and 2 rows; weight= makes the mean exact by rows
    layout = cr.LayoutInvariant(micro_batches=8)
    ref = _train(cr.OneDeviceStrategy(layout_invariant=layout), optimizer=optimizer, batch=50, weighted=True)
    for n in (2, 4, 8):  # 8: one micro-batch per replica, straight from .grad
        got = _train(cr.MirroredStrategy(num_replicas=n, layout_invariant=layout), optimizer=optimizer, batch=50,
                     weighted=True)
        _assert_same(ref, got)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_accumulation_over_runs_and_overlap(overlap):
    ref = _train(cr.OneDeviceStrategy(layout_invariant=LAYOUT), accumulate=2, steps=8, overlap=overlap)
    for n in (2, 4):
        got = _train(cr.MirroredStrategy(num_replicas=n, layout_invariant=LAYOUT), accumulate=2, steps=8,
                     overlap=overlap)
        _assert_same(ref, got)


def test_one_micro_batch_per_replica_draws_as_the_default_mode():
    # M = R: replica m runs micro-batch m with seed base + m, as the default mode's replica m
    layout = cr.LayoutInvariant(micro_batches=4)
    strategy = cr.MirroredStrategy(num_replicas=4, layout_invariant=layout)
    plain = cr.MirroredStrategy(num_replicas=4)

    def draw(x):
        return torch.rand(3) + 0 * x.sum()

    xs = torch.zeros(8, 2)
    for s in (strategy, plain):
        torch.manual_seed(3)
        out = s.run(draw, args=(next(iter(s.distribute_dataset([xs]))),))
        if s is strategy:
            got = s.experimental_local_results(out)
        else:
            want = s.experimental_local_results(out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_results_combine_by_the_rule():
    layout = cr.LayoutInvariant(micro_batches=4, results="concat")
    strategy = cr.MirroredStrategy(num_replicas=2, layout_invariant=layout)
    x = torch.arange(8.0)
    out = strategy.run(lambda t: t * 2, args=(next(iter(strategy.distribute_dataset([x]))),))
    assert torch.equal(torch.cat(strategy.experimental_local_results(out)), x * 2)
    summed = cr.MirroredStrategy(num_replicas=2, layout_invariant=cr.LayoutInvariant(4, results="sum"))
    out = summed.run(lambda t: t.sum(), args=(next(iter(summed.distribute_dataset([x]))),))
    assert [v.item() for v in summed.experimental_local_results(out)] == [6.0, 22.0]


def test_runs_without_rows_run_once_per_replica():
    strategy = cr.MirroredStrategy(num_replicas=2, layout_invariant=LAYOUT)
    calls = strategy.run(lambda: cr.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(calls) == (0, 1)


# ---------------------------------------------------------------------------- refusals


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match=r"micro_batches=4\) has fewer micro-batches than the 6 replicas in sync: "
                                         r"replicas 4..5 would only run empty micro-batches; use micro_batches >= 6"):
        cr.MirroredStrategy(num_replicas=6, layout_invariant=cr.LayoutInvariant(micro_batches=4))
    with pytest.raises(TypeError, match="layout_invariant must be a cr.LayoutInvariant"):
        cr.MirroredStrategy(num_replicas=2, layout_invariant=8)
    with pytest.raises(ValueError, match="micro_batches"):
        cr.LayoutInvariant(micro_batches=0)
    with pytest.raises(ValueError, match="results must be one of"):
        cr.LayoutInvariant(micro_batches=2, results="median")


def test_a_split_other_than_the_micro_batches_is_refused():
    strategy = cr.MirroredStrategy(num_replicas=2, layout_invariant=cr.LayoutInvariant(micro_batches=4))
    x = cr.PerReplica([torch.zeros(3, 2), torch.zeros(3, 2)])  # 6 rows: the split gives 4 and 2
    with pytest.raises(ValueError, match="got 3 rows of a global batch of 6"):
        strategy.run(lambda t: t, args=(x,))
    assert cr.replica_share(6, 4, 2) == [4, 2]


def _sync_bn_step(model, batch):
    return model(batch)


def test_sync_batch_norm_and_grad_scaler_are_refused():
    strategy = cr.MirroredStrategy(num_replicas=2, layout_invariant=cr.LayoutInvariant(micro_batches=2))
    model = strategy.mirror(cr.nn.SyncBatchNorm(4))
    batch = next(iter(strategy.distribute_dataset([torch.randn(4, 4)])))
    with pytest.raises(ValueError, match="SyncBatchNorm cannot train in the layout-invariant mode"):
        strategy.run(_sync_bn_step, args=(model, batch))

    net = strategy.mirror(nn.Linear(4, 1))
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)), args=(net,))

    def with_scaler(m, o, x):
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(m(x).sum()).backward()
        scaler.step(o)

    with pytest.raises(ValueError, match="GradScaler cannot be used in the layout-invariant mode"):
        strategy.run(with_scaler, args=(net, opts, batch))


def _scheduled_training(strategy, where: str, steps: int = 4) -> dict[str, torch.Tensor]:
    """An MLP trained with SGD and an ExponentialLR scheduler stepped ``where`` ("inside" the
    replica function, or "outside" it in cross-replica context)."""
    torch.manual_seed(0)
    net = strategy.mirror(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)), args=(net,))
    scheds = strategy.run(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5), args=(opts,))

    def step(m, o, *rest):
        *sched, (x, y) = rest
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
        for s in sched:
            s.step()

    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = next(iter(strategy.distribute_dataset([(torch.randn(8, 4, generator=g),
                                                        torch.randn(8, 1, generator=g))])))
        strategy.run(step, args=(net, opts, scheds, batch) if where == "inside" else (net, opts, batch))
        if where == "outside":
            for s in strategy.experimental_local_results(scheds):
                s.step()
    return {k: v.clone() for k, v in strategy.experimental_local_results(net)[0].state_dict().items()}


def test_an_lr_scheduler_stepped_per_micro_batch_is_refused_and_outside_the_run_is_bitwise():
    """The replica function runs once per micro-batch: a scheduler stepped in it would step
    ceil(M/R) times per optimizer step, a schedule that depends on the layout. The
    hyperparameters changing between two micro-batches of one step is an error naming the
    fix; stepped in cross-replica context the run is bitwise the one-device run."""
    invariant = cr.LayoutInvariant(micro_batches=4)
    with pytest.raises(ValueError, match=r"lr changed between micro-batch [02] and micro-batch [13] of one step.*"
                                         r"step it after strategy.run, in cross-replica context"):
        _scheduled_training(cr.MirroredStrategy(2, layout_invariant=invariant), "inside")
    one = _scheduled_training(cr.OneDeviceStrategy("cpu", layout_invariant=invariant), "outside")
    two = _scheduled_training(cr.MirroredStrategy(2, layout_invariant=invariant), "outside")
    four = _scheduled_training(cr.MirroredStrategy(4, layout_invariant=invariant), "outside")
    assert all(torch.equal(one[k], two[k]) and torch.equal(one[k], four[k]) for k in one)
    # with one micro-batch per replica the function runs once per step: stepping inside is fine
    per_replica = cr.LayoutInvariant(micro_batches=2)
    inside = _scheduled_training(cr.MirroredStrategy(2, layout_invariant=per_replica), "inside")
    outside = _scheduled_training(cr.MirroredStrategy(2, layout_invariant=per_replica), "outside")
    assert all(torch.equal(inside[k], outside[k]) for k in inside)


# ---------------------------------------------------------------------------- processes (the CLI)


def _cli(tmp_path, name, *args, torchrun=None):
    from harness import REPO, subprocess_env

    from crossreplica.testing import free_port

    out = tmp_path / f"{name}.pt"
    train = ["-m", "crossreplica.cli", "train", "--layout-invariant", "--epochs", "1", "--no-progress",
             "--no-compare", "--dropout", "0.1", "--save-params", str(out), *args]
    cmd = [sys.executable, *train]
    if torchrun is not None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={torchrun}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *train,
               "--strategy", "multi_worker"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, text
    return torch.load(out)


@pytest.mark.multiprocess
def test_cli_save_params_bitwise_across_processes_and_hierarchical(tmp_path):
    reference = _cli(tmp_path, "one", "--strategy", "one_device")
    _assert_same(reference, _cli(tmp_path, "threads", "--replicas", "4"))
    _assert_same(reference, _cli(tmp_path, "procs", torchrun=2))
    _assert_same(reference, _cli(tmp_path, "hier", "--replicas-per-worker", "2", torchrun=2))


def _eval(model, batch):
    x, _ = batch
    model.eval()
    try:
        with torch.no_grad():
            return model(x).sum()
    finally:
        model.train()


def test_a_run_that_changes_no_buffer_leaves_them_bitwise():
    strategy = cr.MirroredStrategy(num_replicas=2, layout_invariant=LAYOUT)
    _train(strategy)  # running statistics away from their initial values
    model = strategy.mirror(_Net())
    for m in strategy.experimental_local_results(model):
        m.bn.running_var.copy_(torch.linspace(0.3, 3.7, 32))  # 24 * x / 24 would round some of these
    before = {k: v.clone() for k, v in strategy.experimental_local_results(model)[0].state_dict().items()}
    strategy.run(_eval, args=(model, next(iter(strategy.distribute_dataset(_batches((8,), 1, 48))))))
    _assert_same(before, strategy.experimental_local_results(model)[0].state_dict())


def _local(values):
    return values[cr.get_replica_context()._local_index]


def _lbfgs_step(model, opt, batch):
    x, y = batch

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return opt.step(closure)


def _train_lbfgs(strategy):
    torch.manual_seed(0)
    model = strategy.mirror(_Net(bn=False))
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)),
                        args=(model,))
    torch.manual_seed(5)
    losses = [strategy.run(_lbfgs_step, args=(model, opts, b))
              for b in strategy.distribute_dataset(_batches((8,), 3, 48))]
    return ({k: v.clone() for k, v in strategy.experimental_local_results(model)[0].state_dict().items()},
            [strategy.experimental_local_results(loss)[0] for loss in losses])


def test_lbfgs_closures_of_every_micro_batch():
    # the closure draws dropout masks: each micro-batch's evaluations continue its own stream
    (ref, ref_losses) = _train_lbfgs(cr.OneDeviceStrategy(layout_invariant=LAYOUT))
    for n in (2, 3):
        params, losses = _train_lbfgs(cr.MirroredStrategy(num_replicas=n, layout_invariant=LAYOUT))
        _assert_same(ref, params)
        assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))  # the step's loss: the tree mean


def _run_steps_train(strategy, per_dispatch):
    torch.manual_seed(0)
    model = strategy.mirror(_Net())
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)), args=(model,))
    torch.manual_seed(5)
    it = iter(strategy.distribute_dataset(_batches((8,), 6, 48)))
    models, optims = strategy.experimental_local_results(model), strategy.experimental_local_results(opts)
    for _ in range(6 // per_dispatch):
        strategy.experimental_run_steps(lambda b: _step(_local(models), _local(optims), b, False), it, per_dispatch)
    return {k: v.clone() for k, v in strategy.experimental_local_results(model)[0].state_dict().items()}


def test_experimental_run_steps_is_one_micro_batched_run_per_step():
    ref = _run_steps_train(cr.OneDeviceStrategy(layout_invariant=LAYOUT), 1)
    _assert_same(ref, _run_steps_train(cr.MirroredStrategy(num_replicas=4, layout_invariant=LAYOUT), 3))


def test_micro_batches_without_rows_add_nothing():
    # 6 rows, 8 micro-batches: two are empty; weighted by rows they contribute exact zeros
    layout = cr.LayoutInvariant(micro_batches=8)
    ref = _train(cr.OneDeviceStrategy(layout_invariant=layout), "plain_mlp", "sgd", steps=2, batch=6, weighted=True)
    got = _train(cr.MirroredStrategy(num_replicas=4, layout_invariant=layout), "plain_mlp", "sgd", steps=2, batch=6,
                 weighted=True)
    _assert_same(ref, got)
    assert all(torch.isfinite(v).all() for v in ref.values() if v.is_floating_point())


def _worker_train(strategy, model_name, optimizer, loader):
    from crossreplica.micro_batches import check_layout

    # The pool's strategy, switched to the mode as its constructor argument would.
    strategy.extended.layout_invariant = check_layout(LAYOUT, strategy.num_replicas_in_sync)
    return _train(strategy, model_name, optimizer, steps=3, batch=50, loader=loader)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_name,optimizer,loader", [("mlp", "adamw", True), ("encoder", "sgd", False)],
                         ids=["mlp-dataloader", "encoder-list"])
@pytest.mark.parametrize("workers,per_worker", [(2, 1), (2, 2)], ids=["2x1", "2x2"])
def test_bitwise_on_processes_and_hierarchical(model_name, optimizer, loader, workers, per_worker, hosts):
    from crossreplica.testing import run_workers

    # 50 rows in 24 micro-batches: uneven (3 and 2 rows), and uneven over the workers too
    # (a DataLoader draws its seed from the caller's generator: the reference reads one too)
    reference = _train(cr.OneDeviceStrategy(layout_invariant=LAYOUT), model_name, optimizer, steps=3, batch=50,
                       loader=loader)
    for got in run_workers(_worker_train, workers, per_worker, args=(model_name, optimizer, loader), hosts=hosts):
        _assert_same(reference, got)


@pytest.mark.parametrize("sharded", [False, True], ids=["gathered", "sharded"])
def test_both_forms_of_the_tree_sum(sharded, monkeypatch):
    import crossreplica.collectives.tree as tree

    reference = _train(cr.OneDeviceStrategy(layout_invariant=LAYOUT), "encoder")
    monkeypatch.setattr(tree, "SHARDED", sharded)
    for n in (3, 4):  # 3: uneven slices of the elements (padding)
        _assert_same(reference, _train(cr.MirroredStrategy(num_replicas=n, layout_invariant=LAYOUT), "encoder"))


# ---------------------------------------------------------------------------- empty micro-batches, uneven deals


def _small_net():
    """No dropout and no BatchNorm: plain torch's step is the reference, to float rounding."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _small_batches(sizes, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def _plain_torch(sizes, accumulate=1):
    """The same steps on one device with plain torch: the mean loss over each batch's rows; the
    state and the loss of each step's last batch."""
    ref = one_device_training(_small_net(), _sgd, _small_batches(sizes), cross_entropy, accumulate=accumulate)
    return ref.model.state_dict(), ref.losses[accumulate - 1::accumulate]


def _small_train(strategy, sizes, accumulate=1):
    model = strategy.mirror(_small_net())
    opts = strategy.run(lambda m: cr.CrossShardOptimizer(_sgd(m.parameters())), args=(model,))
    losses = []
    for i, b in enumerate(strategy.distribute_dataset(_small_batches(sizes))):
        if (i + 1) % accumulate:
            strategy.run(_accumulate, args=(model, b))
        else:
            losses.append(strategy.experimental_local_results(strategy.run(_step, args=(model, opts, b, False))))
    copies = strategy.experimental_local_results(model)
    for c in copies[1:]:
        _assert_same(copies[0].state_dict(), c.state_dict())
    return {k: v.clone() for k, v in copies[0].state_dict().items()}, losses


EIGHT = cr.LayoutInvariant(micro_batches=8)


@pytest.mark.parametrize("sizes,accumulate", [([5, 5, 5], 1), ([5, 16, 3, 8], 2)],
                         ids=["5-rows", "accumulate-5-and-16-rows"])
def test_a_batch_with_fewer_rows_than_micro_batches_gives_plain_torchs_numbers(sizes, accumulate):
    # 5 rows in 8 micro-batches: 5 of one row, 3 empty; the empty ones contribute nothing and
    # are not counted, so the mean is over the 5 rows, as plain torch's
    want, want_losses = _plain_torch(sizes, accumulate)
    ref, losses = _small_train(cr.OneDeviceStrategy(layout_invariant=EIGHT), sizes, accumulate)
    for k in want:
        torch.testing.assert_close(ref[k], want[k], rtol=1e-5, atol=1e-6)
    for (got,), plain in zip(losses, want_losses):  # the returned mean loss: the rows' mean, not nan
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    for n in (2, 3, 4, 8):  # 3 replicas: 3 + 3 + 2 micro-batches (the deal padded with an empty one)
        _assert_same(ref, _small_train(cr.MirroredStrategy(num_replicas=n, layout_invariant=EIGHT), sizes,
                                       accumulate)[0])


def test_a_replicas_mean_loss_leaves_out_its_empty_micro_batches():
    # 5 rows over 4 replicas in 8 micro-batches: 2, 2, 1 and 0 rows
    strategy = cr.MirroredStrategy(num_replicas=4, layout_invariant=EIGHT)
    (x, y), = _small_batches([5])
    _, (losses,) = _small_train(strategy, [5])
    model = _small_net()
    for got, rows in zip(losses[:3], (slice(0, 2), slice(2, 4), slice(4, 5))):
        torch.testing.assert_close(got, F.cross_entropy(model(x[rows]), y[rows]).detach(), rtol=1e-5, atol=1e-6)
    assert torch.isnan(losses[3])  # no rows at all: its function's mean of nothing, as torch's


def test_a_buffer_mean_leaves_out_empty_micro_batches():
    strategy = cr.MirroredStrategy(num_replicas=3, layout_invariant=EIGHT)  # micro-batch 8: padding
    norm = strategy.mirror(nn.BatchNorm2d(4, momentum=None))  # running mean: the average of the batches'
    x = torch.randn(6, 4, 3, 3)  # 6 micro-batches of one row, 2 empty ones and the padding
    strategy.run(lambda m, b: m(b), args=(norm, next(iter(strategy.distribute_dataset([x])))))
    for copy in strategy.experimental_local_results(norm):
        torch.testing.assert_close(copy.running_mean, x.mean((0, 2, 3)))
        assert copy.num_batches_tracked.item() == 1


def test_replica_share_deals_micro_batches_to_any_replica_count():
    assert cr.replica_share(8, 8, 3) == [3, 3, 2]  # micro-batches [0, 3), [3, 6), [6, 8) and an empty one
    assert cr.replica_share(5, 8, 4) == [2, 2, 1, 0]
    assert cr.replica_share(50, 24, 5) == [12, 10, 10, 10, 8]  # 5 micro-batches each, the last 4 and an empty one
    assert cr.replica_share(50, 24, 7) == [10, 8, 8, 8, 8, 8, 0]  # 4 each: the last replica's are all empty
    for n in range(1, 25):
        assert sum(cr.replica_share(50, 24, n)) == 50


def _small_worker_train(strategy, sizes):
    from crossreplica.micro_batches import check_layout

    strategy.extended.layout_invariant = check_layout(EIGHT, strategy.num_replicas_in_sync)
    return _small_train(strategy, sizes)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers,per_worker", [(2, 1), (3, 1), (2, 2)], ids=["2x1", "3x1", "2x2"])
def test_fewer_rows_than_micro_batches_and_uneven_deals_on_processes(workers, per_worker):
    from crossreplica.testing import run_workers

    reference, _ = _small_train(cr.OneDeviceStrategy(layout_invariant=EIGHT), [5, 5, 12])
    for got in run_workers(_small_worker_train, workers, per_worker, args=([5, 5, 12],)):
        _assert_same(reference, got)
