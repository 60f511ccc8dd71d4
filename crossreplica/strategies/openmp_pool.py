"""The caller's OpenMP threads, put to sleep while replica threads compute.

After each parallel region an OpenMP runtime keeps its worker threads
spinning, so that the next region starts without a wake-up: GNU libgomp spins
about 300,000 pause instructions (10-15 ms on a current x86 core), LLVM's
libomp 200 ms (KMP_BLOCKTIME). A caller that runs one parallelised torch op
between two ``strategy.run`` calls (building the next batch, an update) leaves
its workers spinning on cores that the replica threads need for the whole
next run: on 2 cores with 2 replicas, 40 runs took 1.8-2.4x as long as with an
idle caller. ``OMP_WAIT_POLICY=PASSIVE`` or ``GOMP_SPINCOUNT=0`` remove it, but
only when set before torch is imported, and they slow every other region of
the program.

OpenMP 5.0's ``omp_pause_resource_all(omp_pause_soft)`` ends the spinning at
once from the caller's own thread: libgomp ends the calling thread's worker
threads (the caller's next parallel op creates them again), libomp puts its
idle threads to sleep. No thread count changes, so no kernel splits its work
differently and no replica's bits change. A runtime without the call (older
than OpenMP 5.0, or no OpenMP at all) is left alone.

Only a run that follows a run of at least ``replica_threads.QUIET_AFTER``
(1 ms) does it: the workers' spinning costs a core for at most the run's
length, while ending and re-creating them costs tens of microseconds, and on a
2-vCPU VM a new or woken worker placed on the caller's busy CPU sometimes
stalled the caller's next op by 7-8 ms (BENCHMARKS.md, "A busy caller").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable

__all__ = ["quiet_caller_threads"]

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft
# Where the runtime is not in the global namespace: the names torch's wheels load it by.
_RUNTIMES = ("libgomp.so.1", "libomp.so", "libiomp5.so", "libomp.dylib", "libiomp5.dylib")

_pause: Callable[[int], int] | None = None
_looked = False


def _find_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime torch loaded, or None."""
    if sys.platform == "win32":
        return None
    handles = []
    for name in (None, *_RUNTIMES):  # the global namespace, then by name: only if already loaded
        with contextlib.suppress(OSError, AttributeError):
            handles.append(ctypes.CDLL(name) if name is None else ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
    for handle in handles:
        try:
            pause = handle.omp_pause_resource_all
        except AttributeError:
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def quiet_caller_threads() -> None:
    """Ends the spinning of the calling thread's idle OpenMP workers (see the module
    docstring); the caller calls it just before it hands work to the replica threads
    and waits. 0.2 us when the caller has no workers, about 40 us when it has."""
    global _pause, _looked
    if not _looked:
        import torch  # noqa: F401  (the runtime is torch's; loaded by now)

        _pause, _looked = _find_pause(), True
    if _pause is not None:
        _pause(_OMP_PAUSE_SOFT)  # -1 inside a parallel region: nothing to quiet there
