"""A second, remote copy of every persisted checkpoint: ``Checkpointer(root, mirror="s3://...")``.

Runs in the writer process. Once a checkpoint is committed under the local root, the writer
queues it for the mirror and answers the save: training goes on, and the slot is free. A thread
of the writer uploads each queued checkpoint in the order they were committed, from the files
(opened and mapped when queued, so that retention on the local root may delete them
meanwhile), and commits it in object storage as a save there would be (`object_commit.save`:
the same name, several ranks meeting in the bucket under the same attempt), then applies the
mirror's retention. A failed upload is logged and the next one goes on: the local checkpoint
stands. `drain` waits for the queue (the Checkpointer's `close`, the writer's own close after
its trainer died), so that a save committed locally is mirrored before the writer exits.
`remove_checkpoint` (``Checkpointer.remove`` with a mirror) removes the local checkpoint and
queues its removal from the mirror behind the uploads queued before it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PathNotFoundError
from ..shm.native import crc32c
from . import commit, object_commit, object_store, object_upload, progress
from .object_store import ObjectPath

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT = 1800.0  # seconds a closing writer waits for its mirror (a save's write timeout)


@dataclass
class _Job:
    target: ObjectPath  # the checkpoint in the mirror
    files: dict[str, tuple[Any, memoryview]]  # name -> (its map, a view of it)
    options: dict[str, Any]  # object_commit.save's keyword arguments
    remove: bool = False  # remove `target` from the mirror instead of uploading it
    checksums: bool = False  # record each object's CRC32C (files without checksums of their own)


class Mirror:
    """The writer process's queue of checkpoints to mirror, and the thread that uploads them."""

    def __init__(self) -> None:
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._idle = threading.Condition()  # guards _pending and _thread
        self._pending = 0
        self._thread: threading.Thread | None = None

    def put(
        self,
        directory: Path,
        target: ObjectPath,
        *,
        files: tuple[str, ...],
        checksums: bool = False,
        **options: Any,
    ) -> None:
        """Queue the committed checkpoint `directory` (this rank's `files` of it) for `target`;
        `options` are `object_commit.save`'s. With `checksums`, the commit record holds each
        object's CRC32C (``"crc32c"``), which a download checks (`object_download`)."""
        mapped: dict[str, tuple[Any, memoryview]] = {}
        try:
            for name in files:
                fd = os.open(directory / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    size = os.fstat(fd).st_size
                    region = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
                finally:
                    os.close(fd)
                view = memoryview(region) if region is not None else memoryview(b"")
                mapped[name] = (region, view)
        except BaseException:
            _unmap(mapped)
            raise
        self._enqueue(_Job(target, mapped, options, checksums=checksums))

    def remove(self, target: ObjectPath) -> None:
        """Queue the removal of `target` from the mirror (after what is queued already: a
        checkpoint still being uploaded is uploaded, then removed)."""
        self._enqueue(_Job(target, {}, {}, remove=True))

    def _enqueue(self, job: _Job) -> None:
        with self._idle:
            self._pending += 1
            self._queue.put(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pyshmckpt-mirror", daemon=True
                )
                self._thread.start()

    def drain(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every queued checkpoint is mirrored or failed;
        True when none is left. Waiting on a queue that moves is progress (no stall)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 1.0))
                progress.advance()
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job.remove:
                    _remove(job.target)
                else:
                    self._mirror(job)
            except Exception as exc:  # the local checkpoint stands: say so, go on
                what = "remove" if job.remove else "mirror"
                logger.warning("could not %s %s: %s: %s", what, job.target, type(exc).__name__, exc)
            finally:
                try:
                    _unmap(job.files)
                finally:
                    with self._idle:
                        self._pending -= 1
                        self._idle.notify_all()

    def _mirror(self, job: _Job) -> None:
        def upload(target: ObjectPath) -> dict[str, dict[str, Any]]:
            out = {}
            for name, (_, view) in job.files.items():
                etag, size = object_upload.upload(target / name, [view])
                out[name] = {"etag": etag, "size": size}
                if name.endswith(".safetensors") and size >= 8:  # as `_upload_files` records it
                    out[name]["header"] = 8 + int.from_bytes(view[:8], "little")
                if job.checksums:
                    out[name]["crc32c"] = crc32c(view)
            return out

        object_commit.save(job.target, upload, files=tuple(job.files), **job.options)
        logger.info("mirrored %s", job.target)


def _unmap(files: dict[str, tuple[Any, memoryview]]) -> None:
    """Release the views and close the maps (a map still viewed elsewhere, by a traceback,
    closes with the last of those)."""
    for region, view in files.values():
        view.release()
        if region is not None:
            with contextlib.suppress(BufferError):
                region.close()


def _remove(target: ObjectPath) -> None:
    try:
        object_commit.remove(target.parent, target.name)
    except PathNotFoundError:  # never mirrored (its upload failed), or another rank removed it
        logger.debug("%s was not in the mirror", target)
        return
    logger.info("removed %s from the mirror", target)


MIRROR = Mirror()


def remove_checkpoint(root: str, name: str, mirror: str) -> None:
    """`Checkpointer.remove` of a root with a mirror, in the writer process: the checkpoint is
    removed under `root` now (`commit.remove_checkpoint`), and from `mirror` in the background,
    once the uploads queued before it are done. A checkpoint missing under `root` fails the call
    (errno ENOENT) once the mirror's removal is queued: the mirror may hold it still."""
    target = object_store.parse(mirror) / name
    try:
        commit.remove_checkpoint(root, name)
    except PathNotFoundError:
        MIRROR.remove(target)
        raise
    MIRROR.remove(target)


def drain(timeout: float = DRAIN_TIMEOUT) -> bool:
    """`Mirror.drain` of this writer process's mirror (a call the Checkpointer makes)."""
    return MIRROR.drain(timeout)
