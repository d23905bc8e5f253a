"""The writer process's view of staged state dicts: zero-copy tensors (and NumPy arrays, for
the rows that were arrays) over a mapped slot.

Steady-state checkpoints have the same layout every time, so the tensors built for a slot are
kept and only the containers and leaves are rebuilt. Each block gets a storage of its own (a
zero-copy slice of the slot's), so torch.save of a tensor writes that block, not the whole slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..shm import SlotMapping
from .manifest import Manifest, build, make_tensors


class SlotViews:
    """Per slot (by name): the last full manifest received, and the tensors built for it."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[Manifest, list[Any] | None]] = {}

    def remember(self, slot: str, manifest: Manifest) -> None:
        """A full manifest arrived for `slot`: keep it (and drop views of another layout)."""
        cached = self._cache.get(slot)
        if cached is None or cached[0].layout_key != manifest.layout_key:
            self._cache[slot] = (manifest, None)

    def resolve(self, slot: str, tree: Any, layout_key: bytes) -> Manifest | None:
        """The manifest of a write sent by reference (same layout as the last full one for
        `slot`, new structure `tree`); None when this process holds no such layout."""
        cached = self._cache.get(slot)
        if cached is None or cached[0].layout_key != layout_key:
            return None
        return dataclasses.replace(cached[0], tree=tree)

    def rebuild(self, slot: SlotMapping, manifest: Manifest) -> Any:
        """The staged state dict of `manifest` with CPU tensors viewing `slot` (zero-copy)."""
        cached_manifest, tensors = self._cache[slot.name]
        if tensors is None:
            tensors = _tensors(slot, manifest)
            self._cache[slot.name] = (cached_manifest, tensors)
        return build(manifest.tree, tensors)

    def retain(self, names: set[str]) -> None:
        """Forget every slot not in `names` (their arena was retired)."""
        for name in set(self._cache) - names:
            del self._cache[name]


def _tensors(slot: SlotMapping, manifest: Manifest) -> list[Any]:
    import torch  # only a StateDictWriter's process gets here: a SlotWriter's never loads torch

    storage = None
    if len(manifest.blocks):  # (a buffer without bytes cannot be viewed)
        storage = torch.frombuffer(slot.memoryview(), dtype=torch.uint8).untyped_storage()
    return make_tensors(manifest, storage)
