"""A committed checkpoint in object storage copied to a directory: every object its commit record
names, each read with parallel ranged GETs straight into the pages of its file (on condition
that the object is still the one the record names), its size and, where the record holds one,
its CRC32C checked, then fsynced and renamed into place. A framework's files that carry no
checksums of their own (DeepSpeed's, mirrored with `Mirror.put(checksums=True)`) are checked
that way; pyshmckpt's own checkpoints carry a CRC32C per entry, which `load` checks.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, PyshmckptError, from_os_error
from .commit import fsync_path
from .object_files import RemoteBytes
from .object_store import ObjectPath

logger = logging.getLogger(__name__)


def download(checkpoint: ObjectPath, record: dict[str, Any], directory: Path) -> list[Path]:
    """Copy every object of the committed `checkpoint` (its commit record `record`) into
    `directory` (created if missing) under its name; a file of that name there is replaced
    atomically. Returns the files, in the record's order.

    Raises:
        CheckpointCorruptError: the record names an object that is not a plain file name, or
            an object changed since it was committed, is missing, or does not match its
            recorded size or CRC32C (nothing of that object is left in `directory`).
        ObjectStoreError: (a subclass) the service refused or kept failing a request.
        PyshmckptOSError: `directory` cannot be created or written.
    """
    objects = record.get("objects")
    if not isinstance(objects, dict):
        raise CheckpointCorruptError(str(checkpoint), "the commit record names no objects")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise from_os_error(exc, f"cannot create {directory}") from exc
    files = [_download_one(checkpoint, name, entry, directory) for name, entry in objects.items()]
    try:
        fsync_path(directory)
    except OSError as exc:
        raise from_os_error(exc, f"cannot sync {directory}") from exc
    logger.info("downloaded %s into %s (%d files)", checkpoint, directory, len(files))
    return files


def _download_one(checkpoint: ObjectPath, name: str, entry: Any, directory: Path) -> Path:
    where = checkpoint / str(name)
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or "/" in name
        or "\0" in name
        or not isinstance(entry, dict)
        or type(entry.get("size")) is not int
        or entry["size"] < 0
    ):
        raise CheckpointCorruptError(str(where), "the commit record names it unreadably")
    size, expected = int(entry["size"]), entry.get("crc32c")
    target = directory / name
    temp = directory / f".{name}.tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise from_os_error(exc, f"cannot create {temp}") from exc
    try:
        try:
            os.ftruncate(fd, size)
            if size:
                remote = RemoteBytes(where, str(entry.get("etag", "")), size, fd)
                try:
                    remote.fetch_all()
                    got = remote.checksum() if expected is not None else None
                finally:
                    remote.close()
                if expected is not None and got != expected:
                    raise CheckpointCorruptError(
                        str(where), f"CRC32C {got:#010x}, its commit recorded {expected!r}"
                    )
            elif expected not in (None, 0):
                raise CheckpointCorruptError(str(where), "empty, its commit recorded bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
        temp.replace(target)
    except BaseException as exc:
        temp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, PyshmckptError):
            raise from_os_error(exc, f"cannot write {target}") from exc
        raise
    return target
