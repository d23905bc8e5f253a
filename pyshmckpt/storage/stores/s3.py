"""Amazon S3 and the services that speak its API (``s3://``), through boto3's low-level client
(the ``s3`` extra).

Credentials, region and endpoint come from the AWS chain and settings as for any AWS tool
(``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``, instance roles, ``AWS_REGION``, ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` for another service). Every request is bounded: a connect and a read
timeout per try, and a bounded number of tries (``PYSHMCKPT_OBJECT_ATTEMPTS``) with exponential
backoff and jitter for throttling and server errors (botocore's standard retry mode). Uploads of
several parts are S3 multipart uploads, each part with its CRC32C (``x-amz-checksum-crc32c``),
which the service checks.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import random
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
)
from .. import progress
from ..object_store import ObjectPath
from .base import Clients, Part, PartBody, Store, _ShortRead, crc32c_b64, joined, run_all

logger = logging.getLogger(__name__)

_ACCESS_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
    "InvalidSecurity", "RequestTimeTooSkewed",
})  # fmt: skip
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_UNAVAILABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable",
    "InternalError", "RequestLimitExceeded", "TooManyRequestsException",
})  # fmt: skip
# The settings a client is made from: a change of one (another endpoint, other keys) makes another.
_SETTINGS = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
    "PYSHMCKPT_OBJECT_ATTEMPTS", "PYSHMCKPT_OBJECT_CONCURRENCY",
)  # fmt: skip

T = TypeVar("T")


def client() -> Any:
    """This process's S3 client for the current settings (thread-safe, made on first use)."""
    return _clients.get()


def _new_client() -> Any:
    import boto3
    import botocore.config

    config = botocore.config.Config(
        connect_timeout=10,
        read_timeout=60,
        retries={"mode": "standard", "total_max_attempts": knobs.object_attempts()},
        max_pool_connections=max(32, 2 * knobs.object_concurrency()),
        parameter_validation=False,  # bodies are memoryviews of shared memory: not copied
        request_checksum_calculation="when_required",  # parts carry our own CRC32C
        response_checksum_validation="when_required",  # entries are checked against theirs
        tcp_keepalive=True,
        # Parts carry their CRC32C, which the service checks: no SHA-256 of every body for the
        # signature (botocore skips it only for checksums it adds itself).
        s3={"payload_signing_enabled": False},
    )
    return boto3.session.Session().client("s3", config=config)


_clients = Clients(_SETTINGS, _new_client)


def error(path: ObjectPath | str, what: str, exc: BaseException) -> ObjectStoreError:
    """A failure of boto3 (`exc`) while doing `what` at `path`, as the matching ObjectStoreError."""
    import botocore.exceptions as bx

    url = str(path)
    if isinstance(exc, bx.ClientError):
        info = exc.response.get("Error", {})
        code = str(info.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = (
            f"{what} failed: {code or 'error'} (HTTP {status}): {info.get('Message', '')}".rstrip(
                ": "
            )
        )
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                url, f"{what} failed: the bucket does not exist", code, status
            )
        if code in _ACCESS_CODES or status == 403:
            return ObjectStoreAccessError(url, message, code, status)
        if code in _UNAVAILABLE_CODES or (
            isinstance(status, int) and (status >= 500 or status == 429)
        ):
            return ObjectStoreUnavailableError(
                url, f"{message}, after {knobs.object_attempts()} tries", code, status
            )
        return ObjectStoreError(url, message, code, status)
    name = type(exc).__name__
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return ObjectStoreAccessError(
            url, f"{what} failed: no credentials found ({exc}); set them as for any AWS tool "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role)", name,
        )  # fmt: skip
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionError, bx.HTTPClientError)):
        return ObjectStoreUnavailableError(url, f"{what} failed: {exc}", name)
    return ObjectStoreError(url, f"{what} failed: {name}: {exc}", name)


def _missing(exc: BaseException) -> bool:
    """Whether boto3's `exc` says the object does not exist (not the bucket)."""
    import botocore.exceptions as bx

    if not isinstance(exc, bx.ClientError):
        return False
    return str(exc.response.get("Error", {}).get("Code", "")) in _MISSING_CODES


def _precondition_failed(exc: BaseException) -> bool:
    import botocore.exceptions as bx

    return isinstance(exc, bx.ClientError) and (
        exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
        or exc.response.get("Error", {}).get("Code")
        in ("PreconditionFailed", "ConditionalRequestConflict")
    )


def _call(path: ObjectPath, what: str, function: Callable[..., T], **kwargs: Any) -> T:
    """`function(**kwargs)` of the client, its failures as ObjectStoreErrors about `path`. An
    answer is progress (`progress`): the service is alive and the write moves on."""
    try:
        answer = function(**kwargs)
    except Exception as exc:
        raise error(path, what, exc) from exc
    progress.advance()
    return answer


def _changed(path: ObjectPath) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        str(path), "the object changed after its checkpoint was committed (replaced?)"
    )


class S3Store(Store):
    """Amazon S3, or a service that speaks its API (`AWS_ENDPOINT_URL`)."""

    max_parts = 10_000  # S3's limit on the parts of one upload

    def get(self, path: ObjectPath, *, limit: int, if_match: str | None) -> bytes | None:
        extra = {"IfMatch": if_match} if if_match else {}
        try:
            answer = client().get_object(Bucket=path.bucket, Key=path.key, **extra)
            size = int(answer.get("ContentLength", 0))
            if size > limit:
                answer["Body"].close()
                raise ObjectStoreError(str(path), f"{size} bytes: more than the {limit} expected")
            with answer["Body"] as body:
                data = bytes(body.read())
            progress.advance()
            return data
        except ObjectStoreError:
            raise
        except Exception as exc:
            if _missing(exc):
                progress.advance()
                return None
            if _precondition_failed(exc):
                raise _changed(path) from None
            raise error(path, "reading", exc) from exc

    def put(self, path: ObjectPath, data: bytes, *, create_only: bool) -> str:
        extra = {"IfNoneMatch": "*"} if create_only else {}
        try:
            answer = client().put_object(
                Bucket=path.bucket, Key=path.key, Body=data, ChecksumCRC32C=crc32c_b64(data),
                **extra,
            )  # fmt: skip
        except Exception as exc:
            if create_only and _precondition_failed(exc):
                return self.created_already(path, data)
            raise error(path, "writing", exc) from exc
        progress.advance()
        return str(answer.get("ETag", ""))

    def check(self, path: ObjectPath) -> None:
        _call(path, "listing", client().list_objects_v2, Bucket=path.bucket, Prefix=path.prefix,
              MaxKeys=1)  # fmt: skip

    def listing(self, path: ObjectPath, *, delimiter: bool) -> Iterator[dict[str, Any]]:
        paginator = client().get_paginator("list_objects_v2")
        extra = {"Delimiter": "/"} if delimiter else {}
        try:
            for page in paginator.paginate(Bucket=path.bucket, Prefix=path.prefix, **extra):
                progress.advance()
                yield from page.get("CommonPrefixes", [])
                yield from page.get("Contents", [])
        except Exception as exc:
            raise error(path, "listing", exc) from exc

    def delete(self, path: ObjectPath, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            answer = _call(path, "deleting", client().delete_objects, Bucket=path.bucket,
                           Delete={"Objects": batch, "Quiet": True})  # fmt: skip
            failed = answer.get("Errors") or []
            if failed:
                first = failed[0]
                raise ObjectStoreError(
                    f"{path.scheme}://{path.bucket}/{first.get('Key', '')}",
                    f"deleting failed: {first.get('Code', '')}: {first.get('Message', '')} "
                    f"({len(failed)} of {len(batch)} objects)", str(first.get("Code", "")),
                )  # fmt: skip

    def upload_parts(self, path: ObjectPath, parts: list[Part]) -> str:
        store = client()
        started = _call(
            path, "starting a multipart upload", store.create_multipart_upload,
            Bucket=path.bucket, Key=path.key, ChecksumAlgorithm="CRC32C",
        )  # fmt: skip
        upload_id = started["UploadId"]
        try:
            sent = _send_parts(path, upload_id, parts)
            done = _call(
                path, "completing a multipart upload", store.complete_multipart_upload,
                Bucket=path.bucket, Key=path.key, UploadId=upload_id,
                MultipartUpload={"Parts": sent},
            )  # fmt: skip
        except BaseException:
            self.abort(path, path.key, upload_id)
            raise
        return str(done.get("ETag", ""))

    def read_ranges(
        self, path: ObjectPath, etag: str, pieces: list[tuple[int, memoryview]]
    ) -> None:
        first, last = pieces[0][0], pieces[-1][0] + len(pieces[-1][1])
        extra = {"IfMatch": etag} if etag else {}
        where = f"reading bytes {first}-{last - 1}"
        tries, failed = knobs.object_attempts(), 0
        while True:  # botocore retries the request, not a body cut off while it is read
            try:
                answer = client().get_object(
                    Bucket=path.bucket, Key=path.key, Range=f"bytes={first}-{last - 1}", **extra
                )
                with answer["Body"] as body:
                    _read_pieces(where, body, first, pieces)
                progress.advance()
                return
            except Exception as exc:
                if _precondition_failed(exc):
                    raise _changed(path) from None
                if _missing(exc):
                    raise CheckpointCorruptError(str(path), "the object is missing") from None
                failed += 1
                if failed < tries and _cut_off(exc):
                    time.sleep(random.uniform(0, min(20.0, 0.05 * 2 ** (failed - 1))))
                    continue
                if _cut_off(exc):
                    raise ObjectStoreUnavailableError(
                        str(path), f"{where} failed: {exc}, after {tries} tries", type(exc).__name__
                    ) from exc
                raise error(path, where, exc) from exc

    def unfinished(self, path: ObjectPath) -> Iterator[tuple[str, datetime.datetime, Any]]:
        paginator = client().get_paginator("list_multipart_uploads")
        try:
            for page in paginator.paginate(Bucket=path.bucket, Prefix=path.prefix):
                progress.advance()
                for upload in page.get("Uploads", []):
                    yield upload["Key"], upload["Initiated"], upload["UploadId"]
        except Exception as exc:
            raise error(path, "listing multipart uploads", exc) from exc

    def abort(self, path: ObjectPath, key: str, handle: Any) -> None:
        with contextlib.suppress(Exception):
            client().abort_multipart_upload(Bucket=path.bucket, Key=key, UploadId=handle)
            return
        logger.warning("could not abort the upload of %s: the root's cleanup will", path)


def _cut_off(exc: BaseException) -> bool:
    """Whether `exc` is a read cut off mid-answer (worth another try)."""
    import botocore.exceptions as bx
    import urllib3.exceptions as ux

    return isinstance(
        exc,
        (_ShortRead, ux.ProtocolError, ux.ReadTimeoutError, bx.ResponseStreamingError,
         bx.IncompleteReadError, bx.ReadTimeoutError, bx.ConnectionClosedError),
    )  # fmt: skip


def _read_pieces(where: str, body: Any, first: int, pieces: list[tuple[int, memoryview]]) -> None:
    """Read a ranged answer `body` (from byte `first`) into the pieces' views."""
    cursor = first
    for start, view in pieces:
        while cursor < start:  # a gap between two wanted ranges
            skipped = len(body.read(min(start - cursor, 1 << 20)))
            if not skipped:
                raise _ShortRead(f"{where} ended at byte {cursor}")
            cursor += skipped
        got = 0
        while got < len(view):
            n = body.readinto(view[got:])
            if not n:
                raise _ShortRead(f"{where} ended at byte {cursor + got}")
            got += n
        cursor += got


def _send_parts(path: ObjectPath, upload_id: str, parts: list[Part]) -> list[dict[str, Any]]:
    store = client()

    def send(number: int, part: Part) -> dict[str, Any]:
        body = joined(part)  # here, not before: one part's copy at a time
        crc = crc32c_b64(body)
        answer = _call(
            path, f"uploading part {number}", store.upload_part, Bucket=path.bucket,
            Key=path.key, UploadId=upload_id, PartNumber=number, Body=PartBody(body),
            ChecksumCRC32C=crc,
        )  # fmt: skip
        progress.advance(len(body))
        return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32C": crc}

    calls = [functools.partial(send, number, part) for number, part in enumerate(parts, 1)]
    return run_all(knobs.object_concurrency(), calls, "pyshmckpt-upload")
