"""Progress of the work in hand in a writer process, which its trainer judges stalls by.

pyshmckpt's own writers call `advance` as their bytes reach the file (and while they wait for
other ranks that are alive); the writer process reports the count to the trainer while it serves
a write. A write whose count stops moving for the stall timeout is stuck (a hung filesystem, a
stopped process), however slow a write that keeps moving is.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_bytes = 0
_steps = 0


def advance(nbytes: int = 0) -> None:
    """Say that the write in hand moved on (by `nbytes` written, or by a step without bytes)."""
    global _bytes, _steps
    with _lock:
        _bytes += nbytes
        _steps += 1


def current() -> tuple[int, int]:
    """(bytes written, steps) so far in this process."""
    with _lock:
        return _bytes, _steps
