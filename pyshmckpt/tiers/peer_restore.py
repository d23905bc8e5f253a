"""Restoring from another node's memory: during a collective restore, a rank whose checkpoint is
held only on another node (its replica on its buddy node, or its own memory copy on the node
it ran on before a restart moved it) fetches it from a rank running there.

Every rank lists what its node holds for the other ranks of the root (`offers`) and opens a
listening socket (`Server`) before the ranks exchange their options; once they agree on a
checkpoint, each rank that needs a copy from another node connects to the rank that offered it
(the lowest one), authenticated by a secret drawn for this restore and shared through the
exchange, and receives the checkpoint into a segment of its own, every entry's CRC32C checked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
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
    return max(found, key=lambda r: int(r.get("staged_ns", 0))) if found else None


def offers(root: str | os.PathLike[str], world_size: int, rank: int) -> list[Offer]:
    """What this node holds for the other ranks of `root` (one listing of ``/dev/shm``)."""
    keys = {records.hold_key(root, other): other for other in range(world_size)}
    held, replica = f"{knobs.segment_prefix()}-held-", f"{knobs.segment_prefix()}-replica-"
    ranks = set()
    with contextlib.suppress(OSError):
        for name in (entry.name for entry in SHM_DIR.iterdir()):
            if name.startswith(held):
                key = name[len(held) :]
            elif name.startswith(replica):
                key = name[len(replica) :].rsplit("-", 1)[0]
            else:
                continue
            if key in keys and keys[key] != rank:
                ranks.add(keys[key])
    out = []
    for other in sorted(ranks):
        record = held_here(root, other)
        if record is not None:
            out.append(Offer(other, str(record.get("name", "")), int(record.get("staged_ns", 0))))
    return out


class Server:
    """Serves this node's copies to the ranks that fetch them, during one restore."""

    def __init__(self, root: str | os.PathLike[str], address: str) -> None:
        self.root = root
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((address, 0))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._wanted: dict[int, str] = {}
        self._thread: threading.Thread | None = None

    def serve(self, wanted: dict[int, str], secret: str, timeout: float) -> None:
        """From now on serve `wanted` (rank -> checkpoint name, each once), until `close` or
        `timeout` seconds from the first call."""
        with self._lock:
            self._wanted = dict(wanted)
        if wanted and self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, args=(secret, timeout), name="pyshmckpt-peer-restore",
                daemon=True,
            )  # fmt: skip
            self._thread.start()

    def _serve(self, secret: str, timeout: float) -> None:
        deadline = wire.Deadline(timeout)
        while True:
            try:
                self._sock.settimeout(deadline.left())
                conn, _ = self._sock.accept()
            except (OSError, ReplicationError):
                return  # closed, or out of time
            with conn:
                try:
                    if not wire.accept(conn, secret, min(10.0, deadline.left())):
                        logger.warning("a connection that did not authenticate was refused")
                        continue
                    rank = int(wire.recv_message(conn).get("rank", -1))
                    record = held_here(self.root, rank)
                    with self._lock:
                        name = self._wanted.pop(rank, None)
                    if name is None or record is None or record.get("name") != name:
                        wire.send_message(conn, {"kind": "none"})
                        continue
                    replicas.send(conn, record, deadline)
                    wire.recv_message(conn)  # the fetcher's answer: it holds the bytes
                except (OSError, PyshmckptError, ValueError, TypeError) as exc:
                    logger.warning("serving a checkpoint to another node failed: %s", exc)

    def close(self) -> None:
        """Stop serving (the serving thread's accept returns at once)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._thread is not None:
            self._thread.join(30.0)


def fetch(
    address: tuple[str, int], secret: str, rank: int, timeout: float
) -> tuple[dict[str, Any], Segment]:
    """Rank `rank`'s checkpoint from the rank serving at `address`, received into a new segment
    of this node and checked (every entry's CRC32C).

    Raises:
        ReplicationError: the server cannot be reached, did not authenticate, broke off, or no
            longer holds it.
        CheckpointCorruptError: an entry's bytes do not match.
    """
    deadline = wire.Deadline(timeout)
    with wire.connect(address, secret, deadline) as sock:
        wire.send_message(sock, {"kind": "fetch", "rank": rank})
        record, segment = replicas.receive(sock, deadline)
        with contextlib.suppress(OSError):
            wire.send_message(sock, {"ok": True})
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
