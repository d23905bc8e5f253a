"""The private parts of torch that pyshmckpt relies on, all in this one module.

Nothing else in the package touches an underscore name of torch or imports one of its private
modules. `REQUIRED` lists the private attributes the library cannot work without; `EXPERIMENTAL`
the classes of ``torch.distributed.checkpoint._experimental`` it uses where present (the stager
protocol, and torch's transport that ``pyshmckpt demo`` compares against).
tests/test_torch_private.py checks every one against the installed torch and names its version
when one is missing, so a torch upgrade that removes one fails loudly there, not deep in a save.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

#: (where, name): every private attribute used below.
REQUIRED: list[tuple[str, str]] = [
    ("torch.UntypedStorage", "_new_shared_fd_cpu"),
    ("torch._C", "_storage_Use_Count"),
    ("torch.UntypedStorage", "_cdata"),
]

EXPERIMENTAL_PACKAGE = "torch.distributed.checkpoint._experimental"
#: module of EXPERIMENTAL_PACKAGE -> the names used from it.
EXPERIMENTAL: dict[str, tuple[str, ...]] = {
    "staging": ("CheckpointStager", "CheckpointStagerConfig", "DefaultStager"),
    "checkpoint_process": ("CheckpointProcess", "CheckpointProcessConfig"),
    "checkpoint_writer": ("CheckpointWriter", "CheckpointWriterConfig"),
    "types": ("RankInfo",),
}


def shared_fd_storage(fd: int, nbytes: int) -> torch.UntypedStorage:
    """A CPU storage over `nbytes` of the shared-memory file `fd`, mapped by torch's own
    allocator: torch's multiprocessing pickler then sends it as this one descriptor."""
    new = torch.UntypedStorage._new_shared_fd_cpu  # type: ignore[attr-defined]
    return new(fd, nbytes)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many C++ references (tensors, storage objects) hold `storage`."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def experimental(module: str, name: str) -> Any:
    """`name` from ``torch.distributed.checkpoint._experimental.<module>``; raises ImportError
    (or AttributeError) where this torch has no such thing."""
    return getattr(importlib.import_module(f"{EXPERIMENTAL_PACKAGE}.{module}"), name)


def experimental_or_none(module: str, name: str) -> Any:
    """`experimental(module, name)`, or None where this torch lacks it."""
    try:
        return experimental(module, name)
    except (ImportError, AttributeError):
        return None


def resolve(where: str, name: str) -> Any:
    """The object `where.name` of REQUIRED; raises AttributeError or ImportError where torch
    lacks it."""
    try:
        owner: Any = importlib.import_module(where)
    except ImportError:
        module, _, attribute = where.rpartition(".")
        owner = getattr(importlib.import_module(module), attribute)
    if name == "_cdata":  # an attribute of every storage instance
        owner = owner(0)
    return getattr(owner, name)
