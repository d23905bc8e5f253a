"""Bytes into a file, the way pyshmckpt's writers write them: in bounded pieces, each reported to
`progress`, with write-behind (each piece is handed to the disk while the next is written, and
the one before it waited for), so that the final fsync has little left to flush and a write
makes visible progress at the disk's pace instead of one long silent fsync at its end.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections import deque
from typing import Any, BinaryIO, cast

from . import progress

CHUNK = 64 << 20  # bytes per write call, and per write-behind range
IOV_MAX = 1024

_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4


@functools.cache
def _sync_file_range() -> Any:
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


class WriteBehind:
    """Hands each CHUNK of a file written in order to the disk as soon as it is complete, and
    waits for the one before it (Linux's sync_file_range; a no-op where there is none, or the
    filesystem ignores it, as tmpfs does)."""

    def __init__(self, fd: int, position: int = 0) -> None:
        self.fd = fd
        self.flushed = position  # written back up to here (or handed to the disk)
        self.previous: tuple[int, int] | None = None
        self.position = position

    def wrote(self, nbytes: int) -> None:
        self.position += nbytes
        function = _sync_file_range()
        while function is not None and self.position - self.flushed >= CHUNK:
            start = self.flushed
            function(self.fd, start, CHUNK, _SYNC_FILE_RANGE_WRITE)  # errors: fsync reports them
            if self.previous is not None:
                wait = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
                function(self.fd, *self.previous, wait | _SYNC_FILE_RANGE_WAIT_AFTER)
                progress.advance()
            self.previous = (start, CHUNK)
            self.flushed += CHUNK


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """writev every buffer completely at the file's position, at most CHUNK bytes per call."""
    pending = deque(b for b in buffers if len(b))
    behind = WriteBehind(fd, os.lseek(fd, 0, os.SEEK_CUR))
    while pending:
        batch: list[memoryview] = []
        size = 0
        for buffer in pending:
            if len(batch) == IOV_MAX or size == CHUNK:
                break
            piece = buffer[: CHUNK - size]
            batch.append(piece)
            size += len(piece)
        written = os.writev(fd, batch)
        progress.advance(written)
        behind.wrote(written)
        while written and written >= len(pending[0]):
            written -= len(pending.popleft())
        if written:
            pending[0] = pending[0][written:]


def pwrite_all(fd: int, data: memoryview, position: int) -> None:
    """pwrite all of `data` at `position`, at most CHUNK bytes per call."""
    while len(data):
        written = os.pwrite(fd, data[:CHUNK], position)
        progress.advance(written)
        data, position = data[written:], position + written


class ProgressFile:
    """A binary file for serializers that write through ``write()`` (torch.save): every write
    goes out in bounded pieces with write-behind and progress, as `write_all` does."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self._behind = WriteBehind(file.fileno(), file.tell())

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK):
            piece = view[start : start + CHUNK]
            self._file.write(piece)
            progress.advance(len(piece))
        self._file.flush()  # write-behind works on what reached the kernel
        self._behind.wrote(len(view))
        return len(view)

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return int(self._file.fileno())

    def tell(self) -> int:
        return int(self._file.tell())


def progress_file(file: BinaryIO) -> BinaryIO:
    """`file` wrapped in a `ProgressFile`, typed as the file it stands for."""
    return cast(BinaryIO, ProgressFile(file))
