"""The seam for torch's private APIs (crossreplica/torch_private.py).

Every private torch symbol the package uses is declared there and reached only
through it: this test lists the symbols, checks each resolves in this torch,
scans the rest of the package for any private torch use, and checks that a
torch lacking one fails ``import crossreplica`` with a message naming it.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from crossreplica import torch_private as tp

ROOT = pathlib.Path(__file__).resolve().parents[2] / "crossreplica"

#: Every private symbol the package uses (add here when the seam declares a new one).
SYMBOLS = {
    # dispatcher: per-replica random streams
    "torch._C._IncludeDispatchKeyGuard", "torch._C._ExcludeDispatchKeyGuard", "torch._C.DispatchKey",
    "torch._C.DispatchKeySet", "torch._C._dispatch_keyset_full_after", "torch._C._parse_dispatch_key",
    "torch._C._TorchDispatchModeKey", "torch._C._get_dispatch_mode", "torch._C._dispatch_get_all_op_names",
    "torch._C._get_schema", "torch.ops.aten.add.Tensor._schema", "torch.ops.aten.add.Tensor._handle.redispatch_boxed",
    "torch.library.Library.fallback", "torch._dynamo.callback.callback_handler",
    # thread state carried into replica threads
    "torch._C._is_fwd_grad_enabled", "torch.autograd.forward_ad._set_fwd_grad_enabled",
    "torch._C._len_torch_function_stack", "torch.overrides._get_current_function_mode_stack",
    "torch._C._autograd._top_saved_tensors_default_hooks", "torch.utils._device.DeviceContext",
    # autograd
    "torch._C._are_functorch_transforms_active", "torch.autograd.Variable._execution_engine",
    # tensors
    "torch.Tensor._base", "torch.Tensor._version", "torch.Tensor._values", "torch.Tensor._indices",
    "torch._C._storage_Use_Count", "torch.UntypedStorage._cdata",
    # underscore-named ops and helpers
    "torch._foreach_copy_", "torch._foreach_add_", "torch._foreach_mul_", "torch._foreach_maximum_",
    "torch._foreach_minimum_", "torch._amp_foreach_non_finite_check_and_unscale_",
    "torch._utils._flatten_dense_tensors", "torch._utils._unflatten_dense_tensors",
    # GPUs: the in-process collectives' stream reads and fused fold
    "torch._C._cuda_getCurrentStream", "torch.cuda.jiterator._create_jit_fn",
    # pytree
    "torch.utils._pytree", "torch.utils._pytree.SUPPORTED_NODES", "torch.utils._pytree.GetAttrKey",
    "torch.utils._pytree.SequenceKey", "torch.utils._pytree.MappingKey",
    "torch.utils._pytree.NodeDef.flatten_with_keys_fn",
    # nn
    "torch.nn.modules.batchnorm._BatchNorm", "torch.nn.Module._buffers", "torch.nn.Module._modules",
    # optim
    "torch.optim.Optimizer._optimizer_step_pre_hooks", "torch.optim.Optimizer._optimizer_step_post_hooks",
    "torch.optim.Optimizer._optimizer_state_dict_pre_hooks", "torch.optim.Optimizer._optimizer_state_dict_post_hooks",
    "torch.optim.Optimizer._optimizer_load_state_dict_pre_hooks",
    "torch.optim.Optimizer._optimizer_load_state_dict_post_hooks", "torch.optim.Optimizer._patch_step_function",
    "torch.amp.GradScaler.step._step_supports_amp_scaling",
    # distributed
    "torch.distributed.distributed_c10d._get_default_store", "torch.distributed.distributed_c10d._world",
}

# Private attributes of torch objects, whatever name the object has here (the package's
# own classes may use the same names for their own state: allowed on ``self`` only).
TORCH_PRIVATE_ATTRS = {"_C", "_base", "_version", "_values", "_indices", "_cdata", "_handle", "_schema",
                       "_execution_engine", "_get_default_store", "_world", "_pytree", "_utils", "_device", "_buffers",
                       "_modules"}
# Private torch names no class of the package may use, not even on ``self`` (Optimizer's hook tables).
TORCH_PRIVATE_PREFIXES = ("_foreach_", "_amp_foreach", "_optimizer_", "_patch_step_function")


def test_the_seam_declares_exactly_the_listed_symbols():
    declared = [r.symbol for r in tp.PRIVATE]
    assert len(declared) == len(set(declared)), "a symbol is declared twice"
    assert set(declared) == SYMBOLS


def test_every_record_says_what_since_and_what_breaks():
    for r in tp.PRIVATE:
        assert r.what and r.breaks and r.since[0].isdigit(), r


@pytest.mark.parametrize("record", tp.PRIVATE, ids=lambda r: r.symbol)
def test_each_symbol_resolves_in_this_torch(record):
    assert record not in tp._missing
    if record.set_by is not None:  # an instance attribute: named in the code that sets (or reads) it
        assert record.symbol.rpartition(".")[2] in tp._names(record.set_by.__code__)
        return
    try:
        tp._resolve(record.symbol)
    except (AttributeError, ImportError):
        if record.required:
            raise
        pytest.skip(f"optional {record.symbol} is absent in torch {torch.__version__}")


def _torch_aliases(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or one of its submodules."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _violations(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    aliases = _torch_aliases(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            on_self = isinstance(root, ast.Name) and root.id in ("self", "cls") and node.value is root
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{where} {ast.unparse(node)}")
            elif node.attr.startswith(TORCH_PRIVATE_PREFIXES) or node.attr in TORCH_PRIVATE_ATTRS and not on_self:
                found.append(f"{where} .{node.attr}")
    return sorted(set(found), key=found.index)  # one entry per private name on a line


def test_no_module_but_the_seam_uses_private_torch():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name != "torch_private.py" or path.parent != ROOT:
            found += _violations(path)
    assert not found, "private torch used outside crossreplica/torch_private.py:\n" + "\n".join(found)


def test_the_scan_catches_private_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nimport torch.distributed as dist\nfrom torch.utils import _pytree\n"
                      "torch._C._foo()\ndist.distributed_c10d._get_default_store()\nt._base\nm._buffers\n"
                      "self._buffers\nself._optimizer_step_pre_hooks\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = {f.split(" ")[0] for f in _violations(sample)}
    finally:
        ROOT = saved
    assert len(found) == 6, found  # all but self._buffers (the package's own attribute)


def test_a_torch_lacking_a_symbol_fails_at_import_naming_it():
    code = "import torch; del torch._C._are_functorch_transforms_active; import crossreplica"
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr[proc.stderr.rindex("ImportError"):]
    assert "torch._C._are_functorch_transforms_active" in last
    assert torch.__version__ in last
    assert f"torch {tp.SUPPORTED_TORCH[0]} to {tp.SUPPORTED_TORCH[1]}" in last


def test_the_message_names_symbol_version_and_range():
    msg = tp.missing_message([tp.PRIVATE[0]], "2.7.1")
    assert tp.PRIVATE[0].symbol in msg and "2.7.1" in msg and tp.SUPPORTED_TORCH[0] in msg
