"""Where a slot lies: what crosses to the writer process so it can attach the slot (no torch)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SlotAddress:
    """What a process needs to attach a slot: segment name, data size and token, and where the
    slot's data starts in the mapping."""

    name: str
    size: int
    token: bytes
    offset: int
