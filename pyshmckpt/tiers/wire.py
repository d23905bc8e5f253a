"""The wire between nodes: an authenticated TCP connection that carries a checkpoint's record and
its bytes, from a shared-memory segment to the socket and from the socket into a mapping.

Both ends prove they know the job's secret before anything else is sent (a challenge-response
with HMAC-SHA256 over fresh nonces from both sides): a peer without it is disconnected having
received nothing but the server's nonce. The secret is drawn by rank 0 and shared through the
process group; it never travels over this connection. The connection is authenticated, not
encrypted: checkpoint bytes cross the cluster's network as they are (each entry's CRC32C is
checked where they land).

Messages are JSON objects framed by a 4-byte length; bulk bytes follow a message raw, sent with
``sendfile`` from the segment's file (no copy through user space) and received with
``recv_into`` straight into the destination mapping.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import struct
import time
from typing import Any

from .. import knobs
from ..errors import ReplicationError

MAGIC = b"pyshmckpt-peer-1\n"
_NONCE = 16
_DIGEST = 32
_LENGTH = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # a record: the manifest of one rank, its tree and its CRCs


def new_secret() -> str:
    """A fresh secret for a job's peers (hex)."""
    return secrets.token_hex(32)


def _mac(secret: str, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(bytes.fromhex(secret), role + b"".join(parts), hashlib.sha256).digest()


class Deadline:
    """A point in time every blocking call on one connection is bounded by."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise ReplicationError(f"the peer did not answer within {self.seconds:g} s")
        return left


def connect(address: tuple[str, int], secret: str, deadline: Deadline) -> socket.socket:
    """A connection to the peer at `address`, both sides authenticated; connection refusals are
    retried (the peer's writer may still be starting) until `deadline`.

    Raises:
        ReplicationError: unreachable until the deadline, or the peer failed to authenticate.
    """
    refused: OSError | None = None
    while True:
        try:
            left = deadline.left()
        except ReplicationError:
            raise ReplicationError(
                f"cannot reach the peer at {address[0]}:{address[1]}: {refused}"
            ) from None
        try:
            sock = socket.create_connection(address, timeout=min(left, 10.0))
            break
        except (ConnectionRefusedError, TimeoutError, OSError) as exc:
            refused = exc
            time.sleep(min(0.2, max(0.0, deadline.left())))
    try:
        sock.settimeout(deadline.left())
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = _recv_exact(sock, len(MAGIC) + _NONCE)
        if not challenge.startswith(MAGIC):
            raise ReplicationError(f"{address[0]}:{address[1]} is not a pyshmckpt peer")
        theirs, ours = challenge[len(MAGIC) :], os.urandom(_NONCE)
        sock.sendall(ours + _mac(secret, b"client", theirs, ours))
        sock.settimeout(deadline.left())
        proof = _recv_exact(sock, _DIGEST)
        if not hmac.compare_digest(proof, _mac(secret, b"server", ours, theirs)):
            raise ReplicationError(f"the peer at {address[0]}:{address[1]} failed to authenticate")
    except BaseException:
        sock.close()
        raise
    return sock


def accept(sock: socket.socket, secret: str, timeout: float) -> bool:
    """Authenticate a peer that connected to us; False (and nothing sent beyond our nonce) when
    it does not prove it knows `secret` within `timeout` seconds."""
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ours = os.urandom(_NONCE)
        sock.sendall(MAGIC + ours)
        reply = _recv_exact(sock, _NONCE + _DIGEST)
        theirs, proof = reply[:_NONCE], reply[_NONCE:]
        if not hmac.compare_digest(proof, _mac(secret, b"client", ours, theirs)):
            return False
        sock.sendall(_mac(secret, b"server", theirs, ours))
    except (OSError, ReplicationError):
        return False
    return True


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """The next message.

    Raises:
        ReplicationError: the connection ended, or what arrived is not a message.
    """
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > MAX_MESSAGE:
        raise ReplicationError(f"a message of {length} bytes from the peer is too large")
    try:
        message = json.loads(_recv_exact(sock, length))
    except ValueError:
        raise ReplicationError("the peer sent a malformed message") from None
    if not isinstance(message, dict):
        raise ReplicationError("the peer sent a malformed message")
    return message


def send_file_range(
    sock: socket.socket, fd: int, offset: int, count: int, deadline: Deadline
) -> None:
    """Send `count` bytes of file `fd` from `offset` (``sendfile``: page cache to socket), by
    `deadline`."""
    sent = 0
    while sent < count:
        try:
            n = os.sendfile(sock.fileno(), fd, offset + sent, min(count - sent, 1 << 30))
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath
            _, writable, _ = select.select([], [sock], [], deadline.left())
            if not writable:
                deadline.left()
            continue
        if n == 0:
            raise ReplicationError("the peer closed the connection")
        sent += n


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket.

    Raises:
        ReplicationError: the connection ended first.
    """
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], min(total - got, 1 << 24))
        if n == 0:
            raise ReplicationError(f"the peer closed the connection after {got} of {total} bytes")
        got += n


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    try:
        recv_into(sock, memoryview(buffer))
    except TimeoutError:
        raise ReplicationError("the peer did not answer in time") from None
    return bytes(buffer)


def set_timeout(sock: socket.socket, deadline: Deadline) -> None:
    with contextlib.suppress(OSError):
        sock.settimeout(deadline.left())


def node_address() -> str:
    """The IPv4 address that names this node to the others and that its peers listen on:
    ``PYSHMCKPT_REPLICA_ADDRESS``, else the local address of the route to ``MASTER_ADDR``
    (torchrun's rendezvous host: the interface the job's traffic uses), else the host name's."""
    configured = knobs.replica_address()
    if configured:
        return configured
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError, ValueError):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return str(probe.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())
