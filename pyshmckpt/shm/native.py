"""The compiled core, ``pyshmckpt._C``, loaded here and nowhere else.

Shared-memory segments, their pinning and the copies into them stay inside this layer (`arena`,
`attached`); other layers use only the few functions re-exported below (checksums, the copy
thread pool). Importing from a source tree whose extension was never built fails here with one
`ImportError` that says what to run.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ExtensionMissingError


def _load() -> ModuleType:
    try:
        return importlib.import_module("pyshmckpt._C")
    except ModuleNotFoundError as exc:
        if exc.name != "pyshmckpt._C":
            raise
    package = Path(__file__).resolve().parent.parent
    raise ExtensionMissingError(
        f"pyshmckpt's compiled extension (pyshmckpt._C) is missing from {package}. In a clone of "
        "the repository, build it in place with `python -m pip install torch==2.13.0 "
        "scikit-build-core pybind11 && python -m pip install --no-build-isolation -e .` (see "
        "CONTRIBUTING.md), or install pyshmckpt with `python -m pip install .` and import "
        "it from outside the clone."
    )


_C = _load()

Segment = _C.Segment
CopyEvent = _C.CopyEvent
HostCopy = _C.HostCopy


def crc32c(data: object, value: int = 0) -> int:
    """CRC32C of a buffer (hardware instruction where the CPU has one; GIL released)."""
    return int(_C.crc32c(data, value))


def copy_threads() -> int:
    """Threads of the native pool that runs copies, prefaulting and checksums."""
    return int(_C.num_threads())


def set_copy_threads(count: int) -> None:
    """Resize the native pool (PYSHMCKPT_THREADS)."""
    _C.set_num_threads(count)


def cuda_device_count() -> int:
    """CUDA devices the driver sees (0 without a usable driver or a device; loads the driver on
    the first call)."""
    return int(_C.cuda_device_count())


def cuda_driver_status() -> dict[str, Any]:
    """What loading the CUDA driver found (see `cuda.driver_status`)."""
    return dict(_C.cuda_driver_status())


def read_file_ranges(fd: int, entries: Any, *, checksums: bool, path: str) -> tuple[Any, Any]:
    """pread each (file offset, address, nbytes) row of the (n, 3) uint64 array `entries` into
    memory on the native pool, GIL released, large rows split across threads. Returns (crcs,
    got): the CRC32C of each row's bytes as they landed (0 without `checksums`) and the bytes
    read (fewer when the file ends first). A failed pread raises OSError naming `path`.

    The caller owns the memory: every address must be writable for its byte count, not overlap
    another row's, and stay alive and untouched until this returns; `fd` stays open until then.
    """
    crcs, got = _C.read_file_ranges(fd, entries, checksums, path)
    return crcs, got


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of A + B from crc32c(A), crc32c(B) and len(B)."""
    return int(_C.crc32c_combine(crc_a, crc_b, len_b))
