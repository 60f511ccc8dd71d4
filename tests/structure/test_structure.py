"""The structure figures that must stay at zero (scripts/structure_figures.py computes them all)."""

from __future__ import annotations

import importlib.util
import os
import pathlib

from harness import REPO


# Modules whose waits the elastic work moves onto engines/deadline.py next (issue 39): strike each
# once it is converted; when none is left, the package figures themselves must read 0.
WAITS_PENDING: set[str] = set()


def _script():
    spec = importlib.util.spec_from_file_location("structure_figures", os.path.join(REPO, "scripts", "structure_figures.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures() -> dict[str, str]:
    return _script().figures(pathlib.Path(REPO))


def test_kinds_read_by_field_waits_bounded_by_one_primitive_seams_typed():
    f = _figures()
    assert f["positional parameter reads (engines, collectives)"] == "0"  # a kind's record is read by field
    assert f["strategy / rctx / engine typed Any"] == "0"  # the protocols and classes type them
    assert f["strategy classes with several bases (mixins)"] == "0"
    assert f["private torch uses outside torch_private.py"] == "0"


def test_every_wait_keeps_its_deadline_and_pauses_in_engines_deadline():
    """No module but engines/deadline.py computes a deadline, doubles a pause or sleeps in a
    loop itself (the figures' "waits keeping their own deadline", "loops doubling their own
    pause", "time.sleep in while-loops")."""
    script = _script()
    package = pathlib.Path(REPO) / "crossreplica"
    by_hand = {}
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        waits = script.hand_waits(path.read_text())
        if name != script.WAITS and name not in WAITS_PENDING and any(waits.values()):
            by_hand[name] = waits
    assert by_hand == {}, "wait through crossreplica.engines.deadline.Deadline (sleep, back_off, left) instead"
    if not WAITS_PENDING:
        f = _figures()
        assert f["waits keeping their own deadline (package)"] == f["loops doubling their own pause (package)"] \
            == f["time.sleep in while-loops (package)"] == "0"


def test_the_wait_scan_finds_each_kind_of_hand_wait():
    """hand_waits counts what it is meant to (so that a 0 above means something)."""
    script = _script()
    source = """
import time
def wait(ready, timeout):
    end, pause = time.monotonic() + timeout, 0.001
    while not ready():
        if deadline - time.monotonic() < 0:
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
        delay = min(delay * 2, 1.0)
"""
    assert script.hand_waits(source) == {"deadline": 2, "back-off": 2, "sleep": 1}
    assert script.hand_waits("def f(wait):\n    while not wait.expired():\n        wait.back_off(1e-3, 0.1)\n") \
        == {"deadline": 0, "back-off": 0, "sleep": 0}
