"""Per-replica random streams: every replica draws from generators of its own.

torch's default generators are process wide, so replicas that are threads of one
process would race for them (replica 0 and replica 1 swap dropout masks from run
to run). Instead every ``run`` gives each replica its own stream, a documented
function of the caller's seed and of the replica's global id, the same on every
strategy and engine:

    base = torch.randint(0, 2**63 - 1, (), device="cpu").item()  # once per run, in the caller's thread
    seed(i) = base + i                              # replica i runs as after torch.manual_seed(seed(i))

``base`` comes from the caller's default CPU generator (one draw, on every
worker alike), so ``torch.manual_seed(s)`` before ``run`` makes the run
reproducible and two runs in a row draw different numbers. Replica ``i``'s
generators are fresh for each run: one per device it draws on, each seeded
with ``seed(i)``.

Routing: while a replica runs, its thread has a dispatch key (:data:`KEY`) in
torch's thread-local include set. Every aten operator with a ``Generator?``
argument has a kernel at that key that fills in the replica's generator for
the op's device when none was given (an overload without a generator argument
is sent to its ``generator=`` twin), so every way to a random number is
covered, in C++ composites too, and an explicit ``generator=`` is left
untouched. Operators that draw but take no generator (``native_dropout``, the
fused attention kernels with dropout) run with the device's default generator
swapped to the replica's state, under a lock. torch.compile saves the default
generators' states when it starts compiling and restores them when it ends, in
whichever thread compiles: a swap in another thread in between would draw from
the restored state, or leave its replica's state in the caller's generator. So a
compilation holds the lock too, from torch's compile-start callback to its
compile-end callback; swaps in the compiling thread itself nest inside its save
and restore and go ahead. Every other operator
falls through the key at no cost (why this key: docs/fidelity.md, "Random
numbers"). Tracing for ``torch.compile`` sees the ops unchanged, so compiled
graphs hold no generator; at run time inductor draws its seeds through the
replica's stream.

Outside a replica (the caller, ``merge_fn`` in cross-replica context, threads
the replica starts) draws use torch's default generators, as ever.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import settings
from . import torch_private as tp
from .errors import CollectiveTimeoutError

__all__ = ["ReplicaStream", "checkpoint_context_fn", "current_stream", "draw_base", "entered", "replica_generator",
           "replica_seed", "replica_stream", "suspended"]

#: Upper bound (exclusive) of the per-run draw ``base``.
BASE_BOUND = 2**63 - 1


def _pick_key() -> tuple[str, Any, Any]:
    """The routing dispatch key (name, key) and the library that makes every op fall through it."""
    for name in ("DeferredInit", "CustomRNGKeyId"):
        key = tp.parse_dispatch_key(name)
        if key is None:
            continue
        lib = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a backend fallback, not an op
        try:
            lib.fallback(torch.library.fallthrough_kernel, name)
        except RuntimeError:  # another library owns this key's fallback
            continue
        return name, key, lib
    raise RuntimeError("crossreplica: no dispatch key for per-replica random streams in this torch build")


class ReplicaStream:
    """One replica's generators for one run: a seed, and one generator per device, made on first use;
    ``timeout``: how long its ops wait for the default generator (None: CROSSREPLICA_TIMEOUT)."""

    __slots__ = ("seed", "timeout", "_gens")

    def __init__(self, seed: int, timeout: float | None = None):
        self.seed = seed
        self.timeout = timeout
        self._gens: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The replica's generator for ``device`` (None for devices without generators, e.g. meta)."""
        g = self._gens.get(device)
        if g is None:
            if device.type == "meta":
                return None
            key = device
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            try:
                g = torch.Generator(device=device)
            except RuntimeError:
                return None
            g.manual_seed(self.seed)
            self._gens[key] = self._gens[device] = g
        return g


class _Local(threading.local):
    stream: ReplicaStream | None = None


_local = _Local()
_install_lock = threading.Lock()
#: Held while a replica's state is in a default generator (one op), or while torch.compile compiles.
_swap_lock = threading.Lock()
_compiling: int | None = None  # the thread whose compilation holds _swap_lock
_installed: list[Any] = []  # the libraries holding the kernels (alive as long as the process)
KEY: Any = None  # the dispatch key, once installed
_AFTER: Any = None
_EXCLUDE: Any = None
_MODES = tuple(getattr(tp.TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL"))
_PYTHON = tp.DispatchKey.Python
_CPU = torch.device("cpu")
_NOTHING = contextlib.nullcontext()


def replica_seed(base: int, replica_id: int) -> int:
    """Replica ``replica_id``'s seed for a run whose draw was ``base``: ``base + replica_id``."""
    return base + replica_id


def draw_base() -> int:
    """Draws this run's ``base`` from the calling thread's default CPU generator (the caller's seed)."""
    _install()
    _watch_compilations()  # once per run, before any replica can compile
    with suspended():
        return int(torch.randint(0, BASE_BOUND, (), device="cpu"))


@contextlib.contextmanager
def entered(seed: int | ReplicaStream, timeout: float | None = None) -> Iterator[ReplicaStream]:
    """Runs the body on a fresh stream seeded with ``seed`` (in this thread only), or on
    the stream given, where its draws left off. ``timeout``: the strategy's, which bounds
    the wait for the default generator (default: the enclosing stream's)."""
    _install()
    saved = _local.stream
    if isinstance(seed, ReplicaStream):
        stream = seed
    else:
        stream = ReplicaStream(seed, timeout if timeout is not None else saved.timeout if saved is not None else None)
    _local.stream = stream
    try:
        with tp.IncludeDispatchKeyGuard(KEY):
            yield stream
    finally:
        _local.stream = saved


def current_stream() -> ReplicaStream | None:
    """The stream draws in this thread come from (None: torch's default generators)."""
    return _local.stream


def replica_stream(base: int | None, replica_id: int,
                   timeout: float | None = None) -> contextlib.AbstractContextManager[Any]:
    """Replica ``replica_id``'s stream for a run that drew ``base`` (nothing when ``base`` is None);
    ``timeout``: the strategy's (see :func:`entered`)."""
    return _NOTHING if base is None else entered(replica_seed(base, replica_id), timeout)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Draws in the body use torch's default generators (the caller's stream): merge_fn's rule."""
    saved = _local.stream
    _local.stream = None
    try:
        yield
    finally:
        _local.stream = saved


def replica_generator(device: str | torch.device = "cpu") -> torch.Generator:
    """The generator random ops on ``device`` draw from here: the current replica's, else torch's default.

    Inside a replica, use it where torch's functions act on the default generator
    only: ``replica_generator().get_state()`` / ``set_state(...)`` save and restore
    the replica's CPU stream (``torch.get_rng_state`` would read the caller's).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a device string such as 'cpu' or 'cuda:0'; "
                         f"got {device!r}") from None
    stream = _local.stream
    g = stream.generator(dev) if stream is not None else None
    if g is not None:
        return g
    default = _default_generator(dev)
    if default is None:
        raise ValueError(f"device must be a device with a random generator (cpu, cuda, ...); got {device!r}")
    return default


def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` that makes
    the recomputation draw what the forward drew from the replica's stream (dropout masks match).

    torch's ``preserve_rng_state`` saves and restores torch's default generators only; inside
    a replica, random ops draw from the replica's stream instead (and torch's save and
    restore, which bypasses the lock of ops without a generator argument, can be turned off
    with ``preserve_rng_state=False`` in code that only runs in replicas). Outside a replica
    this returns two empty contexts (torch's own handling applies).
    """
    stream = _local.stream
    if stream is None:
        return _NOTHING, _NOTHING
    snapshot = _copy(stream)
    return _NOTHING, _recompute(snapshot)


def _copy(stream: ReplicaStream) -> ReplicaStream:
    out = ReplicaStream(stream.seed)
    copies: dict[int, torch.Generator] = {}  # "cuda" and "cuda:0" may name one generator
    for device, g in stream._gens.items():
        if id(g) not in copies:
            copies[id(g)] = torch.Generator(device=g.device)
            copies[id(g)].set_state(g.get_state())
        out._gens[device] = copies[id(g)]
    return out


@contextlib.contextmanager
def _recompute(snapshot: ReplicaStream) -> Iterator[None]:
    saved = _local.stream
    _local.stream = _copy(snapshot)  # a fresh copy for every recomputation
    try:
        with tp.IncludeDispatchKeyGuard(KEY):
            yield
    finally:
        _local.stream = saved


# ---------------------------------------------------------------------------- the kernels

def _tracing(keyset: Any) -> bool:
    """True while torch.compile / export trace (fake, proxy or functional tensors)."""
    return keyset.has(_PYTHON) and any(tp.get_dispatch_mode(m) is not None for m in _MODES)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a.device
    d = kwargs.get("device")
    return torch.device(d) if d is not None else _CPU


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


def _stream_generator(keyset: Any, args: tuple, kwargs: dict) -> torch.Generator | None:
    stream = _local.stream
    if stream is None or _tracing(keyset):
        return None
    return stream.generator(_device_of(args, kwargs))


def _inject(op: Any, index: int, name: str, kwarg_only: bool) -> Callable[..., Any]:
    """The kernel of an overload with a generator argument: fills it in when it is None."""
    redispatch = tp.redispatch_boxed(op)  # OpOverload.redispatch without its Python frame

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwarg_only and len(args) > index:
            if args[index] is None:
                g = _stream_generator(keyset, args, kwargs)
                if g is not None:
                    args = (*args[:index], g, *args[index + 1:])
        elif kwargs.get(name) is None:
            g = _stream_generator(keyset, args, kwargs)
            if g is not None:
                kwargs[name] = g
        return redispatch(keyset & _AFTER, *args, **kwargs)
    return kernel


def _reroute(op: Any, twin: Any, name: str) -> Callable[..., Any]:
    """The kernel of an overload without a generator argument: calls its ``generator=`` twin.

    The twin's composite passes the generator on to the ops it calls (``rand`` -> ``uniform_``),
    so they need not come through the key again (a Python call each)."""
    redispatch, twin_redispatch = tp.redispatch_boxed(op), tp.redispatch_boxed(twin)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        g = _stream_generator(keyset, args, kwargs)
        if g is None:
            return redispatch(keyset & _AFTER, *args, **kwargs)
        kwargs[name] = g
        with tp.ExcludeDispatchKeyGuard(_EXCLUDE):
            return twin_redispatch(keyset & _AFTER, *args, **kwargs)
    return kernel


def _swap(op: Any, draws: Callable[[tuple, dict], bool]) -> Callable[..., Any]:
    """The kernel of an op that draws from the default generator with no way to pass one: it runs
    with the device's default generator holding the replica's state (under a lock)."""
    redispatch = tp.redispatch_boxed(op)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        g = _stream_generator(keyset, args, kwargs) if draws(args, kwargs) else None
        default = _default_generator(_device_of(args, kwargs)) if g is not None else None
        if default is None:
            return redispatch(keyset & _AFTER, *args, **kwargs)
        mine = _compiling == threading.get_ident()  # inside this thread's own compilation: the lock is its
        if not mine:
            _acquire("a random op without a generator argument (dropout, attention with dropout)")
        try:
            saved = default.get_state()
            default.set_state(g.get_state())  # type: ignore[union-attr]
            try:
                with tp.ExcludeDispatchKeyGuard(_EXCLUDE):  # ops inside draw from the default
                    return redispatch(keyset & _AFTER, *args, **kwargs)
            finally:
                g.set_state(default.get_state())  # type: ignore[union-attr]
                default.set_state(saved)
        finally:
            if not mine:
                _swap_lock.release()
    return kernel


def _acquire(waiter: str) -> None:
    """Takes the default generator's lock within the running strategy's timeout."""
    if _swap_lock.acquire(blocking=False):
        return
    stream = _local.stream
    seconds = stream.timeout if stream is not None and stream.timeout is not None else settings.timeout()
    if not _swap_lock.acquire(timeout=seconds):
        raise CollectiveTimeoutError(
            f"crossreplica: {waiter} waited {seconds:g} s for torch's default generator, which another "
            "thread's random op or torch.compile compilation holds; a compilation that takes longer needs a "
            "larger timeout (the strategy's timeout_seconds, or CROSSREPLICA_TIMEOUT)")


def _compile_started(*_: Any) -> None:
    """torch's compile-start callback: no swap until the compilation ends (see the module docstring)."""
    global _compiling
    _acquire("torch.compile")
    _compiling = threading.get_ident()


def _compile_ended(*_: Any) -> None:
    """torch's compile-end callback (possibly in another thread, when compilations overlap)."""
    global _compiling
    if _compiling is not None:  # None: _compile_started raised
        _compiling = None
        _swap_lock.release()


def _watch_compilations() -> None:
    """Registers the compile callbacks, again after ``torch._dynamo.reset()`` (which clears them)."""
    handler = tp.compile_callbacks
    if handler is None or _compile_started in handler.start_callbacks:
        return
    with _install_lock:  # callers in several threads: register once
        if _compile_started not in handler.start_callbacks:
            handler.register_start_callback(_compile_started)
            handler.register_end_callback(_compile_ended)


def _argument(op: Any, name: str, default: Any) -> Callable[[tuple, dict], Any]:
    index = [a.name for a in tp.op_schema(op).arguments].index(name)

    def get(args: tuple, kwargs: dict) -> Any:
        if len(args) > index:
            return args[index]
        return kwargs.get(name, default)
    return get


def _native_dropout_draws(op: Any) -> Callable[[tuple, dict], bool]:
    p, train = _argument(op, "p", 0.0), _argument(op, "train", None)
    return lambda args, kwargs: p(args, kwargs) > 0 and train(args, kwargs) is not False


def _dropout_p_draws(op: Any) -> Callable[[tuple, dict], bool]:
    p = _argument(op, "dropout_p", 0.0)
    return lambda args, kwargs: p(args, kwargs) > 0


#: Ops that draw from the default generator and take none (CUDA's fused dropout and attention).
_SWAPPED: dict[str, Callable[[Any], Callable[[tuple, dict], bool]]] = {
    "native_dropout": _native_dropout_draws,
    "_scaled_dot_product_flash_attention": _dropout_p_draws,
    "_scaled_dot_product_flash_attention_for_cpu": _dropout_p_draws,
    "_scaled_dot_product_efficient_attention": _dropout_p_draws,
    "_scaled_dot_product_cudnn_attention": _dropout_p_draws,
    "_scaled_dot_product_fused_attention_overrideable": _dropout_p_draws,
    "_flash_attention_forward": _dropout_p_draws,
    "_efficient_attention_forward": _dropout_p_draws,
}


def _generator_argument(op: Any) -> tuple[int, str, bool] | None:
    """``(index, name, kwarg_only)`` of the op's generator argument, or None."""
    for i, a in enumerate(tp.op_schema(op).arguments):
        if "Generator" in str(a.type):
            return i, a.name, a.kwarg_only
    return None


def _signature(op: Any, skip: int | None = None) -> list[tuple[str, str, bool]]:
    return [(a.name, str(a.type), a.kwarg_only) for i, a in enumerate(tp.op_schema(op).arguments) if i != skip]


def _random_packets() -> list[str]:
    """The aten operators with an overload that takes a generator (found from the schemas: cheap)."""
    found = set()
    for full in tp.dispatch_get_all_op_names():
        if full.startswith("aten::"):
            base, _, overload = full[6:].partition(".")
            schema = tp.get_schema(f"aten::{base}", overload)
            if any("Generator" in str(a.type) for a in schema.arguments):
                found.add(base)
    return sorted(found)


def _kernels() -> Iterator[tuple[str, Callable[..., Any]]]:
    """``(overload name, kernel)`` for every aten overload that draws random numbers."""
    for base in _SWAPPED:
        packet = getattr(torch.ops.aten, base, None)
        for name in packet.overloads() if packet is not None else ():
            op = getattr(packet, name)
            yield _qualified(base, name), _swap(op, _SWAPPED[base](op))
    for base in _random_packets():
        packet = getattr(torch.ops.aten, base)
        overloads = {name: getattr(packet, name) for name in packet.overloads()}
        gens = {name: (op, arg) for name, op in overloads.items() if (arg := _generator_argument(op)) is not None}
        for name, op in overloads.items():
            if name in gens:
                yield _qualified(base, name), _inject(op, *gens[name][1])
                continue
            sig = _signature(op)
            twins = [(t, arg) for t, arg in gens.values() if arg[2] and _signature(t, arg[0]) == sig]
            if len(twins) == 1:
                twin, (_, arg_name, _) = twins[0]
                yield _qualified(base, name), _reroute(op, twin, arg_name)


def _qualified(base: str, overload: str) -> str:
    return base if overload == "default" else f"{base}.{overload}"


def _install() -> None:
    """Registers the kernels (once per process, on first use)."""
    global KEY, _AFTER, _EXCLUDE
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        name, key, fallback = _pick_key()
        lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
        for op_name, kernel in _kernels():
            lib.impl(op_name, kernel, name, with_keyset=True)
        KEY, _AFTER = key, tp.dispatch_keyset_full_after(key)
        _EXCLUDE = tp.DispatchKeySet(key)
        _installed.extend([fallback, lib])
