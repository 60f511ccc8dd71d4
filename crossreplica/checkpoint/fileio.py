"""The checkpoint file: an ordinary ``torch.save`` archive, written atomically, with a checksum.

A file is written to a temporary file beside the target (beside a symlink's
target: saving through a link replaces the file it points to, not the link),
named ``.<name>.crtmp-<host>-<pid>-<random>``, flushed to disk and renamed over
the target (``os.replace`` is atomic), so a writer killed at any point leaves
the previous checkpoint intact; a save removes the temporary files that dead
writers of the same host left. The file gets the mode the umask gives new files.

Integrity: the archive carries one more record, a sha256 over every other
record; :func:`read` checks it before unpickling, so a truncated, corrupted or
modified file is a :class:`CheckpointError` naming the path (files without the
record, from ``torch.save``, are checked against their zip CRCs). Loading uses
torch's safe unpickler (``weights_only=True``) by default and never falls back
to the unrestricted one; what it reads is then decoded by :mod:`.safe_values`.
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

from ..errors import CheckpointError
from .safe_values import decode

__all__ = ["atomic_save", "file_bytes", "read", "verify"]

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


def atomic_save(obj: Any, path: str) -> None:
    """Writes ``obj`` next to ``path`` (through a symlink: next to its target) and renames it over."""
    target = os.path.realpath(path)
    directory, base = os.path.split(target)
    directory = directory or "."
    # As TF's checkpoint.save: missing parent directories are created (by the writer only).
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cr.save: cannot create the directory {directory!r} for the checkpoint "
                               f"{path!r}: {e.strerror or e}") from None
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


def verify(data: bytes, path: str) -> None:
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


def file_bytes(path: str) -> bytes:
    """The bytes of ``path``; a directory is a CheckpointError, a missing file FileNotFoundError."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except IsADirectoryError:
        raise CheckpointError(f"cr.load: {path!r} is a directory, not a checkpoint file") from None


def read(data: bytes, path: str, map_location: Any, weights_only: bool) -> Any:
    """Verifies and loads a checkpoint's bytes (read from ``path``, which messages name);
    every failure is a CheckpointError."""
    verify(data, path)
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
    return decode(value, path)
