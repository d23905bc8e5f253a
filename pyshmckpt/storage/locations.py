"""Where checkpoints go: a local (or shared) filesystem path, or object storage (``s3://``,
``gs://``: `object_store`). A URL is never taken for a local path.

``Path("s3://bucket/run")`` is the relative path ``s3:/bucket/run``: written there, checkpoints
would land in a directory named ``s3:`` of the current directory while the caller believes them
in a bucket. So every place that takes a checkpoint root, directory or file passes it through
`location` (the Checkpointer, `load`, `verify`, the command line: ``s3://`` is object storage)
or `local_path` (DeepSpeed's save directory, which must be a directory), which refuse anything else that
starts like a URL (``scheme:/``, also after a Path collapsed its ``//``) with
`UnsupportedLocationError`, and take ``file://`` URLs as the path they name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError, ConfigTypeError, UnsupportedLocationError
from . import object_store
from .object_store import ObjectPath

# A URL's scheme (RFC 3986) and the slash that follows it: "s3://b/k", or "s3:/b/k" once a Path
# collapsed the double slash.
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):/")
# Services pyshmckpt does not write, by the schemes their URLs take: (the service, the URL of
# one it does write, where there is one).
_OTHER_STORES = {
    "s3a": ("Amazon S3 through Hadoop's s3a", "s3://bucket/prefix"),
    "gcs": ("Google Cloud Storage through fsspec's gcs://", "gs://bucket/prefix"),
    "az": ("Azure Blob Storage", None),
    "abfs": ("Azure Data Lake Storage", None),
    "abfss": ("Azure Data Lake Storage", None),
}


def location(value: Any, what: str = "checkpoint location") -> Path | ObjectPath:
    """`value` as a local path, or as an `ObjectPath` for a URL of object storage pyshmckpt
    reads and writes (``s3://``, ``gs://``; see `object_store`).

    Raises:
        UnsupportedLocationError: another URL, an invalid bucket or key, or object storage
            without its extra installed.
        ConfigTypeError: `value` is neither a str nor path-like.
    """
    if isinstance(value, ObjectPath):
        return value
    if isinstance(value, str) and object_store.is_url(value):
        return object_store.parse(value)
    return local_path(value, what)


def object_root(value: Any, what: str = "mirror") -> ObjectPath:
    """`value` as a root in object storage (a mirror's: ``s3://bucket/prefix``,
    ``gs://bucket/prefix``).

    Raises:
        ConfigError: `value` is a local path.
        UnsupportedLocationError: a URL pyshmckpt does not write, or its extra is missing.
        ConfigTypeError: `value` is neither a str nor path-like.
    """
    where = location(value, what)
    if not isinstance(where, ObjectPath):
        raise ConfigError(
            f"{what} must be an object storage root (s3://bucket/prefix or gs://bucket/prefix), "
            f"not {value!r}"
        )
    return where


def local_path(value: Any, what: str = "checkpoint location") -> Path:
    """`value` (a str or path-like) as a local filesystem path.

    Raises:
        UnsupportedLocationError: `value` is a URL other than ``file://`` (object storage, http):
            it is refused, never taken for a local directory of that name.
        ConfigTypeError: `value` is neither a str nor path-like (from `os.fspath`).
    """
    try:
        text = os.fspath(value)
    except TypeError:
        raise ConfigTypeError(
            f"{what} must be a str or a path, not {type(value).__name__}"
        ) from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    match = _URL.match(text)
    if match is None:
        return Path(text)
    scheme = match.group("scheme").lower()
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise UnsupportedLocationError(
                text, f"a file:// URL of another host ({parts.netloc}) is not a local path"
            )
        return Path(unquote(parts.path))
    other = _OTHER_STORES.get(scheme)
    if scheme in object_store.SCHEMES and "://" not in text:
        why = (
            f"a URL with one slash after '{scheme}:' is not supported: a Path collapses the "
            f"'//' of a URL; pass '{scheme}://bucket/prefix' as a str"
        )
    elif scheme in object_store.SCHEMES:
        why = (
            f"object storage is not supported as a {what} here: it is a directory on a local "
            "or shared filesystem (object storage is a Checkpointer's root, and a path of "
            "load, verify and inspect)"
        )
    elif other is not None:
        service, instead = other
        why = f"{service} is not supported: " + (
            f"write {instead}"
            if instead
            else "pyshmckpt writes object storage through the S3 API (s3://, and "
            "AWS_ENDPOINT_URL for another service that speaks it) and Google Cloud Storage "
            "(gs://)"
        )
    else:
        why = (
            f"'{scheme}:' URLs are not supported: a {what} is a directory on a local or shared "
            "filesystem, or s3://bucket/prefix or gs://bucket/prefix"
        )
    raise UnsupportedLocationError(text, why)
