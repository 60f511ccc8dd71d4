"""The package's layering: each module imports only from its own layer or below.

The layers, bottom to top, as docs/architecture.md draws them. An import of a
higher layer, an internal import done inside a function (a lazy import hides a
cycle) or an engine reaching into another engine's private names fails here.
Layer 5 has three sub-layers (5a data, nn, variables < 5b strategies < 5c optim,
checkpoint); a type-only import (under ``if TYPE_CHECKING:``) may point up a
sub-layer of its own layer, never up a whole layer.
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "crossreplica"

# module (dotted, relative to crossreplica; a package name covers its modules) -> layer;
# layer 5's sub-layers are 5.0 (5a), 5.1 (5b) and 5.2 (5c)
LAYERS: dict[str, float] = {
    "errors": 0, "reduce_op": 0, "arguments": 0, "devices": 0, "nest": 0, "groups": 0,
    "values": 0, "packing": 0, "version": 0, "types": 0, "timeouts": 0, "torch_state": 0, "logs": 0,
    "random_streams": 0, "torch_private": 0, "settings": 0, "tree_sum": 0, "micro_batches": 0, "store_keys": 0,
    "engines": 1,
    # the coordinator's wire, server and client: below the strategies, whose set-up reaches the store
    "elastic.protocol": 1, "elastic.coordinator": 1, "elastic.store": 1,
    "context": 2,
    "collectives": 3,
    "cross_device_ops": 4, "replica_reduce": 4, "cross_device_compat": 4,
    "data": 5.0, "input_shards": 5.0, "nn": 5.0, "variables": 5.0,
    "strategies": 5.1, "elastic.job_store": 5.1,  # where a job's workers meet: the strategies' set-up
    "optim": 5.2, "checkpoint": 5.2, "elastic": 5.2,
    "demo": 6, "cli": 6, "testing": 6,
    "__init__": 7, "__main__": 7,
}
SUB_LAYERS = {5.0: "5a", 5.1: "5b", 5.2: "5c"}
LONG_MODULE = 700  # lines; a longer module gets a warning (split along concepts, not to fit a number)
CONCRETE_ENGINES = ("threads", "torch_dist", "hierarchical")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> float:
    name = module
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    raise KeyError(f"crossreplica.{module} has no layer: add it to LAYERS and to docs/architecture.md")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The crossreplica modules an ``import from`` names (relative or absolute)."""
    if node.level == 0:
        if not (node.module or "").startswith("crossreplica"):
            return []
        base = (node.module or "").removeprefix("crossreplica").lstrip(".")
    else:
        here = module.split(".") if is_package else module.split(".")[:-1]
        if node.level > 1:
            here = here[:len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    if node.module is None or node.level == 0 and base == "":
        return [f"{base}.{a.name}".lstrip(".") for a in node.names]
    return [base]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _imports(path: pathlib.Path) -> list[tuple[ast.ImportFrom | ast.Import, bool, bool]]:
    """Every import statement of the file, whether it sits inside a function, and whether
    it is type-only (inside ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[ast.ImportFrom | ast.Import, bool, bool]] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function, type_only))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)),
                  type_only or _is_type_checking(child))
    visit(tree, False, False)
    return found


def _name(layer: float) -> str:
    return SUB_LAYERS.get(layer, f"{layer:g}")


FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    module = _module_name(path)
    layer = _layer(module)
    for node, in_function, type_only in _imports(path):
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix("crossreplica").lstrip(".") for a in node.names
                       if a.name.startswith("crossreplica")]
        else:
            targets = _resolve(module, path.name == "__init__.py", node)
        for target in targets:
            where = f"crossreplica.{module} line {node.lineno}"
            assert not in_function, f"{where} imports crossreplica.{target} inside a function"
            if target == "" or target.split(".")[0] == module.split(".")[0]:
                continue  # the package itself, or a module of its own package
            allowed = int(layer) + 0.99 if type_only else layer  # a type-only import: within its layer
            assert _layer(target) <= allowed, (
                f"{where} imports crossreplica.{target} (layer {_name(_layer(target))}) from layer {_name(layer)}")


@pytest.mark.parametrize("path", sorted((ROOT / "engines").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_engines_use_no_other_engine_private_names(path):
    module = _module_name(path)
    own = module.split(".")[1] if module.count(".") >= 1 else ""
    for node, _, _ in _imports(path):
        if not isinstance(node, ast.ImportFrom):
            continue
        for target in _resolve(module, path.name == "__init__.py", node):
            parts = target.split(".")
            if len(parts) > 1 and parts[0] == "engines" and parts[1] in CONCRETE_ENGINES and parts[1] != own:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"crossreplica.{module} imports private {private} from crossreplica.{target}"


def test_long_modules_are_flagged():
    """Not a limit: a module is cut along its concepts, not to fit a line count. A module over
    LONG_MODULE lines gets a warning (shown in pytest's summary) asking whether it holds two."""
    too_long = {str(p.relative_to(ROOT)): n for p in FILES if (n := len(p.read_text().splitlines())) > LONG_MODULE}
    for name, n in too_long.items():
        warnings.warn(f"crossreplica/{name} has {n} lines (over {LONG_MODULE}): does it hold more than one concept?",
                      UserWarning, stacklevel=1)
