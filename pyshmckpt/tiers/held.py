"""Reading a checkpoint held in shared memory: the record's manifest over the segment's bytes.

A hold (or replica) record (`records`) holds what ``rankN.json`` would hold for the checkpoint on
disk, laid out as an exact image of the slot, plus the segment's name, size and token. Opening it
(`open_held`) gives the same `OpenedRank` a checkpoint directory gives, so memory and disk are
read and verified by the same code; `entry_rows` lists the entries and their CRC32C for a writer
process, which loads no torch.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import mmap
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._gc import gc_paused
from ..errors import CheckpointCorruptError, from_os_error
from ..shm.stale import SHM_DIR, read_header
from ..storage.safetensors_header import expected_crcs, parse_header

if TYPE_CHECKING:  # rank_files imports torch, which the writer process never loads
    from ..storage.rank_files import OpenedRank


@gc_paused()
def open_held(record: dict[str, Any], source: str = "memory") -> OpenedRank:
    """The held checkpoint of `record`, opened like a rank's files: the manifest is the record's,
    the data file the segment (checked: this user's, 0600, the record's size and token).

    Raises:
        CheckpointCorruptError: the segment is gone, not as recorded, or the record is malformed.
    """
    try:
        segment = record["segment"]
        name, size, token = (
            str(segment["name"]),
            int(segment["size"]),
            bytes.fromhex(segment["token"]),
        )
        offset, data_bytes = int(segment["offset"]), int(record["data_bytes"])
        header_bytes = base64.b64decode(record["header"])
        described = record["described"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(source, f"malformed hold record: {exc}") from None
    from ..storage.rank_files import OpenedRank, check_format_version

    if "/" in name or not isinstance(described, dict):
        raise CheckpointCorruptError(source, "malformed hold record")
    check_format_version(source, described)
    path = SHM_DIR / name
    try:  # a FIFO of another user's at that name would wait for a writer: not opened
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointCorruptError(str(path), "the held segment is gone") from None
    except OSError as exc:
        raise from_os_error(exc, f"cannot open {path}") from exc
    f = os.fdopen(fd, "rb")
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(str(path), "the held segment is not a file")
        found = read_header(f.read(4096))
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise CheckpointCorruptError(str(path), "the held segment is not this user's alone")
        if found is None or found.size != size or found.token != token:
            raise CheckpointCorruptError(str(path), "the held segment is not the one recorded")
        data_start = offset  # from the segment's start, past its header
        if offset < found.header_size or data_start + data_bytes > st.st_size:
            raise CheckpointCorruptError(str(path), "the held segment is shorter than recorded")
        header = parse_header(source, io.BytesIO(header_bytes), len(header_bytes) + data_bytes)
        header = dataclasses.replace(header, data_start=data_start)
        mapped = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_COPY)
    except BaseException:
        f.close()
        raise
    return OpenedRank(Path(source), path, described, header, mapped, f)


def entry_rows(
    record: dict[str, Any], source: str
) -> tuple[list[str], list[tuple[int, int]], list[int]]:
    """The entries of a held checkpoint: their names, (offset from the segment's start, length)
    and recorded CRC32C (no torch needed: a writer process calls this).

    Raises:
        CheckpointCorruptError: the record is malformed or lacks a checksum.
    """
    try:
        header_bytes = base64.b64decode(record["header"])
        data_bytes, offset = int(record["data_bytes"]), int(record["segment"]["offset"])
        recorded = record["described"].get("entries")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(source, f"malformed hold record: {exc}") from None
    header = parse_header(source, io.BytesIO(header_bytes), len(header_bytes) + data_bytes)
    expected = expected_crcs(Path(source), header, recorded)
    names = list(expected)
    rows = [
        (offset + header.entries[n].begin, header.entries[n].end - header.entries[n].begin)
        for n in names
    ]
    return names, rows, [expected[n] for n in names]
