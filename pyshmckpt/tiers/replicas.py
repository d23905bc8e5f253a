"""Replicas: a rank's checkpoint held in the memory of another node, and moving one over the wire.

A replica is held like a checkpoint of the memory tier (a segment, and a record in the format of
`records` that describes it), under ``/dev/shm/<prefix>-replica-<key>-<token>``: the key is the
hold key of (root, rank) of the rank whose state it is, the token one drawn by the process that
holds it (`records.own_record_path`), so that no other user of the node can predict the name
and take it first. Each holder writes only records named with its own token, so a newer replica
never races an older holder's release for one name; `find` takes the newest whose holder lives.

`send` puts a staged checkpoint on an authenticated connection (its record, then its bytes with
``sendfile`` from the segment); `receive` checks the record (a malformed one, or one announcing
more bytes than its entries hold, is refused before anything is allocated), takes the bytes into
a new segment with ``recv_into``, allocating its pages as they arrive, and checks every entry's
CRC32C before the replica counts.
"""

from __future__ import annotations

import contextlib
import logging
import os
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

# Bytes a record may announce beyond the end of its last entry (the slot's trailing alignment).
SLACK = 1 << 20
# Fields of a record that describe where it is held, not the checkpoint: never sent.
_LOCAL = ("segment", "holder", "agent", "deadline")


def replica_path(root: str | os.PathLike[str], rank: int) -> Path:
    """Where this process keeps its record of a replica of (root, rank)."""
    return records.own_record_path(root, rank, "replica")


def replicas_of(root: str | os.PathLike[str], rank: int) -> list[tuple[Path, dict[str, Any]]]:
    """This node's replicas of (root, rank) whose holder lives, newest staged first."""
    return records.live_records(root, rank, "replica")


def find(root: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """The newest replica of (root, rank) on this node whose segment still exists, or None."""
    for _, record in replicas_of(root, rank):
        with contextlib.suppress(KeyError, TypeError):
            if (SHM_DIR / str(record["segment"]["name"])).exists():
                return record
    return None


def send(
    channel: wire.Channel,
    record: dict[str, Any],
    deadline: wire.Deadline,
    moved: Callable[[int], None] | None = None,
) -> None:
    """Send a held checkpoint: its record, then its `data_bytes` bytes straight from the
    segment the record names, at the record's offset; `moved(n)` as bytes leave.

    Raises:
        ReplicationError: the peer broke off or did not answer by `deadline`.
        OSError: the segment is gone.
    """
    segment = record["segment"]
    sent = {k: v for k, v in record.items() if k not in _LOCAL}
    fd = os.open(
        SHM_DIR / str(segment["name"]), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    )
    try:
        channel.send_message({"kind": "replica", "record": sent}, deadline)
        channel.send_file(fd, int(segment["offset"]), int(record["data_bytes"]), deadline, moved)
    finally:
        os.close(fd)


def _malformed(why: str) -> ReplicationError:
    return ReplicationError(f"the peer sent a malformed checkpoint record: {why}")


def check_record(
    record: Any, *, rank: int | None = None, name: str | None = None
) -> tuple[list[str], list[tuple[int, int]], list[int]]:
    """Check a record received from a peer before anything is allocated for it: the fields a
    replica needs, of their types; entries that lie within its `data_bytes`, which in turn
    may exceed what they need by `SLACK` at most; and, when given, the `rank` and `name` asked
    for. Returns its entries: names, (offset from the data's start, length), CRC32C.

    Raises:
        ReplicationError: the record is malformed, or not of the rank or name asked for.
    """
    if not isinstance(record, dict):
        raise _malformed("not an object")
    for field, kind in (("root", str), ("name", str), ("header", str), ("described", dict)):
        if not isinstance(record.get(field), kind) or not record[field]:
            raise _malformed(f"no {field}")
    for field in ("rank", "staged_ns", "data_bytes"):
        value = record.get(field)
        if type(value) is not int or value < 0:
            raise _malformed(f"{field} is {value!r}, not an integer >= 0")
    world_size = record.get("world_size")
    if world_size is not None and (type(world_size) is not int or world_size <= record["rank"]):
        raise _malformed(f"rank {record['rank']} of a world of {world_size!r}")
    if rank is not None and record["rank"] != rank:
        raise ReplicationError(
            f"the peer sent rank {record['rank']}'s checkpoint, not rank {rank}'s"
        )
    if name is not None and record["name"] != name:
        raise ReplicationError(f"the peer sent checkpoint {record['name']!r}, not {name!r}")
    placed = dict(record, segment={"offset": 0})
    try:
        names, rows, expected = held.entry_rows(placed, f"replica of rank {record['rank']}")
    except (CheckpointCorruptError, RecursionError, ValueError, TypeError, KeyError) as exc:
        raise _malformed(str(exc)) from None
    data_bytes = int(record["data_bytes"])
    end = max((offset + length for offset, length in rows), default=0)
    if end > data_bytes or data_bytes > end + SLACK:
        raise _malformed(f"{data_bytes} bytes announced for entries that end at {end}")
    return names, rows, expected


def receive(
    channel: wire.Channel,
    deadline: wire.Deadline,
    spare: Callable[[int], Segment | None] | None = None,
    *,
    rank: int | None = None,
    name: str | None = None,
) -> tuple[dict[str, Any], Segment]:
    """Receive a checkpoint sent by `send` into a segment of this user's (0600) and check the
    CRC32C of every entry; returns its record (naming that segment) and the segment, which the
    caller owns. The segment is `spare(nbytes)` when that gives one (a segment of ours whose
    pages are in place: an older replica's, given over), else a new one whose pages are
    allocated as the bytes arrive. `rank`, `name`: what was asked for (see `check_record`).

    Raises:
        ReplicationError: the peer broke off, or sent something that is not a checkpoint (or
            not the one asked for), or there is no room for it here.
        CheckpointCorruptError: an entry's bytes do not match its CRC32C (the segment is gone).
    """
    message = channel.recv_message(deadline)
    record = message.get("record")
    if message.get("kind") == "none":
        raise ReplicationError(f"{channel.peer} does not hold the checkpoint asked for")
    if message.get("kind") != "replica" or not isinstance(record, dict):
        raise ReplicationError(f"{channel.peer} sent no checkpoint")
    names, rows, expected = check_record(record, rank=rank, name=name)
    data_bytes = int(record["data_bytes"])
    segment = spare(data_bytes) if spare is not None else None
    allocate = segment is None
    if segment is None:
        try:
            segment = Segment.create(max(data_bytes, 1), knobs.segment_prefix(), False)
        except (OSError, ValueError, TypeError, OverflowError) as exc:  # no room; no such size
            raise ReplicationError(
                f"no room here for a copy of {data_bytes} bytes: {exc}"
            ) from None
    try:
        start = segment.data_offset
        record["segment"] = {
            "name": segment.name, "size": segment.size, "token": segment.token.hex(),
            "offset": start,
        }  # fmt: skip
        source = f"replica of rank {record['rank']}"
        rows = [(start + offset, length) for offset, length in rows]
        _receive_checked(
            channel, segment, start, data_bytes, (names, rows, expected), source, deadline,
            allocate,
        )  # fmt: skip
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return record, segment


def _receive_checked(
    channel: wire.Channel,
    segment: Segment,
    start: int,
    data_bytes: int,
    entries: tuple[list[str], list[tuple[int, int]], list[int]],
    source: str,
    deadline: wire.Deadline,
    allocate: bool,
) -> None:
    """Receive the bytes into the segment while a thread checks each entry whose bytes are all
    in (the native checksums release the GIL): the check ends soon after the last byte."""
    names, rows, expected = entries
    order = sorted(range(len(rows)), key=lambda i: rows[i][0] + rows[i][1])
    checks: list[tuple[list[int], Future[Any]]] = []
    done = 0

    def landed(pool: ThreadPoolExecutor, end: int) -> None:
        nonlocal done
        ready = []
        while done < len(order) and sum(rows[order[done]]) <= start + end:
            ready.append(order[done])
            done += 1
        if ready:
            ranges = np.array([rows[i] for i in ready], dtype=np.uint64).reshape(-1, 2)
            checks.append((ready, pool.submit(segment.checksums, ranges)))

    def allocate_pages(at: int, nbytes: int) -> None:
        try:
            segment.allocate_pages(start + at, nbytes)
        except OSError as exc:
            raise ReplicationError(
                f"no room here for a copy of {data_bytes} bytes: {exc}"
            ) from None

    with ThreadPoolExecutor(1, thread_name_prefix="pyshmckpt-replica-crc") as pool:
        with memoryview(segment) as view:
            channel.recv_into(
                view[start : start + data_bytes], deadline,
                allocate=allocate_pages if allocate else None,
                landed=lambda end: landed(pool, end),
            )  # fmt: skip
        for indices, future in checks:
            for i, crc in zip(indices, future.result().tolist(), strict=True):
                if crc != expected[i]:
                    raise CheckpointCorruptError(
                        source, f"checksum mismatch ({crc:#010x} != {expected[i]:#010x})",
                        tensor=names[i],
                    )  # fmt: skip
    if done < len(order):
        raise CheckpointCorruptError(source, "entries lie beyond the bytes sent")
