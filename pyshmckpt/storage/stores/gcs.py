"""Google Cloud Storage (``gs://``), through google-cloud-storage's client (the ``gcs`` extra).

Credentials and project come from Google's Application Default Credentials as for any Google
Cloud tool (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, the
metadata server of a VM or a GKE workload identity; ``GOOGLE_CLOUD_PROJECT``);
``STORAGE_EMULATOR_HOST`` points the client at another server (an emulator, anonymously).

Every request is bounded: a connect and a read timeout per try, and at most
``PYSHMCKPT_OBJECT_ATTEMPTS`` tries, the library's own retries off, with exponential backoff and
full jitter for throttling (429), server errors and dropped connections. An object's "ETag" here
is its generation: a read names the generation its commit recorded, and an object replaced since
is not found (no read of a mix). A commit record is created with ``ifGenerationMatch=0``, the
service's conditional create.

Uploads in several parts: the JSON API has no multipart upload of parts, so each part is an
object of its own (``<key>.pyshmckpt-part-<token>-<n>``, its CRC32C given for the service to
check), uploaded several at once, then composed into the object (at most 32 sources per compose:
a tree of composes beyond), whose CRC32C the service computes and which is checked against the
parts'; the part objects are then deleted. Parts of an upload that died are found and removed by
the root's cleanup (`unfinished`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ... import knobs
from ...errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    ObjectStoreAccessError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
    PyshmckptError,
)
from ...shm.native import crc32c, crc32c_combine
from .. import progress
from ..object_store import ObjectPath
from .base import Clients, Part, PartBody, Store, _ShortRead, b64_of, crc32c_b64, joined, run_all

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TIMEOUT = (10, 60)  # seconds to connect, and to wait for each answer, per try
_MULTIPART_LIMIT = 8 << 20  # the client sends bodies up to this in one request, from bytes
_COMPOSE_LIMIT = 32  # sources of one compose request
_PART = re.compile(r"^(?P<key>.+)\.pyshmckpt-part-[0-9a-f]{16}-[0-9a-z]+$")
_SETTINGS = (
    "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
    "PYSHMCKPT_OBJECT_CONCURRENCY",
)  # fmt: skip


def client() -> Any:
    """This process's client for the current settings (thread-safe, made on first use)."""
    return _clients.get()


def _new_client() -> Any:
    import requests.adapters
    from google.cloud import storage

    # Object requests need no project: an explicit None skips looking one up.
    made = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT"))
    # The client's cache of bucket metadata (for its traces) fetches it on threads of its own,
    # with its own retries: not a request of ours, unbounded by our settings.
    if hasattr(made, "_bucket_metadata_cache"):
        made._bucket_metadata_cache = None
    # As many connections as requests in flight (requests keeps 10 per host otherwise); a
    # session with mutual TLS keeps its own adapter.
    if not getattr(made._http, "is_mtls", False):
        connections = max(32, 2 * knobs.object_concurrency())
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=connections)
        for prefix in ("https://", "http://"):
            made._http.mount(prefix, adapter)
    return made


_clients = Clients(_SETTINGS, _new_client)


def _bucket(path: ObjectPath) -> Any:
    return client().bucket(path.bucket)


def error(
    path: ObjectPath | str, what: str, exc: BaseException, *, bucket_missing: bool = True
) -> ObjectStoreError:
    """A failure of the client (`exc`) while doing `what` at `path`, as the matching
    ObjectStoreError; a 404 is the bucket's unless `bucket_missing` is False."""
    import google.auth.exceptions as ga
    from google.api_core import exceptions as gx

    url = str(path)
    name = type(exc).__name__
    if isinstance(exc, gx.GoogleAPICallError):
        status = exc.code if isinstance(exc.code, int) else None
        message = f"{what} failed: {name} (HTTP {status}): {exc.message}".rstrip(": ")
        if isinstance(exc, gx.NotFound) and bucket_missing:
            return BucketNotFoundError(url, f"{what} failed: the bucket does not exist", name, 404)
        if status in (401, 403):
            return ObjectStoreAccessError(url, message, name, status)
        if status is not None and (status >= 500 or status in (408, 429)):
            return ObjectStoreUnavailableError(
                url, f"{message}, after {knobs.object_attempts()} tries", name, status
            )
        return ObjectStoreError(url, message, name, status)
    if isinstance(exc, (ga.DefaultCredentialsError, ga.RefreshError)):
        return ObjectStoreAccessError(
            url, f"{what} failed: no usable credentials ({exc}); set them as for any Google "
            "Cloud tool (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default "
            "login`, a service account of the VM or workload)", name,
        )  # fmt: skip
    if _transient(exc):  # a connection refused, cut or timed out, every try
        return ObjectStoreUnavailableError(
            url, f"{what} failed: {exc}, after {knobs.object_attempts()} tries", name
        )
    return ObjectStoreError(url, f"{what} failed: {name}: {exc}", name)


def _transient(exc: BaseException) -> bool:
    """Whether another try may succeed: throttling, a server error, a connection refused, cut
    or timed out (also mid-answer, where the client reads the body itself)."""
    import http.client

    import google.auth.exceptions as ga
    import requests
    import urllib3.exceptions as ux
    from google.api_core import exceptions as gx

    if isinstance(exc, gx.GoogleAPICallError):
        return isinstance(exc.code, int) and (exc.code >= 500 or exc.code in (408, 429))
    if isinstance(exc, PyshmckptError):  # ours, decided already (some are ConnectionErrors)
        return False
    return isinstance(
        exc,
        (_ShortRead, ConnectionError, requests.ConnectionError, requests.Timeout,
         requests.exceptions.ChunkedEncodingError, ux.ProtocolError, ux.ReadTimeoutError,
         http.client.IncompleteRead, ga.TransportError),
    )  # fmt: skip


def _tried(function: Callable[[], T]) -> T:
    """`function()`, tried up to ``PYSHMCKPT_OBJECT_ATTEMPTS`` times while it fails with a
    transient error: before try i+1, a random delay up to 2^i x 1 s (Google's advice for its
    service), at most 20 s. An answer is progress (the stall timeout)."""
    tries, failed = knobs.object_attempts(), 0
    while True:
        try:
            answer = function()
        except Exception as exc:
            failed += 1
            if failed >= tries or not _transient(exc):
                raise
            time.sleep(random.uniform(0, min(20.0, 2.0 ** (failed - 1))))
            continue
        progress.advance()
        return answer


def _not_found(exc: BaseException) -> bool:
    from google.api_core import exceptions as gx

    return isinstance(exc, gx.NotFound)


def _precondition_failed(exc: BaseException) -> bool:
    from google.api_core import exceptions as gx

    return isinstance(exc, gx.PreconditionFailed)


def _generation(etag: str | None) -> int | None:
    return int(etag) if etag and etag.isdigit() else None


class GCSStore(Store):
    """Google Cloud Storage, through its JSON API."""

    max_parts = _COMPOSE_LIMIT**3  # three levels of composes

    def get(self, path: ObjectPath, *, limit: int, if_match: str | None) -> bytes | None:
        from google.api_core import exceptions as gx

        def read() -> bytes:
            blob = _bucket(path).blob(path.key, generation=_generation(if_match))
            return bytes(blob.download_as_bytes(
                start=0, end=limit, raw_download=True, checksum=None, timeout=_TIMEOUT,
                retry=None,
            ))  # fmt: skip

        try:
            data = _tried(read)
        except gx.RequestRangeNotSatisfiable:  # an empty object
            return b""
        except Exception as exc:
            if _not_found(exc) and if_match:  # not of that generation any more, or gone
                raise CheckpointCorruptError(
                    str(path), "the object changed after its checkpoint was committed, or is gone"
                ) from None
            if _not_found(exc):
                return None
            raise error(path, "reading", exc, bucket_missing=False) from exc
        if len(data) > limit:
            raise ObjectStoreError(str(path), f"more than the {limit} bytes expected")
        return data

    def put(self, path: ObjectPath, data: bytes, *, create_only: bool) -> str:
        def write() -> Any:
            blob = _bucket(path).blob(path.key)
            blob.crc32c = crc32c_b64(data)  # checked by the service (the client adds none)
            blob.upload_from_string(
                data, if_generation_match=0 if create_only else None, checksum=None,
                timeout=_TIMEOUT, retry=None,
            )  # fmt: skip
            return blob

        try:
            blob = _tried(write)
        except Exception as exc:
            if create_only and _precondition_failed(exc):
                return self.created_already(path, data)
            raise error(path, "writing", exc) from exc
        return str(blob.generation)

    def check(self, path: ObjectPath) -> None:
        try:
            _tried(lambda: list(client().list_blobs(
                path.bucket, prefix=path.prefix, max_results=1, timeout=_TIMEOUT, retry=None
            )))  # fmt: skip
        except Exception as exc:
            raise error(path, "listing", exc) from exc

    def listing(self, path: ObjectPath, *, delimiter: bool) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            try:
                page, prefixes, token = _tried(functools.partial(_page, path, delimiter, token))
            except Exception as exc:
                raise error(path, "listing", exc) from exc
            yield from ({"Prefix": prefix} for prefix in sorted(prefixes))
            yield from page
            if not token:
                return

    def delete(self, path: ObjectPath, keys: list[str]) -> None:
        def remove(key: str) -> None:
            try:
                _tried(lambda: _bucket(path).blob(key).delete(timeout=_TIMEOUT, retry=None))
            except Exception as exc:
                if not _not_found(exc):
                    where = f"{path.scheme}://{path.bucket}/{key}"
                    raise error(where, "deleting", exc, bucket_missing=False) from exc

        if keys:
            run_all(knobs.object_concurrency(), [functools.partial(remove, key) for key in keys])

    def upload_parts(self, path: ObjectPath, parts: list[Part]) -> str:
        token = secrets.token_hex(8)
        made: list[str] = []  # part objects (and intermediate composes) to delete at the end
        made_lock = threading.Lock()

        def send(number: int, part: Part) -> tuple[Any, int, int]:
            body = joined(part)  # here, not before: one part's copy at a time
            key = f"{path.key}.pyshmckpt-part-{token}-{number}"
            crc = crc32c(body)
            with made_lock:
                made.append(key)

            def upload() -> Any:
                blob = _bucket(path).blob(key)
                blob.crc32c = b64_of(crc)  # checked by the service (the client adds none)
                _send(blob, body)
                return blob

            try:
                blob = _tried(upload)
            except Exception as exc:
                where = path.parent / key.rpartition("/")[2]
                raise error(where, f"uploading part {number}", exc) from exc
            progress.advance(len(body))
            return blob, crc, len(body)

        try:
            calls = [functools.partial(send, n, part) for n, part in enumerate(parts, 1)]
            sent = run_all(knobs.object_concurrency(), calls, "pyshmckpt-upload")
            expected = sent[0][1]
            for _, crc, size in sent[1:]:
                expected = crc32c_combine(expected, crc, size)
            blob = _compose(path, [b for b, _, _ in sent], token, made, made_lock)
            if blob.crc32c != b64_of(expected):
                with contextlib.suppress(Exception):  # never leave it for a commit to name
                    blob.delete(if_generation_match=blob.generation, timeout=_TIMEOUT, retry=None)
                raise ObjectStoreError(
                    str(path), f"the composed object's CRC32C {blob.crc32c} is not its parts' "
                    f"({b64_of(expected)})",
                )  # fmt: skip
            return str(blob.generation)
        finally:
            with made_lock:
                leftovers = list(made)
            with contextlib.suppress(ObjectStoreError):
                self.delete(path, leftovers)

    def read_ranges(
        self, path: ObjectPath, etag: str, pieces: list[tuple[int, memoryview]]
    ) -> None:
        first, last = pieces[0][0], pieces[-1][0] + len(pieces[-1][1])
        where = f"reading bytes {first}-{last - 1}"

        def read() -> None:
            blob = _bucket(path).blob(path.key, generation=_generation(etag))
            landing = _Landing(first, pieces)
            blob.download_to_file(
                landing, start=first, end=last - 1, raw_download=True, checksum=None,
                timeout=_TIMEOUT, retry=None,
            )  # fmt: skip
            if landing.cursor != last:
                raise _ShortRead(f"{where} ended at byte {landing.cursor}")

        try:
            _tried(read)
        except Exception as exc:
            if _not_found(exc):
                raise CheckpointCorruptError(
                    str(path), "the object changed after its checkpoint was committed, or is gone"
                ) from None
            raise error(path, where, exc, bucket_missing=False) from exc

    def unfinished(self, path: ObjectPath) -> Iterator[tuple[str, datetime.datetime, Any]]:
        for entry in self.listing(path, delimiter=False):
            match = _PART.match(entry.get("Key", ""))
            if match is not None:
                yield match["key"], entry["LastModified"], entry["Key"]

    def abort(self, path: ObjectPath, key: str, handle: Any) -> None:
        with contextlib.suppress(ObjectStoreError):
            self.delete(path, [str(handle)])
            return
        logger.warning("could not remove the part %s of %s: the root's cleanup will", handle, path)


def _send(blob: Any, body: memoryview) -> None:
    """Upload one part from memory: a resumable upload reads it from a view of it (no copy);
    the client takes what fits one request only as bytes."""
    if len(body) <= _MULTIPART_LIMIT:
        blob.upload_from_string(bytes(body), checksum=None, timeout=_TIMEOUT, retry=None)
    else:
        blob.upload_from_file(
            PartBody(body), size=len(body), checksum=None, timeout=_TIMEOUT, retry=None
        )


def _compose(
    path: ObjectPath, sources: list[Any], token: str, made: list[str], made_lock: threading.Lock
) -> Any:
    """Compose `sources` into the object at `path` (a tree of composes of at most
    _COMPOSE_LIMIT sources each, those of one level at once); the composed blob."""
    level = 0
    while len(sources) > _COMPOSE_LIMIT:
        level += 1
        groups = [sources[i : i + _COMPOSE_LIMIT] for i in range(0, len(sources), _COMPOSE_LIMIT)]
        keys = [f"{path.key}.pyshmckpt-part-{token}-c{level}x{i}" for i in range(len(groups))]
        with made_lock:
            made.extend(keys)
        calls = [
            functools.partial(_compose_one, path, k, g) for k, g in zip(keys, groups, strict=True)
        ]
        sources = run_all(knobs.object_concurrency(), calls, "pyshmckpt-compose")
    return _compose_one(path, path.key, sources)


def _compose_one(path: ObjectPath, key: str, sources: list[Any]) -> Any:
    def compose() -> Any:
        target = _bucket(path).blob(key)
        target.compose(sources, timeout=_TIMEOUT, retry=None)
        return target

    try:
        return _tried(compose)
    except Exception as exc:
        if _not_found(exc):  # a part vanished (removed as an abandoned upload's?)
            raise ObjectStoreError(
                str(path), "composing the parts failed: a part is gone", type(exc).__name__, 404
            ) from exc
        raise error(path, "composing the parts", exc) from exc


class _Landing:
    """A file-like sink for a ranged download: the bytes from `first` on go into the pieces'
    views, those between pieces are dropped."""

    def __init__(self, first: int, pieces: list[tuple[int, memoryview]]) -> None:
        self.cursor = first
        self._pieces = pieces
        self._index = 0

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        while len(chunk) and self._index < len(self._pieces):
            start, view = self._pieces[self._index]
            if self.cursor < start:  # a gap
                skip = min(start - self.cursor, len(chunk))
                chunk, self.cursor = chunk[skip:], self.cursor + skip
                continue
            offset = self.cursor - start
            take = min(len(view) - offset, len(chunk))
            view[offset : offset + take] = chunk[:take]
            chunk, self.cursor = chunk[take:], self.cursor + take
            if offset + take == len(view):
                self._index += 1
        return len(data)


def _page(
    path: ObjectPath, delimiter: bool, token: str | None
) -> tuple[list[dict[str, Any]], set[str], str | None]:
    """One page of a listing: its objects, the names below the delimiter, the next page's
    token (None: the last page)."""
    listed = client().list_blobs(
        path.bucket, prefix=path.prefix, delimiter="/" if delimiter else None,
        page_token=token, page_size=1000, timeout=_TIMEOUT, retry=None,
    )  # fmt: skip
    page = next(listed.pages, None)
    if page is None:
        return [], set(), None
    objects = [
        {"Key": blob.name, "Size": blob.size, "LastModified": blob.updated,
         "ETag": str(blob.generation)}
        for blob in page
    ]  # fmt: skip
    return objects, set(page.prefixes), listed.next_page_token
