"""Staged tensors through torch's multiprocessing pickler: one descriptor per slot, no copy.

A staged tensor's storage is its block of the slot, a slice of the slot's storage (see
`staging.manifest.make_tensors`). torch's pickler (``torch.multiprocessing``, used by DCP's
process executor and torch's own CheckpointProcess) sends a storage that is not itself a shared
mapping by copying it into a new shared-memory file, one per block. This module registers a
reducer for storages with multiprocessing's ``ForkingPickler``, which stays torch's for every other
storage: a slice of a live slot travels as the slot's storage, which torch sends as one file
descriptor per message (and the receiver maps once and caches), plus the slice's bounds; the
receiver slices it again. Slots register their storage while they live (`register_slot`).

Only the ``file_descriptor`` sharing strategy (Linux's default) is served this way: under
``file_system`` torch's reducer would replace the slot storage's memory with a copy of its own,
under every slice of it, so a slice takes torch's reducer alone (a copy of the block).
"""

from __future__ import annotations

import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

_lock = threading.Lock()
# Data address of each live slot storage -> (its size in bytes, the storage).
_slots: dict[int, tuple[int, torch.UntypedStorage]] = {}
_installed = False


def register_slot(storage: torch.UntypedStorage) -> None:
    """Send slices of `storage` (a slot's, a shared mapping of torch's) by reference from now on."""
    global _installed
    with _lock:
        _slots[storage.data_ptr()] = (storage.nbytes(), storage)
        if not _installed:
            ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
            _installed = True


def unregister_slot(storage: torch.UntypedStorage) -> None:
    """`storage`'s slot is closing: its slices are pickled by torch alone (copied) from now on."""
    with _lock:
        _slots.pop(storage.data_ptr(), None)


def _slot_holding(storage: torch.UntypedStorage) -> tuple[torch.UntypedStorage, int] | None:
    """The registered slot storage `storage` is a strict part of, and its offset there."""
    address = storage.data_ptr()
    with _lock:
        for start, (size, whole) in _slots.items():
            if start <= address < start + size:
                if address == start and storage.nbytes() == size:
                    return None  # the slot's storage itself: torch's own
                return whole, address - start
    return None


def _reduce_storage(storage: torch.UntypedStorage) -> Any:
    found = None
    if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
        found = _slot_holding(storage)
    if found is None:
        return reductions.reduce_storage(storage)
    whole, offset = found
    return _slice, (whole, offset, storage.nbytes())


def _slice(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.UntypedStorage:
    """The receiver's end: bytes [offset, offset + nbytes) of the slot storage, shared."""
    return storage[offset : offset + nbytes]
