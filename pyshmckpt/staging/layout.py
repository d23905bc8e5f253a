"""Lay a nested state dict out in a slot: validation, grouping, offsets and the copies.

`plan()` walks dict/list/tuple containers, validates every tensor, groups tensors that share a
storage and assigns each storage one aligned block of the slot. The result is a `StagingPlan`: a
`Manifest` (structure, leaves, per-tensor dtype/shape/stride/offset) plus the copy rows that fill
the slot, alignment gaps between blocks included (zeroed, so no byte of an earlier stage survives
in the part of the slot a writer may read). Anything that cannot be staged raises
`UnsupportedValueError` naming its key path, before any byte is copied.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import operator
import threading
from collections.abc import Callable, Iterator
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
    offsets_in_blocks,
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
    # A reused plan from Planner.plan(..., defer_flags=True): checks the tensors' flags (what a
    # copy does not need to read its sources safely), returning why a full plan is needed or None.
    recheck: Callable[[], str | None] | None = None


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
    with gc_paused():
        return _plan(state_dict, pickle_unsupported)[0]


def _plan(state_dict: Any, pickle_unsupported: bool) -> tuple[StagingPlan, _Template]:
    """A full plan, and what a Planner keeps to reuse its layout for the next state dict."""
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

    # Attributes, one column at a time (map() over getters is the cheapest way to read thousands
    # of tensors from Python); the columns a later state dict is matched against come first and
    # serve this plan too.
    signature = _signature(tensors)
    flag_columns = _flags(tensors)
    classes, dtypes, shapes, strides, storage_offsets, _ = signature
    _, requires_grad, conj, neg = flag_columns
    dtype_codes = {dtype: code for code, dtype in enumerate(dict.fromkeys(dtypes))}
    code = np.fromiter([dtype_codes[d] for d in dtypes], dtype=np.int16, count=n)
    itemsize = (
        np.array([d.itemsize for d in dtype_codes], dtype=np.int64)[code]
        if n
        else np.zeros(0, np.int64)
    )
    numel = np.fromiter(map(torch.Tensor.numel, tensors), dtype=np.int64, count=n)
    start = np.fromiter(storage_offsets, dtype=np.int64, count=n) * itemsize
    storage = np.fromiter(
        [t.untyped_storage().data_ptr() for t in tensors], dtype=np.uint64, count=n
    )
    device = np.fromiter(map(torch.Tensor.get_device, tensors), dtype=np.int64, count=n)
    lazy = np.fromiter(conj, dtype=bool, count=n) | np.fromiter(neg, dtype=bool, count=n)
    plain = np.fromiter(map(torch.Tensor.is_contiguous, tensors), dtype=bool, count=n) & ~lazy
    Parameter = torch.nn.Parameter
    flags = np.fromiter([c is Parameter for c in classes], dtype=np.uint8, count=n) | (
        np.fromiter(requires_grad, dtype=np.uint8, count=n) << 1
    )
    nbytes = numel * itemsize
    extent = nbytes.copy()  # bytes from element 0 to one past the last reachable byte
    gather = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(~plain & (numel > 0)).tolist():
        size = int(itemsize[i])
        extent[i] = size + sum(
            (d - 1) * s * size for d, s in zip(shapes[i], strides[i], strict=True)
        )
        # Gaps between elements, or a lazy conjugate/negation: copy the elements densely.
        gather[i] = extent[i] > nbytes[i] or lazy[i]

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
    view_strides = strides
    if gather.any():
        view_strides = list(strides)
        positions = np.concatenate([[0], np.cumsum(ndim, dtype=np.int64)[:-1]]).tolist()
        for i in np.flatnonzero(gather).tolist():
            pos = positions[i]
            dense = contiguous_stride(tuple(shapes[i]))
            flat_strides[pos : pos + len(dense)] = dense
            view_strides[i] = dense
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
        # (not np.unique, which imports numpy.ma on first use: 15 ms of a first save)
        for d in sorted(set(block_device[block_device >= 0].tolist()))
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
    # The manifest works these out from its columns when asked; from the lists at hand they cost
    # a tenth of that (a first save of 8,192 tensors builds its views from them).
    manifest.__dict__["view_args"] = (
        shapes,
        view_strides,
        code.tolist(),
        block.tolist(),
        offsets_in_blocks(offset, block, manifest.blocks).tolist(),
    )
    staging_plan = StagingPlan(
        manifest=manifest, host=host, device=devices, gathers=gathers, sources=tensors
    )
    # What a later state dict must match to reuse this layout, and how to refill the rows.
    member = staged[~is_gather]  # tensors copied as part of a block (not gathered)
    raw_blocks = np.flatnonzero(raw)
    template = _Template(
        manifest=manifest,
        signature=signature,
        flags=flag_columns,
        dtensors=frozenset(walker.dtensors),
        start=start.astype(np.uint64),
        member=member,
        member_block=np.searchsorted(raw_blocks, group[~is_gather]),
        block_first=first_member[raw],
        block_lo=lo[raw].astype(np.uint64),
        block_device=block_device,
        storage=storage[first_member[raw]],
        host=host,
        device=devices,
        gathers=np.flatnonzero(gather),
    )
    return staging_plan, template


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


# -- plan reuse ------------------------------------------------------------------------------------
#
# A training loop stages state dicts of one structure again and again. A Planner keeps the layout
# of the last one and checks the next against it: the same containers and keys, the same tensor
# objects pattern (which places hold one object), and for each tensor the same class, dtype,
# shape, stride, storage offset, device, layout, autograd flags and lazy conj/neg bits, the same
# storage-sharing pattern and (for DTensors) the same placements. Then offsets and manifest columns
# are the old ones; only the copy rows' source addresses, the leaves and the DTensor specs are
# new. Any difference falls back to a full plan.


@dataclasses.dataclass
class PlannerStats:
    """What a Planner did: full plans, plans reused, and why the last full plan was needed."""

    plans: int = 0
    reuses: int = 0
    last_replan: str | None = None  # None: no plan to reuse yet (or the last one was reused)


Signature = tuple[list[Any], ...]


# What `_signature` and `_flags` read of each tensor: getters that `map` calls in C, about half
# the cost of attribute lookups in a comprehension, which matters at thousands of tensors.
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


def _signature(tensors: list[torch.Tensor]) -> Signature:
    """What places each tensor in a slot, one column per attribute: class, dtype, shape, stride,
    storage offset and device. With these unchanged, the copy rows read inside each tensor's
    memory.

    Columns compare with one ``==`` each, in C. Raises whatever torch raises for a tensor without
    strides (sparse, nested): the caller treats that as a mismatch.
    """
    return (list(map(type, tensors)), *(list(map(get, tensors)) for get in _SIGNATURE_GETTERS))


def _flags(tensors: list[torch.Tensor]) -> Signature:
    """The rest of what a layout depends on: layout, requires_grad and the lazy conj/neg bits."""
    return tuple(list(map(get, tensors)) for get in _FLAG_GETTERS)


@dataclasses.dataclass
class _Template:
    """A full plan less its tensors (a Planner must not keep training memory alive), with what
    refills its copy rows for other tensors of the same layout."""

    manifest: Manifest
    signature: Signature
    flags: Signature
    dtensors: frozenset[int]  # indices of tensors that are DTensors' local shards
    start: np.ndarray  # (n,) uint64: byte offset of element 0 in its storage
    member: np.ndarray  # tensors copied as part of a block (staged, not gathered)
    member_block: np.ndarray  # the block of each, as an index into the block_* arrays
    block_first: np.ndarray  # per block copied by rows: the tensor whose storage it copies
    block_lo: np.ndarray  # uint64: where the block starts in that storage
    block_device: np.ndarray  # -1 (host) or the CUDA device index
    storage: np.ndarray  # uint64: storage address of each block in the last plan
    host: np.ndarray  # the last plan's host rows (blocks on the host, then gap rows)
    device: dict[int, np.ndarray]
    gathers: np.ndarray  # indices of gathered tensors
    runs: dict[int, int] | None = None  # see tensor_runs; made by the first reuse

    def tensor_runs(self) -> dict[int, int]:
        """The containers whose children are all plain tensors numbered start, start + 1, ...,
        each appearing nowhere else (by id of the tree node, which the template keeps alive):
        the first index of each. The matcher takes such children in one slice."""
        if self.runs is None:
            counts: dict[int, int] = {}
            containers: list[tuple[Any, ...]] = []
            _count_tensors(self.manifest.tree, counts, containers)
            runs = {}
            for node in containers:
                children = node[2]
                if not children or any(type(c) is not int for c in children):
                    continue
                start = children[0]
                if children == tuple(range(start, start + len(children))) and all(
                    counts[c] == 1 and c not in self.dtensors for c in children
                ):
                    runs[id(node)] = start
            self.runs = runs
        return self.runs

    def rows(self, storage: np.ndarray) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Fresh host and device rows reading the blocks from `storage` (per block)."""
        if np.array_equal(storage, self.storage):
            return self.host, self.device  # never written to once made: safe to share
        source = storage + self.block_lo
        host = self.host.copy()
        on_host = self.block_device < 0
        host[: int(np.count_nonzero(on_host)), 0] = source[on_host]
        device = {}
        for d, old in self.device.items():
            rows = old.copy()
            rows[:, 0] = source[self.block_device == d]
            device[d] = rows
        return host, device


def _count_tensors(node: Any, counts: dict[int, int], containers: list[tuple[Any, ...]]) -> None:
    """How often each tensor index occurs under `node`, and its container nodes."""
    if type(node) is int:
        counts[node] = counts.get(node, 0) + 1
        return
    if node[0] in (LEAF, PICKLED):
        return
    containers.append(node)
    for child in node[2]:
        _count_tensors(child, counts, containers)


_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


class _Mismatch(Exception):
    """The state dict differs from the template's; the reason goes to PlannerStats."""


class _Matcher:
    """Walks a state dict along a template's tree: collects its tensors in tree order, takes fresh
    copies of the leaves and raises _Mismatch at the first structural difference."""

    def __init__(self, count: int, dtensors: frozenset[int], runs: dict[int, int]) -> None:
        self.seen: list[Any] = [None] * count  # tensor index -> the object found there
        self.tensors: list[Any] = [None] * count  # the tensor to copy (a DTensor's local shard)
        self.dtensors = dtensors
        self.runs = runs  # see _Template.tensor_runs
        self.found: dict[int, tuple[Any, Any]] = {}  # index -> (DTensor, ShardInfo)
        self.memo: dict[int, Any] = {}

    def match(self, obj: Any, node: Any) -> Any:
        if type(node) is int:
            self._tensor(obj, node)
            return node
        kind = node[0]
        cls = type(obj)
        if kind == DICT:
            keys = node[1]
            if (
                cls is not dict
                or len(obj) != len(keys)
                or tuple(obj) != keys
                or any(type(a) is not type(b) for a, b in zip(obj, keys, strict=True))
            ):  # (1 == True == 1.0: the types too)
                raise _Mismatch("a dict's keys changed")
            return self._children(obj.values(), node)
        if kind == LIST or kind == TUPLE:
            if cls is not (list if kind == LIST else tuple) or len(obj) != len(node[2]):
                raise _Mismatch("a list or tuple changed type or length")
            return self._children(obj, node)
        if kind == NAMED_TUPLE:
            if cls is not node[3] or len(obj) != len(node[2]):
                raise _Mismatch("a named tuple changed type or length")
            return self._children(obj, node)
        if kind == LEAF:
            return self._leaf(obj, node)
        if kind == REDUCED:
            return self._reduced(obj, node)
        return self._pickled(obj)

    def _children(self, values: Any, node: tuple[Any, ...]) -> tuple[Any, ...]:
        children = node[2]
        start = self.runs.get(id(node))
        if start is not None:  # plain tensors only, in one slice (else: the loop names the change)
            objs = list(values)
            if len(objs) == len(children) and _PLAIN_TENSORS.issuperset(map(type, objs)):
                stop = start + len(objs)
                self.seen[start:stop] = objs
                self.tensors[start:stop] = objs
                return node
        out = None
        match = self.match
        for i, (value, child) in enumerate(zip(values, children, strict=True)):
            if type(child) is int:
                self._tensor(value, child)
                continue
            new = match(value, child)
            if new is not child:
                if out is None:
                    out = list(children)
                out[i] = new
        if out is None:
            return node  # only tensors and unchanged atoms below: the old node serves
        return (*node[:2], tuple(out), *node[3:])

    def _tensor(self, obj: Any, index: int) -> None:
        seen = self.seen[index]
        if seen is not None:
            if seen is not obj:
                raise _Mismatch("a tensor appearing twice is now two tensors")
            return
        cls = type(obj)
        if index in self.dtensors:
            if cls is not dtensor_type():
                raise _Mismatch("a DTensor is now something else")
            try:
                info = shard_info(obj)
            except UnsupportedValueError:
                raise _Mismatch("a DTensor's shard cannot be described") from None
            self.found[index] = (obj, info)
            self.tensors[index] = _torch_private.local_tensor(obj)
        elif cls is torch.Tensor or cls is torch.nn.Parameter:
            self.tensors[index] = obj
        else:
            raise _Mismatch("a tensor is now something else")
        self.seen[index] = obj

    def _leaf(self, obj: Any, node: tuple[Any, ...]) -> tuple[Any, ...]:
        cls = type(obj)
        if cls in _ATOMIC:
            # Only the same object: equal is not enough (0.0 == -0.0, 1 == True).
            return node if node[1] is obj else (LEAF, obj)
        if isinstance(obj, (torch.Tensor, dict, list, tuple)):
            raise _Mismatch("a leaf is now a tensor or a container")
        try:
            return (LEAF, copy.deepcopy(obj, self.memo))
        except Exception as exc:
            raise _Mismatch(f"a leaf cannot be copied: {exc!r}") from None

    def _reduced(self, obj: Any, node: tuple[Any, ...]) -> tuple[Any, ...]:
        _, keys, children, func = node[:4]
        cls = type(obj)
        if (
            cls is dict
            or cls is list
            or not isinstance(obj, (dict, list))
            or isinstance(obj, dict) != (keys is not None)
        ):
            raise _Mismatch("a container changed type")
        try:
            reduced = obj.__reduce_ex__(4)
            func_now, args, state, listitems, dictitems = (*reduced, None, None, None)[:5]
            if func_now is not func:
                raise _Mismatch("a container changed type")
            args, state = copy.deepcopy((args, state), self.memo)
            if keys is not None:
                items = list(dictitems) if dictitems is not None else []
                if len(items) != len(keys) or tuple([k for k, _ in items]) != keys:
                    raise _Mismatch("a dict's keys changed")
                values: list[Any] = [v for _, v in items]
            else:
                values = list(listitems) if listitems is not None else []
                if len(values) != len(children):
                    raise _Mismatch("a list changed length")
        except _Mismatch:
            raise
        except Exception as exc:
            raise _Mismatch(f"a container cannot be reduced: {exc!r}") from None
        new = self._children(values, node)
        return (REDUCED, keys, new[2], func, args, state)

    def _pickled(self, obj: Any) -> tuple[Any, ...]:
        if not isinstance(obj, torch.Tensor) or type(obj) is dtensor_type():
            raise _Mismatch("a pickled value changed kind")
        problem = _tensor_problem(obj)
        if problem is None:
            raise _Mismatch("a tensor that travelled pickled can now be staged")
        try:
            return (PICKLED, Pickled.snapshot(obj))
        except Exception as exc:
            raise _Mismatch(f"a tensor cannot be pickled: {exc!r}") from None


_GC_LOCK = threading.Lock()
_GC_PAUSES = [0, False]  # pauses in progress, whether automatic collection was on at the first


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector's automatic runs (not gc.collect()) for a stretch that
    allocates thousands of small objects that refcounting frees: otherwise each stage triggers
    full collections, whose cost grows with every object of the process, not with the state
    dict. Nests and works across threads; the collector is re-enabled after the last pause only
    if it was enabled before the first."""
    with _GC_LOCK:
        if _GC_PAUSES[0] == 0:
            _GC_PAUSES[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSES[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES[0] -= 1
            if _GC_PAUSES[0] == 0 and _GC_PAUSES[1]:
                gc.enable()


class Planner:
    """Plans state dicts like `plan()`, reusing the layout of the last one when the next has the
    same structure (see the notes above `PlannerStats`); `stats` says how often it did.

    The cached layout holds no tensor, so it keeps no training memory alive. Thread-safe.
    """

    def __init__(self, *, pickle_unsupported: bool = False, reuse: bool = True) -> None:
        self.pickle_unsupported = pickle_unsupported
        self.reuse = reuse
        self.stats = PlannerStats()
        self._template: _Template | None = None
        self._lock = threading.Lock()

    def plan(self, state_dict: Any, *, defer_flags: bool = False) -> StagingPlan:
        """A StagingPlan for `state_dict`; raises UnsupportedValueError as `plan()` does.

        With `defer_flags`, a reused plan is returned once everything its copies read by is
        checked, and its ``recheck`` checks the rest (the tensors' flags): the caller starts the
        copies, calls it meanwhile, and on a reason abandons them and calls `replan`.
        """
        with self._lock, gc_paused():
            template = self._template
            if template is not None and self.reuse:
                try:
                    reused = _reuse(template, state_dict, defer_flags)
                except _Mismatch as exc:
                    self.stats.last_replan = str(exc)
                else:
                    self.stats.reuses += 1
                    self.stats.last_replan = None
                    return reused
            return self._full_plan(state_dict)

    def replan(self, state_dict: Any, stale: StagingPlan, reason: str) -> StagingPlan:
        """A full plan of `state_dict`, whose plan `stale` was abandoned for `reason` (its
        recheck's, when it was a reused plan: that reuse is then taken back)."""
        with self._lock, gc_paused():
            if stale.recheck is not None:  # a reused plan with its flags deferred
                self.stats.reuses -= 1  # counted when it was handed out
            self.stats.last_replan = reason
            return self._full_plan(state_dict)

    def _full_plan(self, state_dict: Any) -> StagingPlan:
        self._template = None  # a state dict that fails to plan leaves nothing to reuse
        staging_plan, self._template = _plan(state_dict, self.pickle_unsupported)
        self.stats.plans += 1
        return staging_plan

    def forget(self) -> None:
        """Drop the cached layout: the next state dict is planned in full."""
        with self._lock:
            self._template = None


def _reuse(template: _Template, state_dict: Any, defer_flags: bool = False) -> StagingPlan:
    """`template`'s layout with `state_dict`'s tensors and leaves; _Mismatch if it differs (or,
    with `defer_flags`, if it differs in more than flags: the plan's recheck looks at those)."""
    manifest = template.manifest
    n = len(manifest)
    matcher = _Matcher(n, template.dtensors, template.tensor_runs())
    tree = matcher.match(state_dict, manifest.tree)
    tensors = matcher.tensors
    if n and len(set(map(id, matcher.seen))) != n:
        raise _Mismatch("two tensors are now one object")
    try:
        signature = _signature(tensors)
    except Exception as exc:  # no strides: sparse, nested and the like
        raise _Mismatch(f"a tensor has no strided layout: {exc!r}") from None
    if signature != template.signature:
        raise _Mismatch("a tensor's class, dtype, shape, stride, offset or device changed")

    def recheck() -> str | None:
        if _flags(tensors) != template.flags:
            return "a tensor's layout, requires_grad or lazy conj/neg bit changed"
        return None

    if not defer_flags and (reason := recheck()) is not None:
        raise _Mismatch(reason)
    sharding = None
    if template.dtensors:
        sharding = Sharding.of(matcher.found)
        if manifest.sharding is None or sharding.digest() != manifest.sharding.digest():
            raise _Mismatch("a DTensor's placement changed")
    # Storage addresses, element 0 less its offset (cheaper than untyped_storage()). Tensors that
    # shared a storage must still share one, and no two blocks may now share one.
    pointers = np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.uint64, count=n)
    storage = pointers - template.start
    block_storage = storage[template.block_first]
    if not np.array_equal(storage[template.member], block_storage[template.member_block]):
        raise _Mismatch("tensors that shared a storage no longer do")
    # Blocks at the addresses of the last plan are distinct as they were then.
    if not np.array_equal(block_storage, template.storage):
        ordered = np.sort(block_storage)
        if (ordered[1:] == ordered[:-1]).any():
            raise _Mismatch("tensors that did not share a storage now do")
    host, device = template.rows(block_storage)
    template.storage, template.host, template.device = block_storage, host, device
    gathers = [(i, tensors[i]) for i in template.gathers.tolist()]
    replanned = manifest.with_tree(tree, sharding)
    return StagingPlan(
        manifest=replanned,
        host=host,
        device=device,
        gathers=gathers,
        sources=tensors,
        recheck=recheck if defer_flags else None,
    )
