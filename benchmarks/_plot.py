"""Pictures of the benchmark results: one PNG per script, under docs/img/.

matplotlib is imported here only (the ``benchmarks`` extra of pyproject.toml;
crossreplica itself never needs it), with the non-interactive Agg backend so
the scripts run on machines without a display. Without matplotlib a script
prints its tables and says that it skipped the picture.

Every function takes plain numbers (seconds, bytes), so a script hands over
what it measured and the picture follows the table it printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from _common import fmt_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG_DIR = os.path.join(ROOT, "docs", "img")


def default_path(name: str) -> str:
    """``docs/img/<name>.png`` in the repository."""
    return os.path.join(IMG_DIR, f"{name}.png")


def add_plot_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--plot PATH`` (default docs/img/<name>.png) and ``--no-plot``."""
    parser.add_argument("--plot", default=default_path(name), metavar="PATH",
                        help=f"where to write the PNG picture of the results (default docs/img/{name}.png)")
    parser.add_argument("--no-plot", action="store_true", help="print the tables only")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'crossreplica[benchmarks]'); no picture written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, path: str, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    rel = os.path.relpath(path, os.getcwd())
    print(f"picture: {path if rel.startswith('..') else rel}")


#: The note a smoke run (``--quick``) prints on its picture.
SMOKE_NOTE = "smoke run (--quick): checks the script, not a measurement"


def _titled(title: str, note: str | None) -> str:
    return title if not note else f"{title}\n[{note}]"


def _time_axis(ax: Any) -> None:
    """A log time axis labelled in us/ms/s; call after plotting (it looks at the data range)."""
    from matplotlib.ticker import LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.set_ylabel("time per call")
    lo, hi = ax.get_ylim()
    if hi / lo < 100:  # under two decades: label 1, 2 and 5 of each decade, not only powers of ten
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(_time_formatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", alpha=0.3)


def _size_axis(ax: Any, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes))
    ax.set_xticklabels([fmt_size(s) for s in sizes], rotation=30)
    ax.minorticks_off()
    ax.set_xlabel("bytes per replica")


def _time_formatter() -> Any:
    """Seconds as us / ms / s on a log axis."""
    from matplotlib.ticker import FuncFormatter

    def fmt(seconds: float, _pos: int) -> str:
        if seconds <= 0:
            return ""
        if seconds < 1e-3:
            return f"{seconds * 1e6:g} us"
        if seconds < 1:
            return f"{seconds * 1e3:g} ms"
        return f"{seconds:g} s"
    return FuncFormatter(fmt)


# ------------------------------------------------------------------ in-process all-reduce

def plot_allreduce(rows: Sequence[Mapping[str, float]], path: str, note: str | None = None) -> None:
    """All-reduce time vs size per replica count (ours, naive, traffic bound), and
    latency at the smallest size vs replicas.

    Args:
        rows: ``{"replicas", "bytes", "ours", "naive", "bound"}`` (seconds) per measurement.
    """
    plt = _pyplot()
    if plt is None:
        return
    counts = sorted({int(r["replicas"]) for r in rows})
    sizes = sorted({int(r["bytes"]) for r in rows})
    fig, axes = plt.subplots(1, len(counts) + 1, figsize=(4.2 * (len(counts) + 1), 4.0))
    styles = {"ours": ("crossreplica", "-", "o"), "naive": ("naive stack+sum", "--", "s"),
              "bound": ("memory-traffic bound", ":", "^")}
    for ax, n in zip(axes, counts):
        mine = sorted((r for r in rows if int(r["replicas"]) == n), key=lambda r: r["bytes"])
        for key, (label, ls, marker) in styles.items():
            ax.plot([r["bytes"] for r in mine], [r[key] for r in mine], ls, marker=marker, label=label)
        _size_axis(ax, sizes)
        _time_axis(ax)
        ax.set_title(f"{n} in-process replicas")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small", frameon=False)
    ax = axes[-1]
    small = sizes[0]
    for key, (label, ls, marker) in styles.items():
        pts = sorted((int(r["replicas"]), r[key]) for r in rows if int(r["bytes"]) == small)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker=marker, label=label)
    ax.set_xticks(counts)
    ax.set_xlabel("replicas")
    _time_axis(ax)
    ax.set_title(f"latency at {fmt_size(small)}")
    fig.suptitle(_titled("In-process all-reduce (threads engine), median per call", note))
    _save(fig, path, rect=(0, 0.06, 1, 1))  # room for the shared legend below
    plt.close(fig)


# ------------------------------------------------------------------ across processes

def plot_dist_allreduce(results: Mapping[str, Sequence[Mapping[str, float]]], path: str,
                        note: str | None = None) -> None:
    """Per layout: engine vs raw torch.distributed time vs size; and hierarchical vs flat.

    Args:
        results: layout ("2x1") -> rows ``{"bytes", "raw", "raw_clone", "engine"}``
            (seconds; raw values 0/None where not measured).
    """
    plt = _pyplot()
    if plt is None:
        return
    layouts = list(results)
    sizes = sorted({int(r["bytes"]) for rows in results.values() for r in rows})
    fig, axes = plt.subplots(1, len(layouts), figsize=(4.4 * len(layouts), 4.0), squeeze=False)
    styles = {"engine": ("crossreplica engine", "-", "o"), "raw": ("raw dist.all_reduce (in place)", "--", "s"),
              "raw_clone": ("raw on a fresh copy", ":", "^")}
    for ax, lay in zip(axes[0], layouts):
        rows = sorted(results[lay], key=lambda r: r["bytes"])
        for key, (label, ls, marker) in styles.items():
            pts = [(r["bytes"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker=marker, label=label)
        if lay == "2x2" and "4x1" in results:
            flat = sorted(results["4x1"], key=lambda r: r["bytes"])
            ax.plot([r["bytes"] for r in flat], [r["engine"] for r in flat], "-.", marker="x",
                    label="flat 4x1 engine (same 4 replicas)")
        workers, rpw = lay.split("x")
        ax.set_title(f"{workers} processes x {rpw} replica(s)")
        _size_axis(ax, sizes)
        _time_axis(ax)
        ax.legend(fontsize="small")
    fig.suptitle(_titled("All-reduce across processes (gloo, loopback), median per call on rank 0", note))
    _save(fig, path)
    plt.close(fig)


# ------------------------------------------------------------------ training steps

def _ratio_bars(ax: Any, names: Sequence[str], values: Sequence[float], baseline_label: str) -> None:
    colors = ["0.6"] + ["C0"] * (len(values) - 1)
    bars = ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)))
    ax.set_yticklabels(names, fontsize="small")
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.2f}x", va="center",
                fontsize="small")
    ax.set_xlabel(f"median step time / {baseline_label}")
    ax.set_xlim(0, max(values) * 1.25)


def plot_optimizer_step(times: Mapping[str, Sequence[float]], path: str, title: str,
                        note: str | None = None) -> None:
    """Median time per step of each variant; speed-ups over the per-tensor baseline."""
    plt = _pyplot()
    if plt is None:
        return
    names = list(times)
    med = [statistics.median(times[n]) * 1e3 for n in names]
    fig, ax = plt.subplots(figsize=(8.0, 3.4))
    colors = ["0.6" if "baseline" in n else "C0" for n in names]
    bars = ax.barh(range(len(names)), med, color=colors)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize="small")
    ax.invert_yaxis()
    for i, (bar, v) in enumerate(zip(bars, med)):
        base = med[i - i % 2]  # variants come in (baseline, fused) pairs
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {v:.2f} ms" + ("" if i % 2 == 0 else f"  ({base / v:.1f}x faster)"), va="center",
                fontsize="small")
    ax.set_xlabel("median ms per step")
    ax.set_xlim(0, max(med) * 1.45)
    ax.set_title(_titled(title, note), fontsize="medium")
    _save(fig, path)
    plt.close(fig)


def plot_training_step(mlp: Mapping[str, Sequence[float]], mlp_baseline: str,
                       demo: Mapping[str, Sequence[float]], demo_baseline: str,
                       demo_replicas: Mapping[str, int], path: str, note: str | None = None) -> None:
    """Step time relative to one process (the large MLP), and the demo model's step time
    vs replicas against the plain-torch line."""
    plt = _pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.0, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    base = statistics.median(mlp[mlp_baseline])
    names = list(mlp)
    _ratio_bars(ax1, names, [statistics.median(mlp[n]) / base for n in names], "one process")
    ax1.set_title("MLP 784-1024-1024-10, global batch 256", fontsize="medium")
    pts = sorted((demo_replicas[n], statistics.median(ts) * 1e3) for n, ts in demo.items() if n in demo_replicas)
    ax2.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label="crossreplica strategy")
    ax2.axhline(statistics.median(demo[demo_baseline]) * 1e3, color="0.5", ls="--", label="plain torch, one device")
    ax2.set_xticks([p[0] for p in pts])
    ax2.set_xlabel("replicas (in-process)")
    ax2.set_ylabel("median ms per step")
    ax2.set_ylim(0, max(p[1] for p in pts) * 1.2)
    ax2.legend(fontsize="small")
    ax2.set_title("demo MLP 64-128-128-10, global batch 64", fontsize="medium")
    if note:
        fig.suptitle(note, color="C3")
    _save(fig, path)
    plt.close(fig)


def plot_dist_training(t_ddp: Sequence[float], t_ours: Sequence[float], path: str, title: str,
                       note: str | None = None) -> None:
    """Step time of CrossShardOptimizer vs DDP: medians as bars, every step as dots."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    series = [("torch DDP", t_ddp), ("crossreplica\n(CrossShardOptimizer)", t_ours)]
    base = statistics.median(t_ddp)
    labels = []
    for i, (label, ts) in enumerate(series):
        med = statistics.median(ts)
        ax.barh(i, med * 1e3, color="0.6" if i == 0 else "C0", height=0.6)
        ax.plot([t * 1e3 for t in ts], [i] * len(ts), "k.", alpha=0.35, ms=4)
        labels.append(f"{label}\nmedian {med * 1e3:.2f} ms, {med / base:.2f}x DDP")
    ax.set_yticks(range(len(series)))
    ax.set_yticklabels(labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (bar: median; dots: every step)")
    ax.set_title(_titled(title, note), fontsize="small")
    _save(fig, path)
    plt.close(fig)
