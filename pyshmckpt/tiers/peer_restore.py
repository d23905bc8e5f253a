"""Restoring from another node's memory: during a collective restore, a rank whose checkpoint is
held only on another node (its replica on its buddy node, or its own memory copy on the node
it ran on before a restart moved it) fetches it from a rank running there.

Every rank lists what its node holds for the other ranks of the root (`offers`) and opens a
listening socket (`Server`) before the ranks exchange their options; once they agree on a
checkpoint, each rank that needs a copy from another node connects to the rank that offered it
(the lowest one), authenticated by a secret drawn for this restore and shared through the
exchange, and receives the checkpoint into a segment of its own, every entry's CRC32C checked.

The server serves each fetch on a thread of its own (`wire.Listener`: connections that do not
authenticate are bounded in number and time). A fetch names the rank and the checkpoint it
wants; what arrives is checked to be that before anything is allocated for it, and a fetch or a
serve gives up once nothing has moved for `_IDLE` seconds, so that one stopped peer costs the
other ranks seconds, not the restore timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any, NamedTuple

from .. import knobs
from ..errors import PyshmckptError, ReplicationError
from ..shm.native import Segment
from ..shm.stale import SHM_DIR
from . import records, replicas, wire
from .held import open_held

logger = logging.getLogger(__name__)


class Offer(NamedTuple):
    """A checkpoint this node holds for rank `rank` of the root (a replica, or that rank's own
    memory copy left here): its name and when it was staged."""

    rank: int
    name: str
    staged_ns: int


def held_here(root: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """The newest checkpoint of (root, rank) held on this node, its own hold or a replica."""
    found = [r for r in (records.find(root, rank), replicas.find(root, rank)) if r is not None]
    return max(found, key=records.staged_ns) if found else None


def offers(root: str | os.PathLike[str], world_size: int, rank: int) -> list[Offer]:
    """What this node holds for the other ranks of `root` (one listing of ``/dev/shm``)."""
    keys = {records.hold_key(root, other): other for other in range(world_size)}
    held, replica = f"{knobs.segment_prefix()}-held-", f"{knobs.segment_prefix()}-replica-"
    ranks = set()
    with contextlib.suppress(OSError):
        for name in (entry.name for entry in SHM_DIR.iterdir()):
            if name.startswith(held):  # <prefix>-held-<key>-<token>, and so for replicas
                key = name[len(held) :].split("-", 1)[0]
            elif name.startswith(replica):
                key = name[len(replica) :].split("-", 1)[0]
            else:
                continue
            if key in keys and keys[key] != rank:
                ranks.add(keys[key])
    out = []
    for other in sorted(ranks):
        record = held_here(root, other)
        if record is not None:
            out.append(Offer(other, str(record.get("name", "")), records.staged_ns(record)))
    return out


# Seconds a fetch or a serve may go with nothing moving (its connection and handshake
# included): a peer that stopped is given up in seconds, not at the restore timeout.
_IDLE = 30.0
# Fetches one rank serves at once, and connections to its port in their handshake at once.
_SESSIONS = 32
_PENDING = 64
# Bytes of a fetch request, at most.
_REQUEST_MAX = 4096


def _server_identity(address: tuple[str, int]) -> str:
    return wire.identity("restore", address=address)


class Server:
    """Serves this node's copies to the ranks that fetch them, during one restore, each fetch
    on a thread of its own."""

    def __init__(self, root: str | os.PathLike[str], address: str) -> None:
        self.root = root
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((address, 0))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._wanted: dict[int, str] = {}
        self._end = 0.0
        self._listener: wire.Listener | None = None

    def serve(self, wanted: dict[int, str], secret: str, timeout: float) -> None:
        """From now on serve `wanted` (rank -> checkpoint name, each once), until `close` or
        `timeout` seconds from the first call."""
        with self._lock:
            self._wanted = dict(wanted)
            if not wanted or self._listener is not None:
                return
            self._end = time.monotonic() + timeout
            self._listener = wire.Listener(
                self._sock, secret, _server_identity(self.address), self._send,
                name="pyshmckpt-peer-restore", pending=_PENDING, sessions=_SESSIONS,
            )  # fmt: skip

    def _send(self, channel: wire.Channel) -> None:
        left = self._end - time.monotonic()
        if left <= 0:
            return
        deadline = wire.Deadline(left, idle=_IDLE)
        try:
            request = channel.recv_message(deadline, limit=_REQUEST_MAX)
            rank, name = request.get("rank"), request.get("name")
            wanted, record = None, None
            if type(rank) is int:
                with self._lock:
                    wanted = self._wanted.pop(rank, None)
                record = held_here(self.root, rank) if wanted is not None else None
            if record is None or record.get("name") != wanted or name not in (None, wanted):
                channel.send_message({"kind": "none"}, deadline)
                return
            replicas.send(channel, record, deadline)
            channel.recv_message(deadline, limit=_REQUEST_MAX)  # the fetcher holds the bytes
        except (OSError, PyshmckptError) as exc:
            logger.warning("serving a checkpoint to %s failed: %s", channel.peer, exc)

    def close(self) -> None:
        """Stop serving (fetches in progress get a moment to end)."""
        with self._lock:
            listener, self._listener = self._listener, None
            self._end = 0.0
        if listener is not None:
            listener.close(wait=_IDLE)
        else:
            self._sock.close()


def fetch(
    address: tuple[str, int],
    secret: str,
    rank: int,
    timeout: float,
    *,
    name: str | None = None,
    idle: float = _IDLE,
) -> tuple[dict[str, Any], Segment]:
    """Rank `rank`'s checkpoint (`name`, when given) from the rank serving at `address`,
    received into a new segment of this node and checked (every entry's CRC32C). The caller
    owns the segment. Bounded by `timeout` seconds overall, and by `idle` seconds with nothing
    moving (the connection and handshake included).

    Raises:
        ReplicationError: the server cannot be reached, did not authenticate, broke off, no
            longer holds it, or sent another rank's or another checkpoint's copy, or a
            malformed one (nothing of it is kept).
        CheckpointCorruptError: an entry's bytes do not match.
    """
    deadline = wire.Deadline(timeout, idle=idle)
    with wire.connect(
        address, secret, deadline.within(idle), client=wire.identity("restore-fetch", rank=rank),
        server=_server_identity(address),
    ) as channel:  # fmt: skip
        channel.send_message({"kind": "fetch", "rank": rank, "name": name}, deadline)
        record, segment = replicas.receive(channel, deadline, rank=rank, name=name)
        with contextlib.suppress(ReplicationError):
            channel.send_message({"ok": True}, deadline)
    return record, segment


def open_fetched(record: dict[str, Any], segment: Segment) -> Any:
    """A fetched checkpoint opened like a held one; its segment's name is removed at once (the
    open mapping keeps the memory until the load is done)."""
    try:
        opened = open_held(record, source=f"memory of another node (rank {record.get('rank')})")
    finally:
        segment.unlink()
        segment.close()
    return opened
