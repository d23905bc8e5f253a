"""Pausing the cyclic garbage collector around work that allocates many small objects."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_GC_LOCK = threading.Lock()
_GC_PAUSES = [0, False]  # pauses in progress, whether automatic collection was on at the first


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector's automatic runs (not gc.collect()) for a stretch that
    allocates thousands of small objects that refcounting frees (staging a state dict, parsing
    a manifest and building the state of a load): otherwise each such stretch triggers full
    collections, whose cost grows with every object of the process, not with the state dict.
    Nests and works across threads; the collector is re-enabled after the last pause only if it
    was enabled before the first. Also a decorator (``@gc_paused()``)."""
    with _GC_LOCK:
        if _GC_PAUSES[0] == 0:
            _GC_PAUSES[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSES[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES[0] -= 1
            if _GC_PAUSES[0] == 0 and _GC_PAUSES[1]:
                gc.enable()
