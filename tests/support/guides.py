"""Runs the ```python blocks of a guide under docs/ (the porting guides' shared convention).

A guide's ```python blocks whose first line is not its *original* marker (``# TF`` in
docs/porting.md, ``# DDP`` in docs/ddp_porting.md: the code being ported) run, in order, in
one namespace per ``## `` section that starts with ``torch`` and ``cr``; an HTML comment
starting with ``setup`` holds code run at that point without being shown.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import torch

import crossreplica as cr

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
_PIECE = re.compile(r"```python\n(?P<code>.*?)```|<!-- setup\n(?P<setup>.*?)-->", re.S)


def sections(guide: pathlib.Path, original: str) -> dict[str, list[tuple[str, str]]]:
    """Per ``## `` section title, its pieces of code in order: (kind, source); blocks whose
    first line starts with ``original`` are left out."""
    text = guide.read_text()
    found: dict[str, list[tuple[str, str]]] = {}
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    for title, body in zip(parts[1::2], parts[2::2]):
        pieces = []
        for m in _PIECE.finditer(body):
            if m.group("setup") is not None:
                pieces.append(("setup", m.group("setup")))
            elif not m.group("code").lstrip().startswith(original):
                pieces.append(("snippet", m.group("code")))
        found[title.strip()] = pieces
    return found


def run_section(guide: pathlib.Path, title: str, pieces: list[tuple[str, str]]) -> None:
    """Runs one section's pieces in a fresh namespace; fails if it has no snippet."""
    namespace: dict = {"torch": torch, "cr": cr, "__name__": f"guide_{guide.stem}_{len(title)}"}
    snippets = 0
    for kind, source in pieces:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(source, f"docs/{guide.name} [{title}] {kind}", "exec"), namespace)  # noqa: S102
        snippets += kind == "snippet"
    assert snippets, f"section {title!r} has setup code but no snippet"
