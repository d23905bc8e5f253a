"""What a layout depends on, per tensor, read in bulk: the columns a reused plan compares.

`planner` reuses the last layout for a state dict whose tensors have the same signature (and
checks their flags while the copies run); `layout` records both for the next comparison.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

Signature = tuple[list[Any], ...]


# What `tensor_signature` and `tensor_flags` read of each tensor: getters that `map` calls in C,
# cheaper than attribute lookups in a comprehension, which matters at thousands of tensors.
_SIGNATURE_GETTERS = (
    operator.attrgetter("dtype"),
    operator.attrgetter("shape"),
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    operator.attrgetter("device"),
)
_FLAG_GETTERS = (
    operator.attrgetter("layout"),
    operator.attrgetter("requires_grad"),
    torch.Tensor.is_conj,
    torch.Tensor.is_neg,
)


def tensor_signature(tensors: list[torch.Tensor]) -> Signature:
    """What places each tensor in a slot, one column per attribute: class, dtype, shape, stride,
    storage offset and device. With these unchanged, the copy rows read inside each tensor's
    memory.

    Columns compare with one ``==`` each, in C. Raises whatever torch raises for a tensor without
    strides (sparse, nested): the caller treats that as a mismatch.
    """
    return (list(map(type, tensors)), *(list(map(get, tensors)) for get in _SIGNATURE_GETTERS))


def tensor_flags(tensors: list[torch.Tensor]) -> Signature:
    """The rest of what a layout depends on: layout, requires_grad and the lazy conj/neg bits."""
    return tuple(list(map(get, tensors)) for get in _FLAG_GETTERS)
