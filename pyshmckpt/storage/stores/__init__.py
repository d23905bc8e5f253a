"""The object storage services pyshmckpt reads and writes, one module each behind one interface
(`base.Store`): Amazon S3 and the services that speak its API (`s3`), Google Cloud Storage
(`gcs`). `store_of` gives the one of a URL's scheme; each is made once per process.
"""

from __future__ import annotations

import threading

from .base import Store

_stores: dict[str, Store] = {}
_lock = threading.Lock()


def store_of(scheme: str) -> Store:
    """The store of `scheme` (``s3`` or ``gs``; `object_store.parse` checked it and its extra)."""
    with _lock:
        made = _stores.get(scheme)
        if made is None:
            if scheme == "gs":
                from .gcs import GCSStore

                made = GCSStore()
            else:
                from .s3 import S3Store

                made = S3Store()
            _stores[scheme] = made
        return made


__all__ = ["Store", "store_of"]
