"""A rank's files of a committed checkpoint in object storage, opened as `rank_files` opens them
from a disk. The data object's bytes are read when they are needed, with parallel ranged GETs,
each on condition that the object is still the one the commit record names (`RemoteBytes`):
straight into the tensors that will hold them (a fresh load, `into=`), or into an image of the
object in memory (a memfd, which serves as the file: tensors that map it, copies out of it); a
load that reshards reads only the entries that hold the shards it needs. The reader checks every
entry's CRC32C as for a file.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import knobs
from ..errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    from_os_error,
)
from ..shm.native import crc32c, crc32c_combine
from . import object_commit, object_store
from .object_store import ObjectPath
from .object_upload import part_size
from .rank_files import OpenedRank, check_format_version
from .safetensors_header import parse_header
from .safetensors_writer import FORMAT, file_names
from .stores.base import run_all

_MANIFEST_LIMIT = 1 << 30


def resolve(path: ObjectPath) -> tuple[ObjectPath, dict[str, Any]]:
    """The checkpoint `path` names and its commit record: `path` itself when it is a
    committed checkpoint, else (a root) its newest one (see `object_commit.latest`).

    Raises:
        CheckpointNotFoundError: nothing committed there.
    """
    if not path.key:
        return newest(path)
    # One round trip for both (a load waits for them): is `path` a checkpoint, and, were it a
    # root, which checkpoint its `latest` names.
    with ThreadPoolExecutor(2) as pool:
        own = pool.submit(object_commit.record_of, path)
        named = pool.submit(object_commit.pointed, path)
        record = own.result()
        if record is not None:
            return path, record
        found = named.result()
    if found is not None:
        return found
    listed = object_commit.listed_newest(path)
    if listed is None:
        raise CheckpointNotFoundError(str(path), "checkpoint missing: none committed there")
    return listed


def newest(root: ObjectPath) -> tuple[ObjectPath, dict[str, Any]]:
    """The newest committed checkpoint under `root` and its commit record.

    Raises:
        CheckpointNotFoundError: nothing committed there.
    """
    found = object_commit.newest(root)
    if found is None:
        raise CheckpointNotFoundError(str(root), "checkpoint missing: none committed there")
    return found


def ranks(record: dict[str, Any]) -> list[int]:
    return list(range(int(record["world_size"])))


def _object(checkpoint: ObjectPath, record: dict[str, Any], name: str) -> tuple[str, int]:
    entry = _entry(checkpoint, record, name)
    return str(entry.get("etag", "")), int(entry["size"])


def _entry(checkpoint: ObjectPath, record: dict[str, Any], name: str) -> dict[str, Any]:
    entry = record["objects"].get(name)
    if not isinstance(entry, dict) or type(entry.get("size")) is not int:
        raise CheckpointCorruptError(str(checkpoint / name), "the commit record does not name it")
    return entry


def _first_read(entry: dict[str, Any], size: int) -> int:
    """How many of the data object's first bytes to read with the manifest: its header, as the
    commit record gives it (``"header"``), or a guess (a record without it)."""
    header = entry.get("header")
    if type(header) is int and 8 <= header <= size:
        return header
    return min(size, _HEADER_GUESS)


def open_rank(checkpoint: ObjectPath, record: dict[str, Any], rank: int) -> OpenedRank:
    """Rank `rank`'s files of the committed `checkpoint` (its record `record`): the manifest
    read, the data object's header read, its bytes read when asked for (`RemoteBytes`)."""
    st_name, json_name = file_names(rank)
    json_path, st_path = checkpoint / json_name, checkpoint / st_name
    if rank not in ranks(record):
        raise CheckpointCorruptError(
            str(checkpoint), f"rank {rank} is not among the checkpoint's ranks {ranks(record)}"
        )
    json_etag, _ = _object(checkpoint, record, json_name)
    stored = _entry(checkpoint, record, st_name)
    etag, size = str(stored.get("etag", "")), int(stored["size"])
    first_bytes = _first_read(stored, size)
    if size < 8:
        raise CheckpointCorruptError(str(st_path), f"the object is {size} bytes: no header")
    fd = os.memfd_create(f"pyshmckpt-{st_name}", os.MFD_CLOEXEC)
    f = os.fdopen(fd, "r+b")
    try:
        os.ftruncate(fd, size)
        remote = RemoteBytes(st_path, etag, size, fd)
        # The manifest and the data object's header in one round trip.
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(remote.fetch, [(0, first_bytes)])
            raw = object_store.get(json_path, limit=_MANIFEST_LIMIT, if_match=json_etag or None)
            first.result()
        described = _manifest(json_path, rank, raw)
        (length,) = struct.unpack("<Q", remote.fetched(0, 8))
        remote.fetch([(8, min(length, size - 8))])  # what the first bytes did not hold
        header = parse_header(str(st_path), f, size)
        try:
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise from_os_error(exc, f"cannot map the memory of {st_path}") from exc
    except BaseException:
        f.close()
        raise
    return OpenedRank(json_path, st_path, described, header, mapped, f, remote)  # type: ignore[arg-type]


def _manifest(json_path: ObjectPath, rank: int, raw: bytes | None) -> dict[str, Any]:
    if raw is None:
        raise CheckpointCorruptError(str(json_path), f"rank {rank}'s manifest is missing")
    try:
        described = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(str(json_path), f"unreadable manifest: {exc}") from None
    if not isinstance(described, dict) or described.get("format") != FORMAT:
        raise CheckpointCorruptError(str(json_path), "not a pyshmckpt manifest")
    check_format_version(str(json_path), described)
    return described


_GAP = 1 << 20  # bytes between two wanted ranges read with them rather than by another request
_HEADER_GUESS = 64 << 10  # bytes read first where the record does not give the header's size


class RemoteBytes:
    """The bytes of one object in object storage, read on demand with ranged GETs (in parallel,
    adjacent ranges in one request, each request on condition that the object still has the
    ETag its commit recorded): into the object's image in memory (`fetch`, once per byte), or
    straight into the caller's memory (`read_into`)."""

    def __init__(self, path: ObjectPath, etag: str, size: int, fd: int) -> None:
        self.path, self.etag, self.size = path, etag, size
        # Bytes per ranged GET, and the most a GET of adjacent entries holds.
        self._step = part_size(size, object_store.store(path).max_parts)
        self._image = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)  # the memfd's own pages
        self._have: list[tuple[int, int]] = []  # [start, end) ranges of the image read
        self._lock = threading.Lock()

    def fetched(self, start: int, length: int) -> bytes:
        """Bytes `start`..`start + length` of the object (read into the image first)."""
        self.fetch([(start, length)])
        return bytes(self._image[start : start + length])

    def fetch_all(self) -> None:
        self.fetch([(0, self.size)])

    def checksum(self) -> int:
        """The CRC32C of the image (of the whole object once `fetch_all` read it)."""
        return crc32c(self._image)

    def close(self) -> None:
        """Unmap the image (the memory or file behind it stays); after a failed read, the
        traceback may still hold views of it, and the map then goes with them."""
        with contextlib.suppress(BufferError):
            self._image.close()

    def fetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Make the image hold the (start, length) `ranges` of the object."""
        with self._lock:
            wanted = _merge([(a, a + n) for a, n in ranges if n > 0], gap=_GAP)
            missing = [piece for a, b in wanted for piece in _without(a, b, self._have)]
            if not missing:
                return
            view = memoryview(self._image)
            try:
                jobs = [
                    [(a, view[a:b])]
                    for start, end in missing
                    for a, b in _split(start, end, self._step)
                ]
                self._get_all(jobs)
            finally:
                view.release()
            self._have = _merge(self._have + missing, gap=0)

    def read_into(self, rows: np.ndarray, *, checksums: bool) -> tuple[np.ndarray, np.ndarray]:
        """Read each (object offset, address, nbytes) row of `rows` straight into memory at its
        address, as `native.read_file_ranges` reads a file; returns (crcs, got) as it does.

        The caller owns the memory: every address writable for its byte count, no overlaps,
        alive until this returns."""
        order = sorted(range(len(rows)), key=lambda i: int(rows[i, 0]))
        targets: dict[int, memoryview] = {}  # row -> its memory
        for i in order:
            offset, address, nbytes = (int(v) for v in rows[i])
            if offset + nbytes > self.size:
                raise CheckpointCorruptError(str(self.path), "a range lies past the object's end")
            if nbytes:
                targets[i] = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        limit = self._step
        jobs: list[list[tuple[int, memoryview]]] = []
        owners: list[int] = []  # the row of each piece, in the order of the jobs' pieces
        for i, target in targets.items():  # pieces of at most a part, in groups of at most a part
            offset = int(rows[i, 0])
            for a, b in _split(offset, offset + len(target), limit):
                piece = (a, target[a - offset : b - offset])
                last = jobs[-1] if jobs else None
                if last and 0 <= a - _end(last) <= _GAP and b - last[0][0] <= limit:
                    last.append(piece)
                else:
                    jobs.append([piece])
                owners.append(i)
        # Each piece's CRC32C is computed by the thread that read it, as soon as it landed
        # (the other reads go on meanwhile); a row's pieces, in order, combine into its own.
        landed = self._get_all(jobs, checksums=checksums)
        crcs = np.zeros(len(rows), dtype=np.uint32)
        if checksums:
            seen: set[int] = set()
            pieces = (piece for job in jobs for piece in job)
            for row, (_, view), crc in zip(
                owners, pieces, (c for job in landed for c in job), strict=True
            ):
                crcs[row] = crc32c_combine(int(crcs[row]), crc, len(view)) if row in seen else crc
                seen.add(row)
        return crcs, rows[:, 2].copy()

    def _get_all(
        self, jobs: list[list[tuple[int, memoryview]]], *, checksums: bool = False
    ) -> list[list[int]]:
        """Read every job (one ranged GET each, in parallel); with `checksums`, the CRC32C of
        each of its pieces, per job."""

        store = object_store.store(self.path)

        def read(job: list[tuple[int, memoryview]]) -> list[int]:
            store.read_ranges(self.path, self.etag, job)
            return [crc32c(view) for _, view in job] if checksums else []

        calls = [functools.partial(read, job) for job in jobs]
        return run_all(knobs.object_concurrency(), calls, "pyshmckpt-read")


def _end(job: list[tuple[int, memoryview]]) -> int:
    start, view = job[-1]
    return start + len(view)


def _split(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """[start, end) in ranges of at most `step` bytes."""
    return [(a, min(a + step, end)) for a in range(start, end, step)]


def _merge(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """[start, end) ranges sorted, those at most `gap` apart joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _without(start: int, end: int, have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) outside the sorted, disjoint ranges `have`."""
    out, cursor = [], start
    for a, b in have:
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        out.append((cursor, end))
    return out
