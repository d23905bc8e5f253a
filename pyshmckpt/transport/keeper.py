"""Slot segments handed to the writer process by descriptor, so that nobody collects them between
the trainer's death and the writer's first look at them.

A segment is alive while some process holds it open (`shm.stale`: every open segment holds a
shared ``flock``, and stale-segment collection takes only segments nobody holds). The writer
attaches a segment when a write first names it; a trainer that dies right after ``save()``
returned may leave that write in the spool or the pipe, unread, and its segment held by nobody:
any process of this user starting a writer on the node (another job's included) would collect
it, and the staged save with it. So before a write naming a new segment is handed over, the
trainer sends the segment's descriptor over the control channel (``SCM_RIGHTS``): a descriptor
in flight is an open reference to the same open file, which keeps the trainer's lock in force
until the writer receives it and for as long as the writer keeps it, whatever happens to the
trainer. The writer closes what it keeps of a segment once the trainer no longer describes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
from collections.abc import Iterable
from multiprocessing.connection import Connection

from ..errors import ProtocolError
from .channel import Kind, Request, send

logger = logging.getLogger(__name__)

# The byte each descriptor message carries (a message with descriptors must carry data).
_MARK = b"k"
# Seconds the descriptors may take to follow their request.
_FOLLOW = 10.0


def hand_over(conn: Connection, descriptors: dict[str, int]) -> bool:
    """Send a KEEP request naming `descriptors`' segments, then the descriptors themselves;
    False when the writer is gone (nothing to keep then).

    Raises:
        OSError: nothing was sent (no descriptor to spare for the socket here).
        ProtocolError: the request went out and its descriptors could not: the channel is out
            of step, the caller must stop this writer.
    """
    names = sorted(descriptors)
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # before anything is sent
        if not send(conn, Request(Kind.KEEP, 0, payload={"names": names})):
            return False
        try:
            socket.send_fds(sock, [_MARK], [descriptors[name] for name in names])
        except OSError as exc:
            raise ProtocolError(f"the descriptors of {names} could not follow: {exc}") from exc
    return True


class Kept:
    """The writer's descriptors of the trainer's segments, by name (see the module)."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def receive(self, conn: Connection, request: Request) -> None:
        """Take the descriptors that follow `request` (a KEEP) on `conn`, waiting for them at most
        `_FOLLOW` seconds (the trainer sends them right after the request).

        Raises:
            ProtocolError: they did not come, or not as many as named: the channel is out of
                step with the trainer (what it sends next cannot be read as sent).
        """
        names = list(request.payload.get("names", ()))
        try:
            self._receive(conn, names)
        except OSError as exc:
            raise ProtocolError(f"the descriptors of {names} did not come: {exc}") from exc

    def _receive(self, conn: Connection, names: list[str]) -> None:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            if not select.select([sock], [], [], _FOLLOW)[0]:
                raise ProtocolError(f"the descriptors of {names} did not follow in {_FOLLOW:g} s")
            _, fds, _, _ = socket.recv_fds(sock, len(_MARK), max(1, len(names)))
        if len(fds) != len(names):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(
                f"expected the descriptors of {len(names)} segments, got {len(fds)}"
            )
        with self._lock:
            for name, fd in zip(names, fds, strict=True):
                previous = self._fds.pop(name, None)
                self._fds[name] = fd
                if previous is not None:
                    os.close(previous)
        logger.debug("keeping %d segment(s) of the trainer: %s", len(names), names)

    def retain(self, names: Iterable[str]) -> None:
        """Close what is kept of every segment but `names` (the trainer retired the others)."""
        wanted = set(names)
        with self._lock:
            gone = [name for name in self._fds if name not in wanted]
            closed = [self._fds.pop(name) for name in gone]
        for fd in closed:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Close everything kept (what the writer still needs, it has attached)."""
        self.retain(())
