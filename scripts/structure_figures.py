"""Structure figures of a crossreplica tree, for comparing two revisions side by side.

    .venv/bin/python scripts/structure_figures.py [TREE ...]     (default: this checkout)

    git worktree add /tmp/old REV && .venv/bin/python scripts/structure_figures.py /tmp/old .

Prints one table row per figure and one column per tree: modules, lines,
docstring share, the longest module, positional reads of a collective's
parameters, waits anywhere in the package that keep their own deadline, double
their own pauses or sleep in a loop themselves (engines/deadline.py's jobs:
:func:`hand_waits`), signatures typed
``Any`` (and the seams: a strategy, replica context or engine typed ``Any``),
strategy classes built from mixins, and private torch uses outside the seam
(found by tests/structure/test_torch_private.py's scanner of this checkout).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent.parent
SEAM_NAMES = ("strategy", "rctx", "engine", "ext", "extended")
# A wait that computes its own deadline, the time left to it, or its slow mark, instead of asking
# engines/deadline.py ("end = time.monotonic() + grace", "deadline - time.monotonic()").
HAND_DEADLINE = re.compile(r"monotonic\(\)\s*\+|-\s*(?:time\.)?monotonic\(\)|started \+ slow|acquire\(timeout=slow\)")
# A pause a loop doubles itself ("pause = min(2 * pause, cap)") instead of Deadline.back_off.
HAND_BACK_OFF = re.compile(r"\b(\w+)\s*=\s*min\(\s*(?:2\s*\*\s*\1|\1\s*\*\s*2)\b")
WAITS = "engines/deadline.py"  # the one module that may
# call.params[0], or an unpacking: "op, inplace = call.params"
POSITIONAL = re.compile(r"params\[[0-9]+\](\[|\s|\)|,|$)|^\s*\w+\s*(,\s*\w+\s*)+,?\s*=\s*[\w.]*\.params\s*$"
                        r"|^\s*\w+\s*,\s*=\s*[\w.]*\.params\s*$", re.M)


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def hand_waits(source: str) -> dict[str, int]:
    """The waits of one module's ``source`` that do by hand what engines/deadline.py's
    Deadline is for: deadlines (or time left) computed from the clock, pauses doubled by
    the loop, and ``time.sleep`` calls inside a while-loop (Deadline.sleep, back_off)."""
    sleeps = 0
    for loop in ast.walk(ast.parse(source)):
        if isinstance(loop, ast.While):
            sleeps += sum(isinstance(n, ast.Call) and ast.unparse(n.func) in ("time.sleep", "sleep")
                          for n in ast.walk(loop))
    return {"deadline": len(HAND_DEADLINE.findall(source)),
            "back-off": sum(1 for _ in HAND_BACK_OFF.finditer(source)), "sleep": sleeps}


def _private_scanner(package: pathlib.Path):
    spec = importlib.util.spec_from_file_location("_scan", HERE / "tests" / "structure" / "test_torch_private.py")
    assert spec is not None and spec.loader is not None
    scan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scan)
    scan.ROOT = package
    return scan._violations


def figures(tree: pathlib.Path) -> dict[str, str]:
    package = tree / "crossreplica"
    files = sorted(package.rglob("*.py"))
    text = {p: p.read_text() for p in files}
    lines = {p: len(s.splitlines()) for p, s in text.items()}
    parsed = {p: ast.parse(s) for p, s in text.items()}
    total = sum(lines.values())
    doc = 0
    for t in parsed.values():
        for n in [t, *(n for n in ast.walk(t) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]:
            d = ast.get_docstring(n, clean=False)  # type: ignore[arg-type]
            doc += d.count("\n") + 1 if d else 0
    signatures = any_typed = seams = 0
    for t in parsed.values():
        for f in _functions(t):
            signatures += 1
            args = f.args.posonlyargs + f.args.args + f.args.kwonlyargs
            annotations = [a.annotation for a in args if a.annotation] + ([f.returns] if f.returns else [])
            any_typed += any(re.search(r"\bAny\b", ast.unparse(a)) for a in annotations)
            seams += sum(a.arg in SEAM_NAMES and a.annotation is not None
                         and ast.unparse(a.annotation).strip("'\"") == "Any" for a in args)
    longest = max(lines, key=lambda p: lines[p])
    engines = [p for p in files if ("engines" in p.parts or "collectives" in p.parts) and p.name != "deadline.py"]
    waits = [hand_waits(text[p]) for p in files if p.relative_to(package).as_posix() != WAITS]
    violations = _private_scanner(package)
    return {
        "modules": str(len(files)),
        "lines": str(total),
        "docstring lines": f"{doc} ({100 * doc / total:.0f} %)",
        "longest module": f"{longest.relative_to(package)} ({lines[longest]})",
        "positional parameter reads (engines, collectives)": str(sum(len(POSITIONAL.findall(text[p]))
                                                                     for p in engines)),
        "waits keeping their own deadline (package)": str(sum(w["deadline"] for w in waits)),
        "loops doubling their own pause (package)": str(sum(w["back-off"] for w in waits)),
        "time.sleep in while-loops (package)": str(sum(w["sleep"] for w in waits)),
        "signatures typed Any": f"{any_typed} of {signatures}",
        "strategy / rctx / engine typed Any": str(seams),
        "strategy classes with several bases (mixins)": str(sum(
            isinstance(n, ast.ClassDef) and len(n.bases) > 1
            for p, t in parsed.items() if "strategies" in p.parts for n in ast.walk(t))),
        "private torch uses outside torch_private.py": str(
            sum(len(violations(p)) for p in files if p.name != "torch_private.py")),
    }


def main(trees: list[str]) -> None:
    paths = [pathlib.Path(t).resolve() for t in trees or [str(HERE)]]
    columns = [figures(p) for p in paths]
    print("| figure | " + " | ".join(str(p) for p in paths) + " |")
    print("|---|" + "---|" * len(paths))
    for key in columns[0]:
        print(f"| {key} | " + " | ".join(c[key] for c in columns) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
