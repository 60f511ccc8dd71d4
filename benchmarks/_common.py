"""Shared helpers for the benchmark scripts: timing, medians, table printing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def timeit(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call of ``fn`` over ``reps`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def median_time(fn: Callable[[], object], reps: int, rounds: int) -> float:
    """Median seconds per call of ``fn`` over ``rounds`` loops of ``reps`` calls, after one
    loop of warm-up."""
    timeit(fn, reps)
    return statistics.median(timeit(fn, reps) for _ in range(rounds))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def fmt_size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A Markdown table, so the output pastes straight into BENCHMARKS.md."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
