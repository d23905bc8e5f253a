"""Object storage as a checkpoint location: ``s3://bucket/prefix`` for Amazon S3 and the services
that speak its API, through boto3's low-level client (the ``s3`` extra).

Credentials, region and endpoint come from the AWS chain and settings as for any AWS tool
(``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``, instance roles, ``AWS_REGION``, ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` for another service). Every request is bounded: a connect and a read
timeout per try, and a bounded number of tries (``PYSHMCKPT_OBJECT_ATTEMPTS``) with exponential
backoff and jitter for throttling and server errors (botocore's standard retry mode). A failure
that remains is an `ObjectStoreError` naming the URL (`BucketNotFoundError`,
`ObjectStoreAccessError`, `ObjectStoreUnavailableError`).
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .. import knobs
from ..errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    ObjectStoreAccessError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
    UnsupportedLocationError,
    os_error,
)
from . import progress

SCHEMES = ("s3",)
EXTRA = "python -m pip install 'pyshmckpt[s3]' (in a clone: '.[s3]'), which installs boto3"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
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

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ObjectPath:
    """A place in object storage: a bucket and a key (a prefix for a root or a checkpoint,
    without a trailing slash). Joined with ``/`` like a path; ``str()`` is the URL. A
    Checkpointer's ``root``, its `latest`, and what its saves' Futures resolve to are these for
    an ``s3://`` root.

    Attributes:
        bucket: the bucket's name.
        key: the key, or key prefix, within the bucket ("" for the bucket itself).
        scheme: the URL's scheme (``s3``).
    """

    bucket: str
    key: str = ""
    scheme: str = "s3"

    @property
    def url(self) -> str:
        """The URL, ``s3://bucket/key``."""
        return (
            f"{self.scheme}://{self.bucket}/{self.key}"
            if self.key
            else f"{self.scheme}://{self.bucket}"
        )

    @property
    def name(self) -> str:
        """The key's last part (a checkpoint's name)."""
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> ObjectPath:
        """The path one part up (a checkpoint's root)."""
        return dataclasses.replace(self, key=self.key.rpartition("/")[0])

    def __truediv__(self, name: str) -> ObjectPath:
        return dataclasses.replace(self, key=f"{self.key}/{name}" if self.key else name)

    def __str__(self) -> str:
        return self.url

    @property
    def prefix(self) -> str:
        """The key prefix of everything below this path (``key/``, or "" for a bucket)."""
        return f"{self.key}/" if self.key else ""


def is_url(text: str) -> bool:
    """Whether `text` names object storage of a supported scheme (``s3://``)."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def parse(text: str) -> ObjectPath:
    """The ObjectPath an ``s3://bucket/prefix`` URL names.

    Raises:
        UnsupportedLocationError: not a valid bucket name or key (a query, a fragment, empty
            path segments), or the ``s3`` extra (boto3) is not installed.
    """
    scheme, _, rest = text.partition("://")
    bucket, _, key = rest.partition("/")
    key = key.rstrip("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UnsupportedLocationError(text, f"{bucket!r} is not a valid bucket name")
    if (
        any(c in key for c in "?#\\")
        or "//" in key
        or any(p in (".", "..") for p in key.split("/"))
    ):
        raise UnsupportedLocationError(
            text, "the key must be a plain path (no '?', '#', '\\', empty, '.' or '..' segments)"
        )
    if importlib.util.find_spec("boto3") is None:
        raise UnsupportedLocationError(
            text, f"object storage needs the s3 extra, which is not installed: {EXTRA}"
        )
    return ObjectPath(bucket, key, scheme.lower())


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()
# The settings a client is made from: a change of one (another endpoint, other keys) makes another.
_SETTINGS = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
    "PYSHMCKPT_OBJECT_ATTEMPTS", "PYSHMCKPT_OBJECT_CONCURRENCY",
)  # fmt: skip


def client() -> Any:
    """This process's S3 client for the current settings (thread-safe, made on first use)."""
    key = (os.getpid(), *(os.environ.get(name) for name in _SETTINGS))
    with _clients_lock:
        made = _clients.get(key)
        if made is None:
            made = _clients[key] = _new_client()
        return made


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


def missing(exc: BaseException) -> bool:
    """Whether boto3's `exc` says the object does not exist (not the bucket)."""
    import botocore.exceptions as bx

    if not isinstance(exc, bx.ClientError):
        return False
    return str(exc.response.get("Error", {}).get("Code", "")) in _MISSING_CODES


def precondition_failed(exc: BaseException) -> bool:
    import botocore.exceptions as bx

    return isinstance(exc, bx.ClientError) and (
        exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
        or exc.response.get("Error", {}).get("Code")
        in ("PreconditionFailed", "ConditionalRequestConflict")
    )


def call(path: ObjectPath, what: str, function: Callable[..., T], **kwargs: Any) -> T:
    """`function(**kwargs)` of the client, its failures as ObjectStoreErrors about `path`. An
    answer is progress (`progress`): the service is alive and the write moves on."""
    try:
        answer = function(**kwargs)
    except Exception as exc:
        raise error(path, what, exc) from exc
    progress.advance()
    return answer


def get(path: ObjectPath, *, limit: int, if_match: str | None = None) -> bytes | None:
    """The whole object at `path` (None when there is none), refused beyond `limit` bytes."""
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
        if missing(exc):
            progress.advance()
            return None
        if precondition_failed(exc):
            raise CheckpointCorruptError(
                str(path), "the object changed after its checkpoint was committed (replaced?)"
            ) from None
        raise error(path, "reading", exc) from exc


def put(path: ObjectPath, data: bytes, *, create_only: bool = False) -> str:
    """Write one small object whole; its ETag. With `create_only`, an object there already
    fails it (PathExistsError) and is left as it is (a conditional write)."""
    from .object_upload import checksum

    extra = {"IfNoneMatch": "*"} if create_only else {}
    try:
        answer = client().put_object(
            Bucket=path.bucket, Key=path.key, Body=data, ChecksumCRC32C=checksum(data), **extra
        )
    except Exception as exc:
        if create_only and precondition_failed(exc):
            raise os_error(errno.EEXIST, f"{path} exists already", str(path)) from None
        raise error(path, "writing", exc) from exc
    progress.advance()
    return str(answer.get("ETag", ""))


def check(path: ObjectPath) -> None:
    """One listing request below `path`: raises what the service says of the bucket and the
    credentials (`BucketNotFoundError`, `ObjectStoreAccessError` ...)."""
    call(
        path, "listing", client().list_objects_v2, Bucket=path.bucket, Prefix=path.prefix, MaxKeys=1
    )


def listing(path: ObjectPath, *, delimiter: bool = False) -> Iterator[dict[str, Any]]:
    """Every object below `path` (``{"Key", "Size", "LastModified", "ETag"}``), or with
    `delimiter` also the names directly below it (``{"Prefix"}`` entries), page by page."""
    paginator = client().get_paginator("list_objects_v2")
    extra = {"Delimiter": "/"} if delimiter else {}
    try:
        for page in paginator.paginate(Bucket=path.bucket, Prefix=path.prefix, **extra):
            progress.advance()
            yield from page.get("CommonPrefixes", [])
            yield from page.get("Contents", [])
    except Exception as exc:
        raise error(path, "listing", exc) from exc


def delete(path: ObjectPath, keys: list[str]) -> None:
    """Delete the objects `keys` of `path`'s bucket (a missing one is no error)."""
    for start in range(0, len(keys), 1000):
        batch = [{"Key": key} for key in keys[start : start + 1000]]
        answer = call(path, "deleting", client().delete_objects, Bucket=path.bucket,
                      Delete={"Objects": batch, "Quiet": True})  # fmt: skip
        failed = answer.get("Errors") or []
        if failed:
            first = failed[0]
            raise ObjectStoreError(
                f"{path.scheme}://{path.bucket}/{first.get('Key', '')}",
                f"deleting failed: {first.get('Code', '')}: {first.get('Message', '')} "
                f"({len(failed)} of {len(batch)} objects)", str(first.get("Code", "")),
            )  # fmt: skip
