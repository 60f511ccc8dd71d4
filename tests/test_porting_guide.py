"""docs/porting.md runs: every crossreplica snippet of the porting guide is executed.

The guide's convention (stated at its top): each ```python block whose first line is not
``# TF`` runs, in order, in one namespace per ``## `` section that starts with ``torch``
and ``cr``; an HTML comment starting with ``setup`` holds code run at that point without
being shown. The snippets assert what they claim (results computed in plain torch by the
snippet itself); a snippet that raises fails its section here. The parser and runner are
shared with docs/ddp_porting.md's test (tests/support/guides.py).
"""

from __future__ import annotations

import pytest
from guides import DOCS, run_section, sections

GUIDE = DOCS / "porting.md"
SECTIONS = sections(GUIDE, "# TF")


def test_the_guide_has_its_sections():
    for title in ("Strategies and replica functions", "Cross-device ops", "CrossShardOptimizer",
                  "Variables with synchronization and aggregation", "The rest of the strategy surface"):
        assert any(title in t for t in SECTIONS), title
    assert sum(kind == "snippet" for pieces in SECTIONS.values() for kind, _ in pieces) >= 19  # the parser finds them


@pytest.mark.parametrize("title", [t for t, pieces in SECTIONS.items() if pieces])
def test_section_snippets_run(title):
    run_section(GUIDE, title, SECTIONS[title])
