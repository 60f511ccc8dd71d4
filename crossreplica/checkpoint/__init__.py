"""Checkpoints of mirrored training state: the chief writes atomically, everyone agrees.

``cr.save(path, state)`` takes a nest of tensors, modules, optimizers and
distributed values. Modules and optimizers are saved as their ``state_dict``;
a ``Mirrored`` value is saved from replica 0's copy (replicas hold identical
copies, and on the chief local replica 0 is global replica 0); a ``PerReplica``
is refused, since which replica's value to keep is the caller's decision.
Tensors are saved on the CPU so a checkpoint loads on any device.

Across processes (cr.MultiWorkerMirroredStrategy with more than one worker)
only the chief (rank 0, which holds replica 0) writes; the write goes to a
temporary file in the same directory, is flushed to disk and renamed over
``path`` (``os.replace`` is atomic), so a worker killed mid-write leaves the
previous checkpoint intact. Every worker then waits for the chief (a bounded
collective that also carries the chief's success or failure), so no worker
runs ahead of a checkpoint that does not exist yet. ``cr.load`` reads on the
chief and broadcasts, so every replica gets the same state even without a
shared file system; a missing file is a FileNotFoundError on every worker.

In one process both are plain atomic save and load.

Integrity. The file is an ordinary ``torch.save`` archive plus one record, a
sha256 over every other record; ``cr.load`` checks it before unpickling, so a
truncated, corrupted or modified file is a :class:`cr.errors.CheckpointError`
naming the path (files without the record, from ``torch.save``, are checked
against their zip CRCs). Loading uses torch's safe unpickler
(``weights_only=True``) by default and never falls back to the unrestricted
one; values it would refuse that people commonly save (numpy arrays and
scalars, numpy's legacy RNG state, namedtuples, dataclasses) are converted to
tensors and builtins by ``cr.save`` and restored by ``cr.load``. Dataclasses
and namedtuples are rebuilt from classes already imported (a checkpoint never
imports code; a namedtuple whose class is not imported comes back as a
namedtuple of the same name and fields).

Temporary files are named ``.<name>.crtmp-<host>-<pid>-<random>`` beside the
target (beside a symlink's target: saving through a link replaces the file it
points to, not the link); a save removes those left by dead writers of the
same host. The file gets the mode the umask gives new files.

Layer: strategies (layer 5); see docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import secrets
import socket
import zipfile
import zlib
from typing import Any

import torch

from .. import context, nest
from ..errors import CheckpointError, ReplicaContextError
from ..reduce_op import ReduceOp
from ..values import Mirrored, PerReplica
from .safe_values import decode as _decode
from .safe_values import encode as _encode

__all__ = ["save", "load"]


class _Workers:
    """Who writes, and how the workers agree on the outcome."""

    def __init__(self, is_chief: bool, max_flag: Any):
        self.is_chief = is_chief
        self.max_flag = max_flag  # int -> the maximum over every worker (a bounded collective)


def _cross_process(strategy: Any) -> _Workers | None:
    """How to reach the other workers, or None when everything is in this process.

    A multi-process strategy in scope (or passed) is used; outside any scope, an
    initialised torch.distributed world of several processes still makes rank 0
    the only writer, so a script that calls cr.save outside ``strategy.scope()``
    does not write once per process."""
    ext = getattr(strategy, "extended", None)
    engine = getattr(ext, "engine", None)
    if ext is not None and getattr(engine, "world_size", 1) > 1 and hasattr(ext, "is_chief"):
        n = len(ext.worker_devices)
        return _Workers(ext.is_chief, lambda flag: int(ext.reduce_values(
            ReduceOp.MAX, [torch.tensor([flag], dtype=torch.int32)] * n).item()))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        def max_flag(flag: int) -> int:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if str(dist.get_backend()) == "nccl" else torch.device("cpu")
            t = torch.tensor([flag], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # bounded by the process group's timeout
            return int(t.item())
        return _Workers(dist.get_rank() == 0, max_flag)
    return None


def _resolve(strategy: Any, api: str) -> Any:
    if context.get_replica_context() is not None:
        raise ReplicaContextError(
            f"cr.{api} must be called in cross-replica context (outside strategy.run), once per "
            f"process; it saves or loads the state every replica shares")
    return strategy if strategy is not None else context.get_strategy()


def _plain(state: Any, path: tuple = ()) -> Any:
    """``state`` with modules/optimizers as state_dicts, Mirrored as replica 0's copy, tensors on CPU."""
    if isinstance(state, (torch.nn.Module, torch.optim.Optimizer)):
        return _plain(state.state_dict(), path)
    if isinstance(state, Mirrored):
        return _plain(state.values[0], path)
    if isinstance(state, PerReplica):
        where = "/".join(str(p) for p in path) or "<root>"
        raise TypeError(
            f"cr.save: state at {where} is a PerReplica (one different value per replica); reduce it "
            f"first (strategy.reduce) or pick a replica's value (strategy.experimental_local_results)")
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if nest.is_container(state):
        keys, items = nest.children(state)
        return nest.rebuild(state, keys, (_plain(v, path + (k,)) for k, v in zip(keys, items)))
    return state


# ---------------------------------------------------------------- the file

_TMP_MARK = ".crtmp-"  # temporary files: .<name>.crtmp-<host>-<pid>-<random>
_DIGEST = ".crossreplica_sha256"


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _clean_stale(directory: str, base: str) -> None:
    """Removes temporary files of earlier writers of ``base`` that died mid-write.

    Only files of this host whose process is gone are removed: a live writer
    (here or on another host sharing the directory) is never disturbed."""
    prefix = f".{base}{_TMP_MARK}{_host()}-"
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # still alive (or another user's process): not ours to remove
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _digest(zf: zipfile.ZipFile) -> str:
    """sha256 over every record of the archive (name and bytes), ours excluded."""
    h = hashlib.sha256()
    for info in sorted(zf.infolist(), key=lambda i: i.filename):
        if info.filename.endswith("/" + _DIGEST):
            continue
        h.update(info.filename.encode() + b"\0")
        with zf.open(info) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _atomic_save(obj: Any, path: str) -> None:
    """Writes ``obj`` next to ``path`` (through a symlink: next to its target) and renames it over."""
    target = os.path.realpath(path)
    directory, base = os.path.split(target)
    directory = directory or "."
    _clean_stale(directory, base)
    tmp = os.path.join(directory, f".{base}{_TMP_MARK}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        # os.open with 0o666 lets the umask decide the mode, as for any new file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        with zipfile.ZipFile(tmp, "a") as zf:
            root = zf.infolist()[0].filename.split("/", 1)[0]
            zf.writestr(f"{root}/{_DIGEST}", _digest(zf))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):  # name the user's path, never the temporary file
            raise OSError(e.errno, f"cr.save: cannot write the checkpoint {path!r}: {e.strerror or e}") from None
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _verify(data: bytes, path: str) -> None:
    """Raises CheckpointError unless ``data`` (read from ``path``) is a complete,
    unmodified checkpoint.

    A file in torch's legacy (non-zip, pre-1.6) format carries no checksum; it is
    left to the safe loader, whose failures are CheckpointErrors too."""
    try:
        if data[:1] == b"\x80":  # a bare pickle: torch's legacy format
            return
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = [i.filename for i in zf.infolist()]
            stored = next((n for n in names if n.endswith("/" + _DIGEST)), None)
            if stored is None:  # written by torch.save or an older cr.save: the records' CRCs
                bad = zf.testzip()
                if bad is not None:
                    raise CheckpointError(f"cr.load: {path!r} is corrupted (record {bad.split('/', 1)[-1]!r} "
                                          f"fails its CRC check)")
                return
            try:
                ok = zf.read(stored).decode(errors="replace") == _digest(zf)
            except (zipfile.BadZipFile, zlib.error):  # a record fails its own CRC while being read
                ok = False
            if not ok:
                raise CheckpointError(
                    f"cr.load: {path!r} is corrupted: its contents do not match the checksum written with "
                    f"it (modified or damaged on disk); restore it or use an older checkpoint")
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error) as e:
        raise CheckpointError(
            f"cr.load: {path!r} is not a complete checkpoint (truncated, corrupted or not written by "
            f"cr.save / torch.save): {type(e).__name__}") from None


def _file_bytes(path: str) -> bytes:
    """The bytes of ``path``; a directory is a CheckpointError, a missing file FileNotFoundError."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except IsADirectoryError:
        raise CheckpointError(f"cr.load: {path!r} is a directory, not a checkpoint file") from None


def _read(data: bytes, path: str, map_location: Any, weights_only: bool) -> Any:
    """Verifies and loads a checkpoint's bytes (read from ``path``, which messages name);
    every failure is a CheckpointError."""
    _verify(data, path)
    try:
        value = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        text = str(e)
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if weights_only and ("Weights only load failed" in text or found):
            what = found.group(1) if found else "an object"
            raise CheckpointError(
                f"cr.load: {path!r} holds {what}, which the safe loader does not read. cr.save "
                f"converts numpy values, namedtuples and dataclasses itself; for another class, "
                f"register it with torch.serialization.add_safe_globals([...]) or save its state as "
                f"tensors and builtins") from None
        raise CheckpointError(f"cr.load: {path!r} is corrupted: {type(e).__name__}") from None
    except FileNotFoundError:
        raise
    except (EOFError, OSError, KeyError, RuntimeError, ValueError, TypeError, AttributeError,
            IndexError) as e:
        raise CheckpointError(
            f"cr.load: {path!r} cannot be read as a checkpoint (truncated or corrupted): "
            f"{type(e).__name__}") from None
    return _decode(value, path)


def save(path: str | os.PathLike, state: Any, *, strategy: Any = None) -> None:
    """Saves ``state`` to ``path``: written once by the chief, atomically; every worker returns
    only after the file is in place.

    Raises:
        TypeError: ``path`` is not a path, or ``state`` holds a PerReplica.
        RuntimeError: the chief failed to write (on the other workers).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cr.save: path must be a str or os.PathLike; got {path!r}")
    path = os.fspath(path)
    strategy = _resolve(strategy, "save")
    workers = _cross_process(strategy)
    plain = _encode(_plain(state))
    if workers is None:
        _atomic_save(plain, path)
        return
    failure: BaseException | None = None
    if workers.is_chief:
        try:
            _atomic_save(plain, path)
        except BaseException as e:  # noqa: BLE001 - reported to every worker below
            failure = e
    # The barrier carries the outcome: every worker learns whether the chief succeeded.
    failed = workers.max_flag(1 if failure is not None else 0)
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"cr.save: the chief (rank 0) failed to write {path!r}; see its log")


def load(path: str | os.PathLike, *, map_location: Any = "cpu", strategy: Any = None,
         weights_only: bool = True) -> Any:
    """Loads a checkpoint written by :func:`save`; every worker gets the chief's copy.

    Raises:
        FileNotFoundError: on every worker, when the chief has no file at ``path``.
        CheckpointError: the file is truncated, corrupted, not a checkpoint, or holds a
            value the safe loader does not read (on every worker).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cr.load: path must be a str or os.PathLike; got {path!r}")
    path = os.fspath(path)
    strategy = _resolve(strategy, "load")
    workers = _cross_process(strategy)
    if workers is None:
        return _read(_file_bytes(path), path, map_location, weights_only)
    # The chief reads the file; every worker gets its bytes (never a pickle to trust) and
    # checks and loads them with the same safe loader as a file.
    status, payload = _OK, b""
    if workers.is_chief:
        try:
            payload = _file_bytes(path)
        except FileNotFoundError as e:
            status, payload = _MISSING, str(e).encode()
        except Exception as e:  # noqa: BLE001 - every worker raises it
            status, payload = _FAILED, f"{type(e).__name__}: {e}".encode()
    status, payload = _share_from_chief(status, payload)
    if status == _MISSING:
        raise FileNotFoundError(
            f"cr.load: no checkpoint at {path!r} on the chief (rank 0): {payload.decode(errors='replace')}")
    if status == _FAILED:
        message = payload.decode(errors="replace")
        if message.startswith("CheckpointError: "):
            raise CheckpointError(f"{message[len('CheckpointError: '):]} (read by the chief, rank 0)")
        raise RuntimeError(f"cr.load: the chief (rank 0) could not read {path!r}: {message}")
    value = _read(payload, path, "cpu", weights_only)
    if map_location not in (None, "cpu"):
        value = nest.map_structure(
            lambda t: t.to(map_location) if isinstance(t, torch.Tensor) else t, value)
    return value


_OK, _MISSING, _FAILED = 0, 1, 2


def _share_from_chief(status: int, payload: bytes) -> tuple[int, bytes]:
    """Rank 0's ``(status, payload)`` on every worker, as tensors (bounded by the process
    group's timeout): a header with the status and length, then the bytes."""
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device())
              if str(dist.get_backend()) == "nccl" else torch.device("cpu"))
    header = torch.tensor([status, len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    status, size = (int(v) for v in header.tolist())
    if dist.get_rank() == 0:
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if size
                else torch.empty(0, dtype=torch.uint8)).to(device)
    else:
        data = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        dist.broadcast(data, src=0)
    return status, bytes(data.cpu().contiguous().untyped_storage())

