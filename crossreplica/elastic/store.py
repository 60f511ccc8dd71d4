"""A worker's connection to its job's coordinator, as a ``torch.distributed.Store``.

:class:`CoordinatorStore` speaks :mod:`.protocol` to ``crossreplica coordinator``
(authenticated with the job secret) and is what the process group's rendezvous,
our start tokens, heartbeats and memberships use in place of a ``TCPStore`` when
the worker's environment names a coordinator (``CROSSREPLICA_COORDINATOR``).
``clone()`` opens a connection of its own (the heartbeat's thread uses one), and
one connection serves one request at a time.

A coordinator that is gone (its process died, its host lost) makes every call
raise ``torch.distributed.DistStoreError`` naming it; a wait that outlasts the
store's timeout raises the same, naming the keys, as TCPStore does.
"""

from __future__ import annotations

import atexit
import datetime
import socket
import threading

import torch.distributed as dist

from ..engines.deadline import Deadline
from .protocol import AuthenticationError, Channel, Op, Status, client_handshake, key_of, pack, unpack

__all__ = ["CoordinatorStore"]

#: seconds a request may take on top of the wait it asks for before the connection counts as gone
_SLACK = 30.0

#: every open CoordinatorStore: torch holds a Python store through a pointer that does not keep
#: the Python object alive (a PrefixStore over it, a clone made for torch), and a store whose
#: object is gone fails every call ("pure virtual function"); so each lives until closed
_OPEN: set[CoordinatorStore] = set()
_OPEN_LOCK = threading.Lock()


def _close_all() -> None:
    """At exit: every connection still open is closed (the coordinator sees the worker leave)."""
    with _OPEN_LOCK:
        stores = list(_OPEN)
    for store in stores:
        store.close()


def _bytes(value: object) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, tuple)):  # torch hands a value as a list of byte values on some paths
        return bytes(value)
    raise TypeError(f"a store value must be bytes or str; got {type(value).__name__}")


class CoordinatorStore(dist.Store):
    """The job's store, served by the coordinator at ``host:port`` to clients that know
    ``secret``; connects (retrying while the coordinator is not up yet) within ``timeout``.

    Raises:
        torch.distributed.DistStoreError: the coordinator cannot be reached within ``timeout``.
        ConnectionError (AuthenticationError): it refused the secret, or is no coordinator.
    """

    def __init__(self, host: str, port: int, secret: str, timeout: datetime.timedelta):
        super().__init__()
        self.host, self.port = host, port
        self._secret = secret
        self._seconds = timeout.total_seconds()
        self.set_timeout(timeout)
        self._lock = threading.Lock()
        self._channel = self._connect()
        with _OPEN_LOCK:
            _OPEN.add(self)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> Channel:
        wait = Deadline(self._seconds)
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(min(10.0, wait.left), 0.01))
                break
            except OSError as e:
                if wait.expired():
                    raise dist.DistStoreError(
                        f"cannot reach the job's coordinator at {self.where} within {self._seconds:g}s ({e}); start "
                        f"`crossreplica coordinator --port {self.port}` on {self.host} and check that this host "
                        f"reaches it") from None
                wait.back_off(0.05, 1.0)  # the coordinator may not be up yet
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            return client_handshake(sock, key_of(self._secret), self.where)
        except BaseException:
            sock.close()
            raise

    def _call(self, op: Op, fields: list[bytes], wait: float = 0.0) -> list[bytes]:
        with self._lock:
            try:
                self._channel.sock.settimeout(wait + _SLACK)
                self._channel.send(pack(op, fields))
                status, answer = unpack(self._channel.receive())
            except (OSError, ValueError, AuthenticationError) as e:
                raise dist.DistStoreError(f"the job's coordinator at {self.where} stopped answering "
                                          f"({type(e).__name__}: {e or 'connection closed'})") from None
        if status == Status.OK:
            return answer
        if status == Status.TIMEOUT:
            raise dist.DistStoreError(f"wait timeout after {wait:g}s in the store of the coordinator at "
                                      f"{self.where}, keys: {[k.decode() for k in answer]}")
        raise dist.DistStoreError(f"the coordinator at {self.where} refused a request: "
                                  f"{b''.join(answer).decode(errors='replace')}")

    def _wait_ms(self, timeout: datetime.timedelta | None = None) -> tuple[bytes, float]:
        seconds = self._seconds if timeout is None else timeout.total_seconds()
        return str(max(0, int(seconds * 1000))).encode(), seconds

    # ------------------------------------------------------------ torch.distributed.Store

    def set(self, key: str, value: object) -> None:
        self._call(Op.SET, [key.encode(), _bytes(value)])

    def get(self, key: str) -> bytes:
        ms, seconds = self._wait_ms()
        return self._call(Op.GET, [key.encode(), ms], seconds)[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(Op.ADD, [key.encode(), str(int(value)).encode()])[0])

    def compare_set(self, key: str, expected_value: object, desired_value: object) -> bytes:
        return self._call(Op.COMPARE_SET, [key.encode(), _bytes(expected_value), _bytes(desired_value)])[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(Op.CHECK, [k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        ms, seconds = self._wait_ms(timeout)
        self._call(Op.WAIT, [ms, *(k.encode() for k in keys)], seconds)

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE, [key.encode()])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(Op.NUM_KEYS, [])[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        ms, seconds = self._wait_ms()
        return self._call(Op.MULTI_GET, [ms, *(k.encode() for k in keys)], seconds)

    def multi_set(self, keys: list[str], values: list[object]) -> None:
        fields: list[bytes] = []
        for k, v in zip(keys, values, strict=True):
            fields += [k.encode(), _bytes(v)]
        self._call(Op.MULTI_SET, fields)

    def append(self, key: str, value: object) -> None:
        self._call(Op.APPEND, [key.encode(), _bytes(value)])

    def ping(self) -> None:
        """One round trip: raises DistStoreError when the coordinator is gone."""
        self._call(Op.PING, [])

    def clone(self) -> CoordinatorStore:
        """A connection of its own to the same coordinator (for another thread)."""
        return CoordinatorStore(self.host, self.port, self._secret, datetime.timedelta(seconds=self._seconds))

    def close(self) -> None:
        """Closes the connection: every later call raises, and so does one under way."""
        with _OPEN_LOCK:
            _OPEN.discard(self)
        self._channel.close()


atexit.register(_close_all)
