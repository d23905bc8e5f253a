"""A rank's files of a committed checkpoint in object storage, opened as `rank_files` opens them
from a disk: the data object is read with parallel ranged GETs straight into memory of this
process (a memfd, which then serves as the file: tensors map it, `into=` reads from it), each
range on condition that the object is still the one the commit record names. The reader checks
every entry's CRC32C as for a file.
"""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import knobs
from ..errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ObjectStoreError,
    from_os_error,
)
from . import object_commit, object_store
from .object_store import ObjectPath
from .object_upload import part_size
from .rank_files import OpenedRank, check_format_version
from .safetensors_header import parse_header
from .safetensors_writer import FORMAT, file_names

_MANIFEST_LIMIT = 1 << 30


def resolve(path: ObjectPath) -> tuple[ObjectPath, dict[str, Any]]:
    """The checkpoint `path` names and its commit record: `path` itself when it is a
    committed checkpoint, else (a root) its newest one (see `object_commit.latest`).

    Raises:
        CheckpointNotFoundError: nothing committed there.
    """
    record = object_commit.record_of(path) if path.key else None
    if record is not None:
        return path, record
    newest = object_commit.latest(path)
    record = object_commit.record_of(newest) if newest is not None else None
    if newest is None or record is None:
        raise CheckpointNotFoundError(str(path), "checkpoint missing: none committed there")
    return newest, record


def ranks(record: dict[str, Any]) -> list[int]:
    return list(range(int(record["world_size"])))


def _object(checkpoint: ObjectPath, record: dict[str, Any], name: str) -> tuple[str, int]:
    entry = record["objects"].get(name)
    if not isinstance(entry, dict) or type(entry.get("size")) is not int:
        raise CheckpointCorruptError(str(checkpoint / name), "the commit record does not name it")
    return str(entry.get("etag", "")), int(entry["size"])


def open_rank(checkpoint: ObjectPath, record: dict[str, Any], rank: int) -> OpenedRank:
    """Rank `rank`'s files of the committed `checkpoint` (its record `record`), read into memory."""
    st_name, json_name = file_names(rank)
    json_path, st_path = checkpoint / json_name, checkpoint / st_name
    if rank not in ranks(record):
        raise CheckpointCorruptError(
            str(checkpoint), f"rank {rank} is not among the checkpoint's ranks {ranks(record)}"
        )
    etag, _ = _object(checkpoint, record, json_name)
    raw = object_store.get(json_path, limit=_MANIFEST_LIMIT, if_match=etag or None)
    if raw is None:
        raise CheckpointCorruptError(str(json_path), f"rank {rank}'s manifest is missing")
    try:
        described = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(str(json_path), f"unreadable manifest: {exc}") from None
    if not isinstance(described, dict) or described.get("format") != FORMAT:
        raise CheckpointCorruptError(str(json_path), "not a pyshmckpt manifest")
    check_format_version(str(json_path), described)
    etag, size = _object(checkpoint, record, st_name)
    if not size:
        raise CheckpointCorruptError(str(st_path), "empty file")
    fd = os.memfd_create(f"pyshmckpt-{st_name}", os.MFD_CLOEXEC)
    f = os.fdopen(fd, "r+b")
    try:
        os.ftruncate(fd, size)
        _download(st_path, etag, size, fd)
        header = parse_header(str(st_path), f, size)
        try:
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise from_os_error(exc, f"cannot map what was read of {st_path}") from exc
    except BaseException:
        f.close()
        raise
    return OpenedRank(json_path, st_path, described, header, mapped, f)  # type: ignore[arg-type]


def _download(path: ObjectPath, etag: str, size: int, fd: int) -> None:
    """Read the object at `path` (of `size` bytes, ETag `etag`) into the file `fd`, with
    parallel ranged GETs straight into a shared map of it."""
    step = part_size(size)
    ranges = [(start, min(step, size - start)) for start in range(0, size, step)]
    with mmap.mmap(fd, size, access=mmap.ACCESS_WRITE) as target:
        view = memoryview(target)
        try:
            with ThreadPoolExecutor(min(knobs.object_concurrency(), len(ranges))) as pool:
                done = [pool.submit(_read_range, path, etag, start, view[start : start + n])
                        for start, n in ranges]  # fmt: skip
                for future in done:
                    future.result()
        finally:
            view.release()


def _read_range(path: ObjectPath, etag: str, start: int, into: memoryview) -> None:
    extra = {"IfMatch": etag} if etag else {}
    end = start + len(into) - 1
    try:
        answer = object_store.client().get_object(
            Bucket=path.bucket, Key=path.key, Range=f"bytes={start}-{end}", **extra
        )
        got = 0
        with answer["Body"] as body:
            while got < len(into):
                n = body.readinto(into[got:])
                if not n:
                    break
                got += n
    except Exception as exc:
        if object_store.precondition_failed(exc):
            raise CheckpointCorruptError(
                str(path), "the object changed after its checkpoint was committed (replaced?)"
            ) from None
        if object_store.missing(exc):
            raise CheckpointCorruptError(str(path), "the object is missing") from None
        raise object_store.error(path, f"reading bytes {start}-{end}", exc) from exc
    finally:
        into.release()
    if got != end - start + 1:
        raise ObjectStoreError(str(path), f"reading bytes {start}-{end} ended after {got} bytes")
