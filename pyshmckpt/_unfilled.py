"""New tensors whose contents the caller overwrites (or that hold no elements), of any dtype."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

# The dtypes torch has no fill kernel for: with torch.use_deterministic_algorithms(True), which
# fills new memory, torch.empty (and Tensor.new) of these raise NotImplementedError.
_NO_FILL = frozenset(
    getattr(torch, name)
    for name in (
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "bits8",
        "bits16",
        "float4_e2m1fn_x2",
        *(f"uint{n}" for n in range(1, 8)),
        *(f"int{n}" for n in range(1, 8)),
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
)


def unfilled(shape: Sequence[int], dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, also for the dtypes that torch cannot
    fill in deterministic mode: their bytes are made as uint8 and viewed as `dtype`. The contents
    are undefined."""
    if dtype not in _NO_FILL:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    raw = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=device)
    return raw.view(dtype).view(tuple(shape))


def unfilled_strided(
    shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """``torch.empty_strided(shape, stride, dtype=dtype)`` on the CPU, as `unfilled` is to
    ``torch.empty``."""
    if dtype not in _NO_FILL:
        return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
    reach = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
    base = unfilled((reach,), dtype)
    return base.set_(base.untyped_storage(), 0, tuple(shape), tuple(stride))


def empty_maker(dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """A maker of new tensors of `dtype` without elements (to `set_` over a storage): the fast
    ``Tensor.new`` where torch can make them in any mode, else `unfilled`."""
    if dtype not in _NO_FILL:
        return torch.empty(0, dtype=dtype).new
    return functools.partial(unfilled, (0,), dtype)
