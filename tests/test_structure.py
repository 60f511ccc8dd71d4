"""The structure figures that must stay at zero (scripts/structure_figures.py computes them all)."""

from __future__ import annotations

import importlib.util
import os
import pathlib

from harness import REPO


def _figures() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("structure_figures", os.path.join(REPO, "scripts", "structure_figures.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.figures(pathlib.Path(REPO))


def test_kinds_read_by_field_waits_bounded_by_one_primitive_seams_typed():
    f = _figures()
    assert f["positional parameter reads (engines, collectives)"] == "0"  # a kind's record is read by field
    assert f["collective waits keeping their own deadline"] == "0"  # engines/deadline.py bounds them
    assert f["strategy / rctx / engine typed Any"] == "0"  # the protocols and classes type them
    assert f["strategy classes with several bases (mixins)"] == "0"
    assert f["private torch uses outside torch_private.py"] == "0"
