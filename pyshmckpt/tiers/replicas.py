"""Replicas: a rank's checkpoint held in the memory of another node, and moving one over the wire.

A replica is held like a checkpoint of the memory tier (a segment, and a record in the format of
`records` that describes it), under ``/dev/shm/<prefix>-replica-<key>-<pid>``: the key is the
hold key of (root, rank) of the rank whose state it is, the pid the process that holds it. Each
holder writes only records named with its own pid, so a newer replica never races an older
holder's release for one name; `find` takes the newest valid one.

`send` puts a staged checkpoint on an authenticated connection (its record, then its bytes with
``sendfile`` from the segment); `receive` takes it into a new segment with ``recv_into`` and
checks every entry's CRC32C before the replica counts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .. import knobs
from ..errors import CheckpointCorruptError, ReplicationError
from ..shm.native import Segment
from ..shm.stale import SHM_DIR
from . import held, records, wire

logger = logging.getLogger(__name__)


def replica_path(root: str | os.PathLike[str], rank: int, holder: int) -> Path:
    """Where process `holder` keeps its record of a replica of (root, rank)."""
    prefix = knobs.segment_prefix()
    return SHM_DIR / f"{prefix}-replica-{records.hold_key(root, rank)}-{holder}"


def replicas_of(root: str | os.PathLike[str], rank: int) -> list[tuple[Path, dict[str, Any]]]:
    """This node's replicas of (root, rank), newest first."""
    prefix = knobs.segment_prefix()
    pattern = f"{prefix}-replica-{records.hold_key(root, rank)}-*"
    found = []
    with contextlib.suppress(FileNotFoundError):
        for path in SHM_DIR.glob(pattern):
            if path.name.rsplit("-", 1)[-1].isdigit():
                record = records.read_record(path)
                if record is not None:
                    found.append((path, record))
    return sorted(found, key=lambda pr: int(pr[1].get("staged_ns", 0)), reverse=True)


def find(root: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """The newest replica of (root, rank) on this node whose segment still exists, or None."""
    for _, record in replicas_of(root, rank):
        with contextlib.suppress(KeyError, TypeError):
            if (SHM_DIR / str(record["segment"]["name"])).exists():
                return record
    return None


def send(sock: socket.socket, record: dict[str, Any], deadline: wire.Deadline) -> None:
    """Send a held checkpoint: its record, then its `data_bytes` bytes straight from the
    segment the record names, at the record's offset.

    Raises:
        ReplicationError: the peer broke off or did not answer by `deadline`.
        OSError: the segment is gone.
    """
    segment = record["segment"]
    sent = {k: v for k, v in record.items() if k not in ("segment", "holder", "agent", "deadline")}
    fd = os.open(SHM_DIR / str(segment["name"]), os.O_RDONLY | os.O_CLOEXEC)
    try:
        wire.send_message(sock, {"kind": "replica", "record": sent})
        wire.send_file_range(sock, fd, int(segment["offset"]), int(record["data_bytes"]), deadline)
    finally:
        os.close(fd)
    wire.set_timeout(sock, deadline)  # for the answer that follows


def receive(
    sock: socket.socket,
    deadline: wire.Deadline,
    spare: Callable[[int], Segment | None] | None = None,
) -> tuple[dict[str, Any], Segment]:
    """Receive a checkpoint sent by `send` into a segment of this user's (0600) and check the
    CRC32C of every entry; returns its record (naming that segment) and the segment. The
    segment is `spare(nbytes)` when that gives one (a segment of ours whose pages are in
    place: an older replica's, given over), else a new one.

    Raises:
        ReplicationError: the peer broke off, or sent something that is not a checkpoint.
        CheckpointCorruptError: an entry's bytes do not match its CRC32C (the segment is gone).
    """
    message = wire.recv_message(sock)
    record = message.get("record")
    if message.get("kind") != "replica" or not isinstance(record, dict):
        raise ReplicationError("the peer sent no checkpoint")
    try:
        data_bytes = int(record["data_bytes"])
        described = record["described"]
    except (KeyError, TypeError, ValueError):
        raise ReplicationError("the peer sent a malformed checkpoint record") from None
    if data_bytes < 0 or not isinstance(described, dict):
        raise ReplicationError("the peer sent a malformed checkpoint record")
    segment = spare(data_bytes) if spare is not None else None
    if segment is None:  # populated up front: one pass, not a page fault per page as bytes land
        segment = Segment.create(max(data_bytes, 1), knobs.segment_prefix(), True)
    try:
        start = segment.data_offset
        record["segment"] = {
            "name": segment.name, "size": segment.size, "token": segment.token.hex(),
            "offset": start,
        }  # fmt: skip
        _receive_checked(sock, segment, record, start, data_bytes, deadline)
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return record, segment


# Bytes received between two hand-offs of complete entries to the checksum thread.
_PIECE = 32 << 20


def _receive_checked(
    sock: socket.socket,
    segment: Segment,
    record: dict[str, Any],
    start: int,
    data_bytes: int,
    deadline: wire.Deadline,
) -> None:
    """Receive the bytes into the segment while a thread checks each entry whose bytes are all
    in (the native checksums release the GIL): the check ends soon after the last byte."""
    source = f"replica of rank {record.get('rank')}"
    try:
        names, rows, expected = held.entry_rows(record, source)
    except CheckpointCorruptError as exc:
        raise ReplicationError(f"the peer sent a malformed checkpoint record: {exc}") from None
    order = sorted(range(len(rows)), key=lambda i: rows[i][0] + rows[i][1])
    checks: list[tuple[list[int], Future[Any]]] = []
    done = 0
    with ThreadPoolExecutor(1, thread_name_prefix="pyshmckpt-replica-crc") as pool:
        with memoryview(segment) as view:
            got = 0
            wire.set_timeout(sock, deadline)
            while got < data_bytes:
                piece = min(_PIECE, data_bytes - got)
                wire.recv_into(sock, view[start + got : start + got + piece])
                got += piece
                ready = []
                while done < len(order) and sum(rows[order[done]]) <= start + got:
                    ready.append(order[done])
                    done += 1
                if ready:
                    ranges = np.array([rows[i] for i in ready], dtype=np.uint64).reshape(-1, 2)
                    checks.append((ready, pool.submit(segment.checksums, ranges)))
        for indices, future in checks:
            for i, crc in zip(indices, future.result().tolist(), strict=True):
                if crc != expected[i]:
                    raise CheckpointCorruptError(
                        source, f"checksum mismatch ({crc:#010x} != {expected[i]:#010x})",
                        tensor=names[i],
                    )  # fmt: skip
    if done < len(order):
        raise CheckpointCorruptError(source, "entries lie beyond the bytes sent")
