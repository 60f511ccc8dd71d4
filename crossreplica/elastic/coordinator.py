"""``crossreplica coordinator``: a job's coordination service, apart from its workers.

The coordinator is the job's store (what torch.distributed's rendezvous, our
start tokens, heartbeats, abort keys and fault-tolerant memberships are written
to) served by a process that holds no training state, on any machine. Losing
any worker, or any worker's host, the chief's included, then leaves the store
standing, so ``cr.FaultTolerance`` can survive it; under a hand launch rank 0
serves the store, and under torchrun its agent, so losing that host ends the job.

Every client authenticates with the job secret (:mod:`.protocol`: a mutual
challenge-response, then signed frames): a client without it can read, list or
write nothing. There is no way to list keys at all. Workers reach it through
:class:`~crossreplica.elastic.store.CoordinatorStore`, a ``torch.distributed.Store``.

Why our own server and not torch's ``TCPStore``: TCPStore has no authentication
(anyone who reaches its port can list every key and write any), and torch's
rendezvous backends do not offer one either; etcd has TLS and authentication but
is another service to install and run. The store's traffic is small (set-up, a
few heartbeat counters a second, memberships), so a threaded Python server is
fast enough (benchmarks/fault_tolerance.py measures the steady state through it).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable

from .. import settings
from ..engines.deadline import Deadline
from .protocol import (HANDSHAKE_SECONDS, AuthenticationError, Channel, Op, Status, key_of, pack,
                       server_handshake, shut, unpack)

__all__ = ["MIN_SECRET", "Coordinator", "add_arguments", "main"]

_log = logging.getLogger(__name__)

#: connections still proving themselves, at most; more are dropped at once
_MAX_UNPROVEN = 64
#: the shortest job secret the coordinator accepts (a random hex secret of 16 bytes has 32 characters)
MIN_SECRET = 16


class Coordinator:
    """Serves one job's store on ``host:port`` (port 0: a free one, see :attr:`port`) to the
    clients that prove they know ``secret``, from a thread of its own until :meth:`close`.

    Attributes:
        refused: connections refused for not knowing the secret (or speaking another protocol).
    """

    def __init__(self, secret: str, host: str = "0.0.0.0", port: int = 0):
        if not isinstance(secret, str) or len(secret) < MIN_SECRET:
            raise ValueError(f"the job secret must be a string of at least {MIN_SECRET} characters (e.g. "
                             f"`openssl rand -hex 16`); got one of {len(secret) if isinstance(secret, str) else 0}")
        self._key = key_of(secret)
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._unproven = threading.BoundedSemaphore(_MAX_UNPROVEN)
        self._closed = False
        self.refused = 0
        try:
            self._listener = socket.create_server((host, port), backlog=1024, reuse_port=False)
        except OSError as e:
            raise RuntimeError(f"the coordinator cannot listen on {host}:{port}: {e}; choose a free port and an "
                               f"address of this host (--host, --port)") from None
        self.host, self.port = host, self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="crossreplica-coordinator", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ connections

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            if not self._unproven.acquire(blocking=False):
                sock.close()  # a flood of unauthenticated connections: drop the newest
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name="crossreplica-coordinator-client",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, peer: tuple) -> None:
        with self._changed:
            if self._closed:
                sock.close()
                self._unproven.release()
                return
            self._connections.add(sock)
        channel: Channel | None = None
        try:
            try:
                sock.settimeout(HANDSHAKE_SECONDS)
                channel = server_handshake(sock, self._key)
            except (AuthenticationError, OSError) as e:
                with self._changed:
                    self.refused += 1
                _log.warning("crossreplica coordinator: refused a connection from %s:%s (%s)", peer[0], peer[1],
                             e if isinstance(e, AuthenticationError) else f"no handshake: {e}")
                return
            finally:
                self._unproven.release()
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                request = channel.receive()
                channel.send(self._answer(request))
        except (OSError, AuthenticationError):
            pass  # the client went away (or tampered with the connection): drop it
        finally:
            with self._changed:
                self._connections.discard(sock)
            sock.close()

    def close(self) -> None:
        """Stops serving: the listener and every connection close (clients see the coordinator gone)."""
        with self._changed:
            self._closed = True
            connections = list(self._connections)
            self._changed.notify_all()
        shut(self._listener)  # wakes the accept
        self._listener.close()
        for sock in connections:
            shut(sock)  # their threads close them
        self._thread.join(5.0)

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the store

    def _answer(self, request: bytes) -> bytes:
        try:
            code, fields = unpack(request)
            handler = self._HANDLERS[Op(code)]
            return handler(self, fields)
        except (ValueError, KeyError, IndexError) as e:
            return pack(Status.ERROR, [f"bad request: {type(e).__name__}: {e}".encode()])

    def _await(self, ready: Callable[[], bool], timeout_ms: bytes) -> bool:
        """Waits (holding the condition) until ``ready()`` or the client's timeout; whether it is."""
        wait = Deadline(int(timeout_ms) / 1000)
        while not ready():
            if wait.expired() or self._closed:
                return False
            self._changed.wait(wait.left)
        return True

    def _set(self, f: list[bytes]) -> bytes:
        with self._changed:
            self._data[f[0].decode()] = f[1]
            self._changed.notify_all()
        return pack(Status.OK, [])

    def _get(self, f: list[bytes]) -> bytes:
        key = f[0].decode()
        with self._changed:
            if not self._await(lambda: key in self._data, f[1]):
                return pack(Status.TIMEOUT, [key.encode()])
            return pack(Status.OK, [self._data[key]])

    def _add(self, f: list[bytes]) -> bytes:
        key = f[0].decode()
        with self._changed:
            value = int(self._data.get(key, b"0")) + int(f[1])
            self._data[key] = str(value).encode()
            self._changed.notify_all()
        return pack(Status.OK, [str(value).encode()])

    def _compare_set(self, f: list[bytes]) -> bytes:
        # torch's TCPStore rule: a missing key with an empty expectation is set; a missing
        # key otherwise answers the expectation; a match is replaced; else the current value
        key, expected, desired = f[0].decode(), f[1], f[2]
        with self._changed:
            current = self._data.get(key)
            if (current is None and expected == b"") or (current is not None and current == expected):
                self._data[key] = desired
                self._changed.notify_all()
                return pack(Status.OK, [desired])
            return pack(Status.OK, [expected if current is None else current])

    def _check(self, f: list[bytes]) -> bytes:
        with self._changed:
            return pack(Status.OK, [b"1" if all(k.decode() in self._data for k in f) else b"0"])

    def _wait(self, f: list[bytes]) -> bytes:
        keys = [k.decode() for k in f[1:]]
        with self._changed:
            if not self._await(lambda: all(k in self._data for k in keys), f[0]):
                return pack(Status.TIMEOUT, [k.encode() for k in keys if k not in self._data])
        return pack(Status.OK, [])

    def _delete(self, f: list[bytes]) -> bytes:
        with self._changed:
            return pack(Status.OK, [b"1" if self._data.pop(f[0].decode(), None) is not None else b"0"])

    def _num_keys(self, f: list[bytes]) -> bytes:
        with self._changed:
            return pack(Status.OK, [str(len(self._data)).encode()])

    def _multi_get(self, f: list[bytes]) -> bytes:
        keys = [k.decode() for k in f[1:]]
        with self._changed:
            if not self._await(lambda: all(k in self._data for k in keys), f[0]):
                return pack(Status.TIMEOUT, [k.encode() for k in keys if k not in self._data])
            return pack(Status.OK, [self._data[k] for k in keys])

    def _multi_set(self, f: list[bytes]) -> bytes:
        if len(f) % 2:
            raise ValueError("multi_set takes keys and values in pairs")
        with self._changed:
            for k, v in zip(f[::2], f[1::2]):
                self._data[k.decode()] = v
            self._changed.notify_all()
        return pack(Status.OK, [])

    def _append(self, f: list[bytes]) -> bytes:
        key = f[0].decode()
        with self._changed:
            self._data[key] = self._data.get(key, b"") + f[1]
            self._changed.notify_all()
        return pack(Status.OK, [])

    def _ping(self, f: list[bytes]) -> bytes:
        return pack(Status.OK, [])

    _HANDLERS: dict[Op, Callable[[Coordinator, list[bytes]], bytes]] = {
        Op.SET: _set, Op.GET: _get, Op.ADD: _add, Op.COMPARE_SET: _compare_set, Op.CHECK: _check,
        Op.WAIT: _wait, Op.DELETE: _delete, Op.NUM_KEYS: _num_keys, Op.MULTI_GET: _multi_get,
        Op.MULTI_SET: _multi_set, Op.APPEND: _append, Op.PING: _ping,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0",
                        help="the address to listen on (default: every address of this host)")
    parser.add_argument("--port", type=int, required=True, help="the TCP port to listen on (0: a free one)")
    parser.usage = "crossreplica coordinator [--host ADDR] --port PORT"
    parser.epilog = ("Serves one job's store to the workers that know the job secret (CROSSREPLICA_JOB_SECRET, "
                     "the same on every host), until Ctrl-C or SIGTERM. Start each host's workers with "
                     "`crossreplica launch --coordinator HOST:PORT --nnodes N --nproc-per-node K -- COMMAND` "
                     "(docs/reliability.md).")


def main(args: argparse.Namespace) -> int:
    """``crossreplica coordinator``: serves until Ctrl-C or SIGTERM; a usage error is one line
    on stderr and exit code 2."""
    secret = settings.job_secret()
    try:
        if not secret:
            raise ValueError("set CROSSREPLICA_JOB_SECRET to a random value shared with every host of the job "
                             "(e.g. `export CROSSREPLICA_JOB_SECRET=$(openssl rand -hex 16)`): the coordinator "
                             "serves only the clients that know it")
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be a TCP port in 0..65535; got {args.port}")
        coordinator = Coordinator(secret, args.host, args.port)
    except (ValueError, RuntimeError) as e:
        print(f"crossreplica coordinator: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    saved = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"crossreplica coordinator: serving the job's store on {coordinator.host}:{coordinator.port} "
          f"(clients authenticate with CROSSREPLICA_JOB_SECRET)", flush=True)
    try:
        while not stop.is_set():
            stop.wait(1.0)  # a signal handler sets it
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        coordinator.close()
    if coordinator.refused:
        print(f"crossreplica coordinator: refused {coordinator.refused} connection(s) without the job secret",
              file=sys.stderr)
    return 0
