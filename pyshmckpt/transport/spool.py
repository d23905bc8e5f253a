"""The spool: writes handed to a writer process that is still starting.

A writer process takes a while to start (a fraction of a second for the Checkpointer's default
writer, which does not import torch; seconds for a writer that does). Rather than
make the trainer's first save wait for it, its WRITE requests are appended to a spool: an
anonymous memory file (``memfd``) that the writer process inherits when it is spawned. A record
is complete once ``append`` returns, and from then on it lives in kernel memory that the writer
holds too, so a trainer killed right after ``save()`` returned still has its save finished: the
writer reads the spool when it is ready (or when it notices the trainer's death).

Record format: 8-byte little-endian length, then a pickled request. The payload is written before
its length, so a record cut short by the trainer's death reads as the end of the spool. When the
writer is ready, the trainer stops appending and tells it over the control channel how many
records the spool holds (an ADOPT request); every later write goes over the channel.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import struct
from multiprocessing import reduction
from typing import Any

from ..errors import from_os_error

_LENGTH = struct.Struct("<Q")
logger = logging.getLogger(__name__)


class Spool:
    """The trainer's end: append pickled requests to a memfd the writer process inherits."""

    def __init__(self) -> None:
        try:
            self.fd = os.memfd_create("pyshmckpt-spool", os.MFD_CLOEXEC)
        except OSError as exc:
            raise from_os_error(exc, "cannot create the spool of the writer process") from None
        self._end = 0
        self.count = 0

    def append(self, message: Any) -> None:
        """Add one record; it survives this process once this returns. Pickling errors raise
        before anything is written."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            _write_all(self.fd, data, self._end + _LENGTH.size)
            _write_all(self.fd, _LENGTH.pack(len(data)), self._end)  # the record is complete now
        except OSError as exc:
            raise from_os_error(
                exc, "cannot queue a write for the starting writer process"
            ) from None
        self._end += _LENGTH.size + len(data)
        self.count += 1

    def inheritable(self) -> InheritedFd:
        """The spool's descriptor, to pass among a spawned process's arguments."""
        return InheritedFd(self.fd)

    def close(self) -> None:
        """Drop the trainer's reference; the writer keeps its own. Idempotent."""
        fd, self.fd = self.fd, -1
        close_quietly(fd)


class SpoolReader:
    """The writer's end: the records of the spool, in order, each read once."""

    def __init__(self, fd: int | None) -> None:
        self._fd = -1 if fd is None else fd
        self._offset = 0
        self._read = 0  # records passed so far

    def read(self, limit: int | None = None) -> list[Any]:
        """Up to `limit` (None: every) complete records not read yet. A record that cannot be
        unpickled is logged and passed over: the others are still finished. Never raises: what
        cannot be read (the spool's descriptor failing) ends the records, logged."""
        records: list[Any] = []
        while self._fd >= 0 and (limit is None or len(records) < limit):
            try:
                header = os.pread(self._fd, _LENGTH.size, self._offset)
                if len(header) < _LENGTH.size:
                    break
                (length,) = _LENGTH.unpack(header)
                if length == 0:
                    break
                data = os.pread(self._fd, length, self._offset + _LENGTH.size)
            except OSError as exc:
                logger.error("cannot read the spool past its record %d: %s", self._read, exc)
                break
            if len(data) < length:
                break
            self._offset += _LENGTH.size + length
            self._read += 1
            try:
                records.append(pickle.loads(data))
            except Exception as exc:  # noqa: BLE001 - one bad record must not cost the others
                logger.error(
                    "spooled write %d cannot be read (%s: %s): it is lost, the others are kept",
                    self._read, type(exc).__name__, exc,
                )  # fmt: skip
        return records

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        close_quietly(fd)


class InheritedFd:
    """A file descriptor among a spawned process's arguments: multiprocessing's spawn passes it
    to the child (as it passes a Connection's), where it unpickles to the int descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _adopt, (reduction.DupFd(self.fd),)


def close_quietly(fd: int) -> None:
    """Close a descriptor (none when negative), ignoring errors: cleanup that must not raise."""
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _adopt(duplicate: Any) -> int:
    return int(duplicate.detach())


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
