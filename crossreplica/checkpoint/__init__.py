"""Checkpoints of a whole training state: ``cr.save(path, state)``, ``cr.load(path, into=state)``.

``state`` is a nest (dicts, lists, tuples, dataclasses) of tensors, modules,
optimizers, LR schedulers, ``torch.amp.GradScaler``, ``cr.Variable``, random
streams (``torch.default_generator``, numpy's ``RandomState``, the ``random``
module, per-replica generators) and distributed values (``Mirrored``,
``PerReplica``). What each becomes is decided in one place, the state walker
(:mod:`.state`); a ``PerReplica`` is saved once when every replica's state is
the same and once per replica otherwise (:mod:`.per_replica`).
``cr.load(path)`` returns the saved nest (state dicts, tensors, builtins);
``cr.load(path, into=state)`` also restores every object of ``state`` in place
(:mod:`.restore`), on any number of replicas for state the replicas share.

The file (:mod:`.fileio`) is an ordinary ``torch.save`` archive with a sha256
record, written atomically; it loads with torch's safe unpickler, and
:mod:`.safe_values` converts what that loader refuses. Across processes
(:mod:`.workers`) the chief alone writes it and every worker waits for the
outcome; ``cr.load`` reads on the chief and sends the bytes, so the hosts need
no shared file system.

Why one file written by the chief, not ``torch.distributed.checkpoint``:
docs/checkpoints.md, "Why not torch.distributed.checkpoint".
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .. import context, nest
from ..errors import CheckpointError, ReplicaContextError
from .fileio import CheckpointWriteError
from .fileio import atomic_save as _atomic_save
from .fileio import file_bytes as _file_bytes
from .fileio import read as _read
from .per_replica import resolve as _resolve_records
from .per_replica import settle as _settle
from .restore import restore as _restore
from .safe_values import encode as _encode
from .state import Unsettled as _Unsettled
from .state import capture as _capture
from .workers import FAILED as _FAILED
from .workers import MISSING as _MISSING
from .workers import OK as _OK
from .workers import cross_process as _cross_process

if TYPE_CHECKING:
    from ..strategies.base import Strategy

__all__ = ["CheckpointWriteError", "save", "load"]


def _resolve(strategy: Strategy | None, api: str) -> Strategy:
    if context.current_replica_context() is not None:
        raise ReplicaContextError(
            f"cr.{api} must be called in cross-replica context (outside strategy.run), once per "
            f"process; it saves or loads the state every replica shares")
    return strategy if strategy is not None else context.get_strategy()


def _plain(state: Any, strategy: Strategy) -> Any:
    """``state`` as the plain nest the file holds (a collective when it holds per-replica
    values or ON_READ variables: every worker calls it)."""
    unsettled: list[_Unsettled] = []
    plain = _capture(state, strategy, unsettled)
    if not unsettled:
        return plain
    settled = dict(zip(map(id, unsettled), _settle(unsettled, strategy)))
    return nest.map_structure(lambda v: settled[id(v)] if isinstance(v, _Unsettled) else v, plain)


def save(path: str | os.PathLike, state: Any, *, strategy: Strategy | None = None) -> None:
    """Saves ``state`` to ``path``: written once by the chief, atomically; every worker returns
    only after the file is in place.

    Raises:
        TypeError: ``path`` is not a path.
        ValueError: a PerReplica in ``state`` does not have one value per local replica.
        CheckpointError: the file could not be written (a full disk, an I/O error, no
            permission): a ``CheckpointWriteError``, also an OSError with the cause's errno,
            naming the path and the cause; on the other workers, a CheckpointError with the
            chief's message. The previous file at ``path`` is left as it was.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cr.save: path must be a str or os.PathLike; got {path!r}")
    path = os.fspath(path)
    strategy = _resolve(strategy, "save")
    workers = _cross_process(strategy)
    if workers is not None:
        workers.meet("cr.save")
    plain = _encode(_plain(state, strategy))
    if workers is None:
        _atomic_save(plain, path)
        return
    failure: BaseException | None = None
    if workers.is_chief:
        try:
            _atomic_save(plain, path)
        except BaseException as e:  # noqa: BLE001 - reported to every worker below
            failure = e
    # The barrier carries the outcome: every worker learns whether the chief succeeded, and why not.
    said = b"" if failure is None else (str(failure) if isinstance(failure, CheckpointError)
                                        else f"cr.save: the chief (rank 0) could not write {path!r}: "
                                             f"{type(failure).__name__}: {failure}").encode()
    status, message = workers.share_from_chief(_OK if failure is None else _FAILED, said)
    if failure is not None:
        raise failure
    if status != _OK:
        raise CheckpointError(f"{message.decode(errors='replace')} (written by the chief, rank 0)")


def load(path: str | os.PathLike, *, into: Any = None, map_location: Any = "cpu", strategy: Strategy | None = None,
         weights_only: bool = True) -> Any:
    """Loads a checkpoint written by :func:`save`; every worker gets the chief's copy.

    Args:
        into: a nest of live objects shaped like the state that was saved (usually the
            dict given to ``save``): each is restored in place (see :mod:`.restore`).
        map_location: where tensors of the returned nest go (``torch.load``'s argument).
        strategy: the strategy whose replicas the state belongs to; default, the one in scope.
        weights_only: torch's safe unpickler (the default); False reads any pickle.

    Returns:
        The saved nest: state dicts, tensors and builtins. State saved once per replica
        comes back as a PerReplica of this process's replicas' parts; with ``into``, such
        an entry saved on another number of replicas that ``into`` does not restore comes
        back as its record, ``{"__crossreplica_value__": "per_replica", "replicas": [...]}``.

    Raises:
        FileNotFoundError: on every worker, when the chief has no file at ``path``.
        CheckpointError: the file is truncated, corrupted, not a checkpoint, or holds a
            value the safe loader does not read (on every worker); an entry of ``into``
            is missing or refuses its state; per-replica state asked for (restored into
            ``into``, or returned without ``into``) saved on another number of replicas.
        TypeError: ``path`` is not a path; a leaf of ``into`` cannot be restored in place.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cr.load: path must be a str or os.PathLike; got {path!r}")
    path = os.fspath(path)
    strategy = _resolve(strategy, "load")
    value = _read_everywhere(path, map_location, weights_only, strategy)
    if into is not None:
        _restore(into, value, strategy)
    # Only what the caller asks for may fail: with into=, a per-replica entry it does not
    # restore, saved on another replica count, comes back as saved (every replica's state).
    return _resolve_records(value, strategy, strict=into is None)


def _read_everywhere(path: str, map_location: Any, weights_only: bool, strategy: Strategy) -> Any:
    """The checkpoint's nest, read on the chief and sent to every worker."""
    workers = _cross_process(strategy)
    if workers is None:
        return _read(_file_bytes(path), path, map_location, weights_only)
    workers.meet("cr.load")
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
    status, payload = workers.share_from_chief(status, payload)
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
