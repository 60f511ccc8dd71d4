"""The one seam between crossreplica and torch's private APIs.

Every private torch symbol the package uses is reached through this module, and
nowhere else (``tests/structure/test_torch_private.py`` scans the package for any other
use). Each one is declared once, below, with what it is, the oldest torch where
it exists in the form used (verified on the torch the package pins; older
entries are from torch's history) and what in crossreplica breaks without it;
:data:`PRIVATE` holds those records.

What counts as private: a name with a leading underscore anywhere on its path
(``torch._C.…``, ``torch.utils._pytree``, ``Tensor._base``, ``Module._buffers``),
the underscore-named ops included (``torch._foreach_add_``: torch lists them as
beta at most, so they are routed here too). Where torch has a public API for a
need, the package uses it (optimizer hooks are registered with torch's own
``register_step_pre_hook`` and friends; GradScaler is driven through the
attributes its ``step`` reads); what is left here has no public equivalent with
the same behaviour in the supported range, and a record's ``public`` says why
the closest public API does not do.

Module-level symbols are looked up once, when this module is imported;
attributes of torch objects are read through the small functions below, and
checked at import where a class or a constructor shows them. A missing required
symbol fails ``import crossreplica`` with an ImportError that names every
missing symbol, the torch version found and :data:`SUPPORTED_TORCH`.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any, NamedTuple

import torch

__all__ = ["PRIVATE", "SUPPORTED_TORCH", "Private", "missing_message"]

#: The torch releases crossreplica supports (oldest, newest), inclusive; named in the ImportError.
SUPPORTED_TORCH = ("2.11", "2.15")  # pyproject.toml's lower bound; the newest release tested (README)


class Private(NamedTuple):
    """One private torch symbol crossreplica uses."""

    symbol: str  #: its dotted path from ``torch`` (an attribute of instances: via the class)
    what: str  #: what it is
    since: str  #: the oldest torch where it exists in the form used
    breaks: str  #: what in crossreplica breaks without it
    required: bool = True  #: False: crossreplica works without it (slower or less prompt)
    set_by: Any = None  #: for an attribute torch sets on instances: the function whose code sets it
    public: str = ""  #: the closest public API, and why it does not do


#: Every private symbol, in the order declared below.
PRIVATE: list[Private] = []
_missing: list[Private] = []


def _resolve(path: str) -> Any:
    """``torch.a.b.c`` looked up attribute by attribute, importing submodules as needed."""
    parts = path.split(".")
    obj: Any = torch
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


def _names(code: CodeType) -> set[str]:
    """The attribute names and string constants a function's code uses (nested code included)."""
    out = set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}
    for c in code.co_consts:
        if isinstance(c, CodeType):
            out |= _names(c)
    return out


def _need(symbol: str, what: str, since: str, breaks: str, *, required: bool = True,
          set_by: Callable[..., Any] | None = None, public: str = "") -> Any:
    """Declares a private symbol and returns it (None when absent and not required).

    ``set_by``: for an attribute torch's code sets on instances (no class attribute to
    look up), the function that uses the name; the name must appear in its code."""
    record = Private(symbol, what, since, breaks, required, set_by, public)
    PRIVATE.append(record)
    try:
        if set_by is not None:
            if symbol.rpartition(".")[2] not in _names(set_by.__code__):
                raise AttributeError(symbol)
            return None
        return _resolve(symbol)
    except (AttributeError, ImportError):
        if required:
            _missing.append(record)
        return None


def missing_message(missing: Iterable[Private], version: str) -> str:
    """The ImportError's text for the private symbols ``missing`` from torch ``version``."""
    lines = [f"  {r.symbol} ({r.what}; since torch {r.since}): "
             f"without it {r.breaks}" for r in missing]
    return (f"crossreplica cannot use torch {version}: it lacks private symbols crossreplica needs\n"
            + "\n".join(lines)
            + f"\ncrossreplica supports torch {SUPPORTED_TORCH[0]} to {SUPPORTED_TORCH[1]}")


# ---------------------------------------------------------------------------- dispatcher (random_streams)

_RNG = "per-replica random streams (random_streams.py) cannot route draws"
IncludeDispatchKeyGuard: Any = _need(
    "torch._C._IncludeDispatchKeyGuard", "adds a dispatch key to the thread-local include set", "2.0", _RNG)
ExcludeDispatchKeyGuard: Any = _need(
    "torch._C._ExcludeDispatchKeyGuard", "adds keys to the thread-local exclude set", "2.0", _RNG)
DispatchKey: Any = _need("torch._C.DispatchKey", "the dispatcher's key enum", "2.0", _RNG)
DispatchKeySet: Any = _need("torch._C.DispatchKeySet", "a set of dispatch keys", "2.0", _RNG)
dispatch_keyset_full_after: Any = _need(
    "torch._C._dispatch_keyset_full_after", "every dispatch key below a key", "2.0", _RNG)
parse_dispatch_key: Any = _need(
    "torch._C._parse_dispatch_key", "a dispatch key by name (None if unknown)", "2.1", _RNG)
TorchDispatchModeKey: Any = _need(
    "torch._C._TorchDispatchModeKey", "the infra dispatch modes (fake, proxy, functional)", "2.1",
    "random ops traced by torch.compile would hold a replica's generator")
get_dispatch_mode: Any = _need(
    "torch._C._get_dispatch_mode", "the active infra dispatch mode of a kind", "2.1",
    "random ops traced by torch.compile would hold a replica's generator")
dispatch_get_all_op_names: Any = _need(
    "torch._C._dispatch_get_all_op_names", "every registered operator's name", "2.0", _RNG)
get_schema: Any = _need("torch._C._get_schema", "an operator overload's schema by name", "2.0", _RNG)
_need("torch.ops.aten.add.Tensor._schema", "an OpOverload's FunctionSchema", "2.0", _RNG)
_need("torch.ops.aten.add.Tensor._handle.redispatch_boxed",
      "an OpOverload's redispatch without its Python frame", "2.1", _RNG)
compile_callbacks: Any = _need(
    "torch._dynamo.callback.callback_handler",
    "runs callbacks when torch.compile starts and ends compiling (dynamo, lazy backward, cudagraph recording)",
    "2.3", "a replica's dropout or attention with dropout could draw from a state torch.compile restores "
    "in another thread", required=False)
# Public (torch.library), named here because torch before 2.8 lacks it and the error should say so.
_need("torch.library.Library.fallback", "a backend fallback kernel (public API)", "2.8", _RNG)


def op_schema(op: Any) -> Any:
    """The ``torch.FunctionSchema`` of an ``OpOverload``."""
    return op._schema


def redispatch_boxed(op: Any) -> Callable[..., Any]:
    """``op``'s boxed redispatch (``OpOverload.redispatch`` without its Python frame)."""
    return op._handle.redispatch_boxed


# ---------------------------------------------------------------------------- thread state (torch_state)

_STATE = "replica threads would not get the caller's torch state (torch_state.py)"
is_fwd_grad_enabled: Callable[[], bool] = _need(
    "torch._C._is_fwd_grad_enabled", "whether forward-mode AD is on in this thread", "1.10", _STATE)
set_fwd_grad_enabled: Any = _need(
    "torch.autograd.forward_ad._set_fwd_grad_enabled", "context manager setting forward-mode AD", "1.10", _STATE)
len_torch_function_stack: Callable[[], int] = _need(
    "torch._C._len_torch_function_stack", "the depth of the torch-function mode stack", "2.0", _STATE)
get_current_function_mode_stack: Callable[[], list[Any]] = _need(
    "torch.overrides._get_current_function_mode_stack", "the torch-function modes in force", "2.0", _STATE,
    public="torch.get_default_device() answers cpu, not None, without a mode and adds a CUDA index")
top_saved_tensors_default_hooks: Callable[[bool], Any] = _need(
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "the saved-tensor hooks in force (its ignore_is_tracing argument)", "2.8", _STATE,
    public="torch.autograd.graph.saved_tensors_hooks sets hooks; nothing public reads them")
DeviceContext: Any = _need(
    "torch.utils._device.DeviceContext", "the mode ``with torch.device(...)`` pushes", "2.0", _STATE)


# ---------------------------------------------------------------------------- autograd

are_functorch_transforms_active: Callable[[], bool] = _need(
    "torch._C._are_functorch_transforms_active", "whether a functorch transform (vmap, grad) is active", "2.0",
    "collectives under torch.func transforms would take the eager path (collectives/autodiff.py)")
_execution_engine: Any = _need(
    "torch.autograd.Variable._execution_engine", "the autograd engine (queue_callback)", "1.0",
    "overlap=True could not finish its reductions at the end of backward (optim/overlap.py)",
    public="none: torch has no public callback for the end of a backward pass")


def queue_autograd_callback(fn: Callable[[], None]) -> None:
    """Runs ``fn`` when the current backward pass ends (what DDP does)."""
    _execution_engine.queue_callback(fn)


# ---------------------------------------------------------------------------- tensors

_need("torch.Tensor._base", "the tensor a view was taken from (None if not a view)", "1.0",
      "collectives could return views aliasing their inputs (collectives/)")
_need("torch.Tensor._version", "the in-place write counter of a tensor", "1.0",
      "the mirrored-buffer check would compare every run (strategies/buffers.py), and gradients clipped "
      "before CrossShardOptimizer reduces them would pass unnoticed (optim/guards.py)")
_need("torch.Tensor._values", "a sparse COO tensor's values, coalesced or not, not differentiable", "1.0",
      "sparse gradients could not be reduced or unscaled (engines/sparse.py, optim/)",
      public="Tensor.values() needs a coalesced tensor and is differentiable")
_need("torch.Tensor._indices", "a sparse COO tensor's indices, coalesced or not", "1.0",
      "sparse gradients could not be reduced (engines/sparse.py, optim/routing.py)",
      public="Tensor.indices() needs a coalesced tensor")
_use_count: Any = _need(
    "torch._C._storage_Use_Count", "the reference count of a storage", "2.1",
    "the engines' buffer pool would not reuse buffers (slower, same results)", required=False)
_need("torch.UntypedStorage._cdata", "a storage's C pointer, for _storage_Use_Count", "2.0",
      "the engines' buffer pool would not reuse buffers (slower, same results)", required=False)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None."""
    return t._base


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (it grows with every in-place write)."""
    return t._version


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor's values (coalesced or not; outside autograd)."""
    return t._values()


def sparse_indices(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor's indices (coalesced or not)."""
    return t._indices()


def storage_refs(t: torch.Tensor) -> int:
    """How many references hold ``t``'s storage (only when :func:`has_storage_refs`)."""
    return _use_count(t.untyped_storage()._cdata)


def has_storage_refs() -> bool:
    """Whether :func:`storage_refs` works in this torch."""
    return _use_count is not None


# ---------------------------------------------------------------------------- ops

_foreach = "the foreach kernels the reductions and packs use"
foreach_copy_: Callable[..., Any] = _need(
    "torch._foreach_copy_", "copies a list of tensors into another in one call", "2.1",
    "packing, buffer sync, routed optimizer buffers and the fault-tolerant step's copy (packing.py, "
    "strategies/buffers.py, optim/routing.py, fault_tolerance.py)")
foreach_add_: Callable[..., Any] = _need(
    "torch._foreach_add_", "in-place elementwise add over lists", "1.7", f"{_foreach} (engines/reduction.py)")
foreach_mul_: Callable[..., Any] = _need(
    "torch._foreach_mul_", "in-place elementwise multiply over lists", "1.7", f"{_foreach} (engines/reduction.py)")
foreach_maximum_: Callable[..., Any] = _need(
    "torch._foreach_maximum_", "in-place elementwise maximum over lists", "2.0", f"{_foreach} (engines/reduction.py)")
foreach_minimum_: Callable[..., Any] = _need(
    "torch._foreach_minimum_", "in-place elementwise minimum over lists", "2.0", f"{_foreach} (engines/reduction.py)")
amp_foreach_non_finite_check_and_unscale_: Callable[..., Any] = _need(
    "torch._amp_foreach_non_finite_check_and_unscale_", "GradScaler.unscale_'s kernel", "1.6",
    "GradScaler could not unscale a CrossShardOptimizer's reduced gradients (optim/amp.py)",
    public="GradScaler.unscale_ works per optimizer and records its own per-optimizer state")
cuda_current_stream_data: Callable[[int], tuple[int, int, int]] | None = _need(
    "torch._C._cuda_getCurrentStream", "the calling thread's current stream on a GPU as (id, device, type)",
    "1.0", "in-process GPU collectives read each replica's stream through torch.cuda.current_stream "
    "(5 us a call on the GPU host measured, against well under 1 us)", required=False,
    public="torch.cuda.current_stream builds a Stream object (and enters the device) on every call")
create_jit_fn: Callable[..., Any] | None = _need(
    "torch.cuda.jiterator._create_jit_fn", "an elementwise CUDA kernel from a C++ string (NVRTC)", "1.13",
    "the one-kernel fold of in-process GPU reductions (engines/cuda_fold.py) falls back to a kernel "
    "per member", required=False, public="torch.sum over a stacked tensor does not add in member order")
flatten_dense_tensors: Callable[..., torch.Tensor] = _need(
    "torch._utils._flatten_dense_tensors", "one flat tensor from a list (as DDP's buckets)", "1.0",
    "tensor packing (packing.py)", public="torch.cat of reshaped tensors: a Python loop per pack")
unflatten_dense_tensors: Callable[..., Any] = _need(
    "torch._utils._unflatten_dense_tensors", "views of a flat tensor shaped as a list", "1.0",
    "tensor packing (packing.py)")


# ---------------------------------------------------------------------------- pytree (nest)

_NEST = "nests with torch-registered containers (deque, user pytree nodes) (nest.py)"
pytree: Any = _need("torch.utils._pytree", "torch's pytree registry", "2.0", _NEST,
                    public="torch.utils.pytree does not exist in torch 2.13")
for _name in ("SUPPORTED_NODES", "GetAttrKey", "SequenceKey", "MappingKey"):
    _need(f"torch.utils._pytree.{_name}", "the registry / its key entries", "2.2", _NEST)
_need("torch.utils._pytree.NodeDef.flatten_with_keys_fn", "a node's keyed flatten", "2.2", _NEST)


# ---------------------------------------------------------------------------- nn

BatchNormBase: Any = _need(
    "torch.nn.modules.batchnorm._BatchNorm", "the base of BatchNorm1d/2d/3d", "1.0",
    "cr.SyncBatchNorm and its convert_sync_batchnorm (nn.py)")
_MODULE = "sync_buffers could not walk modules' own buffers (strategies/buffers.py)"
_need("torch.nn.Module._buffers", "a module's own buffers by name (values may be None)", "1.0",
      _MODULE, set_by=torch.nn.Module.__init__,
      public="named_buffers(recurse=False): slower, and the walk runs every run")
_need("torch.nn.Module._modules", "a module's direct children by name (values may be None)", "1.0",
      _MODULE, set_by=torch.nn.Module.__init__, public="children(): slower, and the walk runs every run")


def own_buffers(m: torch.nn.Module) -> Iterable[torch.Tensor | None]:
    """``m``'s own buffers (None for an unset one), without the cost of ``named_buffers``."""
    return m._buffers.values()


def child_modules(m: torch.nn.Module) -> Iterable[torch.nn.Module | None]:
    """``m``'s direct children (None for an unset one), without the cost of ``children()``."""
    return m._modules.values()


# ---------------------------------------------------------------------------- optim

_HOOKS = ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
          "load_state_dict_post")
_WRAPPER = ("CrossShardOptimizer's hooks (register_step_pre_hook and the like, global step hooks) "
            "(optim/optimizer.py)")
for _kind in _HOOKS:
    _need(f"torch.optim.Optimizer._optimizer_{_kind}_hooks", "the hook table behind register_*_hook", "2.1",
          _WRAPPER, set_by=torch.optim.Optimizer.__init__,
          public="Optimizer.__init__ makes them, but would reset the wrapped optimizer's param_groups and state")
_need("torch.optim.Optimizer._patch_step_function", "wraps a class's step to run the step hooks", "1.5", _WRAPPER,
      public="Optimizer.__init__ calls it (see the hook tables)")
_need("torch.amp.GradScaler.step._step_supports_amp_scaling",
      "the optimizer attribute GradScaler.step reads first (an optimizer that unscales itself)", "1.13",
      "GradScaler would check a replica's unreduced gradients (optim/amp.py)", set_by=torch.amp.GradScaler.step,
    public="none: it is how GradScaler.step learns an optimizer handles scaling itself")

#: The attribute ``GradScaler.step`` reads (CrossShardOptimizer defines it).
STEP_SUPPORTS_AMP_SCALING = "_step_supports_amp_scaling"


def init_optimizer_hooks(opt: torch.optim.Optimizer) -> None:
    """What ``Optimizer.__init__`` sets up for hooks, for a wrapper that does not call it
    (its parameters stay with the optimizer it wraps): the six hook tables, and the
    class's step wrapped to run the step hooks."""
    for kind in _HOOKS:
        setattr(opt, f"_optimizer_{kind}_hooks", OrderedDict())
    opt._patch_step_function()


def optimizer_hooks(opt: torch.optim.Optimizer, kind: str) -> Iterable[Callable[..., Any]]:
    """The hooks registered on ``opt`` of ``kind`` (``"state_dict_pre"``, ...), in order."""
    return getattr(opt, f"_optimizer_{kind}_hooks").values()


# ---------------------------------------------------------------------------- distributed

_get_default_store: Any = _need(
    "torch.distributed.distributed_c10d._get_default_store", "the default process group's store", "1.8",
    "a lost worker would be noticed at the next timeout, not at once (engines/torch_dist/watchdog.py)",
    required=False)


def default_store() -> Any:
    """The default process group's store, or None (none, or no such function in this torch)."""
    if _get_default_store is None:
        return None
    try:
        return _get_default_store()
    except Exception:  # noqa: BLE001 - private API: without it, no prompt abort
        return None


_world: Any = _need(
    "torch.distributed.distributed_c10d._world", "torch's registry of process groups", "2.0",
    "a fault-tolerant job regrouping after a loss would wait for the old group's pending work to time out "
    "(fault_tolerance.py)", required=False,
    public="destroy_process_group shuts every group down first, which waits for work pending on a lost peer "
           "(gloo cannot abort a receive in progress)")

#: process groups retired after a loss, kept alive for good (see :func:`retire_default_group`)
_RETIRED: list[Any] = []


def retire_default_group() -> None:
    """Replaces nothing and waits for nothing: takes the default process group out of
    torch's registry without shutting it down, so ``init_process_group`` can form a new
    one at once. Its work still pending on a lost peer ends at the group's timeout on
    the group's own threads; the group object is kept for the life of the process,
    since destroying it would wait for that work."""
    group = torch.distributed.group.WORLD
    if group is None:
        return
    _RETIRED.append(group)
    if _world is not None:
        _world.pg_names.pop(group, None)  # destroy_process_group shuts down only what is listed here
    torch.distributed.destroy_process_group()

if _missing:
    raise ImportError(missing_message(_missing, torch.__version__))
