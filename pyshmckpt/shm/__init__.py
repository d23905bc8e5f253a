"""Layer 1, shared memory: segments, the arena and its slots, pinning, stale-segment collection.

The only layer that touches the native segment API (`native`). Everything above sees slots:
`Arena` creates them (prefaulted, pinned where CUDA is available; an arena made by a first stage
leaves that to the stage and a background thread), each `Slot` moves through
FREE -> STAGING -> READY -> WRITING -> FREE under the arena's lock, and the writer process
attaches them by `SlotAddress` (`AttachedSegments`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from .address import SlotAddress
    from .arena import Arena, Slot, SlotState
    from .attached import AttachedSegments, SlotMapping
    from .cuda import CudaInfo, cuda_available, cuda_compiled, cuda_info
    from .stale import collect_stale_segments, list_segments

# Imported on first use (see _lazy): the writer process loads only the modules it runs.
__getattr__, __dir__ = exports(
    __name__,
    {
        "SlotAddress": "address",
        "Arena": "arena",
        "Slot": "arena",
        "SlotState": "arena",
        "AttachedSegments": "attached",
        "SlotMapping": "attached",
        "CudaInfo": "cuda",
        "cuda_available": "cuda",
        "cuda_compiled": "cuda",
        "cuda_info": "cuda",
        "collect_stale_segments": "stale",
        "list_segments": "stale",
    },
)

__all__ = [
    "Arena",
    "AttachedSegments",
    "Slot",
    "SlotAddress",
    "SlotMapping",
    "SlotState",
    "collect_stale_segments",
    "CudaInfo",
    "cuda_available",
    "cuda_compiled",
    "cuda_info",
    "list_segments",
]
