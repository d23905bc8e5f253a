"""Object storage as a checkpoint location: ``s3://bucket/prefix`` (Amazon S3 and the services
that speak its API, through boto3: the ``s3`` extra) and ``gs://bucket/prefix`` (Google Cloud
Storage, through google-cloud-storage: the ``gcs`` extra).

`ObjectPath` is a place in a bucket; `parse` makes one of a URL. The functions below send a
request to the service of the path's scheme (`stores`), each bounded (a timeout per try, a
bounded number of tries with backoff and jitter for throttling and server errors); a failure that
remains is an `ObjectStoreError` naming the URL (`BucketNotFoundError`, `ObjectStoreAccessError`,
`ObjectStoreUnavailableError`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedLocationError

if TYPE_CHECKING:
    from .stores.base import Store

SCHEMES = ("s3", "gs")
# What each scheme's client needs: (the module, how to install it).
EXTRAS = {
    "s3": (
        "boto3",
        "python -m pip install 'pyshmckpt[s3]' (in a clone: '.[s3]'), which installs boto3",
    ),
    "gs": (
        "google.cloud.storage",
        "python -m pip install 'pyshmckpt[gcs]' (in a clone: '.[gcs]'), which installs "
        "google-cloud-storage",
    ),
}
# Bucket names: S3's (no '_'), Google Cloud Storage's ('_' allowed; dotted names up to 222).
_BUCKETS = {
    "s3": re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
    "gs": re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$"),
}


@dataclasses.dataclass(frozen=True)
class ObjectPath:
    """A place in object storage: a bucket and a key (a prefix for a root or a checkpoint,
    without a trailing slash). Joined with ``/`` like a path; ``str()`` is the URL. A
    Checkpointer's ``root``, its `latest`, and what its saves' Futures resolve to are these for
    an ``s3://`` or ``gs://`` root.

    Attributes:
        bucket: the bucket's name.
        key: the key, or key prefix, within the bucket ("" for the bucket itself).
        scheme: the URL's scheme (``s3`` or ``gs``).
    """

    bucket: str
    key: str = ""
    scheme: str = "s3"

    @property
    def url(self) -> str:
        """The URL, ``s3://bucket/key`` (or ``gs://``)."""
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
    """Whether `text` names object storage of a supported scheme (``s3://``, ``gs://``)."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def parse(text: str) -> ObjectPath:
    """The ObjectPath an ``s3://bucket/prefix`` or ``gs://bucket/prefix`` URL names.

    Raises:
        UnsupportedLocationError: not a valid bucket name or key (a query, a fragment, empty
            path segments), or the scheme's extra (boto3, google-cloud-storage) is not
            installed.
    """
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise UnsupportedLocationError(text, f"{scheme}:// is not object storage pyshmckpt writes")
    bucket, _, key = rest.partition("/")
    key = key.rstrip("/")
    if not _BUCKETS[scheme].match(bucket) or ".." in bucket:
        raise UnsupportedLocationError(text, f"{bucket!r} is not a valid bucket name")
    if (
        any(c in key for c in "?#\\")
        or "//" in key
        or any(p in (".", "..") for p in key.split("/"))
    ):
        raise UnsupportedLocationError(
            text, "the key must be a plain path (no '?', '#', '\\', empty, '.' or '..' segments)"
        )
    module, install = EXTRAS[scheme]
    if not _installed(module):
        raise UnsupportedLocationError(
            text, f"{scheme}:// needs an extra that is not installed: {install}"
        )
    return ObjectPath(bucket, key, scheme)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def store(path: ObjectPath) -> Store:
    """The service of `path`'s scheme (see `stores`)."""
    from .stores import store_of  # the stores import ObjectPath from here

    return store_of(path.scheme)


def get(path: ObjectPath, *, limit: int, if_match: str | None = None) -> bytes | None:
    """The whole object at `path` (None when there is none), refused beyond `limit` bytes;
    with `if_match`, only the object of that ETag (`CheckpointCorruptError` otherwise)."""
    return store(path).get(path, limit=limit, if_match=if_match)


def put(path: ObjectPath, data: bytes, *, create_only: bool = False) -> str:
    """Write one small object whole; its ETag. With `create_only`, an object there already
    fails it (PathExistsError) and is left as it is (a conditional write)."""
    return store(path).put(path, data, create_only=create_only)


def check(path: ObjectPath) -> None:
    """One listing request below `path`: raises what the service says of the bucket and the
    credentials (`BucketNotFoundError`, `ObjectStoreAccessError` ...)."""
    store(path).check(path)


def listing(path: ObjectPath, *, delimiter: bool = False) -> Iterator[dict[str, Any]]:
    """Every object below `path` (``{"Key", "Size", "LastModified", "ETag"}``), or with
    `delimiter` also the names directly below it (``{"Prefix"}`` entries), page by page."""
    return store(path).listing(path, delimiter=delimiter)


def delete(path: ObjectPath, keys: list[str]) -> None:
    """Delete the objects `keys` of `path`'s bucket (a missing one is no error)."""
    store(path).delete(path, keys)
