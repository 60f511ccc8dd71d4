"""The files behind the same-host all-reduce (``shared_memory.py``).

A buffer is a file in ``SHM_DIR`` (a tmpfs on Linux): a ``HEADER``-byte header of
int64 words, then the data, mapped into every worker of the host. Its pages are
reserved as it is created, so a full tmpfs fails at creation instead of with
SIGBUS at a later write, and its name appears only once it is complete.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets

import torch

__all__ = ["HEADER", "SHM_DIR", "alive", "create", "open_existing", "reads", "unlink"]

#: where the buffers live; elsewhere the path is off
SHM_DIR = "/dev/shm"
HEADER = 64  # bytes; the data starts cache-line aligned


def create(path: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
    """A new zeroed file of header + data at ``path`` (complete before the name appears)."""
    size = HEADER + numel * torch.empty((), dtype=dtype).element_size()
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:  # reserve the pages now: a full tmpfs fails here, not with SIGBUS at a later write
            os.posix_fallocate(fd, 0, size)
        except (AttributeError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)  # a file system (or platform) without fallocate
        os.rename(tmp, path)
        return _map(fd, size, numel, dtype)
    except BaseException:
        unlink([tmp, path])
        raise
    finally:
        os.close(fd)


def open_existing(path: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
    size = HEADER + numel * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise RuntimeError(f"shared-memory buffer {path} holds {os.fstat(fd).st_size} bytes; expected "
                               f"{size}: the workers asked for different buffers")
        return _map(fd, size, numel, dtype)
    finally:
        os.close(fd)


def _map(fd: int, size: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
    mm = mmap.mmap(fd, size)
    header = memoryview(mm)[:HEADER].cast("q")  # type: ignore[arg-type]
    tensor = torch.frombuffer(mm, dtype=dtype, count=numel, offset=HEADER)
    return tensor, header


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a worker that died, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def reads(path: str, token: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
