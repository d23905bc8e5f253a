"""Lay a nested state dict out in a slot: validation, grouping, offsets and the copies.

`plan()` walks dict/list/tuple containers, validates every tensor, groups tensors that share a
storage and assigns each storage one aligned block of the slot. The result is a `StagingPlan`: a
`Manifest` (structure, leaves, per-tensor dtype/shape/stride/offset) plus the copy rows that fill
the slot, alignment gaps between blocks included (zeroed, so no byte of an earlier stage survives
in the part of the slot a writer may read). Anything that cannot be staged raises
`UnsupportedValueError` naming its key path, before any byte is copied.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from typing import Any

import numpy as np
import torch

from .. import _torch_private, knobs
from ..errors import UnsupportedValueError
from .dtensors import Sharding, dtensor_type, shard_info
from .manifest import (
    DICT,
    LEAF,
    LIST,
    NAMED_TUPLE,
    PICKLED,
    REDUCED,
    TUPLE,
    Manifest,
    Pickled,
    contiguous_stride,
    dtype_name,
    format_path,
)

logger = logging.getLogger(__name__)

# Dtypes whose values only make sense with a quantizer: a plain tensor viewed as one cannot be
# restored faithfully.
_QUANTIZED_DTYPES = {
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
}
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Leaves that are immutable and so need no copy to be a snapshot.
_ATOMIC = (
    type(None), bool, int, float, complex, str, bytes, range, torch.dtype, torch.device,
    torch.Size, torch.layout, torch.memory_format, type,
)  # fmt: skip


@dataclasses.dataclass
class StagingPlan:
    """A manifest plus what fills the slot: byte copies and gathers of non-dense tensors.

    Offsets in `host` and `device` entries are relative to the slot start. The plan holds the
    source tensors, so their memory stays alive while the plan does. Together the entries write
    every byte of the slot's first ``manifest.size`` bytes exactly once: `host` holds one row per
    CPU block that is not gathered, followed by rows that copy zeros (from a buffer that lives as
    long as the process) into the alignment gaps between blocks, whatever the blocks' devices.
    """

    manifest: Manifest
    host: np.ndarray  # (n, 3) uint64: source address, offset in slot, nbytes (blocks, then gaps)
    device: dict[int, np.ndarray]  # CUDA device index -> (n, 3) entries as above
    gathers: list[tuple[int, torch.Tensor]]  # (tensor index, source) copied by torch
    sources: list[torch.Tensor]


class _Invalid(Exception):
    """Raised inside the walk; plan() turns it into UnsupportedValueError with the key path."""

    def __init__(self, obj: Any, reason: str) -> None:
        super().__init__(reason)
        self.obj = obj
        self.reason = reason


def _tensor_problem(t: torch.Tensor) -> str | None:
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        return (
            f"tensor subclass {cls.__module__}.{cls.__qualname__} cannot be staged; "
            "convert it to a plain tensor first"
        )
    if t.is_nested:
        return "nested (jagged) tensors cannot be staged"
    if t.layout is not torch.strided:
        return f"tensors with layout {t.layout} (sparse or opaque) cannot be staged"
    if t.is_quantized or t.dtype in _QUANTIZED_DTYPES:
        return "quantized tensors cannot be staged"
    if not (t.is_cpu or t.is_cuda):
        if t.is_meta:
            return "meta tensors have no data to stage"
        return f"tensors on device {t.device} cannot be staged (only cpu and cuda)"
    return None


class _Walker:
    """Builds the structure tree and collects distinct tensors (by identity) in visiting order.

    Raises _Invalid for the first value that cannot be staged; key paths are only worked out then,
    so the common case pays nothing for them.
    """

    def __init__(self, pickle_unsupported: bool = False) -> None:
        self.pickle_unsupported = pickle_unsupported
        self.pickled = 0
        self.tensors: list[torch.Tensor] = []
        self.index: dict[int, int] = {}
        # tensor index -> (the DTensor whose local shard it is, its ShardInfo)
        self.dtensors: dict[int, tuple[Any, Any]] = {}
        self.dtensor_type = dtensor_type()
        self.active: set[int] = set()
        self.memo: dict[int, Any] = {}

    def walk(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or isinstance(obj, torch.Tensor):
            i = self.index.get(id(obj))
            if i is None and cls is self.dtensor_type:
                return self._dtensor(obj)
            if i is None:
                problem = _tensor_problem(obj)
                if problem is not None:
                    if self.pickle_unsupported:
                        return self._pickled(obj, problem)
                    raise _Invalid(obj, problem)
                i = len(self.tensors)
                self.index[id(obj)] = i
                self.tensors.append(obj)
            return i
        if cls in _ATOMIC:
            return (LEAF, obj)
        if (
            isinstance(obj, (dict, list))
            or cls is tuple
            or (isinstance(obj, tuple) and hasattr(cls, "_fields"))
        ):
            return self._container(obj, cls)
        try:
            return (LEAF, copy.deepcopy(obj, self.memo))
        except Exception as exc:
            raise _Invalid(
                obj, f"value of type {cls.__qualname__} cannot be copied: {exc}"
            ) from exc

    def _dtensor(self, obj: Any) -> Any:
        # The local shard is staged like any tensor, as a row of its own (a plain appearance of
        # the same local tensor elsewhere gets another row; grouping by storage ties the bytes).
        local = _torch_private.local_tensor(obj)
        problem = _tensor_problem(local)
        if problem is not None:
            problem = f"the local shard of a DTensor: {problem}"
            if self.pickle_unsupported:
                return self._pickled(obj, problem)
            raise _Invalid(obj, problem)
        try:
            info = shard_info(obj)
        except UnsupportedValueError as exc:
            raise _Invalid(obj, exc.reason) from None
        i = len(self.tensors)
        self.index[id(obj)] = i
        self.tensors.append(local)
        self.dtensors[i] = (obj, info)
        return i

    def _pickled(self, obj: torch.Tensor, problem: str) -> tuple[Any, ...]:
        try:
            leaf = Pickled.snapshot(obj)
        except Exception as exc:
            raise _Invalid(
                obj, f"{problem}, and it cannot be pickled to travel beside the slot: {exc}"
            ) from exc
        self.pickled += 1
        return (PICKLED, leaf)

    def _container(self, obj: Any, cls: type) -> tuple[Any, ...]:
        key = id(obj)
        if key in self.active:
            raise _Invalid(obj, "the state dict contains a reference cycle")
        self.active.add(key)
        walk = self.walk
        try:
            if cls is dict:
                return (DICT, tuple(obj), tuple([walk(v) for v in obj.values()]))
            if cls is list:
                return (LIST, None, tuple([walk(v) for v in obj]))
            if cls is tuple:
                return (TUPLE, None, tuple([walk(v) for v in obj]))
            if isinstance(obj, tuple):
                return (NAMED_TUPLE, None, tuple([walk(v) for v in obj]), cls)
            return self._reduced(obj)
        finally:
            self.active.discard(key)

    def _reduced(self, obj: Any) -> tuple[Any, ...]:
        try:
            reduced = obj.__reduce_ex__(4)
        except Exception as exc:
            raise _Invalid(obj, f"{type(obj).__qualname__} cannot be reduced: {exc}") from exc
        if not isinstance(reduced, tuple) or len(reduced) < 2:
            raise _Invalid(obj, f"{type(obj).__qualname__} has an unsupported __reduce_ex__")
        func, args, state, listitems, dictitems = (*reduced, None, None, None)[:5]
        try:
            args, state = copy.deepcopy((args, state), self.memo)
        except Exception as exc:
            raise _Invalid(
                obj, f"the attributes of {type(obj).__qualname__} cannot be copied: {exc}"
            ) from exc
        if isinstance(obj, dict):
            items = list(dictitems) if dictitems is not None else []
            keys = tuple(k for k, _ in items)
            children = tuple([self.walk(v) for _, v in items])
        else:
            keys = None
            children = tuple([self.walk(v) for v in listitems]) if listitems is not None else ()
        return (REDUCED, keys, children, func, args, state)


def _find_path(
    obj: Any, target: Any, path: tuple[Any, ...], seen: set[int]
) -> tuple[Any, ...] | None:
    """Key path of the first occurrence of `target` (by identity) below `obj`."""
    if obj is target:
        return path
    if isinstance(obj, torch.Tensor) or id(obj) in seen:
        return None
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    seen.add(id(obj))
    for key, value in items:
        found = _find_path(value, target, (*path, key), seen)
        if found is not None:
            return found
    return None


def plan(state_dict: Any, *, pickle_unsupported: bool = False) -> StagingPlan:
    """Validate `state_dict` and lay it out; raises UnsupportedValueError before any copy.

    With pickle_unsupported, tensors a slot cannot hold (sparse, nested, quantized, meta,
    subclasses) become `Pickled` leaves (deep copies, carried beside the slot) instead.
    """
    walker = _Walker(pickle_unsupported)
    try:
        tree = walker.walk(state_dict)
    except _Invalid as bad:
        path = _find_path(state_dict, bad.obj, (), set())
        raise UnsupportedValueError(format_path(path or ()), bad.reason) from bad.__cause__
    if walker.pickled:
        logger.debug("%d value(s) the slot cannot hold travel pickled beside it", walker.pickled)
    tensors = walker.tensors
    n = len(tensors)
    align = knobs.alignment()

    # Attributes, one column at a time: a comprehension per attribute is the cheapest way to read
    # thousands of tensors from Python.
    dtypes = [t.dtype for t in tensors]
    dtype_codes = {dtype: code for code, dtype in enumerate(dict.fromkeys(dtypes))}
    code = np.fromiter([dtype_codes[d] for d in dtypes], dtype=np.int16, count=n)
    itemsize = (
        np.array([d.itemsize for d in dtype_codes], dtype=np.int64)[code]
        if n
        else np.zeros(0, np.int64)
    )
    shapes = [t.shape for t in tensors]
    strides = [t.stride() for t in tensors]
    numel = np.fromiter([t.numel() for t in tensors], dtype=np.int64, count=n)
    start = np.fromiter([t.storage_offset() for t in tensors], dtype=np.int64, count=n) * itemsize
    storage = np.fromiter(
        [t.untyped_storage().data_ptr() for t in tensors], dtype=np.uint64, count=n
    )
    device = np.fromiter([t.get_device() for t in tensors], dtype=np.int64, count=n)
    plain = np.fromiter(
        [t.is_contiguous() and not t.is_conj() and not t.is_neg() for t in tensors],
        dtype=bool,
        count=n,
    )
    Parameter = torch.nn.Parameter
    flags = np.fromiter(
        [(type(t) is Parameter) | (t.requires_grad << 1) for t in tensors], dtype=np.uint8, count=n
    )
    nbytes = numel * itemsize
    extent = nbytes.copy()  # bytes from element 0 to one past the last reachable byte
    gather = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(~plain & (numel > 0)).tolist():
        t = tensors[i]
        size = int(itemsize[i])
        extent[i] = size + sum(
            (d - 1) * s * size for d, s in zip(shapes[i], strides[i], strict=True)
        )
        # Gaps between elements, or a lazy conjugate/negation: copy the elements densely.
        gather[i] = extent[i] > nbytes[i] or t.is_conj() or t.is_neg()

    # Tensors sharing a storage (tied weights, views) are staged once, as one block spanning every
    # byte any of them reaches; gathered tensors get a block each. Blocks keep first-seen order.
    has_data = numel > 0
    group_key = storage.copy()
    group_key[gather] = np.uint64(1) << np.uint64(63) | np.flatnonzero(gather).astype(np.uint64)
    staged = np.flatnonzero(has_data)
    keys, first, inverse = np.unique(group_key[staged], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # group ids in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    group = rank[inverse.reshape(-1)]  # group (= block) id of each tensor in `staged`
    m = len(keys)
    # Blocks start 16-byte aligned within their storage, so members of different dtypes keep
    # their alignment relative to each other.
    lo = np.full(m, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(lo, group, start[staged])
    lo &= ~np.int64(15)
    hi = np.zeros(m, dtype=np.int64)
    np.maximum.at(hi, group, (start + extent)[staged])
    is_gather = gather[staged]
    first_member = staged[first[order]]
    lo[gather[first_member]] = start[first_member][gather[first_member]]
    block_bytes = np.where(gather[first_member], nbytes[first_member], hi - lo)
    padded = (block_bytes + align - 1) & ~np.int64(align - 1)
    block_offset = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
    size = int(block_offset[-1] + block_bytes[-1]) if m else 0

    offset = np.zeros(n, dtype=np.int64)
    block = np.full(n, -1, dtype=np.int64)
    block[staged] = group
    offset[staged] = np.where(
        is_gather, block_offset[group], block_offset[group] + start[staged] - lo[group]
    )

    flat_shapes = [d for shape in shapes for d in shape]
    flat_strides = [s for stride in strides for s in stride]
    ndim = np.fromiter([len(s) for s in shapes], dtype=np.int16, count=n)
    gathers = []
    if gather.any():
        positions = np.concatenate([[0], np.cumsum(ndim, dtype=np.int64)[:-1]]).tolist()
        for i in np.flatnonzero(gather).tolist():
            pos = positions[i]
            dense = contiguous_stride(tuple(shapes[i]))
            flat_strides[pos : pos + len(dense)] = dense
            gathers.append((i, tensors[i]))

    raw = ~gather[first_member]
    rows = (
        np.stack(
            [
                storage[first_member] + lo.astype(np.uint64),
                block_offset.astype(np.uint64),
                block_bytes.astype(np.uint64),
            ],
            axis=1,
        )[raw]
        if m
        else np.empty((0, 3), dtype=np.uint64)
    )
    block_device = device[first_member][raw]
    # Zero the alignment gap after every block but the last (whose padding lies past
    # manifest.size): the slot must not keep bytes of an earlier stage there, as they would reach
    # checkpoint files that mirror the slot. The gaps are host copies from a zero buffer whatever
    # the blocks' devices are.
    gaps = _gap_rows(block_offset, block_bytes, padded, align)
    host = np.concatenate([rows[block_device < 0], gaps])
    devices = {
        int(d): np.ascontiguousarray(rows[block_device == d])
        for d in np.unique(block_device[block_device >= 0])
    }

    manifest = Manifest(
        tree=tree,
        dtypes=tuple(dtype_name(d) for d in dtype_codes),
        dtype=code,
        ndim=ndim,
        shapes=np.array(flat_shapes, dtype=np.int64),
        strides=np.array(flat_strides, dtype=np.int64),
        offset=offset,
        nbytes=nbytes,
        block=block,
        flags=flags,
        blocks=np.stack([block_offset, block_bytes], axis=1) if m else np.empty((0, 2), np.int64),
        size=size,
        sharding=Sharding.of(walker.dtensors) if walker.dtensors else None,
    )
    return StagingPlan(
        manifest=manifest, host=host, device=devices, gathers=gathers, sources=tensors
    )


# Zero bytes that gap-filling host copies read from. A plan holds only the address, so buffers are
# never freed: a larger alignment adds a larger one and the older ones stay alive.
_ZERO_BUFFERS: list[np.ndarray] = []
_ZERO_LOCK = threading.Lock()
_ZERO_MIN_BYTES = 4096


def _zeros_address(nbytes: int) -> int:
    """Address of at least `nbytes` read-only zero bytes that live as long as the process."""
    with _ZERO_LOCK:
        if not _ZERO_BUFFERS or len(_ZERO_BUFFERS[-1]) < nbytes:
            zeros = np.zeros(max(nbytes, _ZERO_MIN_BYTES), dtype=np.uint8)
            zeros.flags.writeable = False
            _ZERO_BUFFERS.append(zeros)
        return int(_ZERO_BUFFERS[-1].ctypes.data)


def _gap_rows(
    block_offset: np.ndarray, block_bytes: np.ndarray, padded: np.ndarray, align: int
) -> np.ndarray:
    """Host copy rows (source, slot offset, nbytes) that zero the gaps between consecutive blocks.

    Each gap is shorter than `align` bytes; the one after the last block is left out.
    """
    gap = (padded - block_bytes)[:-1]
    has_gap = gap > 0
    count = int(np.count_nonzero(has_gap))
    out = np.empty((count, 3), dtype=np.uint64)
    if count:
        out[:, 0] = _zeros_address(align)
        out[:, 1] = (block_offset[:-1] + block_bytes[:-1])[has_gap]
        out[:, 2] = gap[has_gap]
    return out
