"""docs/ddp_porting.md runs: every crossreplica snippet of the DDP porting guide is executed.

The convention is docs/porting.md's (tests/support/guides.py): each ```python block whose first line
is not ``# DDP`` runs, in order, in one namespace per ``## `` section that starts with
``torch`` and ``cr``; ``<!-- setup ... -->`` comments hold code run without being shown. The
snippets check their claims against plain torch computed in the snippet.
"""

from __future__ import annotations

import pytest
from guides import DOCS, run_section, sections

GUIDE = DOCS / "ddp_porting.md"
SECTIONS = sections(GUIDE, "# DDP")


def test_the_guide_has_its_sections():
    for title in ("The wrapper", "Gradient accumulation and `no_sync`", "`if master_process:`", "Per-rank seeds",
                  "Learning-rate schedules", "Gradient clipping", "Saving", "Resuming", "`torch.compile`"):
        assert any(t.startswith(title) for t in SECTIONS), title
        assert any(t.startswith(title) and pieces for t, pieces in SECTIONS.items()), f"{title}: nothing runs"
    assert sum(kind == "snippet" for pieces in SECTIONS.values() for kind, _ in pieces) >= 10


@pytest.mark.parametrize("title", [t for t, pieces in SECTIONS.items() if pieces])
def test_section_snippets_run(title):
    run_section(GUIDE, title, SECTIONS[title])
