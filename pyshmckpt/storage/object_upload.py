"""Bytes in memory to one object: a multipart upload whose parts are views of the caller's
memory (the slot, or a map of a file), several in flight, each with its CRC32C for the service to
check; one PUT for what fits one part. A failed upload is aborted, so no part of
it is left billed; what an abort cannot reach (the process died) the root's cleanup removes
(`object_commit.clean_leftovers`).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import math
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from .. import knobs
from ..shm.native import crc32c
from . import object_store, progress
from .object_store import ObjectPath

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000  # S3's limit on the parts of one upload
_MIB = 1 << 20


def checksum(data: Any) -> str:
    """The CRC32C of `data` as S3 carries it (base64 of the big-endian 4 bytes)."""
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()


def part_size(total: int) -> int:
    """Bytes per part for an object of `total` bytes: the setting, or more (whole MiB) where
    the setting would need more than MAX_PARTS parts."""
    size = knobs.object_part_size()
    if math.ceil(total / size) > MAX_PARTS:
        size = math.ceil(total / MAX_PARTS / _MIB) * _MIB
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


def _body(views: list[memoryview]) -> memoryview:
    """One part's bytes: the view itself, or (spanning pieces) the few pieces joined."""
    return views[0] if len(views) == 1 else memoryview(b"".join(views))


class PartBody:
    """A request body over memory, without a copy: read in slices of the view, and seekable,
    so that the client can send it again when it retries the request."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._position = 0

    def __len__(self) -> int:
        return len(self._view)

    def read(self, size: int | None = -1) -> memoryview:
        end = (
            len(self._view)
            if size is None or size < 0
            else min(len(self._view), self._position + size)
        )
        piece = self._view[self._position : end]
        self._position = end
        return piece

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._position, len(self._view))[whence]
        self._position = max(0, min(len(self._view), base + offset))
        return self._position

    def tell(self) -> int:
        return self._position


def upload(path: ObjectPath, pieces: list[memoryview]) -> tuple[str, int]:
    """Upload the concatenation of `pieces` as the object at `path`; its (ETag, size).

    Raises:
        ObjectStoreError: (a subclass) the service refused or kept failing a request; the
            upload is aborted.
    """
    total = sum(len(p) for p in pieces)
    size = part_size(total)
    if total <= size:
        data = bytes(_body([p for p in pieces if len(p)] or [memoryview(b"")]))
        etag = object_store.put(path, data)
        progress.advance(total)
        return etag, total
    store = object_store.client()
    started = object_store.call(
        path, "starting a multipart upload", store.create_multipart_upload,
        Bucket=path.bucket, Key=path.key, ChecksumAlgorithm="CRC32C",
    )  # fmt: skip
    upload_id = started["UploadId"]
    try:
        parts = _upload_parts(path, upload_id, _cut(pieces, size))
        done = object_store.call(
            path, "completing a multipart upload", store.complete_multipart_upload,
            Bucket=path.bucket, Key=path.key, UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )  # fmt: skip
    except BaseException:
        abort(path, upload_id)
        raise
    return str(done.get("ETag", "")), total


def _upload_parts(
    path: ObjectPath, upload_id: str, parts: list[list[memoryview]]
) -> list[dict[str, Any]]:
    store = object_store.client()

    def send(number: int, views: list[memoryview]) -> dict[str, Any]:
        body = _body(views)
        crc = checksum(body)
        answer = object_store.call(
            path, f"uploading part {number}", store.upload_part, Bucket=path.bucket,
            Key=path.key, UploadId=upload_id, PartNumber=number, Body=PartBody(body),
            ChecksumCRC32C=crc,
        )  # fmt: skip
        progress.advance(len(body))
        return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32C": crc}

    workers = min(knobs.object_concurrency(), len(parts))
    with ThreadPoolExecutor(workers, thread_name_prefix="pyshmckpt-upload") as pool:
        futures: list[Future[dict[str, Any]]] = [
            pool.submit(send, number, views) for number, views in enumerate(parts, 1)
        ]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in finished if f.exception() is not None), None)
        if failed is not None:
            for future in futures:
                future.cancel()
            raise failed.exception()  # type: ignore[misc]
        return [future.result() for future in futures]


def abort(path: ObjectPath, upload_id: str) -> None:
    """Abort a multipart upload, best effort (the root's cleanup gets what this cannot)."""
    with contextlib.suppress(Exception):
        object_store.client().abort_multipart_upload(
            Bucket=path.bucket, Key=path.key, UploadId=upload_id
        )
        return
    logger.warning("could not abort the upload of %s: the root's cleanup will", path)
