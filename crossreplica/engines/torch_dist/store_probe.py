"""Store calls that cannot outlast a cut network link.

A wait's store calls (the abort key, the progress keys, a host-side meeting)
go to the store host over TCP. When the link to it is cut (no reset, packets
dropped), such a call blocks until the kernel stops retransmitting, many
minutes later, far past the collective timeout, and the cut-off worker never
reports. :class:`StoreProbe` runs each call on one daemon thread and waits
for its answer for at most ``PROBE_SECONDS``; a call that does not answer
marks the store unreachable, and every later call returns its default at once,
so the wait runs to its deadline and raises with a message that says the store
stopped answering. The blocked call stays on its daemon thread, which never
keeps the process from exiting. A store that refuses or fails a call (its
host died) answers the default at once, as before. (Why a thread and not the
store's own timeout: docs/architecture.md, "engines/torch_dist/store_probe.py".)
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["PROBE_SECONDS", "StoreProbe"]

#: how long one store call of a wait may take before the store counts as unreachable
PROBE_SECONDS = 3.0
#: a second, short wait before that verdict: a worker frozen (SIGSTOP) in a call finds the
#: answer waiting when it thaws, though its clock ran past the first wait
_THAWED = 0.5

_log = logging.getLogger(__name__)

_requests: queue.SimpleQueue = queue.SimpleQueue()
_server: threading.Thread | None = None
_server_lock = threading.Lock()


def _serve() -> None:
    while True:
        request = _requests.get()
        if request is None:  # the interpreter exits
            return
        call, box, done = request
        try:
            box.append(call())
        except Exception as e:  # noqa: BLE001 - the caller decides: its default, or the error
            box.append(_Failed(e))
        done.set()


def _stop_at_exit() -> None:
    """Ends the probe's thread before the interpreter finalizes, so it is never inside a
    store call while the store's objects are torn down (bounded: a call stuck on a cut
    link is left behind)."""
    server = _server
    if server is not None and server.is_alive():
        _requests.put(None)
        server.join(_EXIT_JOIN)


def _reset_in_child() -> None:
    """A forked child starts without the parent's thread, queue and lock."""
    global _requests, _server, _server_lock
    _requests, _server, _server_lock = queue.SimpleQueue(), None, threading.Lock()


atexit.register(_stop_at_exit)
os.register_at_fork(after_in_child=_reset_in_child)

#: seconds the interpreter's exit waits for the probe's thread
_EXIT_JOIN = 1.0


class _Failed:
    """A call that raised (the store host refused or dropped the connection)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


class StoreProbe:
    """The store calls of one engine's waits, each bounded (see the module docstring)."""

    def __init__(self, store: Any, seconds: float = PROBE_SECONDS):
        self.store = store
        self.seconds = seconds
        #: a call did not answer in time: the store host is cut off from this worker
        self.unreachable = False

    def __call__(self, default: Any, call: Callable[[Any], Any], raises: bool = False) -> Any:
        """``call(store)``, or ``default`` when it does not answer in time, or when it fails
        (``raises``: its error instead, for a wait that a dead store host must end)."""
        if self.store is None or self.unreachable:
            return default
        global _server
        with _server_lock:
            if _server is None or not _server.is_alive():
                _server = threading.Thread(target=_serve, name="crossreplica-store-probe", daemon=True)
                _server.start()
        box: list[Any] = []
        done = threading.Event()
        store = self.store
        _requests.put((lambda: call(store), box, done))
        if not done.wait(self.seconds) and not done.wait(_THAWED):
            self.unreachable = True
            _log.warning("the store did not answer within %gs: this worker is probably cut off from the store "
                         "host (rank 0, or torchrun's agent); its waits now run to their timeout", self.seconds)
            return default
        answer = box[0] if box else default
        if isinstance(answer, _Failed):
            if raises:
                raise answer.error
            return default
        return answer
