"""docs/porting.md runs: every crossreplica snippet of the porting guide is executed.

The guide's convention (stated at its top): each ```python block whose first line is not
``# TF`` or ``# JAX`` (the code being ported) runs, in order, in one namespace per ``## ``
section that starts with ``torch`` and ``cr``; an HTML comment starting with ``setup`` holds
code run at that point without being shown. The snippets assert what they claim (results
computed in plain torch by the snippet itself); a snippet that raises fails its section here.
The parser and runner are shared with docs/ddp_porting.md's test (tests/support/guides.py).
"""

from __future__ import annotations

import pytest
from guides import DOCS, run_section, sections

GUIDE = DOCS / "porting.md"
SECTIONS = sections(GUIDE, ("# TF", "# JAX"))  # str.startswith takes a tuple: either marker is left out


def test_the_guide_has_its_sections():
    for title in ("Strategies and replica functions", "Cross-device ops", "CrossShardOptimizer",
                  "Variables with synchronization and aggregation", "The rest of the strategy surface"):
        assert any(title in t for t in SECTIONS), title
    assert sum(kind == "snippet" for pieces in SECTIONS.values() for kind, _ in pieces) >= 19  # the parser finds them


def test_the_pmap_section_runs_its_snippets_only():
    """The JAX pmap section: its four crossreplica snippets (and the autograd one) run, JAX's do not."""
    pieces = SECTIONS["JAX `pmap`"]
    assert sum(kind == "snippet" for kind, _ in pieces) == 5
    assert not any(source.lstrip().startswith("# JAX") for _, source in pieces)
    text = GUIDE.read_text().split("## JAX `pmap`", 1)[1]
    assert text.count("```python\n# JAX") == 4  # every JAX block has its crossreplica counterpart


@pytest.mark.parametrize("title", [t for t, pieces in SECTIONS.items() if pieces])
def test_section_snippets_run(title):
    run_section(GUIDE, title, SECTIONS[title])
