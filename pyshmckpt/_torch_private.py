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
    ("torch._C", "StorageBase"),
    ("torch.UntypedStorage", "_cdata"),
    # DTensors: their local shard and spec, where a shard lies, and building one over a slot.
    ("torch.distributed.tensor.DTensor", "_local_tensor"),
    ("torch.distributed.tensor.DTensor", "_spec"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.Tensor", "_make_wrapper_subclass"),
]
# Set, not read: torch's mark of a tensor subclass instance that is an nn.Parameter.
PARAMETER_MARK = "_is_param"

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


def storage_slice(storage: torch.UntypedStorage, start: int, stop: int) -> torch.UntypedStorage:
    """``storage[start:stop]`` (a storage sharing those bytes and holding `storage`) by
    StorageBase's own slicing, without torch's Python wrapper around it (a third of the cost)."""
    getitem: Any = getattr(torch._C.StorageBase, "__getitem__")  # noqa: B009
    return getitem(storage, slice(start, stop))


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many C++ references (tensors, storage objects) hold `storage`."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def local_tensor(dtensor: Any) -> torch.Tensor:
    """The local shard of a DTensor, the very tensor (no autograd, no copy)."""
    return dtensor._local_tensor


def dtensor_spec(dtensor: Any) -> Any:
    """The DTensorSpec of a DTensor: its mesh, placements and global tensor metadata."""
    return dtensor._spec


def local_shape_and_global_offset(
    global_shape: Any, mesh: Any, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's shard of a DTensor and the global index of its first element."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def is_strided_shard(placement: Any) -> bool:
    """Whether a DTensor placement is a strided shard (FSDP2 over tensor parallelism)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def dtensor_over(dtensor_type: type, local: torch.Tensor, spec: Any) -> Any:
    """A DTensor over `local` (a view into a slot, at some storage offset) with `spec`.

    Built as a wrapper whose own storage offset is 0: torch's DTensor constructor copies the
    local tensor's offset onto the wrapper, whose data pointer is then not null, and pickling
    such a DTensor (as DCP's process executor does) takes it for a dense tensor and crashes
    sharing its empty storage (torch 2.13).
    """
    meta = spec.tensor_meta
    out: Any = torch.Tensor._make_wrapper_subclass(
        dtensor_type,
        meta.shape, strides=meta.stride, storage_offset=0, dtype=local.dtype,
        device=local.device, layout=local.layout, requires_grad=False,
    )  # fmt: skip
    out._spec = spec
    out._local_tensor = local
    return out


def mark_parameter(tensor: torch.Tensor) -> None:
    """Make `tensor` (a tensor subclass instance) an nn.Parameter in place, as nn.Parameter
    does for subclasses, without nn.Parameter's detach."""
    setattr(tensor, PARAMETER_MARK, True)


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
