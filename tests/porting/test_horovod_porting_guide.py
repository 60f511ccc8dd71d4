"""docs/horovod_porting.md runs: every crossreplica snippet of the Horovod porting guide is executed.

The convention is the other porting guides' (tests/support/guides.py): each ```python block whose
first line is not ``# Horovod`` runs, in order, in one namespace per ``## `` section that starts
with ``torch`` and ``cr``; ``<!-- setup ... -->`` comments hold code run without being shown. The
snippets check their claims against plain torch computed in the snippet.
"""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist
from guides import DOCS, run_section, sections

GUIDE = DOCS / "horovod_porting.md"
SECTIONS = sections(GUIDE, "# Horovod")

#: the Horovod API the guide maps, each in the section that runs its counterpart
MAPPED = {
    "`hvd.init()`, `size`, `rank`, `local_rank`": ["hvd.init()", "hvd.size()", "hvd.rank()", "hvd.local_rank()"],
    "`hvd.DistributedOptimizer`": ["hvd.DistributedOptimizer"],
    "`broadcast_parameters` and `broadcast_optimizer_state`": ["hvd.broadcast_parameters",
                                                                 "hvd.broadcast_optimizer_state"],
    "`DistributedSampler`": ["DistributedSampler", "set_epoch"],
    "`model.train()` and `model.eval()`": ["model.train()", "model.eval()"],
    "Metrics: `hvd.allreduce` in host code": ["hvd.allreduce"],
    "`synchronize` and `skip_synchronize`: clipping and mixed precision": ["synchronize()", "skip_synchronize()"],
    "`backward_passes_per_step`": ["backward_passes_per_step"],
    "Elastic Horovod": ["hvd.elastic.TorchState", "hvd.elastic.run"],
    "`hvd.SyncBatchNorm` and collectives in the training step": ["hvd.SyncBatchNorm"],
}


def test_the_guide_maps_horovods_api_and_runs_each_section():
    text = GUIDE.read_text()
    for title, names in MAPPED.items():
        assert title in SECTIONS, title
        assert any(kind == "snippet" for kind, _ in SECTIONS[title]), f"{title}: nothing runs"
        original = re.search(rf"^## {re.escape(title)}\n.*?```python\n(# Horovod\n.*?)```", text, re.S | re.M)
        assert original, f"{title}: no Horovod block"
        for name in names:
            assert name in original.group(1), f"{title}: the Horovod block does not show {name}"
    assert "Compression, `op=`, Adasum" in SECTIONS and "Launching" in SECTIONS
    for title in SECTIONS:  # the contents list links every section
        assert f"[{title}](#" in text, title


@pytest.mark.parametrize("title", [t for t, pieces in SECTIONS.items() if pieces])
def test_section_snippets_run(title):
    had_group = dist.is_initialized()
    try:
        run_section(GUIDE, title, SECTIONS[title])
    finally:
        if dist.is_initialized() and not had_group:  # the elastic section's job, should it fail midway
            dist.destroy_process_group()
    assert dist.is_initialized() == had_group
