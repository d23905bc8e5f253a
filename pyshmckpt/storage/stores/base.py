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
import errno
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from ...errors import ObjectStoreError, os_error
from ...shm.native import crc32c
from ..object_store import ObjectPath

T = TypeVar("T")
Part = list[memoryview]  # one part's bytes: a view, or the few views a part spans


class Clients:
    """A service's client for this process and the current settings (`settings`: the names of
    the environment variables it is made from: a change of one, another endpoint or other keys,
    makes another), made by `make` on first use; thread-safe."""

    def __init__(self, settings: tuple[str, ...], make: Callable[[], Any]) -> None:
        self._settings, self._make = settings, make
        self._made: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()

    def get(self) -> Any:
        key = (os.getpid(), *(os.environ.get(name) for name in self._settings))
        with self._lock:
            made = self._made.get(key)
            if made is None:
                made = self._made[key] = self._make()
            return made


class _ShortRead(OSError):
    """A ranged answer that ended before its last byte (the connection was cut): tried again,
    never raised to a caller (the stores raise `ObjectStoreUnavailableError` once their tries
    are spent)."""


def joined(part: Part) -> memoryview:
    """One part's bytes: its view itself, or (a part spanning pieces) the pieces joined."""
    return part[0] if len(part) == 1 else memoryview(b"".join(part))


def run_all(
    workers: int, calls: Sequence[Callable[[], T]], prefix: str = "pyshmckpt-io"
) -> list[T]:
    """Run `calls` on at most `workers` threads; their results in order. The first that fails
    stops the rest (those not started are cancelled) and its exception is raised."""
    if len(calls) == 1:
        return [calls[0]()]
    with ThreadPoolExecutor(max(1, min(workers, len(calls))), thread_name_prefix=prefix) as pool:
        futures = [pool.submit(call) for call in calls]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in finished if f.exception() is not None), None)
        if failed is not None:
            for future in futures:
                future.cancel()
            error = failed.exception()
            del futures, finished  # the traceback need not keep the others' results alive
            raise error  # type: ignore[misc]
        return [future.result() for future in futures]


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
        `if_match`, only the object of that ETag (`CheckpointCorruptError` when another is
        there, or, where the service cannot tell them apart, when it is gone)."""

    @abc.abstractmethod
    def put(self, path: ObjectPath, data: bytes, *, create_only: bool) -> str:
        """Write one small object whole, with its CRC32C; its ETag. With `create_only`, an
        object there already fails it (errno EEXIST) and is left as it is, unless it holds
        `data` itself: a retry whose first try landed and lost its answer (its ETag is then
        not known: "")."""

    def created_already(self, path: ObjectPath, data: bytes) -> str:
        """After a conditional create of `data` at `path` was refused: "" when the object there
        is `data` (a first try that landed and lost its answer), else errno EEXIST."""
        try:
            if self.get(path, limit=len(data), if_match=None) == data:
                return ""
        except ObjectStoreError:  # another object, larger than `data`, or unreadable
            pass
        raise os_error(errno.EEXIST, f"{path} exists already", str(path))

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
    def upload_parts(self, path: ObjectPath, parts: list[Part]) -> str:
        """Upload the concatenation of `parts` (each sent with its CRC32C, several at once,
        `joined` where it spans pieces) as the object at `path`; its ETag. A failed upload
        leaves no part behind where it can (an abort); what it cannot is found by
        `unfinished`."""

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
