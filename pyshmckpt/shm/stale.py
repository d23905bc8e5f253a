"""Find and remove segments that no process has open any more (a crash, a SIGKILL, a whole node's
failure).

Every open segment, created or attached (`Segment` in ``csrc/segment.cpp``), holds a shared
``flock`` on its descriptor for as long as the descriptor is open, and the kernel drops it when
the last process holding it dies. A segment is stale exactly when a collector can take the lock
exclusively: that proof holds across PID namespaces sharing ``/dev/shm`` (containers started
with ``--ipc=host``), where a pid in a name or header means nothing. The collector removes the
name while it holds the exclusive lock, so nobody can have opened the segment in between; a
creator or an attacher that opened the name before the collector locked it finds, once it holds
its own lock, that the name is gone, and makes another segment or reports ENOENT.

A segment's name is ``<prefix>-<creator pid>-<32 hex digits>`` and its header records the
creator's pid and start time: shown for information (``pyshmckpt gc``), never judged by.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

from .. import knobs

SHM_DIR = Path("/dev/shm")
logger = logging.getLogger(__name__)
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<pid>\d+)-(?P<nonce>[0-9a-f]{32})$")
_MAGIC = b"PYSHMCKPT-SEG\x00\x00\x00"
# SegmentHeader in csrc/segment.h: magic[16], version u32, header_size u32, size u64, token[16],
# owner_pid i64, owner_start_ticks u64.
_HEADER = struct.Struct("<16sIIQ16sqQ")


@dataclass(frozen=True)
class SegmentInfo:
    """One pyshmckpt segment in ``/dev/shm``: its name, its creator (pid and start time in clock
    ticks since boot, as its header or name records them: for information only), its size in
    bytes, and whether it is stale (no process has it open) and why."""

    name: str
    owner_pid: int
    owner_start_ticks: int
    size: int
    stale: bool
    reason: str


@dataclass(frozen=True)
class SegmentHeader:
    """The fields of a segment's header that identify it and its creator."""

    header_size: int
    size: int
    token: bytes
    owner_pid: int
    owner_start_ticks: int


def read_header(raw: bytes) -> SegmentHeader | None:
    """The header at the start of `raw` (a segment's first bytes), or None if it is not ours."""
    if len(raw) < _HEADER.size or not raw.startswith(_MAGIC[:13]):
        return None
    _, _, header_size, size, token, pid, ticks = _HEADER.unpack(raw[: _HEADER.size])
    return SegmentHeader(header_size, size, token, pid, ticks)


def inspect_segment(name: str) -> SegmentInfo | None:
    """Creator and staleness of one of our segments, or None if `name` is not one of ours (not
    this user's, not a regular file, or gone). Judged by its lock (see the module); a stale
    segment is left in place."""
    return _examine(name, remove=False)


def _examine(name: str, *, remove: bool) -> SegmentInfo | None:
    """Judge segment `name` by its lock and, with `remove`, unlink it if stale while the
    exclusive lock is held (so that nobody can have opened it in between). None: not one of
    ours, removed by someone else first, or not to be judged (an error, logged: left alone)."""
    match = _NAME.match(name)
    if match is None:
        return None
    path = SHM_DIR / name
    try:
        # O_NOFOLLOW: a symlink planted under our prefix is never followed; O_NONBLOCK: nor a FIFO
        # waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not S_ISREG(st.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            stale = True
        except BlockingIOError:  # a live process holds its shared lock
            stale = False
        info = _describe(name, int(match["pid"]), os.pread(fd, _HEADER.size, 0), st.st_size, stale)
        if stale and remove:
            named = path.lstat()
            if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
                return None  # removed, and the name taken again, by someone else
            path.unlink()
        return info
    except FileNotFoundError:
        return None  # another collector removed it first
    except OSError as exc:
        logger.warning("cannot judge segment %s, leaving it: %s", name, exc)
        return None
    finally:
        os.close(fd)  # drops our lock


def _describe(name: str, name_pid: int, raw: bytes, file_size: int, stale: bool) -> SegmentInfo:
    header = read_header(raw)
    if header is None:  # created, not yet initialised (or its creator died while allocating)
        reason = "no header; " + ("no process has it open" if stale else "being created")
        return SegmentInfo(name, name_pid, 0, file_size, stale, reason)
    reason = "no process has it open" if stale else "open in a live process"
    return SegmentInfo(name, header.owner_pid, header.owner_start_ticks, header.size, stale, reason)


def list_segments(prefix: str | None = None) -> list[SegmentInfo]:
    """Our segments in /dev/shm whose name starts with `prefix` (default: the configured one),
    each judged by its lock (see `inspect_segment`)."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    out: list[SegmentInfo] = []
    for name in _names(prefix):
        info = inspect_segment(name)
        if info is not None:
            out.append(info)
    return out


def _names(prefix: str) -> list[str]:
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix + "-"))
    except FileNotFoundError:
        return []


def collect_stale_segments(
    prefix: str | None = None, *, dry_run: bool = False
) -> list[SegmentInfo]:
    """Unlink this user's pyshmckpt segments that no process has open (their creator and every
    process that attached them are gone: a crash, a SIGKILL, a lost node's leftovers after a
    restart of the container).

    Each segment is judged by its lock (see the module), which holds across PID namespaces: a
    segment open in any live process, in this container or another sharing ``/dev/shm``, is
    never touched. Every writer runs this at start; `pyshmckpt gc` runs it.

    Args:
        prefix: segment name prefix (None: ``PYSHMCKPT_SEGMENT_PREFIX``, default "pyshmckpt").
        dry_run: only report what would be removed.

    Returns:
        A `SegmentInfo` per segment removed (or, with `dry_run`, that would be).

    Raises:
        ConfigError: ``PYSHMCKPT_SEGMENT_PREFIX`` contains "/".
    """
    prefix = knobs.segment_prefix() if prefix is None else prefix
    removed = []
    for name in _names(prefix):
        info = _examine(name, remove=not dry_run)
        if info is None or not info.stale:
            continue
        if not dry_run:
            logger.info(
                "removed stale segment %s (%s, created by pid %d)",
                info.name, info.reason, info.owner_pid,
            )  # fmt: skip
        removed.append(info)
    return removed
