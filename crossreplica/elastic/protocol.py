"""The coordinator's wire: a mutual challenge-response over the job secret, then signed frames.

Every connection to a job's coordinator (:mod:`.coordinator`) opens with a handshake
in which each side proves that it knows the job secret without sending it:

1. the client sends :data:`MAGIC` and a fresh random nonce ``c``;
2. the coordinator answers :data:`MAGIC`, its own fresh nonce ``s`` and
   ``HMAC(K, "server" s c)``;
3. the client checks that proof (a constant-time compare), so a worker never takes
   orders from a server that does not know the secret, and sends ``HMAC(K, "client" s c)``;
4. the coordinator checks it and answers :data:`ACCEPTED`, or :data:`DENIED` and closes.

The client speaks first, so a server of another protocol (a TCPStore at the
address) hangs up at once instead of waiting for a greeting.
``K`` is derived from the secret (:func:`key_of`); both nonces are fresh for each
connection, so a recorded handshake cannot be replayed. Every later frame carries a
tag, ``HMAC(session, direction, sequence number, payload)`` with a session key from
both nonces: a frame injected into, replayed on or reordered within an
authenticated connection is refused. Payloads are not encrypted (the store holds
addresses and counters, nothing secret); the secret never crosses the network.

A frame is ``length (4 bytes) | payload | tag (16 bytes)``; a request's payload is
an op code and length-prefixed fields, an answer's a status and fields
(:func:`pack` / :func:`unpack`). Nothing is ever unpickled. This is what Horovod's
driver and task services do with their secret, written for a byte store.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import secrets
import socket
import struct

__all__ = ["ACCEPTED", "DENIED", "HANDSHAKE_SECONDS", "MAGIC", "MAX_FRAME", "AuthenticationError", "Channel",
           "Op", "Status", "client_handshake", "key_of", "pack", "server_handshake", "shut", "unpack"]

#: what each side sends first: a plain TCPStore (or anything else) at the address is told apart at once
MAGIC = b"crossreplica-coordinator/1\n"
ACCEPTED, DENIED = b"\x01", b"\x00"
#: how long an unauthenticated connection may take to prove itself before it is dropped
HANDSHAKE_SECONDS = 10.0
#: the largest payload either side accepts (a frame's length is checked before it is read)
MAX_FRAME = 1 << 30

_NONCE = 32
_DIGEST = 32
_TAG = 16
_LENGTH = struct.Struct(">I")
_FIELD = struct.Struct(">I")
_SEQUENCE = struct.Struct(">Q")


class AuthenticationError(ConnectionError):
    """The other side of a coordinator connection does not know the job secret (or is no
    coordinator), or a frame's tag does not match."""


class Op(enum.IntEnum):
    """A request's operation: the ``torch.distributed.Store`` calls, and a ping."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    CHECK = 5
    WAIT = 6
    DELETE = 7
    NUM_KEYS = 8
    MULTI_GET = 9
    MULTI_SET = 10
    APPEND = 11
    PING = 12


class Status(enum.IntEnum):
    OK = 0
    TIMEOUT = 1
    ERROR = 2


def key_of(secret: str) -> bytes:
    """The handshake key of a job secret (never the secret itself on any wire)."""
    return hashlib.sha256(b"crossreplica-coordinator-key:" + secret.encode()).digest()


def _proof(key: bytes, who: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, who + server_nonce + client_nonce, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def server_handshake(sock: socket.socket, key: bytes) -> Channel:
    """The coordinator's side of the handshake on a new connection (with a timeout set on
    ``sock``); raises AuthenticationError for a client without the secret."""
    hello = _read_exactly(sock, len(MAGIC) + _NONCE)
    if hello[:len(MAGIC)] != MAGIC:
        sock.sendall(DENIED)
        raise AuthenticationError("the client does not speak the coordinator's protocol")
    client_nonce = hello[len(MAGIC):]
    server_nonce = secrets.token_bytes(_NONCE)
    sock.sendall(MAGIC + server_nonce + _proof(key, b"server", server_nonce, client_nonce))
    proof = _read_exactly(sock, _DIGEST)
    if not hmac.compare_digest(proof, _proof(key, b"client", server_nonce, client_nonce)):
        sock.sendall(DENIED)
        raise AuthenticationError("the client does not know the job secret")
    sock.sendall(ACCEPTED)
    return Channel(sock, key, server_nonce, client_nonce, server=True)


def client_handshake(sock: socket.socket, key: bytes, where: str) -> Channel:
    """The client's side of the handshake with the coordinator at ``where`` (with a timeout
    set on ``sock``).

    Raises:
        AuthenticationError: the server is no crossreplica coordinator, could not prove it
            knows the secret itself, or refused this client's.
    """
    client_nonce = secrets.token_bytes(_NONCE)
    sock.sendall(MAGIC + client_nonce)
    try:
        hello = _read_exactly(sock, len(MAGIC) + _NONCE + _DIGEST)
    except (ConnectionError, TimeoutError) as e:
        raise AuthenticationError(f"{where} is not a crossreplica coordinator (it did not answer the greeting: "
                                  f"{e or type(e).__name__}); CROSSREPLICA_COORDINATOR must be the address "
                                  f"`crossreplica coordinator` serves") from None
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationError(f"{where} is not a crossreplica coordinator (it answered {hello[:16]!r}); "
                                  f"CROSSREPLICA_COORDINATOR must be the address `crossreplica coordinator` "
                                  f"serves")
    server_nonce, proof = hello[len(MAGIC):-_DIGEST], hello[-_DIGEST:]
    if not hmac.compare_digest(proof, _proof(key, b"server", server_nonce, client_nonce)):
        raise AuthenticationError(f"the server at {where} does not know the job secret: it is not this job's "
                                  f"coordinator (or the secrets differ: give the coordinator and every worker "
                                  f"the same CROSSREPLICA_JOB_SECRET)")
    sock.sendall(_proof(key, b"client", server_nonce, client_nonce))
    try:
        verdict = _read_exactly(sock, 1)
    except ConnectionError:
        verdict = DENIED
    if verdict != ACCEPTED:
        raise AuthenticationError(f"the coordinator at {where} refused this worker's job secret; give the "
                                  f"coordinator and every worker the same CROSSREPLICA_JOB_SECRET")
    return Channel(sock, key, server_nonce, client_nonce, server=False)


class Channel:
    """An authenticated connection: frames out and in, each tagged with the session key and
    its direction's sequence number. Not thread-safe (one request at a time)."""

    def __init__(self, sock: socket.socket, key: bytes, server_nonce: bytes, client_nonce: bytes, server: bool):
        self.sock = sock
        self._session = hmac.new(key, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()
        self._out_direction, self._in_direction = (b"S", b"C") if server else (b"C", b"S")
        self._sent = self._received = 0

    def _tag(self, direction: bytes, sequence: int, payload: bytes) -> bytes:
        mac = hmac.new(self._session, direction + _SEQUENCE.pack(sequence), hashlib.sha256)
        mac.update(payload)
        return mac.digest()[:_TAG]

    def send(self, payload: bytes) -> None:
        tag = self._tag(self._out_direction, self._sent, payload)
        self._sent += 1
        self.sock.sendall(_LENGTH.pack(len(payload)) + payload + tag)

    def receive(self) -> bytes:
        (length,) = _LENGTH.unpack(_read_exactly(self.sock, _LENGTH.size))
        if length > MAX_FRAME:
            raise AuthenticationError(f"a frame of {length} bytes is over the limit of {MAX_FRAME}")
        body = _read_exactly(self.sock, length + _TAG)
        payload, tag = body[:length], body[length:]
        if not hmac.compare_digest(tag, self._tag(self._in_direction, self._received, payload)):
            raise AuthenticationError("a frame's tag does not match: the connection was tampered with")
        self._received += 1
        return payload

    def close(self) -> None:
        shut(self.sock)
        self.sock.close()


def shut(sock: socket.socket) -> None:
    """Shuts ``sock`` down both ways, which wakes a thread blocked on it (closing alone would
    not); one already gone is left as it is."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def pack(code: int, fields: list[bytes]) -> bytes:
    """A request (``code`` an :class:`Op`) or an answer (a :class:`Status`) with its fields."""
    return bytes([code]) + b"".join(_FIELD.pack(len(f)) + f for f in fields)


def unpack(payload: bytes) -> tuple[int, list[bytes]]:
    """The code and fields of a payload :func:`pack` made; ValueError for a malformed one."""
    if not payload:
        raise ValueError("an empty frame")
    fields, pos, end = [], 1, len(payload)
    while pos < end:
        if pos + _FIELD.size > end:
            raise ValueError("a field's length is cut short")
        (n,) = _FIELD.unpack_from(payload, pos)
        pos += _FIELD.size
        if pos + n > end:
            raise ValueError("a field is cut short")
        fields.append(payload[pos:pos + n])
        pos += n
    return payload[0], fields
