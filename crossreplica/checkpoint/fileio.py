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
record, from ``torch.save``, are checked against their zip CRCs). Both checks
read the records as Python's zipfile does; torch's reader also honours the MS-DOS
directory bit of a record's attributes (it then reads no data), so a record
marked as a directory is refused too. Loading uses torch's safe unpickler
(``weights_only=True``) by default and never falls back to the unrestricted one;
what it reads is then decoded by :mod:`.safe_values`.

Writing fails as a :class:`CheckpointWriteError`, a CheckpointError naming the
path and the cause, and an OSError with the cause's errno where the cause is one
(a full disk is ``errno.ENOSPC``, whether torch's writer or the file system says
so); the previous checkpoint is left as it was.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import re
import secrets
import socket
import zipfile
import zlib
from typing import IO, Any, cast

import torch

from ..errors import CheckpointError
from .safe_values import decode

__all__ = ["CheckpointWriteError", "atomic_save", "file_bytes", "read", "verify"]

_TMP_MARK = ".crtmp-"  # temporary files: .<name>.crtmp-<host>-<pid>-<random>
_DIGEST = ".crossreplica_sha256"
_DOS_DIRECTORY = 0x10  # the MS-DOS directory bit of a zip record's external attributes


class CheckpointWriteError(CheckpointError, OSError):
    """``cr.save`` could not write the checkpoint (a full disk, an I/O error, no permission):
    the message names the path and the cause; ``errno`` is the cause's (None when the cause
    was not an OSError, e.g. torch's writer reporting a short write)."""


class _Writer:
    """The temporary file as ``torch.save`` writes it, keeping the first OSError of a write:
    torch's writer reports a failed write as a short one ("unexpected pos"), without the cause."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def _write_error(path: str, cause: BaseException) -> CheckpointWriteError:
    """The CheckpointWriteError for ``cause``, naming ``path`` (never the temporary file)."""
    if isinstance(cause, OSError):
        what = os.strerror(cause.errno) if cause.errno else str(cause)
        hint = " (the disk is full: free space, or save elsewhere)" if cause.errno == errno.ENOSPC else ""
        err = CheckpointWriteError(f"cr.save: cannot write the checkpoint {path!r}: {what}{hint}; the previous "
                                   f"file there, if any, is unchanged")
        err.errno = cause.errno
        return err
    text = str(cause).splitlines()[0] if str(cause) else ""
    hint = ""
    if "unexpected pos" in text:  # torch's writer: a write came up short, as on a full disk
        hint = " (a write came up short: the disk is probably full, or the file system failed)"
    return CheckpointWriteError(f"cr.save: cannot write the checkpoint {path!r}: {type(cause).__name__}: "
                                f"{text}{hint}; the previous file there, if any, is unchanged")


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
    """Writes ``obj`` next to ``path`` (through a symlink: next to its target) and renames it over;
    a failure to write is a :class:`CheckpointWriteError` and leaves ``path`` as it was."""
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
    writer: _Writer | None = None
    try:
        # os.open with 0o666 lets the umask decide the mode, as for any new file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            writer = _Writer(f)
            torch.save(obj, cast(IO[bytes], writer))
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
        cause = writer.error if writer is not None and writer.error is not None else e
        # The file system's errors and torch's writer's (a RuntimeError): name the user's path, never
        # the temporary file. What pickling raises (an object that cannot be saved) stays as it is.
        if isinstance(cause, (OSError, RuntimeError)):
            raise _write_error(path, cause) from None
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
            marked = [i.filename for i in zf.infolist() if i.external_attr & _DOS_DIRECTORY]
            if marked:  # torch's reader reads no data for such a record, where the checks below read its bytes
                raise CheckpointError(
                    f"cr.load: {path!r} is corrupted: its record {marked[0].split('/', 1)[-1]!r} is marked as a "
                    f"directory (damaged on disk); restore it or use an older checkpoint")
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
    except Exception as e:  # noqa: BLE001 - any failure to read the zip (bad flags, methods, versions) is damage
        raise CheckpointError(
            f"cr.load: {path!r} is not a complete checkpoint (truncated, corrupted or not written by "
            f"cr.save / torch.save): {_cause(e)}") from None


def _cause(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 120 characters of it)."""
    text = str(e).splitlines()[0][:120] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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
    except Exception as e:  # noqa: BLE001 - whatever torch's reader raises on damaged bytes
        raise CheckpointError(
            f"cr.load: {path!r} cannot be read as a checkpoint (truncated or corrupted): {_cause(e)}") from None
    return decode(value, path)
