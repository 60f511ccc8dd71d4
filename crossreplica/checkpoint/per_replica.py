"""Per-replica state in a checkpoint: compared across replicas, kept once or once per replica.

A ``PerReplica`` in the state (optimizers returned per replica by
``strategy.run``, per-replica random streams, per-replica counters) is walked on
every replica, and the replicas' states are compared by a sha256 of their bytes
(one small all-gather across workers). The usual case, replicas in sync (the
optimizer state of a CrossShardOptimizer over mirrored parameters), is saved as
one value, which restores on any number of replicas. States that differ are
saved one per replica, in global replica order, as a record
``{"__crossreplica_value__": "per_replica", "replicas": [...]}`` (every worker
sends its replicas' states to the others as bytes read by the safe loader);
such a record restores only on the same number of replicas, and anything else
is an error that says so.
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

import torch

from .. import nest
from ..errors import CheckpointError
from ..values import PerReplica
from .safe_values import TAG, decode, encode
from .state import Unsettled, warn_copies_differ

if TYPE_CHECKING:
    from ..strategies.base import Strategy
    from ..strategies.extended import StrategyExtended

__all__ = ["digest", "is_record", "pick", "record", "resolve", "settle"]


def record(replicas: list[Any]) -> dict[str, Any]:
    """The file's form of a state that differs between replicas (one entry per replica)."""
    return {TAG: "per_replica", "replicas": list(replicas)}


def is_record(value: Any) -> bool:
    return isinstance(value, dict) and value.get(TAG) == "per_replica"


def _update(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().resolve_conj().resolve_neg()
        h.update(f"T{t.dtype}{tuple(t.shape)}{t.layout}".encode())
        if t.layout == torch.strided:
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        else:  # sparse and other layouts: by their serialized bytes
            buf = io.BytesIO()
            torch.save(t, buf)
            h.update(buf.getvalue())
        return
    if nest.is_container(value):
        keys, items = nest.children(value)
        h.update(f"C{type(value).__qualname__}{len(items)}(".encode())
        for key, item in zip(keys, items):
            h.update(repr(key).encode() + b":")
            _update(h, item)
        h.update(b")")
        return
    h.update(f"V{type(value).__qualname__}:{value!r};".encode())


def digest(value: Any) -> bytes:
    """32 bytes that are equal for equal plain states (tensors compared bit for bit)."""
    h = hashlib.sha256()
    _update(h, value)
    return h.digest()


def settle(unsettled: list[Unsettled], strategy: Strategy) -> list[Any]:
    """The value to save for each unsettled PerReplica: one state if every replica's is the
    same, else a :func:`record` of every replica's (a collective: every worker calls it)."""
    if not unsettled:
        return []
    ext = strategy.extended
    local_ids = tuple(ext.local_replica_ids)
    n = int(ext.num_replicas_in_sync)
    encoded = [[encode(v) for v in p.local] for p in unsettled]
    rows = [torch.frombuffer(bytearray(b"".join(digest(e[i]) for e in encoded)), dtype=torch.uint8)
            .reshape(1, -1) for i in range(len(local_ids))]
    table = ext.gather_values(rows, 0)  # [n, 32 * len(unsettled)], in global replica order
    width = 32
    differ = []
    for j, p in enumerate(unsettled):
        same = (table[:, j * width:(j + 1) * width] == table[0, j * width:(j + 1) * width]).all(dim=1)
        if bool(same.all()):
            continue
        if p.mirrored is not None:  # kept once, as every Mirrored: only said
            warn_copies_differ(p.where, f"replicas {same.logical_not().nonzero().flatten().tolist()} differ from "
                                        f"replica 0")
        else:
            differ.append(j)
    everyone: dict[int, dict[int, Any]] = {}
    if differ:
        if len(local_ids) == n:  # every replica is in this process
            everyone = {g: {j: unsettled[j].local[i] for j in differ} for i, g in enumerate(local_ids)}
        else:
            everyone = _exchange(ext, [{j: encoded[j][i] for j in differ} for i in range(len(local_ids))], n)
    return [p.mirrored if p.mirrored is not None else record([everyone[g][j] for g in range(n)]) if j in differ
            else p.local[0] for j, p in enumerate(unsettled)]


def _exchange(ext: StrategyExtended, payloads: list[dict[int, Any]], n: int) -> dict[int, dict[int, Any]]:
    """Every replica's payload on every worker, as bytes read back by the safe loader."""
    blobs = []
    for payload in payloads:
        buf = io.BytesIO()
        torch.save(payload, buf)
        blobs.append(buf.getvalue())
    sizes = ext.gather_values([torch.tensor([len(b)], dtype=torch.int64) for b in blobs], 0).tolist()
    width = max(sizes)
    rows = [torch.nn.functional.pad(torch.frombuffer(bytearray(b), dtype=torch.uint8), (0, width - len(b)))
            .reshape(1, width) for b in blobs]
    table = ext.gather_values(rows, 0)
    out = {}
    for g in range(n):
        data = bytes(table[g, :sizes[g]].contiguous().numpy())
        out[g] = decode(torch.load(io.BytesIO(data), weights_only=True), f"<replica {g}'s state>")
    return out


def pick(value: Any, replica: int, num_replicas: int, name: str) -> Any:
    """Replica ``replica``'s part of a saved value: the value itself, or its entry in a record."""
    if not is_record(value):
        return value
    saved = len(value["replicas"])
    if saved != num_replicas:
        raise CheckpointError(
            f"cr.load: {name} holds per-replica state that differs between the {saved} replicas it was "
            f"saved from, so it restores only on {saved} replicas, not on {num_replicas}. To resume on "
            f"another count, save a state every replica shares (keep the replicas in sync, or reduce it)")
    return value["replicas"][replica]


def resolve(value: Any, strategy: Strategy, path: tuple = (), strict: bool = True) -> Any:
    """The loaded nest with each record replaced by this strategy's replicas' parts: a
    PerReplica of the local replicas' values (the value itself for one local replica
    unless the strategy always wraps). A record saved on another number of replicas is a
    CheckpointError when ``strict``; otherwise (``cr.load(into=...)``, where only the
    entries asked for may fail) it stays the record, every saved replica's state."""
    if is_record(value):
        ext = strategy.extended
        n = int(ext.num_replicas_in_sync)
        if not strict and len(value["replicas"]) != n:
            return value
        local_ids = tuple(ext.local_replica_ids)
        name = "the checkpoint's entry " + nest.path_str(path)
        parts = [pick(value, g, n, name) for g in local_ids]
        return parts[0] if len(parts) == 1 and not ext.always_wrap else PerReplica(parts)
    if nest.is_container(value):
        keys, items = nest.children(value)
        return nest.rebuild(value, keys, [resolve(v, strategy, path + (k,), strict) for k, v in zip(keys, items)])
    return value
