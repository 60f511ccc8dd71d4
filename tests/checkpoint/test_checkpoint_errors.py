"""Checkpoint errors say what happened: every damaged byte, crafted entry, full disk or per-replica
entry on another replica count is a CheckpointError naming the path and the cause (or, for a byte
no reader uses, a load with the values saved), and only what the caller asks for may fail."""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import crossreplica as cr
from crossreplica.checkpoint import fileio
from crossreplica.errors import CheckpointError

pytestmark = pytest.mark.reliability

TAG = "__crossreplica_value__"
Pair = collections.namedtuple("Pair", ["a", "b"])


# ---------------------------------------------------------------------- damaged files


def _small_state():
    return {"w": torch.arange(6, dtype=torch.float32), "n": 3, "p": Pair(1, torch.ones(2)),
            "a": np.arange(3, dtype=np.int16)}


def _equal(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    if isinstance(want, tuple):
        return type(got) is type(want) and len(got) == len(want) and all(map(_equal, got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_equal(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def test_every_damaged_byte_is_a_checkpoint_error_or_the_saved_values(tmp_path):
    # Every byte of a small checkpoint, with its lowest bit, its 0x10 bit and all eight flipped:
    # a load either fails with a CheckpointError naming the path or returns what was saved.
    path = tmp_path / "ck.pt"
    state = _small_state()
    cr.save(path, state)
    data = path.read_bytes()
    other: collections.Counter = collections.Counter()
    for i in range(len(data)):
        for mask in (0xFF, 0x01, 0x10):  # 0x10: the MS-DOS directory bit of a zip record
            damaged = bytearray(data)
            damaged[i] ^= mask
            path.write_bytes(bytes(damaged))
            try:
                got = cr.load(path)
            except CheckpointError as e:
                if str(path) not in str(e):
                    other[f"byte {i} ^ {mask:#x}: a message without the path: {e}"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - what the test is about
                other[f"{type(e).__name__}: {str(e)[:100]}"] += 1
                continue
            if not _equal(got, state):
                other[f"byte {i} ^ {mask:#x}: loaded other values"] += 1
    assert not other, other


def test_a_record_marked_as_a_directory_is_refused(tmp_path):
    # torch's reader reads nothing for a zip record whose MS-DOS directory bit is set, so the
    # tensor's bytes would be whatever memory held: refused, though the checksum matches.
    path = tmp_path / "ck.pt"
    cr.save(path, {"w": torch.arange(6.0)})
    data = bytearray(path.read_bytes())
    directory = data.index(b"PK\x01\x02")  # the central directory's first entry
    at = data.index(b"archive/data/0", directory) - 46  # that record's central directory header
    data[at + 38] |= 0x10  # its external attributes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"its record 'data/0' is marked as a directory"):
        cr.load(path)


@pytest.mark.parametrize("entry,match", [
    ({TAG: "numpy", "dtype": "<f8", "shape": [3], "data": torch.zeros(8, dtype=torch.uint8), "scalar": False},
     "ValueError: cannot reshape array of size 1 into shape"),
    ({TAG: "numpy", "dtype": "no-such-dtype", "shape": [1], "data": torch.zeros(8, dtype=torch.uint8),
      "scalar": False}, "TypeError: data type 'no-such-dtype' not understood"),
    ({TAG: "numpy", "dtype": "|O", "shape": [1], "data": torch.zeros(8, dtype=torch.uint8), "scalar": False},
     "TypeError: dtype object holds Python objects"),
    ({TAG: "numpy", "dtype": "<f4"}, "KeyError: 'data'"),
    ({TAG: "namedtuple", "module": "nowhere", "name": "P", "fields": ["a", "1b"], "values": [1, 2]},
     "ValueError: Type names and field names must be valid identifiers"),
    ({TAG: "namedtuple", "module": "nowhere", "name": "P", "fields": ["a"], "values": [1, 2]},
     "ValueError: 2 values for 1 fields"),
], ids=["numpy-shape", "numpy-dtype", "numpy-object", "numpy-keys", "namedtuple-field", "namedtuple-count"])
def test_a_crafted_entry_is_a_checkpoint_error_naming_it(tmp_path, entry, match):
    path = tmp_path / "ck.pt"
    fileio.atomic_save({"x": [0, entry]}, str(path))  # a valid file whose entry is not cr.save's
    with pytest.raises(CheckpointError, match=rf"cr.load: '{path}' holds a \w+ entry at \['x'\]\[1\] that does not "
                                              rf"decode \(damaged, or not written by cr.save\): {match}"):
        cr.load(path)


# ---------------------------------------------------------------------- a full disk


class _FillingFile:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written, as on a full disk."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _assert_full_disk_error(info, path, previous):
    message = str(info.value)
    assert f"cr.save: cannot write the checkpoint '{path}': No space left on device (the disk is full" in message
    assert ".crtmp-" not in message
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert torch.equal(cr.load(path)["w"], previous)  # the previous checkpoint is intact
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]  # no temporary file left


@pytest.mark.parametrize("room", [0, 300, 700], ids=["at-once", "in-the-header", "in-the-data"])
def test_a_full_disk_during_save_is_a_checkpoint_error_and_keeps_the_previous_file(tmp_path, monkeypatch, room):
    path = str(tmp_path / "ck.pt")
    previous = torch.ones(4)
    cr.save(path, {"w": previous})
    real = os.fdopen
    monkeypatch.setattr(fileio.os, "fdopen", lambda fd, *a, **kw: _FillingFile(real(fd, *a, **kw), room))
    with pytest.raises(CheckpointError) as info:
        cr.save(path, {"w": torch.zeros(4096)})
    monkeypatch.undo()
    _assert_full_disk_error(info, path, previous)


@contextlib.contextmanager
def _tiny_tmpfs(where):
    """A 64 KiB tmpfs mounted at ``where`` (root only; skips where it cannot be mounted)."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_really_full_file_system_is_a_checkpoint_error_and_keeps_the_previous_file(tmp_path):
    with _tiny_tmpfs(tmp_path / "tiny") as tiny:
        path = str(tiny / "ck.pt")
        previous = torch.ones(4)
        cr.save(path, {"w": previous})
        with pytest.raises(CheckpointError) as info:
            cr.save(path, {"w": torch.zeros(100_000)})  # 400 KB on 64 KiB
        _assert_full_disk_error(info, path, previous)


def _save_where_the_chief_cannot(strategy, path):
    try:
        with strategy.scope():
            cr.save(path, {"w": torch.ones(2)})
    except Exception as e:  # noqa: BLE001 - every worker reports what it raised
        return type(e).__name__, isinstance(e, CheckpointError), str(e)
    return None


@pytest.mark.multiprocess
def test_the_chiefs_failure_reaches_every_worker_with_its_cause(tmp_path):
    from crossreplica.testing import run_workers

    (tmp_path / "file").write_text("not a directory")
    path = str(tmp_path / "file" / "ck.pt")  # its parent cannot be created
    chief, other = run_workers(_save_where_the_chief_cannot, 2, 1, args=(path,))
    assert "cannot create the directory" in chief[2]  # an OSError naming the directory (docs/checkpoints.md)
    assert other[:2] == ("CheckpointError", True)
    assert other[2].startswith(f"cr.save: the chief (rank 0) could not write '{path}': {chief[0]}: ")
    assert other[2].endswith("(written by the chief, rank 0)")


# ---------------------------------------------------------------------- only what is asked for may fail


def _per_replica_noise(strategy):
    ids = strategy.extended.local_replica_ids
    return cr.PerReplica([torch.full((2,), float(r)) for r in ids])


def test_load_into_on_another_replica_count_fails_only_on_the_entries_asked_for(tmp_path):
    path = tmp_path / "ck.pt"
    two = cr.MirroredStrategy(2)
    with two.scope():
        torch.manual_seed(0)
        model = two.mirror(torch.nn.Linear(3, 2))
        cr.save(path, {"model": model, "noise": _per_replica_noise(two), "step": 7})
    want = {k: v.clone() for k, v in two.experimental_local_results(model)[0].state_dict().items()}
    four = cr.MirroredStrategy(4)
    with four.scope():
        fresh = four.mirror(torch.nn.Linear(3, 2))
        out = cr.load(path, into={"model": fresh})  # "noise" is not asked for
        for copy in four.experimental_local_results(fresh):
            assert all(torch.equal(copy.state_dict()[k], want[k]) for k in want)
        assert out["step"] == 7
        # the entry not asked for comes back as saved: every saved replica's state
        assert out["noise"][TAG] == "per_replica"
        assert [t.tolist() for t in out["noise"]["replicas"]] == [[0.0, 0.0], [1.0, 1.0]]
        # asked for, it fails, naming the entry and both counts
        with pytest.raises(CheckpointError, match=r"into\['noise'\] holds per-replica state that differs between "
                                                  r"the 2 replicas it was saved from, so it restores only on 2 "
                                                  r"replicas, not on 4"):
            cr.load(path, into={"model": fresh, "noise": _per_replica_noise(four)})
        with pytest.raises(CheckpointError, match=r"the checkpoint's entry \['noise'\] holds per-replica state"):
            cr.load(path)  # without into=, the whole nest is asked for
