"""The wire between nodes: an authenticated TCP connection between two members of a job (writers
replicating a checkpoint, ranks fetching one during a restore) that carries JSON messages and a
checkpoint's bytes.

**Handshake.** The server sends a magic string and a fresh nonce. The client answers with its
own nonce and a hello naming both ends (its own identity and that of the server it means to
reach: role, address and port, or rank) and the suites below that it accepts, under an
HMAC-SHA256 keyed by a master key derived from the job's secret and both nonces. The server
checks that MAC, checks that it is the server the hello names (a connection relayed to another
member of the job is refused), picks a suite and proves the secret in turn with a MAC over the
hello and its reply. A peer without the secret receives the magic and the nonce, nothing else.
Each direction then has a key of its own, derived from the master key and the whole handshake.
The secret itself never crosses this connection.

**Every message after it is authenticated.** Each message, and each piece of at most `CHUNK`
bytes of a checkpoint's data, carries a tag under its direction's key over its sequence number
(its place in the connection), its kind and its bytes: nothing can be changed, dropped,
reordered, replayed or moved to another connection unnoticed. The suites:

- ``aes-gmac``: an AES-GCM tag over the bytes (no encryption), from the `cryptography` package;
  preferred when both ends have it (about ten times cheaper than an HMAC on CPUs with AES
  instructions);
- ``hmac-sha256``: an HMAC-SHA256 per message and per piece, from the standard library;
- ``aes-256-gcm``: every message and every piece encrypted as well (AES-256-GCM), chosen when
  either end asks for it (``PYSHMCKPT_REPLICA_ENCRYPT``); needs `cryptography` on both ends.

Unencrypted, a checkpoint's bytes go out with ``sendfile`` from the segment's file (no copy
through user space; their tags are computed from a read-only mapping of the same pages, beside
the send) and come in with ``recv_into`` straight into the destination mapping. Encrypted, they
go through a buffer each way.

**Bounds.** The handshake has an overall deadline, and every exchange after it an overall
`Deadline` and a limit on how long any one wait may last with nothing moving; a message is at
most `MAX_MESSAGE` bytes and `MAX_DEPTH` levels deep. A `Listener` authenticates the
connections to its port on one thread, at most a given number at a time (the oldest is dropped
for a newer one), keeps accepting through errors of ``accept()`` (EMFILE, ECONNABORTED), and
serves each authenticated connection on a thread of its own, a bounded number at once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import math
import mmap
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import knobs
from ..errors import ConfigError, ReplicationError

logger = logging.getLogger(__name__)

MAGIC = b"pyshmckpt-peer-2\n"
_NONCE = 32
_DIGEST = 32
_GCM_TAG = 16
_HELLO_MAX = 1024  # a hello or a reply: two identities and the suites
_LENGTH = struct.Struct("!I")
_SHORT = struct.Struct("!H")
_UNIT = struct.Struct("!Q1sQ")  # what an HMAC covers besides the bytes: seq, kind, length
MAX_MESSAGE = 64 << 20  # a record: the manifest of one rank, its tree and its CRCs
MAX_DEPTH = 256  # nesting of a message: far deeper than any record, far from the recursion limit
CHUNK = 8 << 20  # bytes of a checkpoint's data under one tag
HANDSHAKE_TIMEOUT = 10.0  # seconds from connecting to an authenticated connection, at most

HMAC_SHA256 = "hmac-sha256"
AES_GMAC = "aes-gmac"
AES_GCM = "aes-256-gcm"
SUITES = (AES_GMAC, HMAC_SHA256, AES_GCM)
_MESSAGE, _BULK = b"M", b"B"  # the kinds of unit a tag covers
_INSTALL = "python -m pip install 'cryptography>=42' (the encrypt extra)"


def new_secret() -> str:
    """A fresh secret for a job's peers (hex)."""
    return secrets.token_hex(32)


def _aesgcm() -> Any:
    """`cryptography`'s AESGCM, or None when it is not installed."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return None
    return AESGCM


def suites(encrypt: bool | None = None) -> tuple[str, ...]:
    """The suites this end accepts, preferred first: with encryption (`encrypt`, by default
    ``PYSHMCKPT_REPLICA_ENCRYPT``) AES-256-GCM only; else the MACs this end has, and encryption
    for a peer that asks for it.

    Raises:
        ConfigError: encryption is asked for and the `cryptography` package is missing.
    """
    if encrypt is None:
        encrypt = knobs.replica_encrypt()
    if _aesgcm() is None:
        if encrypt:
            raise ConfigError(f"PYSHMCKPT_REPLICA_ENCRYPT=1 needs encryption: {_INSTALL}")
        return (HMAC_SHA256,)
    return (AES_GCM,) if encrypt else SUITES


def identity(role: str, *, address: tuple[str, int] | None = None, rank: int | None = None) -> str:
    """How one end of a connection names itself and the other: its role, and its listening
    address or its rank (both ends' identities are bound into the session's keys)."""
    parts = [role]
    if rank is not None:
        parts.append(f"rank={int(rank)}")
    if address is not None:
        parts.append(f"{address[0]}:{int(address[1])}")
    return " ".join(parts)


class Deadline:
    """When one exchange must be over (`seconds` from now), and how long any one wait in it may
    last with nothing moving (`idle`, None: up to the end)."""

    def __init__(self, seconds: float, idle: float | None = None) -> None:
        self.seconds = seconds
        self.idle = idle if idle is not None and idle < seconds else None
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds the next wait may last.

        Raises:
            ReplicationError: the deadline passed.
        """
        left = self._end - time.monotonic()
        if left <= 0:
            raise ReplicationError(f"the peer did not finish within {self.seconds:g} s")
        return left if self.idle is None else min(left, self.idle)

    def within(self, seconds: float) -> Deadline:
        """A deadline `seconds` from now at the latest, with this one's idle limit."""
        return Deadline(min(seconds, max(self._end - time.monotonic(), 0.0)), self.idle)

    def ran_out(self) -> ReplicationError:
        """The error of a wait that ran out: the deadline's, or the idle limit's."""
        if self.idle is None or self._end - time.monotonic() <= 0.01:
            return ReplicationError(f"the peer did not finish within {self.seconds:g} s")
        return ReplicationError(f"nothing moved between the peers for {self.idle:g} s")


# -- the keys of a session -------------------------------------------------------------------------


def _mac(key: bytes, *parts: bytes) -> bytes:
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


def _master(secret: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    try:
        key = bytes.fromhex(secret)
    except (TypeError, ValueError):
        raise ConfigError("the job's secret for its peers is not hex") from None
    return _mac(key, b"pyshmckpt-2 master", server_nonce, client_nonce)


def _session_keys(
    master: bytes, server_nonce: bytes, client_nonce: bytes, hello: bytes, reply: bytes
) -> tuple[bytes, bytes]:
    """(client to server, server to client) keys, bound to the whole handshake."""
    transcript = hashlib.sha256(
        server_nonce + client_nonce + _SHORT.pack(len(hello)) + hello + _SHORT.pack(len(reply))
        + reply
    ).digest()  # fmt: skip
    to_server = _mac(master, b"client to server", transcript)
    return to_server, _mac(master, b"server to client", transcript)


def _nonce(seq: int, kind: bytes) -> bytes:
    return kind + b"\0\0\0" + seq.to_bytes(8, "big")


class _Direction:
    """One direction of a session: its suite, its key, and the sequence number of its next unit
    (a message or a piece of bytes)."""

    def __init__(self, suite: str, key: bytes) -> None:
        self.suite = suite
        self.encrypts = suite == AES_GCM
        self.overhead = _DIGEST if suite == HMAC_SHA256 else _GCM_TAG
        self._key = key
        self._aead: Any = None if suite == HMAC_SHA256 else _aesgcm()(key)
        self._seq = 0

    def take(self) -> int:
        """The sequence number of the next unit (called in the order the units travel)."""
        seq, self._seq = self._seq, self._seq + 1
        return seq

    def tag(self, seq: int, kind: bytes, data: Any) -> bytes:
        """The tag of an unencrypted unit (`data`: any buffer, hashed in place)."""
        if self._aead is None:
            digest = hmac.new(self._key, _UNIT.pack(seq, kind, len(data)), hashlib.sha256)
            digest.update(data)
            return digest.digest()
        return bytes(self._aead.encrypt(_nonce(seq, kind), b"", data))

    def verify(self, seq: int, kind: bytes, data: Any, tag: bytes) -> bool:
        return hmac.compare_digest(self.tag(seq, kind, data), tag)

    def seal_into(self, seq: int, kind: bytes, data: Any, out: memoryview) -> None:
        """Encrypt `data` into `out` (its length plus the tag's)."""
        encrypt_into = getattr(self._aead, "encrypt_into", None)
        if encrypt_into is not None:
            encrypt_into(_nonce(seq, kind), data, None, out)
        else:  # an older cryptography: one copy more
            out[:] = self._aead.encrypt(_nonce(seq, kind), bytes(data), None)

    def open_into(self, seq: int, kind: bytes, sealed: Any, out: memoryview) -> None:
        """Decrypt `sealed` into `out` (its length less the tag's).

        Raises:
            ReplicationError: the tag does not match (changed, or not from this session).
        """
        from cryptography.exceptions import InvalidTag

        try:
            decrypt_into = getattr(self._aead, "decrypt_into", None)
            if decrypt_into is not None:
                decrypt_into(_nonce(seq, kind), sealed, None, out)
            else:
                out[:] = self._aead.decrypt(_nonce(seq, kind), bytes(sealed), None)
        except InvalidTag:
            raise ReplicationError(_FORGED) from None


_FORGED = "what the peer sent failed authentication (changed in transit, or not of this session)"


# -- a connection ----------------------------------------------------------------------------------


class Channel:
    """An authenticated connection (see the module). Its socket does not block: every wait is
    a ``poll`` bounded by the `Deadline` of the call (what it leaves, and its idle limit), so
    a peer that trickles bytes is held to the deadline, and one that moves nothing to the idle
    limit. One thread uses it at a time. Every error of the connection is a
    `ReplicationError`.

    Attributes:
        peer: the other end's identity, as it named itself (a server: as the client named it).
        suite: the suite in use.
    """

    def __init__(
        self,
        sock: socket.socket,
        suite: str,
        outgoing: _Direction,
        incoming: _Direction,
        peer: str,
        where: str,
    ) -> None:
        self.sock = sock
        self.suite = suite
        self.peer = peer
        self._where = where
        self._out = outgoing
        self._in = incoming
        self._polls: dict[int, select.poll] = {}

    @property
    def encrypted(self) -> bool:
        return self._out.encrypts

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_message(self, message: dict[str, Any], deadline: Deadline) -> None:
        """Send one JSON object.

        Raises:
            ReplicationError: the connection broke, or nothing moved in time.
        """
        self._send_body(json.dumps(message, separators=(",", ":")).encode(), deadline)

    def _send_body(self, body: bytes, deadline: Deadline) -> None:
        if len(body) > MAX_MESSAGE:
            raise ReplicationError(f"a message of {len(body)} bytes is over {MAX_MESSAGE}")
        seq = self._out.take()
        if self._out.encrypts:
            sealed = bytearray(_LENGTH.size + len(body) + self._out.overhead)
            _LENGTH.pack_into(sealed, 0, len(body))
            self._out.seal_into(seq, _MESSAGE, body, memoryview(sealed)[_LENGTH.size :])
            _send_all(self, sealed, deadline)
        else:
            tag = self._out.tag(seq, _MESSAGE, body)
            _send_all(self, _LENGTH.pack(len(body)) + body + tag, deadline)

    def recv_message(self, deadline: Deadline, limit: int = MAX_MESSAGE) -> dict[str, Any]:
        """The next JSON object, authenticated, of at most `limit` bytes.

        Raises:
            ReplicationError: the connection ended or broke, nothing moved in time, or what
                arrived is not an authenticated message of this session.
        """
        (length,) = _LENGTH.unpack(_recv_exact(self, _LENGTH.size, deadline))
        if length > limit:
            raise ReplicationError(f"a message of {length} bytes from {self.peer} is too large")
        data = _recv_exact(self, length + self._in.overhead, deadline)
        seq = self._in.take()
        if self._in.encrypts:
            body = bytearray(length)
            self._in.open_into(seq, _MESSAGE, memoryview(data), memoryview(body))
        else:
            body = data[:length]
            if not self._in.verify(seq, _MESSAGE, body, bytes(data[length:])):
                raise ReplicationError(_FORGED)
        return _parse(bytes(body), self.peer)

    def send_file(
        self,
        fd: int,
        offset: int,
        count: int,
        deadline: Deadline,
        moved: Callable[[int], None] | None = None,
    ) -> None:
        """Send `count` bytes of file `fd` from `offset`, piece by piece with their tags;
        `moved(n)` is called as bytes leave.

        Raises:
            ReplicationError: the connection broke, or nothing moved in time.
            OSError: the file cannot be mapped.
        """
        if count == 0:
            return
        workers = _workers()
        with (
            _mapped(fd, offset, count) as view,
            ThreadPoolExecutor(workers, thread_name_prefix="pyshmckpt-wire-out") as pool,
        ):  # the tags (or ciphertext) of the next pieces are made while this one goes out
            pieces = [(start, min(CHUNK, count - start)) for start in range(0, count, CHUNK)]
            buffers = (
                [bytearray(min(CHUNK, count) + self._out.overhead) for _ in range(workers)]
                if self._out.encrypts
                else []
            )

            def prepare(i: int, seq: int) -> Any:
                start, n = pieces[i]
                piece = view[start : start + n]
                if not self._out.encrypts:
                    return self._out.tag(seq, _BULK, piece)
                out = memoryview(buffers[i % workers])[: n + self._out.overhead]
                self._out.seal_into(seq, _BULK, piece, out)
                return out

            ahead: deque[Future[Any]] = deque()
            for i in range(min(workers, len(pieces))):
                ahead.append(pool.submit(prepare, i, self._out.take()))
            for i, (start, n) in enumerate(pieces):
                prepared = ahead.popleft().result()
                if self._out.encrypts:
                    _send_all(self, prepared, deadline, _capped(n, moved))
                else:
                    _send_file(self, fd, offset + start, n, deadline, moved)
                    _send_all(self, prepared, deadline)
                if i + workers < len(pieces):  # its buffer, if any, was this piece's
                    ahead.append(pool.submit(prepare, i + workers, self._out.take()))

    def recv_into(
        self,
        view: memoryview,
        deadline: Deadline,
        *,
        allocate: Callable[[int, int], None] | None = None,
        landed: Callable[[int], None] | None = None,
    ) -> None:
        """Fill `view` with bytes sent by `send_file`, every piece authenticated by the time
        this returns. `allocate(start, n)` is called before each piece lands (so a peer makes
        us allocate only what it sends), `landed(end)` once `view[:end]` is in place.

        Raises:
            ReplicationError: the connection ended or broke, nothing moved in time, or a piece
                failed authentication.
        """
        total = len(view)
        pieces = [(start, min(CHUNK, total - start)) for start in range(0, total, CHUNK)]
        workers = _workers()
        with ThreadPoolExecutor(workers, thread_name_prefix="pyshmckpt-wire-in") as pool:
            if self._in.encrypts:
                self._recv_sealed(view, pieces, deadline, pool, workers, allocate, landed)
                return
            checks: deque[Future[bool]] = deque()
            for start, n in pieces:
                if allocate is not None:
                    allocate(start, n)
                piece = view[start : start + n]
                _recv_exact_into(self, piece, deadline)
                tag = bytes(_recv_exact(self, self._in.overhead, deadline))
                checks.append(pool.submit(self._in.verify, self._in.take(), _BULK, piece, tag))
                while checks and checks[0].done():  # a forgery ends the transfer early
                    if not checks.popleft().result():
                        raise ReplicationError(_FORGED)
                if landed is not None:
                    landed(start + n)
            if not all(c.result() for c in checks):
                raise ReplicationError(_FORGED)

    def _recv_sealed(
        self,
        view: memoryview,
        pieces: list[tuple[int, int]],
        deadline: Deadline,
        pool: ThreadPoolExecutor,
        workers: int,
        allocate: Callable[[int, int], None] | None,
        landed: Callable[[int], None] | None,
    ) -> None:
        """Receive encrypted pieces through a buffer more than there are `workers`, each piece
        decrypted into `view` while the next ones arrive."""
        size = min(CHUNK, len(view)) + self._in.overhead
        buffers = [bytearray(size) for _ in range(workers + 1)]
        opening: deque[tuple[Future[None], int]] = deque()
        for i, (start, n) in enumerate(pieces):
            if len(opening) == len(buffers):  # its buffer is free once that piece is decrypted
                future, end = opening.popleft()
                future.result()
                if landed is not None:
                    landed(end)
            if allocate is not None:
                allocate(start, n)
            sealed = memoryview(buffers[i % len(buffers)])[: n + self._in.overhead]
            _recv_exact_into(self, sealed, deadline)
            opened = pool.submit(
                self._in.open_into, self._in.take(), _BULK, sealed, view[start : start + n]
            )
            opening.append((opened, start + n))
        while opening:
            future, end = opening.popleft()
            future.result()
            if landed is not None:
                landed(end)

    def _wait(self, events: int, deadline: Deadline) -> None:
        """Until the socket is ready for `events`, at most what `deadline` leaves.

        Raises:
            ReplicationError: it was not ready in time.
        """
        poller = self._polls.get(events)
        if poller is None:
            poller = self._polls[events] = select.poll()
            poller.register(self.sock, events)
        if not poller.poll(math.ceil(deadline.left() * 1000)):
            raise deadline.ran_out()

    def _broke(self, exc: OSError) -> ReplicationError:
        return ReplicationError(f"the connection to {self._where} broke: {exc}")


def _send_all(
    channel: Channel,
    data: Any,
    deadline: Deadline,
    moved: Callable[[int], None] | None = None,
) -> None:
    with memoryview(data) as view:
        sent = 0
        while sent < len(view):
            try:
                n = channel.sock.send(view[sent:])
            except BlockingIOError:
                channel._wait(select.POLLOUT, deadline)
                continue
            except OSError as exc:
                raise channel._broke(exc) from None
            sent += n
            if moved is not None:
                moved(n)


def _workers() -> int:
    """Threads that tag, check, encrypt or decrypt the pieces of one transfer at once (pieces
    are independent): up to 4, no more than this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _capped(nbytes: int, moved: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """`moved` reporting at most `nbytes` in all (a piece's data, not its tag)."""
    if moved is None:
        return None
    left = nbytes

    def report(n: int) -> None:
        nonlocal left
        n, left = min(n, left), left - min(n, left)
        if n:
            moved(n)

    return report


def _send_file(
    channel: Channel,
    fd: int,
    offset: int,
    count: int,
    deadline: Deadline,
    moved: Callable[[int], None] | None,
) -> None:
    sent = 0
    while sent < count:
        try:
            n = os.sendfile(channel.sock.fileno(), fd, offset + sent, count - sent)
        except BlockingIOError:
            channel._wait(select.POLLOUT, deadline)
            continue
        except OSError as exc:
            raise channel._broke(exc) from None
        if n == 0:
            raise ReplicationError(f"{channel._where} closed the connection")
        sent += n
        if moved is not None:
            moved(n)


def _recv_exact_into(channel: Channel, view: memoryview, deadline: Deadline) -> None:
    got, total = 0, len(view)
    while got < total:
        try:
            n = channel.sock.recv_into(view[got:])
        except BlockingIOError:
            channel._wait(select.POLLIN, deadline)
            continue
        except OSError as exc:
            raise channel._broke(exc) from None
        if n == 0:
            raise ReplicationError(
                f"{channel._where} closed the connection after {got} of {total} bytes"
            )
        got += n


def _recv_exact(channel: Channel, count: int, deadline: Deadline) -> bytearray:
    buffer = bytearray(count)
    _recv_exact_into(channel, memoryview(buffer), deadline)
    return buffer


@contextlib.contextmanager
def _mapped(fd: int, offset: int, count: int) -> Iterator[memoryview]:
    """`count` bytes of file `fd` from `offset`, mapped read-only. Its pages are mapped as the
    thread that tags (or encrypts) them reads them, beside the sending: populating them all
    up front would delay the first byte by about 0.17 s a GiB."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = offset + count - start
    mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
    try:
        with memoryview(mapping) as whole:
            yield whole[offset - start : offset - start + count]
    finally:
        with contextlib.suppress(BufferError):  # a view still referenced: unmapped when freed
            mapping.close()


def _parse(body: bytes, peer: str) -> dict[str, Any]:
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        raise ReplicationError(f"{peer} sent a malformed message") from None
    if not isinstance(message, dict) or _too_deep(message, MAX_DEPTH):
        raise ReplicationError(f"{peer} sent a malformed message")
    return message


def _too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests containers more than `limit` deep (without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


# -- the handshake ---------------------------------------------------------------------------------


def connect(
    address: tuple[str, int],
    secret: str,
    deadline: Deadline,
    *,
    client: str,
    server: str,
    encrypt: bool | None = None,
    offer: Sequence[str] | None = None,
) -> Channel:
    """An authenticated connection to the server `server` at `address` (see the module), as
    `client`. Refused connections are retried (the peer's writer may still be starting) until
    `deadline`, which bounds the whole handshake. `offer`: the suites to accept (default
    `suites(encrypt)`).

    Raises:
        ReplicationError: unreachable until the deadline, the peer failed to authenticate, or
            refused (it is not `server`, or shares no suite with us).
        ConfigError: encryption is asked for without the `cryptography` package.
    """
    offered = tuple(offer) if offer is not None else suites(encrypt)
    where = f"{address[0]}:{address[1]}"
    refused: OSError | None = None
    while True:
        try:
            left = deadline.left()
        except ReplicationError:
            raise ReplicationError(f"cannot reach the peer at {where}: {refused}") from None
        try:
            sock = socket.create_connection(address, timeout=min(left, HANDSHAKE_TIMEOUT))
            break
        except OSError as exc:
            refused = exc
            with contextlib.suppress(ReplicationError):
                time.sleep(min(0.2, deadline.left()))
    try:
        sock.setblocking(False)  # every wait is a poll, bounded by the deadline
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _client_handshake(sock, secret, deadline, client, server, offered, where)
    except BaseException:
        sock.close()
        raise


def _client_handshake(
    sock: socket.socket,
    secret: str,
    deadline: Deadline,
    client: str,
    server: str,
    offered: tuple[str, ...],
    where: str,
) -> Channel:
    raw = _raw(sock, where)
    greeting = bytes(_recv_exact(raw, len(MAGIC) + _NONCE, deadline))
    if not greeting.startswith(MAGIC):
        raise ReplicationError(f"{where} is not a pyshmckpt peer of this version")
    server_nonce, client_nonce = greeting[len(MAGIC) :], os.urandom(_NONCE)
    hello = json.dumps({"client": client, "server": server, "suites": list(offered)}).encode()
    if len(hello) > _HELLO_MAX:
        raise ConfigError(f"identities too long for a hello: {client!r}, {server!r}")
    master = _master(secret, server_nonce, client_nonce)
    proof = _mac(master, b"client hello", hello)
    _send_all(raw, client_nonce + _SHORT.pack(len(hello)) + hello + proof, deadline)
    (length,) = _SHORT.unpack(_recv_exact(raw, _SHORT.size, deadline))
    if length > _HELLO_MAX:
        raise ReplicationError(f"the peer at {where} failed to authenticate")
    answer = bytes(_recv_exact(raw, length + _DIGEST, deadline))
    reply, theirs = answer[:length], answer[length:]
    if not hmac.compare_digest(theirs, _mac(master, b"server reply", hello, reply)):
        raise ReplicationError(f"the peer at {where} failed to authenticate")
    try:
        chosen = json.loads(reply)
        suite, error = chosen.get("suite"), chosen.get("error")
    except (ValueError, AttributeError, RecursionError):
        raise ReplicationError(f"the peer at {where} sent a malformed reply") from None
    if error is not None:
        raise ReplicationError(f"the peer at {where} refused the connection: {error}")
    if suite not in offered:
        raise ReplicationError(f"the peer at {where} chose a suite not offered: {suite!r}")
    to_server, to_client = _session_keys(master, server_nonce, client_nonce, hello, reply)
    return Channel(
        sock, suite, _Direction(suite, to_server), _Direction(suite, to_client), server, where
    )


class _Refused(Exception):
    """A handshake that cannot go on (internal: the server closes the connection)."""


class _ServerHandshake:
    """The server's side of one handshake, fed the bytes the client sends."""

    def __init__(self, secret: str, me: str, accepted: tuple[str, ...]) -> None:
        self.nonce = os.urandom(_NONCE)
        self.greeting = MAGIC + self.nonce
        self._secret = secret
        self._me = me
        self._accepted = accepted
        self._buffer = bytearray()

    def wanted(self) -> int:
        """Bytes the client has yet to send (0: the hello is complete).

        Raises:
            _Refused: the hello announces more than a hello may hold.
        """
        head = _NONCE + _SHORT.size
        if len(self._buffer) < head:
            return head - len(self._buffer)
        (length,) = _SHORT.unpack_from(self._buffer, _NONCE)
        if length > _HELLO_MAX:
            raise _Refused("a hello too long")
        return head + length + _DIGEST - len(self._buffer)

    def feed(self, data: bytes) -> None:
        self._buffer += data

    @property
    def received(self) -> int:
        """Bytes of the hello received so far."""
        return len(self._buffer)

    def finish(self, sock: socket.socket) -> tuple[bytes, Channel | None, str]:
        """The reply to send, the channel over `sock` (None: refused after authentication, the
        reply says why), and the client's identity.

        Raises:
            _Refused: the client did not prove the secret (nothing is to be sent to it).
        """
        client_nonce = bytes(self._buffer[:_NONCE])
        (length,) = _SHORT.unpack_from(self._buffer, _NONCE)
        hello = bytes(self._buffer[_NONCE + _SHORT.size : _NONCE + _SHORT.size + length])
        proof = bytes(self._buffer[_NONCE + _SHORT.size + length :])
        master = _master(self._secret, self.nonce, client_nonce)
        if not hmac.compare_digest(proof, _mac(master, b"client hello", hello)):
            raise _Refused("it did not prove the job's secret")
        try:
            said = json.loads(hello)
            client, server, offered = said["client"], said["server"], said["suites"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise _Refused("a malformed hello") from None
        client = str(client)
        common = [s for s in self._accepted if isinstance(offered, list) and s in offered]
        if server != self._me:
            answer: dict[str, Any] = {"error": f"this is {self._me}, not {server}"}
        elif not common:
            answer = {"error": f"no suite in common: this end accepts {', '.join(self._accepted)}"}
        else:
            answer = {"suite": common[0]}
        reply = json.dumps(answer).encode()
        frame = _SHORT.pack(len(reply)) + reply + _mac(master, b"server reply", hello, reply)
        if "error" in answer:
            return frame, None, f"{client} ({answer['error']})"
        suite = common[0]
        to_server, to_client = _session_keys(master, self.nonce, client_nonce, hello, reply)
        channel = Channel(
            sock, suite, _Direction(suite, to_client), _Direction(suite, to_server), client,
            _peer_name(sock),
        )  # fmt: skip
        return frame, channel, client


def _raw(sock: socket.socket, where: str) -> Channel:
    """A channel without keys, for the bounded reads and writes of a handshake."""
    return Channel(sock, "", _Direction(HMAC_SHA256, b""), _Direction(HMAC_SHA256, b""), "", where)


def accept(
    sock: socket.socket,
    secret: str,
    me: str,
    deadline: Deadline,
    encrypt: bool | None = None,
) -> Channel | None:
    """Authenticate a client that connected to `sock`, as the server `me`, by `deadline`
    (blocking; a `Listener` does the same for many connections on one thread). None when it
    did not prove the secret, or was refused (it named another server, or shares no suite):
    then nothing beyond the greeting was sent, or the refusal only to a client that proved it.

    Raises:
        ConfigError: encryption is asked for without the `cryptography` package.
    """
    handshake = _ServerHandshake(secret, me, suites(encrypt))
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw = _raw(sock, _peer_name(sock))
        _send_all(raw, handshake.greeting, deadline)
        while wanted := handshake.wanted():
            handshake.feed(bytes(_recv_exact(raw, wanted, deadline)))
        frame, channel, client = handshake.finish(sock)
        _send_all(raw, frame, deadline)
    except (_Refused, ReplicationError) as exc:
        logger.debug("a connection was refused: %s", exc)
        return None
    if channel is None:
        logger.warning("refused a member of the job: %s", client)
    return channel


def _peer_name(sock: socket.socket) -> str:
    with contextlib.suppress(OSError):
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    return "the peer"


# -- a listening port --------------------------------------------------------------------------

# accept() errors that leave no room for a connection; any other concerns one connection only.
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# Seconds between two warnings of a listener: a flood of connections must not flood the log.
_WARN_EVERY = 60.0


class Listener:
    """Accepts and authenticates connections to a listening socket (see the module) and calls
    `handle(channel)` for each authenticated one, on a thread of its own; closes the channel
    when `handle` returns.

    At most `pending` connections are in their handshake at once (a new one drops the oldest),
    each for at most `handshake_timeout` seconds; at most `sessions` are handled at once (more
    are closed once authenticated, with a warning).

    Raises:
        ConfigError: encryption is required without the `cryptography` package.
    """

    def __init__(
        self,
        sock: socket.socket,
        secret: str,
        me: str,
        handle: Callable[[Channel], None],
        *,
        name: str,
        encrypt: bool | None = None,
        pending: int = 64,
        sessions: int = 16,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self._accepted = suites(encrypt)
        self._sock = sock
        self._secret = secret
        self._me = me
        self._handle = handle
        self._name = name
        self._max_pending = pending
        self._handshake_timeout = handshake_timeout
        self._sessions = threading.BoundedSemaphore(sessions)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._closing = False
        self._pending: dict[socket.socket, tuple[float, _ServerHandshake]] = {}
        self._refused = 0  # connections refused since the last warning
        self._warned: dict[str, float] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self, wait: float = 0.0) -> None:
        """Stop accepting (connections in their handshake are dropped); wait up to `wait`
        seconds for the sessions being handled. Idempotent."""
        with self._lock:
            first, self._closing = not self._closing, True
        if first:
            self._closed.set()
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            self._thread.join(5.0)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            if not self._thread.is_alive():  # else it may still read them: left to the exit
                os.close(self._wake_r)
                os.close(self._wake_w)
        end = time.monotonic() + wait
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - the port stays served whatever one step met
                    logger.exception("%s: serving its port met an error", self._name)
                    self._closed.wait(0.1)
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()

    def _step(self) -> None:
        now = time.monotonic()
        first = min((end for end, _ in self._pending.values()), default=None)
        timeout = None if first is None else max(0.0, first - now)
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._sock:
                self._accept()
            elif key.fileobj == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 64)
            elif key.fileobj in self._pending:  # not dropped earlier in this batch
                self._advance(key.fileobj)
        now = time.monotonic()
        for conn, (end, _) in list(self._pending.items()):
            if end <= now:
                self._refuse(conn, "it did not authenticate in time")

    def _accept(self) -> None:
        for _ in range(64):  # then the handshakes in progress get their turn
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self._closed.is_set():
                    return
                if exc.errno in _OUT_OF_RESOURCES:
                    self._out_of_resources(exc)
                else:  # this connection only (ECONNABORTED, EPROTO, ...): take the next
                    logger.debug("%s: accept() failed: %s", self._name, exc)
                return
            self._begin(conn)

    def _out_of_resources(self, exc: OSError) -> None:
        """No descriptor (or memory) for a new connection: the oldest handshake makes room, or
        the listener pauses a moment (the connection waits in the kernel's queue)."""
        self._warn("accept", f"accept() failed: {exc}")
        if self._pending:
            self._refuse(self._evictable(), "room was needed for a newer connection")
        else:
            self._closed.wait(0.1)

    def _evictable(self) -> socket.socket:
        """The handshake that makes room for a newer one: the oldest that has sent nothing yet
        (a member of the job sends its whole hello at once, a flood's idle connection never
        does), else the oldest."""
        for conn, (_, handshake) in self._pending.items():
            if not handshake.received:
                return conn
        return next(iter(self._pending))

    def _begin(self, conn: socket.socket) -> None:
        if len(self._pending) >= self._max_pending:
            self._refuse(self._evictable(), "room was needed for a newer connection")
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake = _ServerHandshake(self._secret, self._me, self._accepted)
            if conn.send(handshake.greeting) != len(handshake.greeting):
                raise _Refused("its greeting did not fit the socket")
            self._selector.register(conn, selectors.EVENT_READ)
        except (OSError, _Refused) as exc:
            conn.close()
            logger.debug("%s: a new connection failed: %s", self._name, exc)
            return
        self._pending[conn] = (time.monotonic() + self._handshake_timeout, handshake)

    def _advance(self, conn: socket.socket) -> None:
        _, handshake = self._pending[conn]
        try:
            data = conn.recv(handshake.wanted())
            if not data:
                raise _Refused("it closed the connection")
            handshake.feed(data)
            if handshake.wanted():
                return
            frame, channel, client = handshake.finish(conn)
        except BlockingIOError:
            return
        except (OSError, _Refused) as exc:
            self._refuse(conn, str(exc))
            return
        self._selector.unregister(conn)
        del self._pending[conn]
        try:
            _send_all(_raw(conn, _peer_name(conn)), frame, Deadline(self._handshake_timeout))
        except ReplicationError as exc:
            conn.close()
            logger.debug("%s: a reply failed: %s", self._name, exc)
            return
        if channel is None:
            conn.close()
            logger.warning("%s refused a member of the job: %s", self._name, client)
            return
        self._start(channel)

    def _start(self, channel: Channel) -> None:
        if not self._sessions.acquire(blocking=False):
            channel.close()
            self._warn("sessions", f"too many connections in progress: refused {channel.peer}")
            return
        thread = threading.Thread(
            target=self._session, args=(channel,), name=f"{self._name}-session", daemon=True
        )
        with self._lock:
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had: this connection goes, not the port
            with self._lock:
                self._threads.discard(thread)
            self._sessions.release()
            channel.close()
            self._warn("thread", f"cannot start a thread for {channel.peer}: {exc}")

    def _session(self, channel: Channel) -> None:
        try:
            with channel:
                self._handle(channel)
        except Exception:  # noqa: BLE001 - one session's failure is not the listener's
            logger.exception("%s: serving %s failed", self._name, channel.peer)
        finally:
            self._sessions.release()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self._drop(conn)
        logger.debug("%s: a connection was refused: %s", self._name, why)
        self._refused += 1
        self._warn("refused")

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def _warn(self, kind: str, message: str | None = None) -> None:
        """A warning of each `kind` at most every `_WARN_EVERY` seconds: a flood of
        connections must not flood the log (refused connections are counted and told then)."""
        now = time.monotonic()
        if now - self._warned.get(kind, -_WARN_EVERY) < _WARN_EVERY:
            return
        self._warned[kind] = now
        if kind == "refused":
            logger.warning(
                "%s refused %d connection(s) that did not authenticate", self._name, self._refused
            )
            self._refused = 0
        elif message is not None:
            logger.warning("%s: %s", self._name, message)


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
