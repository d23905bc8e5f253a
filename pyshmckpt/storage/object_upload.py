"""Bytes in memory to one object: an upload in parts that are views of the caller's memory (the
slot, or a map of a file), several in flight, each with its CRC32C for the service to check
(`stores`: an S3 multipart upload, parts composed on Google Cloud Storage); one PUT for what fits
one part. A failed upload leaves no part behind where it can; what it cannot (the process died)
the root's cleanup removes (`object_commit.clean_leftovers`).
"""

from __future__ import annotations

import logging
import math

from .. import knobs
from . import object_store, progress
from .object_store import ObjectPath
from .stores.base import joined

logger = logging.getLogger(__name__)

_MIB = 1 << 20


def part_size(total: int, max_parts: int = 10_000) -> int:
    """Bytes per part for an object of `total` bytes: the setting, or more (whole MiB) where
    the setting would need more than `max_parts` parts."""
    size = knobs.object_part_size()
    if math.ceil(total / size) > max_parts:
        size = math.ceil(total / max_parts / _MIB) * _MIB
    return size


def _cut(pieces: list[memoryview], size: int) -> list[list[memoryview]]:
    """`pieces` (in order) cut into parts of `size` bytes (the last shorter): each part a list
    of views, more than one only where a part spans the end of a piece."""
    parts: list[list[memoryview]] = [[]]
    room = size
    for piece in pieces:
        while len(piece):
            if room == 0:
                parts.append([])
                room = size
            take = piece[:room]
            parts[-1].append(take)
            room -= len(take)
            piece = piece[len(take) :]
    return [part for part in parts if part]


def upload(path: ObjectPath, pieces: list[memoryview]) -> tuple[str, int]:
    """Upload the concatenation of `pieces` as the object at `path`; its (ETag, size).

    Raises:
        ObjectStoreError: (a subclass) the service refused or kept failing a request; the
            upload is given up.
    """
    total = sum(len(p) for p in pieces)
    store = object_store.store(path)
    size = part_size(total, store.max_parts)
    if total <= size:
        data = bytes(joined([p for p in pieces if len(p)] or [memoryview(b"")]))
        etag = object_store.put(path, data)
        progress.advance(total)
        return etag, total
    etag = store.upload_parts(path, _cut(pieces, size))
    return etag, total
