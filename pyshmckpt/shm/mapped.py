"""A held segment that restored tensors map must never be written again: a lock says so.

A restore that hands out tensors viewing a held segment (``load(..., mmap=True)`` from memory)
maps it privately, copy-on-write: its pages not yet written through that mapping show whatever
is later written to the segment. So while such a mapping lives, nothing may write the segment.
The only writer a held segment can have is a trainer that takes it over as a slot (the memory
tier's takeover); the protocol is a lock on one byte of the segment, an open file description
lock (``F_OFD_SETLK``), which the kernel drops when the last descriptor of that open file goes
(in any process, in any PID namespace):

- a reader that keeps a mapping takes it shared, on the descriptor its mapping keeps open
  (`keep_unwritten`); it lasts as long as the mapping. A reader that cannot take it (a trainer
  may write the segment) copies the bytes instead;
- a trainer takes it exclusive before taking a segment over and keeps it as long as it may write
  (`claim_for_writing`); it takes nothing over that a reader maps, and makes new slots instead.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

from .stale import SHM_DIR

# Past the end of any segment: no other lock of ours is on that byte.
_BYTE = 1 << 62


def _lock(fd: int, kind: int) -> bool:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padded to its size.
    request = struct.pack("hhqqi4x", kind, os.SEEK_SET, _BYTE, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def keep_unwritten(fd: int) -> bool:
    """Take the shared lock on the segment open at `fd` (held while its open file lives, so a
    mapping made from `fd` keeps it); False when a trainer holds it to write the segment."""
    return _lock(fd, fcntl.F_RDLCK)


def claim_for_writing(name: str) -> int | None:
    """A descriptor of segment `name` holding the exclusive lock (close it once nothing of this
    process may write the segment), or None when a reader maps the segment (or it is gone)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if _lock(fd, fcntl.F_WRLCK):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None
