"""Checkpoint integrity: atomic writes, stale temporary files, modes, symlinks, corruption,
and values that must round-trip under the safe loader."""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import crossreplica as cr
from crossreplica.errors import CheckpointError

from harness import REPO  # noqa: E402

pytestmark = pytest.mark.reliability

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Progress:
    step: int
    loss: float
    weights: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str


def _state():
    model = torch.nn.Linear(4, 3)
    return {"model": model, "w": torch.randn(64, 64)}


def test_killed_writer_leaves_a_recognisable_temp_file_that_the_next_save_removes(tmp_path):
    path = tmp_path / "ck.pt"
    script = textwrap.dedent(f"""
        import os, signal, torch, crossreplica as cr
        import crossreplica.checkpoint as ck
        real = torch.save
        def dying_save(obj, f):
            real(obj, f)
            os.kill(os.getpid(), signal.SIGKILL)  # dies after writing, before the rename
        ck.torch.save = dying_save
        cr.save({str(path)!r}, {{"w": torch.ones(3)}})
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".ck.pt.crtmp-")]
    assert leftovers and not path.exists()
    # A live writer's file (this process's pid) is not touched by another save.
    prefix, host, _pid, rand = leftovers[0].split("-")
    live = tmp_path / "-".join([prefix, host, str(os.getppid()), rand])
    live.write_bytes(b"in progress")
    cr.save(path, {"w": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.pt", live.name])
    assert torch.equal(cr.load(path)["w"], torch.ones(3))


def test_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        cr.save(tmp_path / "a.pt", {"w": torch.ones(1)})
        os.umask(0o077)
        cr.save(tmp_path / "b.pt", {"w": torch.ones(1)})
    finally:
        os.umask(old)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.pt").stat().st_mode & 0o777 == 0o600


def test_saving_through_a_symlink_writes_the_target(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "ck.pt"
    cr.save(target, {"step": 1})
    link = tmp_path / "latest.pt"
    link.symlink_to(target)
    cr.save(link, {"step": 2})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert cr.load(target)["step"] == 2 and cr.load(link)["step"] == 2
    assert sorted(os.listdir(tmp_path / "real")) == ["ck.pt"]


@pytest.mark.parametrize("damage", ["truncate_half", "truncate_tail", "empty", "garbage", "flip_64_bytes",
                                    "flip_pickle"])
def test_damaged_file_is_one_checkpoint_error_naming_the_path(tmp_path, damage):
    path = tmp_path / "ck.pt"
    cr.save(path, _state())
    data = bytearray(path.read_bytes())
    if damage == "truncate_half":
        data = data[:len(data) // 2]
    elif damage == "truncate_tail":
        data = data[:-10]
    elif damage == "empty":
        data = bytearray()
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "flip_64_bytes":  # inside the tensor data of "w"
        at = len(data) // 2
        for k in range(64):
            data[at + k] ^= 0x5A
    else:
        at = data.find(b"model")
        data[at:at + 5] = b"mOdel"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(path)) as info:
        cr.load(path)
    message = str(info.value)
    assert "weights_only=False" not in message and ".crtmp-" not in message
    assert isinstance(info.value, ValueError)


def test_flipped_bytes_in_tensor_data_are_detected(tmp_path):
    path = tmp_path / "ck.pt"
    w = torch.arange(4096, dtype=torch.float32)
    cr.save(path, {"w": w})
    data = bytearray(path.read_bytes())
    at = data.find(w.numpy().tobytes()[:64])
    assert at > 0
    for k in range(64):
        data[at + 1000 + k] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is corrupted: its contents do not match the checksum"):
        cr.load(path)


def test_common_values_round_trip_under_the_safe_loader(tmp_path):
    path = tmp_path / "ck.pt"
    np_rng = np.random.RandomState(3)
    gen = np.random.default_rng(5)
    state = {
        "np_scalar": np.float32(1.5), "np_int": np.int64(7), "np_array": np.arange(6).reshape(2, 3),
        "np_bool": np.bool_(True), "np_empty": np.zeros((0, 2)),
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
        "numpy_legacy_rng": np_rng.get_state(), "numpy_generator": gen.bit_generator.state,
        "point": Point(1, torch.ones(2)), "progress": Progress(3, 0.25, torch.zeros(2)),
        "frozen": Frozen("a"), "nested": [Point(np.float64(2.0), [Frozen("b")])],
    }
    cr.save(path, state)
    out = cr.load(path)  # weights_only=True, the default
    assert out["np_scalar"] == np.float32(1.5) and type(out["np_scalar"]) is np.float32
    assert type(out["np_int"]) is np.int64 and out["np_int"] == 7
    assert np.array_equal(out["np_array"], np.arange(6).reshape(2, 3)) and out["np_array"].dtype == np.int64
    assert out["np_bool"] is np.True_ or out["np_bool"] == np.True_
    assert out["np_empty"].shape == (0, 2)
    assert torch.equal(out["torch_rng"], state["torch_rng"])
    random.setstate(out["python_rng"])
    np_rng2 = np.random.RandomState()
    np_rng2.set_state(out["numpy_legacy_rng"])
    assert np_rng2.rand() == np.random.RandomState(3).rand()
    assert out["numpy_generator"] == gen.bit_generator.state
    assert type(out["point"]) is Point and torch.equal(out["point"].y, torch.ones(2))
    assert type(out["progress"]) is Progress and out["progress"].step == 3
    assert torch.equal(out["progress"].weights, torch.zeros(2))
    assert out["frozen"] == Frozen("a") and out["nested"][0].y[0] == Frozen("b")
    assert torch.load(path, weights_only=True)  # still an ordinary torch file


class Custom:
    pass


def test_unsupported_value_gives_a_checkpoint_error_without_unsafe_advice(tmp_path):
    path = tmp_path / "ck.pt"
    cr.save(path, {"c": Custom()})
    with pytest.raises(CheckpointError, match="add_safe_globals") as info:
        cr.load(path)
    assert "weights_only=False" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_load_of_a_plain_torch_file_still_works(tmp_path, legacy):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=not legacy)
    assert torch.equal(cr.load(path)["w"], torch.ones(2))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=str(path)):
        cr.load(path)


def test_write_errors_name_the_path_not_the_temp_file(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        if os.access(directory, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(CheckpointError, match="ro/ck.pt': Permission denied") as info:
            cr.save(directory / "ck.pt", {"w": torch.ones(1)})
        assert ".crtmp-" not in str(info.value)
        assert isinstance(info.value, OSError) and info.value.errno == errno.EACCES
    finally:
        directory.chmod(0o700)


def _plain_sgd_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("cross_shard", [False, True])
def test_save_warns_when_mirrored_copies_differ(tmp_path, cross_shard):
    """A plain torch.optim optimizer per replica trains each copy on its own shard: cr.save
    (which keeps copy 0) warns and names the fix; with CrossShardOptimizer it is silent."""
    import warnings

    s = cr.MirroredStrategy(2, devices=["cpu"] * 2)
    torch.manual_seed(0)
    model = s.mirror(torch.nn.Linear(3, 2))

    def build(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        return cr.CrossShardOptimizer(opt) if cross_shard else opt

    opts = s.run(build, args=(model,))
    x = torch.randn(4, 3)
    with warnings.catch_warnings(record=True) as at_step:
        warnings.simplefilter("always")
        s.run(_plain_sgd_step, args=(model, opts, cr.PerReplica(list(x.chunk(2)))))
    # the step itself already says so (optim/guards.py)
    assert any("no cross-replica reduction" in str(w.message) for w in at_step) != cross_shard
    copies = s.experimental_local_results(model)
    same = all(torch.equal(p, q) for p, q in zip(copies[0].parameters(), copies[1].parameters()))
    assert same == cross_shard
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cr.save(tmp_path / "ckpt.pt", {"model": model}, strategy=s)
    messages = [str(w.message) for w in caught if "Mirrored" in str(w.message)]
    if cross_shard:
        assert messages == []
    else:
        assert len(messages) == 1 and "state['model']" in messages[0] and "CrossShardOptimizer" in messages[0]
