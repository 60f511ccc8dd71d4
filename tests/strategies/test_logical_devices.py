"""Logical devices per replica: the bookkeeping on the CPU, on threads and across processes,
model parallelism inside a replica against a plain-PyTorch reference, and on GPUs where there are some."""

from __future__ import annotations

import pytest
import torch
from plain_torch import mean_gradients

import crossreplica as cr
from crossreplica.errors import ReplicaContextError
from crossreplica.strategies.logical_devices import join_logical_tiles
from crossreplica.testing import run_workers

CPU = torch.device("cpu")


def test_replicas_own_consecutive_devices():
    s = cr.MirroredStrategy(devices=["cpu"] * 6, logical_devices_per_replica=3)
    assert s.num_replicas_in_sync == 2
    assert s.extended.worker_devices == (CPU, CPU)
    assert s.extended.logical_devices_per_replica == 3
    assert s.extended.logical_devices == ((CPU,) * 3, (CPU,) * 3)
    s2 = cr.MirroredStrategy(num_replicas=2, logical_devices_per_replica=2)
    assert s2.num_replicas_in_sync == 2 and s2.extended.logical_devices == ((CPU, CPU), (CPU, CPU))
    s3 = cr.MirroredStrategy(devices=["cpu"] * 4, num_replicas=2, logical_devices_per_replica=2)
    assert s3.num_replicas_in_sync == 2
    plain = cr.MirroredStrategy(3)
    assert plain.extended.logical_devices_per_replica == 1
    assert plain.extended.logical_devices == ((CPU,),) * 3
    assert cr.OneDeviceStrategy().extended.logical_devices == ((CPU,),)
    with pytest.raises(ValueError, match="one group per local replica"):
        plain.extended.set_logical_devices([(CPU,), (CPU,)])
    with pytest.raises(ValueError, match="the same number of logical devices"):
        s2.extended.set_logical_devices([(CPU,), (CPU, CPU)])


@pytest.mark.parametrize("kwargs, match", [
    ({"devices": ["cpu"] * 5, "logical_devices_per_replica": 2}, "not a multiple"),
    ({"devices": ["cpu"] * 4, "num_replicas": 4, "logical_devices_per_replica": 2}, "num_replicas=4"),
    ({"num_replicas": 2, "logical_devices_per_replica": 0}, "logical_devices_per_replica"),
    ({"num_replicas": 2, "logical_devices_per_replica": 1.5}, "logical_devices_per_replica"),
])
def test_bad_layouts_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cr.MirroredStrategy(**kwargs)


def test_multi_worker_checks_devices_before_joining():
    with pytest.raises(ValueError, match="2 devices per local replica"):
        cr.MultiWorkerMirroredStrategy(1, devices=["cpu"] * 3, logical_devices_per_replica=2)
    with pytest.raises(ValueError, match="logical_devices_per_replica"):
        cr.MultiWorkerMirroredStrategy(1, logical_devices_per_replica=-1)


def _inside(strategy):
    """What a replica sees of its logical devices."""
    ext = strategy.extended
    out = {"before": ext.current_logical_device_id}
    with ext.experimental_logical_device(1) as dev:
        out["inside"] = (ext.current_logical_device_id, dev, torch.empty(0).device, torch.get_default_device())
        with ext.experimental_logical_device(0):
            out["nested"] = ext.current_logical_device_id
        out["after_nested"] = ext.current_logical_device_id
    out["after"] = ext.current_logical_device_id
    out["sum"] = cr.all_reduce(torch.tensor([1.0 + cr.replica_id()]), "sum")
    out["n"] = cr.num_replicas()
    for bad in (2, -1, "1", True):
        try:
            with ext.experimental_logical_device(bad):
                pass
        except ValueError as e:
            out.setdefault("errors", []).append(str(e))
    return out


def test_logical_device_scope_inside_a_replica():
    s = cr.MirroredStrategy(devices=["cpu"] * 4, logical_devices_per_replica=2)
    res = s.experimental_local_results(s.run(_inside, args=(s,)))
    assert len(res) == 2
    for out in res:
        assert out["before"] == 0 and out["after"] == 0 and out["nested"] == 0 and out["after_nested"] == 1
        assert out["inside"] == (1, CPU, CPU, CPU)
        assert torch.equal(out["sum"], torch.tensor([3.0]))  # collectives still address the 2 replicas
        assert out["n"] == 2
        assert len(out["errors"]) == 4 and all("logical_device_id" in e for e in out["errors"])
    assert s.extended.current_logical_device_id == 0
    with s.extended.experimental_logical_device(1) as devices:  # cross-replica: where variables go (TF's)
        assert devices == (CPU, CPU) and s.extended.current_logical_device_id == 1
    with pytest.raises(ReplicaContextError, match="belongs to another strategy"):
        cr.MirroredStrategy(2).run(lambda: s.extended.experimental_logical_device(0).__enter__())


def _place(strategy, t, w):
    """Split / replicate / assign inside a replica; the loss's gradient flows back to ``t``."""
    tiles = strategy.experimental_split_to_logical_devices(t, [2, 2])
    copies = strategy.experimental_replicate_to_logical_devices(t)
    moved = strategy.experimental_assign_to_logical_device(t, 3)
    loss = sum((tile * w[j]).sum() for j, tile in enumerate(tiles)) + (moved * copies[1]).sum()
    (grad,) = torch.autograd.grad(loss, t)
    return {"tiles": [x.detach() for x in tiles], "devices": [x.device for x in tiles + copies + (moved,)],
            "copies": len(copies), "joined": join_logical_tiles(tiles, [2, 2]).detach(), "grad": grad}


def test_split_replicate_assign_match_plain_torch():
    s = cr.MirroredStrategy(devices=["cpu"] * 8, logical_devices_per_replica=4)
    t = torch.arange(24.0).reshape(4, 6).requires_grad_()
    w = torch.linspace(0.5, 2.0, 4)
    res = s.experimental_local_results(s.run(_place, args=(s, t, w)))
    # reference: tiles in row-major order of the 2 x 2 grid, the gradient by hand
    ref_tiles = [r for rows in t.detach().chunk(2, 0) for r in rows.chunk(2, 1)]
    ref_grad = torch.cat([torch.cat([torch.full((2, 3), float(w[2 * i + j])) for j in range(2)], 1)
                          for i in range(2)], 0) + 2 * t.detach()
    for out in res:
        assert all(torch.equal(a, b) for a, b in zip(out["tiles"], ref_tiles))
        assert torch.equal(out["joined"], t.detach())
        assert out["devices"] == [CPU] * 9 and out["copies"] == 4
        torch.testing.assert_close(out["grad"], ref_grad)


def _bad_splits(strategy):
    t = torch.zeros(4, 6)
    errors = []
    for dims in ([4], [1, 3], [2, 2, 1], [1, 4], "22", [2, 2.0]):
        try:
            strategy.experimental_split_to_logical_devices(t, dims)
        except (ValueError, TypeError) as e:
            errors.append(type(e).__name__ + ": " + str(e))
    try:
        strategy.experimental_assign_to_logical_device([1.0], 0)
    except TypeError as e:
        errors.append("TypeError: " + str(e))
    return errors


def test_bad_partitions_are_clear_errors():
    s = cr.MirroredStrategy(devices=["cpu"] * 4, logical_devices_per_replica=4)
    errors = s.run(_bad_splits, args=(s,))
    assert len(errors) == 7, errors
    assert "has 1 entries, but the tensor has 2 dimensions" in errors[0]
    assert "makes 3 tiles" in errors[1]
    assert "has 3 entries" in errors[2]
    assert "does not divide dimension 1" in errors[3]
    assert errors[4].startswith("TypeError") and "partition_dimensions" in errors[4]
    assert "partition_dimensions[1]" in errors[5]
    assert errors[6].startswith("TypeError") and "torch.Tensor" in errors[6]
    with pytest.raises(ReplicaContextError):
        s.experimental_replicate_to_logical_devices(torch.ones(2))
    with pytest.raises(ValueError, match="makes 3 tiles"):
        join_logical_tiles([torch.ones(1)] * 4, [3])


class _TwoStage(torch.nn.Module):
    """A model cut in two stages, one per logical device of the replica."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)


def _stage_step(strategy, model, x, y):
    ext = strategy.extended
    with ext.experimental_logical_device(0):
        h = torch.relu(model.a(strategy.experimental_assign_to_logical_device(x, 0)))
    with ext.experimental_logical_device(1):
        out = model.b(strategy.experimental_assign_to_logical_device(h, 1))
        loss = ((out - y.to(out.device)) ** 2).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    return [g.cpu() for g in cr.all_reduce(grads, "mean")]


def test_model_parallel_inside_data_parallel_matches_plain_torch():
    s = cr.MirroredStrategy(devices=["cpu"] * 4, logical_devices_per_replica=2)
    models = s.mirror(_TwoStage())
    xs = [torch.linspace(-1, 1, 12).reshape(3, 4) * (r + 1) for r in range(2)]
    ys = [torch.ones(3, 1) * r for r in range(2)]
    got = s.experimental_local_results(s.run(_stage_step, args=(s, models, cr.PerReplica(xs), cr.PerReplica(ys))))
    ref = mean_gradients(_TwoStage(), lambda m, x, y: ((m.b(torch.relu(m.a(x))) - y) ** 2).mean(), list(zip(xs, ys)))
    for grads in got:
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r)


def _worker_main(strategy):
    """Each worker builds a strategy with two logical devices per replica on the same process group."""
    rpw = len(strategy.extended.worker_devices)
    s = cr.MultiWorkerMirroredStrategy(rpw, timeout_seconds=60, devices=["cpu"] * (2 * rpw),
                                       logical_devices_per_replica=2)
    t = torch.arange(8.0).reshape(2, 4)
    out = s.run(lambda: (cr.all_reduce(torch.tensor([float(cr.replica_id())]), "sum"),
                         s.experimental_split_to_logical_devices(t * (cr.replica_id() + 1), [1, 2]),
                         s.extended.current_logical_device_id))
    s.extended.barrier()
    return {"n": s.num_replicas_in_sync, "groups": s.extended.logical_devices,
            "ids": list(s.extended.local_replica_ids),
            "results": [[x if not isinstance(x, tuple) else list(x) for x in r]
                        for r in zip(*(s.experimental_local_results(v) for v in out))]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers, rpw", [(2, 1), (2, 2)])
def test_logical_devices_across_workers(workers, rpw):
    n = workers * rpw
    for w, out in enumerate(run_workers(_worker_main, workers, rpw)):
        assert out["n"] == n and out["groups"] == ((CPU, CPU),) * rpw
        assert out["ids"] == list(range(w * rpw, (w + 1) * rpw))
        for r, (total, tiles, cur) in zip(out["ids"], out["results"]):
            assert torch.equal(total, torch.tensor([float(sum(range(n)))]))
            t = torch.arange(8.0).reshape(2, 4) * (r + 1)
            assert torch.equal(tiles[0], t[:, :2]) and torch.equal(tiles[1], t[:, 2:]) and cur == 0


def _gpu_place(strategy):
    x = torch.ones(2, 2)
    tiles = strategy.experimental_split_to_logical_devices(x, [2, 1])
    with strategy.extended.experimental_logical_device(1):
        made = torch.zeros(1).device
        current = torch.cuda.current_device()
    return [t.device for t in tiles], made, current


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_logical_devices_on_gpus():
    s = cr.MirroredStrategy(devices=["cuda:0", "cuda:1"], logical_devices_per_replica=2)
    assert s.num_replicas_in_sync == 1
    devices, made, current = s.run(_gpu_place, args=(s,))
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert made == torch.device("cuda", 1) and current == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_logical_device_on_one_gpu_sets_the_default_device():
    s = cr.MirroredStrategy(devices=["cuda:0", "cpu"] * 1, logical_devices_per_replica=2)
    devices, made, _ = s.run(lambda: _gpu_place_mixed(s))
    assert devices == [torch.device("cuda", 0), CPU] and made == CPU


def _gpu_place_mixed(strategy):
    x = torch.ones(2, 2)
    tiles = strategy.experimental_split_to_logical_devices(x, [2, 1])
    with strategy.extended.experimental_logical_device(1):
        made = torch.zeros(1).device
    return [t.device for t in tiles], made, None
