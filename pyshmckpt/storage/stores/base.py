"""What pyshmckpt needs from an object storage service (`Store`), and the pieces every service's
client shares: a request body over memory that a retry can rewind (`PartBody`) and a part's
CRC32C as the services carry it (`crc32c_b64`).

A store's methods take `ObjectPath`s of its own scheme, count every answer as progress (the stall
timeout), and raise `ObjectStoreError` subclasses naming the URL (`BucketNotFoundError`,
`ObjectStoreAccessError`, `ObjectStoreUnavailableError`) once their bounded retries are spent.
Listings give entries as ``{"Key", "Size", "LastModified", "ETag"}`` for an object and
``{"Prefix"}`` for a name below a delimiter. An object's "ETag" is what a later read names to
be sure it reads that object and no other: S3's ETag, Google Cloud Storage's generation.
"""

from __future__ import annotations

import abc
import base64
import datetime
from collections.abc import Iterator
from typing import Any

from ...shm.native import crc32c
from ..object_store import ObjectPath


def crc32c_b64(data: Any) -> str:
    """The CRC32C of `data` as S3 and Google Cloud Storage carry it (base64 of its big-endian
    4 bytes)."""
    return b64_of(crc32c(data))


def b64_of(crc: int) -> str:
    """A CRC32C value as the services carry it."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


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


class Store(abc.ABC):
    """One object storage service, as the commit, the uploads and the loads use it."""

    #: The most parts one object may be uploaded in (the part size grows to stay within it).
    max_parts: int = 10_000

    @abc.abstractmethod
    def get(self, path: ObjectPath, *, limit: int, if_match: str | None) -> bytes | None:
        """The whole object (None: there is none), refused beyond `limit` bytes; with
        `if_match`, only the object of that ETag (`CheckpointCorruptError` otherwise)."""

    @abc.abstractmethod
    def put(self, path: ObjectPath, data: bytes, *, create_only: bool) -> str:
        """Write one small object whole, with its CRC32C; its ETag. With `create_only`, an
        object there already fails it (errno EEXIST) and is left as it is."""

    @abc.abstractmethod
    def check(self, path: ObjectPath) -> None:
        """One request below `path`: raises what the service says of the bucket and the
        credentials."""

    @abc.abstractmethod
    def listing(self, path: ObjectPath, *, delimiter: bool) -> Iterator[dict[str, Any]]:
        """Every object below `path`, or with `delimiter` also the names directly below it."""

    @abc.abstractmethod
    def delete(self, path: ObjectPath, keys: list[str]) -> None:
        """Delete the objects `keys` of `path`'s bucket (a missing one is no error)."""

    @abc.abstractmethod
    def upload_parts(self, path: ObjectPath, parts: list[memoryview]) -> str:
        """Upload the concatenation of `parts` (each sent with its CRC32C, several at once) as
        the object at `path`; its ETag. A failed upload leaves no part behind where it can
        (an abort); what it cannot is found by `unfinished`."""

    @abc.abstractmethod
    def read_ranges(
        self, path: ObjectPath, etag: str, pieces: list[tuple[int, memoryview]]
    ) -> None:
        """One ranged read from the first piece's start to the last one's end, each piece's
        bytes into its view (those between pieces read and dropped), on condition that the
        object is the one of `etag` (`CheckpointCorruptError` otherwise, or when it is gone)."""

    @abc.abstractmethod
    def unfinished(self, path: ObjectPath) -> Iterator[tuple[str, datetime.datetime, Any]]:
        """The uploads below `path` never completed: (the object's key, when it began, what
        `abort` takes)."""

    @abc.abstractmethod
    def abort(self, path: ObjectPath, key: str, handle: Any) -> None:
        """Give an unfinished upload of `key` up (best effort)."""
