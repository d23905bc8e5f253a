"""Find and remove segments whose owning process is gone (crash, SIGKILL, whole-node failure).

A segment's name is ``<prefix>-<owner pid>-<32 hex digits>`` and its header records the owner's
pid and start time (in clock ticks since boot), so a segment is stale when that process no longer
exists, or when its pid now belongs to a process that started at another time.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .. import knobs

SHM_DIR = Path("/dev/shm")
logger = logging.getLogger(__name__)
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<pid>\d+)-(?P<nonce>[0-9a-f]{32})$")
_MAGIC = b"PYSHMCKPT-SEG\x00\x00\x00"
# SegmentHeader in csrc/segment.h: magic[16], version u32, header_size u32, size u64, token[16],
# owner_pid i64, owner_start_ticks u64.
_HEADER = struct.Struct("<16sIIQ16sqQ")
_OWNER = struct.Struct("<qQ")  # owner_pid, owner_start_ticks
_OWNER_OFFSET = _HEADER.size - _OWNER.size


@dataclass(frozen=True)
class SegmentInfo:
    """One pyshmckpt segment in ``/dev/shm``: its name, its owner process (pid and start time in
    clock ticks since boot), its size in bytes, and whether it is stale (its owner is gone) and
    why."""

    name: str
    owner_pid: int
    owner_start_ticks: int
    size: int
    stale: bool
    reason: str


@dataclass(frozen=True)
class SegmentHeader:
    """The fields of a segment's header that identify it and its owner."""

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


def set_owner(name: str, pid: int) -> None:
    """Record process `pid` (alive) as the owner of segment `name`, so that stale-segment
    collection leaves it alone while that process lives (a writer holding a dead trainer's
    segment, a new trainer taking a held one over).

    Raises:
        OSError: the segment cannot be opened or written.
    """
    ticks = process_start_ticks(pid) or 0
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, _OWNER.pack(pid, ticks), _OWNER_OFFSET)
    finally:
        os.close(fd)


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid`, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[1])  # field 4 of the line


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])  # field 22 of the line; fields[0] is field 3


def inspect_segment(name: str) -> SegmentInfo | None:
    """Owner and staleness of one of our segments, or None if `name` is not one of ours."""
    match = _NAME.match(name)
    if match is None:
        return None
    path = SHM_DIR / name
    try:
        st = path.stat()
        if st.st_uid != os.geteuid():
            return None
        with path.open("rb") as f:
            raw = f.read(_HEADER.size)
    except (FileNotFoundError, PermissionError):
        return None
    pid = int(match["pid"])
    if len(raw) < _HEADER.size or not raw.startswith(_MAGIC[:13]):
        # Created but never initialised (the owner died while allocating): judge by the name.
        alive = process_start_ticks(pid) is not None
        return SegmentInfo(name, pid, 0, st.st_size, not alive, "no header; owner " + (
            "alive" if alive else "gone"))  # fmt: skip
    _, _, _, size, _, owner_pid, start_ticks = _HEADER.unpack(raw)
    current = process_start_ticks(owner_pid)
    if current is None:
        return SegmentInfo(name, owner_pid, start_ticks, size, True, "owner process is gone")
    if start_ticks and current != start_ticks:
        return SegmentInfo(name, owner_pid, start_ticks, size, True, "owner pid was reused")
    return SegmentInfo(name, owner_pid, start_ticks, size, False, "owner is alive")


def list_segments(prefix: str | None = None) -> list[SegmentInfo]:
    """Our segments in /dev/shm whose name starts with `prefix` (default: the configured one)."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    out: list[SegmentInfo] = []
    try:
        names = sorted(p.name for p in SHM_DIR.iterdir())
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith(prefix + "-"):
            continue
        info = inspect_segment(name)
        if info is not None:
            out.append(info)
    return out


def collect_stale_segments(
    prefix: str | None = None, *, dry_run: bool = False
) -> list[SegmentInfo]:
    """Unlink this user's pyshmckpt segments whose owner process is gone (a crash, a SIGKILL, a
    lost node's leftovers after a reboot of the container).

    A segment's name records its owner's pid and start time, so a live process's segments (and
    those of a process that reused a dead one's pid) are never touched. `pyshmckpt gc` runs this.

    Args:
        prefix: segment name prefix (None: ``PYSHMCKPT_SEGMENT_PREFIX``, default "pyshmckpt").
        dry_run: only report what would be removed.

    Returns:
        A `SegmentInfo` per segment removed (or, with `dry_run`, that would be).

    Raises:
        ConfigError: ``PYSHMCKPT_SEGMENT_PREFIX`` contains "/".
    """
    removed = []
    for info in list_segments(prefix):
        if not info.stale:
            continue
        if not dry_run:
            try:
                (SHM_DIR / info.name).unlink()
            except FileNotFoundError:
                continue  # someone else collected it first
            logger.info(
                "removed stale segment %s (%s, owner %d)", info.name, info.reason, info.owner_pid
            )
        removed.append(info)
    return removed
