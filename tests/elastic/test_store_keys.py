"""The store's schema: every key crossreplica writes is made in crossreplica/store_keys.py."""

from __future__ import annotations

import ast
import pathlib

import crossreplica
from crossreplica import store_keys

PACKAGE = pathlib.Path(crossreplica.__file__).parent


def _literals_naming_keys(path: pathlib.Path) -> list[str]:
    """String literals (or f-string heads) that start a store key: ``crossreplica/...``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("crossreplica/"):
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def test_every_store_key_is_made_in_the_schema_module():
    stray = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "store_keys.py"
             for hit in _literals_naming_keys(path)]
    assert stray == [], "make the key in crossreplica/store_keys.py (and list it in its docstring)"


def test_the_schema_lists_every_key_it_makes():
    doc = store_keys.__doc__ or ""
    for name in ("greeting", "answer", "arrivals", "start", "launch/hosts", "engines-of-rank", "heartbeat",
                 "progress", "abort", "read/", "meet/", "p2p/", "shm/", "ft/founders", "ft/joins", "join/<t>",
                 "alive/", "decided", "fatal", "grow", "group/"):
        assert name in doc, name
    assert store_keys.alive(3, 2) == "crossreplica/ft/3/alive/2"
    assert store_keys.p2p(store_keys.engine(4), 0, 1) == "crossreplica/engine4/p2p/0->1"
