"""A new trainer's side of the memory tier: taking over the checkpoint a writer holds for its root
and rank, so that the held segment becomes the new arena's first slot (no allocation, no copy)
and stays loadable until the first new save.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..shm import mapped
from ..shm.native import Segment
from . import records, restore

logger = logging.getLogger(__name__)


def claim(
    root: str | os.PathLike[str], rank: int, capacity_bytes: int | None, *, collective: bool
) -> tuple[dict[str, Any], Segment, int] | None:
    """Take the checkpoint held in memory for (root, rank) away from the writer that holds it,
    if its segment can serve as a slot of `capacity_bytes` (None: any) and no restored tensors
    map it (`shm.mapped`): (record, attached segment, a descriptor holding the lock that keeps
    readers from mapping it: close it once nothing may write it), or None. A writer still
    finishing its dead trainer's saves is waited for first (bounded, `restore.orphan_wait`;
    `collective`: other ranks wait meanwhile): what it will hold may be newer. The segment is
    attached before the record is claimed, so it is never unheld (and never collected as stale)
    on its way from the holder to the caller."""
    records.wait_for_holders(root, rank, restore.orphan_wait(collective))
    found = records.newest(root, rank)
    if found is None:
        return None
    path, record = found
    try:
        info = record["segment"]
        name, size, token = str(info["name"]), int(info["size"]), bytes.fromhex(info["token"])
    except (KeyError, TypeError, ValueError):
        return None
    if capacity_bytes is not None and size < capacity_bytes:
        return None  # too small a slot: left to its holder (still loadable, until it ends)
    try:
        segment = Segment.attach(name, size, token, map_pages=False)
    except (OSError, ValueError) as exc:
        logger.warning("cannot take over the checkpoint held in memory: %s", exc)
        return None
    guard = mapped.claim_for_writing(name)
    if guard is None:
        segment.close()
        logger.info(
            "the checkpoint held in memory for rank %d is mapped by restored tensors: it is not "
            "taken over as a slot (new slots are made; its memory lives as long as they do)", rank
        )  # fmt: skip
        return None
    claimed = records.claim(path)
    if claimed is None or claimed.get("segment", {}).get("name") != name:
        os.close(guard)
        segment.close()  # another trainer took it first (attached only: the name stays)
        return None
    return claimed, segment, guard
