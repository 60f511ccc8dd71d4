"""Values the safe loader refuses, converted on save and restored on load.

numpy arrays and scalars, namedtuples and dataclasses become plain dicts of
tensors and builtins marked with a tag, which ``torch.load(weights_only=True)``
reads; loading turns them back, looking classes up only among modules already
imported (a checkpoint never imports code). A tagged entry that does not decode
(damaged or crafted: a bad dtype, shape, field name or count) is a
CheckpointError naming the path, the entry and the cause.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections import OrderedDict
from typing import Any

import torch

from ..errors import CheckpointError, summarize

__all__ = ["TAG", "encode", "decode"]

TAG = _TAG = "__crossreplica_value__"  # marks a dict that stands for a converted value


def encode(value: Any) -> Any:
    """``value`` with numpy arrays and scalars, namedtuples and dataclasses turned into
    plain dicts of tensors and builtins, which ``torch.load(weights_only=True)`` reads."""
    np = sys.modules.get("numpy")
    if isinstance(value, torch.Tensor):
        return value
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise TypeError(f"cr.save: a numpy array of dtype object ({summarize(value)}) cannot be saved "
                            f"safely; convert it to numbers first")
        raw = torch.frombuffer(bytearray(np.ascontiguousarray(arr).tobytes()), dtype=torch.uint8) \
            if arr.nbytes else torch.empty(0, dtype=torch.uint8)
        return {_TAG: "numpy", "dtype": arr.dtype.str, "shape": list(arr.shape), "data": raw,
                "scalar": isinstance(value, np.generic)}
    fields = getattr(type(value), "_fields", None) if isinstance(value, tuple) else None
    if fields is not None:
        return {_TAG: "namedtuple", "module": type(value).__module__, "name": type(value).__qualname__,
                "fields": list(fields), "values": [encode(v) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {_TAG: "dataclass", "module": cls.__module__, "name": cls.__qualname__,
                "fields": {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        items = {k: encode(v) for k, v in value.items()}
        return OrderedDict(items) if isinstance(value, OrderedDict) else items
    if isinstance(value, (list, tuple)):
        return type(value)(encode(v) for v in value)
    return value


def _lookup(module: str, qualname: str) -> Any:
    """A class from a module that is already imported (a checkpoint never imports code)."""
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def decode(value: Any, path: str, where: tuple = ()) -> Any:
    """The inverse of :func:`encode` for a loaded nest (read from ``path``, which errors name)."""
    if isinstance(value, dict):
        kind = value.get(_TAG)
        if kind in _DECODERS:
            try:
                return _DECODERS[kind](value, path, where)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever a damaged or crafted entry makes the conversion raise
                text = str(e).splitlines()[0][:120] if str(e) else ""
                raise CheckpointError(
                    f"cr.load: {path!r} holds a {kind} entry at {_place(where)} that does not decode (damaged, "
                    f"or not written by cr.save): {type(e).__name__}{': ' + text if text else ''}") from None
        out = {k: decode(v, path, where + (k,)) for k, v in value.items()}
        return type(value)(out) if type(value) is OrderedDict else out
    if isinstance(value, list):
        return [decode(v, path, where + (i,)) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(decode(v, path, where + (i,)) for i, v in enumerate(value))
    return value


def _place(where: tuple) -> str:
    return "the top level" if not where else "".join(f"[{k!r}]" for k in where)


def _numpy(value: dict, path: str, where: tuple) -> Any:
    import numpy as np
    dtype = np.dtype(value["dtype"])
    if dtype.hasobject:  # never objects from a checkpoint
        raise TypeError(f"dtype {dtype} holds Python objects")
    data = value["data"]
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise TypeError(f"its data is {summarize(data)}, not a uint8 tensor")
    arr = np.frombuffer(data.numpy().tobytes(), dtype=dtype).reshape(value["shape"]).copy()
    return arr[()] if value["scalar"] else arr


def _namedtuple(value: dict, path: str, where: tuple) -> Any:
    found = _lookup(value["module"], value["name"])
    fields, saved = list(value["fields"]), list(value["values"])
    if len(saved) != len(fields):
        raise ValueError(f"{len(saved)} values for {len(fields)} fields")
    values = [decode(v, path, where + (f,)) for f, v in zip(fields, saved)]
    if found is None or not issubclass(found, tuple) or list(getattr(found, "_fields", ())) != fields:
        found = collections.namedtuple(  # type: ignore[misc,no-redef]  # a class of the same shape
            value["name"].rsplit(".", 1)[-1], fields)
    return found(*values)


def _dataclass(value: dict, path: str, where: tuple) -> Any:
    cls = _lookup(value["module"], value["name"])
    if cls is None or not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise CheckpointError(
            f"cr.load: {path!r} holds a {value['module']}.{value['name']} dataclass; import "
            f"{value['module']} before loading (checkpoints never import code themselves)")
    obj = cls.__new__(cls)
    for k, v in value["fields"].items():
        object.__setattr__(obj, k, decode(v, path, where + (k,)))
    return obj


_DECODERS = {"numpy": _numpy, "namedtuple": _namedtuple, "dataclass": _dataclass}
