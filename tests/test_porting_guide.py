"""docs/porting.md runs: every crossreplica snippet of the porting guide is executed.

The guide's convention (stated at its top): each ```python block whose first line is not
``# TF`` runs, in order, in one namespace per ``## `` section that starts with ``torch``
and ``cr``; an HTML comment starting with ``setup`` holds code run at that point without
being shown. The snippets assert what they claim (results computed in plain torch by the
snippet itself); a snippet that raises fails its section here.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest
import torch

import crossreplica as cr

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "porting.md"
_PIECE = re.compile(r"```python\n(?P<code>.*?)```|<!-- setup\n(?P<setup>.*?)-->", re.S)


def _sections() -> dict[str, list[tuple[str, str]]]:
    """Per ``## `` section title, its pieces of code in order: (kind, source)."""
    text = GUIDE.read_text()
    sections: dict[str, list[tuple[str, str]]] = {}
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    for title, body in zip(parts[1::2], parts[2::2]):
        pieces = []
        for m in _PIECE.finditer(body):
            if m.group("setup") is not None:
                pieces.append(("setup", m.group("setup")))
            elif not m.group("code").lstrip().startswith("# TF"):
                pieces.append(("snippet", m.group("code")))
        sections[title.strip()] = pieces
    return sections


SECTIONS = _sections()


def test_the_guide_has_its_sections():
    for title in ("Strategies and replica functions", "Cross-device ops", "CrossShardOptimizer",
                  "Variables with synchronization and aggregation", "The rest of the strategy surface"):
        assert any(title in t for t in SECTIONS), title
    assert sum(kind == "snippet" for pieces in SECTIONS.values() for kind, _ in pieces) >= 19  # the parser finds them


@pytest.mark.parametrize("title", [t for t, pieces in SECTIONS.items() if pieces])
def test_section_snippets_run(title):
    namespace: dict = {"torch": torch, "cr": cr, "__name__": f"porting_guide_{len(title)}"}
    snippets = 0
    for kind, source in SECTIONS[title]:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(source, f"docs/porting.md [{title}] {kind}", "exec"), namespace)  # noqa: S102
        snippets += kind == "snippet"
    assert snippets, f"section {title!r} has setup code but no snippet"
