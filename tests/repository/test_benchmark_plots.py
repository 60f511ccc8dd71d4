"""The benchmarks' pictures: each plot helper writes a PNG; crossreplica never imports matplotlib."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_crossreplica_does_not_import_matplotlib():
    code = ("import sys, crossreplica, crossreplica.cli, crossreplica.demo; "
            "print('matplotlib' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env, text=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def plot():
    pytest.importorskip("matplotlib")
    import _plot
    return _plot


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_allreduce_picture(plot, tmp_path):
    rows = [{"replicas": n, "bytes": b, "ours": 1e-4 * n, "naive": 5e-5 * b / 4096, "bound": 1e-5}
            for n in (2, 4) for b in (4096, 1 << 20)]
    plot.plot_allreduce(rows, str(tmp_path / "a.png"), plot.SMOKE_NOTE)
    assert _is_png(tmp_path / "a.png")


def test_dist_allreduce_picture(plot, tmp_path):
    def row(b, raw):
        return {"bytes": b, "raw": raw, "raw_clone": raw, "engine": 2e-3}
    results = {"2x1": [row(4096, 1e-3), row(1 << 20, 3e-3)], "2x2": [row(4096, None), row(1 << 20, None)],
               "4x1": [row(4096, 4e-3), row(1 << 20, 9e-3)]}
    plot.plot_dist_allreduce(results, str(tmp_path / "d.png"))
    assert _is_png(tmp_path / "d.png")


def test_training_pictures(plot, tmp_path):
    times = {"baseline": [0.02, 0.03], "fused": [0.002, 0.003]}
    plot.plot_optimizer_step(times, str(tmp_path / "o.png"), "title")
    demo = {"plain": [1e-3], "one": [1.2e-3], "two": [2e-3]}
    plot.plot_training_step(times, "baseline", demo, "plain", {"one": 1, "two": 2}, str(tmp_path / "t.png"))
    plot.plot_dist_training([3e-3, 4e-3], [3.5e-3, 4.1e-3], str(tmp_path / "x.png"), "title")
    assert all(_is_png(tmp_path / f) for f in ("o.png", "t.png", "x.png"))
