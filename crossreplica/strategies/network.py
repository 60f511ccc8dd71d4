"""The network side of forming the process group: which interface gloo uses, and a bound on
the set-up itself.

gloo advertises the address its host name resolves to. With Debian's default
``/etc/hosts`` (the host's own name -> 127.0.1.1) that is a loopback address,
which a peer on another host cannot reach: the peer fails with "Connection
refused, remote=[127.0.1.1]" and the others wait in gloo's connect loop well
past any timeout. :func:`choose_gloo_interface` detects it (the host name
resolves to loopback while ``MASTER_ADDR`` does not) and names the interface
whose address routes to ``MASTER_ADDR``, for ``GLOO_SOCKET_IFNAME``; a
``GLOO_SOCKET_IFNAME`` the user set is honoured.

:func:`bounded` bounds the set-up: torch's ``init_process_group`` can block in
gloo's C++ connect loop, where no Python exception reaches it; past the timeout
(plus a grace) the process reports the cause on stderr and exits, so a job never
hangs in its set-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator

__all__ = ["bounded", "choose_gloo_interface"]

_log = logging.getLogger(__name__)

#: seconds past the timeout before a set-up stuck in the backend ends the process
GRACE_SECONDS = 10.0

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _loopback(host: str) -> bool | None:
    """Whether ``host`` (a name or an address) resolves to a loopback address; None when it
    does not resolve."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return None


def _interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address`` (Linux), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def choose_gloo_interface(master_addr: str) -> str | None:
    """The interface gloo should use to reach ``master_addr``, when its default would not
    (this host's name resolves to loopback while ``master_addr`` is remote); None otherwise
    (also when ``GLOO_SOCKET_IFNAME`` is set: the user's choice stands)."""
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    if chosen:
        _log.info("gloo uses GLOO_SOCKET_IFNAME=%s (set in the environment)", chosen)
        return None
    if _loopback(master_addr) is not False or _loopback(socket.gethostname()) is not True:
        return None  # a job on this host, or gloo's default address is reachable
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master_addr), 9))  # no packet: picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    return _interface_of(local)


@contextlib.contextmanager
def bounded(what: str, seconds: float, fix: str) -> Iterator[None]:
    """Ends the process (exit code 1, the cause on stderr and in the log) if the block takes
    longer than ``seconds`` plus :data:`GRACE_SECONDS`."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds + GRACE_SECONDS):
            return
        message = (f"crossreplica: {what} did not finish within the timeout ({seconds:g}s) plus "
                   f"{GRACE_SECONDS:g}s: it is stuck in the backend's connect loop, so this process "
                   f"exits rather than hang. {fix}")
        _log.error("%s", message)
        print(message, file=sys.stderr, flush=True)
        os._exit(1)

    watcher = threading.Thread(target=watch, name="crossreplica-setup-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
