"""Lay a nested state dict out in a slot: validation, grouping, offsets and the copies.

`plan()` walks dict/list/tuple containers, validates every tensor (NumPy and CuPy arrays are
staged as the tensors that view them, see `arrays`), groups tensors that share a
storage and assigns each storage one aligned block of the slot (`planner` reuses a layout for
the next state dict of the same structure). The result is a `StagingPlan`: a
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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import _torch_private, knobs
from .._gc import gc_paused
from ..errors import CudaUnavailableError, UnsupportedValueError
from ..shm import cuda
from .arrays import ArrayTensors, array_flag, numpy_problem
from .dtensors import Sharding, loaded_dtensor_type, shard_info
from .manifest import (
    DICT,
    LEAF,
    LIST,
    NAMED_TUPLE,
    NUMPY,
    PICKLED,
    REDUCED,
    TUPLE,
    Container,
    Leaf,
    Manifest,
    Pickled,
    contiguous_stride,
    dtype_name,
    format_path,
    offsets_in_blocks,
)
from .signatures import Signature, tensor_flags, tensor_signature

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
ATOMIC = (
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
    """Raised inside the walk; plan() turns it into `error` (UnsupportedValueError or a subclass)
    with the key path."""

    def __init__(
        self, obj: Any, reason: str, error: type[UnsupportedValueError] = UnsupportedValueError
    ) -> None:
        super().__init__(reason)
        self.obj = obj
        self.reason = reason
        self.error = error


def tensor_problem(t: torch.Tensor) -> str | None:
    """Why `t` cannot be staged in a slot, or None."""
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
        self.dtensor_type = loaded_dtensor_type()
        self.array_tensors = ArrayTensors()
        self.array_flags: dict[int, int] = {}  # tensor index -> NUMPY or CUPY: it was an array
        self.active: set[int] = set()
        self.memo: dict[int, Any] = {}
        self.cuda_checked = False

    def _check_cuda(self, obj: torch.Tensor) -> None:
        """CudaUnavailableError (through _Invalid) when the device copies a CUDA tensor needs
        cannot run here: torch may see a device that pyshmckpt's driver cannot use."""
        reason = cuda.unavailable_reason()
        if reason is not None:
            raise _Invalid(
                obj, f"a CUDA tensor needs CUDA to be staged: {reason}", CudaUnavailableError
            )
        self.cuda_checked = True

    def walk(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or isinstance(obj, torch.Tensor):
            i = self.index.get(id(obj))
            if i is None and cls is self.dtensor_type:
                return self._dtensor(obj)
            if i is None:
                problem = tensor_problem(obj)
                if problem is not None:
                    if self.pickle_unsupported:
                        return self._pickled(obj, problem)
                    raise _Invalid(obj, problem)
                if obj.is_cuda and not self.cuda_checked:
                    self._check_cuda(obj)
                i = len(self.tensors)
                self.index[id(obj)] = i
                self.tensors.append(obj)
            return i
        if cls in ATOMIC:
            return Leaf(LEAF, obj)
        if (
            isinstance(obj, (dict, list))
            or cls is tuple
            or (isinstance(obj, tuple) and hasattr(cls, "_fields"))
        ):
            return self._container(obj, cls)
        flag = array_flag(obj)
        if flag:
            return self._array(obj, flag)
        try:
            return Leaf(LEAF, copy.deepcopy(obj, self.memo))
        except Exception as exc:
            raise _Invalid(
                obj, f"value of type {cls.__qualname__} cannot be copied: {exc}"
            ) from exc

    def _dtensor(self, obj: Any) -> Any:
        # The local shard is staged like any tensor, as a row of its own (a plain appearance of
        # the same local tensor elsewhere gets another row; grouping by storage ties the bytes).
        local = _torch_private.local_tensor(obj)
        problem = tensor_problem(local)
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

    def _array(self, obj: Any, flag: int) -> Any:
        """A NumPy or CUDA array, as the tensor that views it (a row flagged `flag`)."""
        i = self.index.get(id(obj))
        if i is not None:
            return i
        try:
            if flag == NUMPY:
                problem = numpy_problem(obj)
                if problem is not None:
                    raise UnsupportedValueError("an array", problem)
                tensor = self.array_tensors.numpy(obj)
            else:
                tensor = self.array_tensors.device(obj)
        except UnsupportedValueError as exc:
            if self.pickle_unsupported:
                return self._pickled(obj, exc.reason)
            raise _Invalid(obj, exc.reason, type(exc)) from exc.__cause__
        i = len(self.tensors)
        self.index[id(obj)] = i
        self.tensors.append(tensor)
        self.array_flags[i] = flag
        return i

    def _pickled(self, obj: Any, problem: str) -> Leaf:
        try:
            leaf = Pickled.snapshot(obj)
        except Exception as exc:
            raise _Invalid(
                obj, f"{problem}, and it cannot be pickled to travel beside the slot: {exc}"
            ) from exc
        self.pickled += 1
        return Leaf(PICKLED, leaf)

    def _container(self, obj: Any, cls: type) -> Container:
        key = id(obj)
        if key in self.active:
            raise _Invalid(obj, "the state dict contains a reference cycle")
        self.active.add(key)
        walk = self.walk
        try:
            if cls is dict:
                return Container(DICT, tuple(obj), tuple([walk(v) for v in obj.values()]))
            if cls is list:
                return Container(LIST, None, tuple([walk(v) for v in obj]))
            if cls is tuple:
                return Container(TUPLE, None, tuple([walk(v) for v in obj]))
            if isinstance(obj, tuple):
                return Container(NAMED_TUPLE, None, tuple([walk(v) for v in obj]), cls)
            return self._reduced(obj)
        finally:
            self.active.discard(key)

    def _reduced(self, obj: Any) -> Container:
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
        return Container(REDUCED, keys, children, func, args, state)


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
    subclasses) and arrays torch cannot view become `Pickled` leaves (deep copies, carried
    beside the slot) instead.
    """
    with gc_paused():
        return lay_out(state_dict, pickle_unsupported)[0]


def lay_out(state_dict: Any, pickle_unsupported: bool) -> tuple[StagingPlan, BlockMap]:
    """A full plan, and the map of its blocks a Planner keeps to reuse the layout."""
    tree, walker = _walk(state_dict, pickle_unsupported)
    tensors = walker.tensors
    columns = _Columns.of(tensors)
    if walker.array_flags:
        columns.flags[list(walker.array_flags)] |= np.fromiter(
            walker.array_flags.values(), dtype=np.uint8, count=len(walker.array_flags)
        )
    blocks = _Blocks.of(columns, knobs.alignment())
    view_strides, flat_strides, gathers = _dense_strides(columns, blocks.gather, tensors)
    host, devices = _copy_rows(columns, blocks)
    shapes = columns.shapes
    manifest = Manifest(
        tree=tree,
        dtypes=tuple(dtype_name(d) for d in columns.dtypes),
        dtype=columns.code,
        ndim=columns.ndim,
        shapes=np.array([d for shape in shapes for d in shape], dtype=np.int64),
        strides=np.array(flat_strides, dtype=np.int64),
        offset=blocks.offset,
        nbytes=columns.nbytes,
        block=blocks.block,
        flags=columns.flags,
        blocks=blocks.table(),
        size=blocks.size,
        sharding=Sharding.of(walker.dtensors) if walker.dtensors else None,
    )
    # The manifest works these out from its columns when asked; from the lists at hand they cost
    # far less (a first save of thousands of tensors builds its views from them).
    manifest.__dict__["view_args"] = (
        shapes,
        view_strides,
        columns.code.tolist(),
        blocks.block.tolist(),
        offsets_in_blocks(blocks.offset, blocks.block, manifest.blocks).tolist(),
    )
    staging_plan = StagingPlan(
        manifest=manifest, host=host, device=devices, gathers=gathers, sources=tensors
    )
    return staging_plan, BlockMap.of(columns, blocks, walker.dtensors, host, devices)


def _walk(state_dict: Any, pickle_unsupported: bool) -> tuple[Any, _Walker]:
    """The structure tree and the distinct tensors; UnsupportedValueError naming the key path of
    the first value that cannot be staged."""
    walker = _Walker(pickle_unsupported)
    try:
        tree = walker.walk(state_dict)
    except _Invalid as bad:
        path = _find_path(state_dict, bad.obj, (), set())
        raise bad.error(format_path(path or ()), bad.reason) from bad.__cause__
    if walker.pickled:
        logger.debug("%d value(s) the slot cannot hold travel pickled beside it", walker.pickled)
    return tree, walker


@dataclasses.dataclass
class _Columns:
    """What the layout reads of each tensor, one numpy column per attribute (tensor i is row i)."""

    signature: Signature  # see tensor_signature
    flag_columns: Signature  # see tensor_flags
    shapes: list[Any]
    strides: list[Any]
    dtypes: dict[torch.dtype, int]  # the distinct dtypes, in order, with their codes
    code: np.ndarray  # int16: dtype code
    ndim: np.ndarray  # int16
    itemsize: np.ndarray  # int64
    numel: np.ndarray  # int64
    nbytes: np.ndarray  # int64: numel * itemsize
    start: np.ndarray  # int64: byte offset of element 0 in its storage
    storage: np.ndarray  # uint64: storage address
    device: np.ndarray  # int64: -1 (host) or the CUDA device index
    lazy: np.ndarray  # bool: a lazy conjugate or negation
    dense: np.ndarray  # bool: contiguous and not lazy
    flags: np.ndarray  # uint8: PARAMETER | REQUIRES_GRAD (lay_out adds NUMPY | CUPY)

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> _Columns:
        # One column at a time (map() over getters is the cheapest way to read thousands of
        # tensors from Python); the columns a later state dict is matched against come first and
        # serve this plan too.
        n = len(tensors)
        signature = tensor_signature(tensors)
        flag_columns = tensor_flags(tensors)
        classes, dtypes, shapes, strides, storage_offsets, _ = signature
        _, requires_grad, conj, neg = flag_columns
        codes = {dtype: code for code, dtype in enumerate(dict.fromkeys(dtypes))}
        code = np.fromiter([codes[d] for d in dtypes], dtype=np.int16, count=n)
        itemsize = (
            np.array([d.itemsize for d in codes], dtype=np.int64)[code]
            if n
            else np.zeros(0, np.int64)
        )
        numel = np.fromiter(map(torch.Tensor.numel, tensors), dtype=np.int64, count=n)
        lazy = np.fromiter(conj, dtype=bool, count=n) | np.fromiter(neg, dtype=bool, count=n)
        contiguous = np.fromiter(map(torch.Tensor.is_contiguous, tensors), dtype=bool, count=n)
        Parameter = torch.nn.Parameter
        flags = np.fromiter([c is Parameter for c in classes], dtype=np.uint8, count=n) | (
            np.fromiter(requires_grad, dtype=np.uint8, count=n) << 1
        )
        return cls(
            signature=signature,
            flag_columns=flag_columns,
            shapes=shapes,
            strides=strides,
            dtypes=codes,
            code=code,
            ndim=np.fromiter([len(s) for s in shapes], dtype=np.int16, count=n),
            itemsize=itemsize,
            numel=numel,
            nbytes=numel * itemsize,
            start=np.fromiter(storage_offsets, dtype=np.int64, count=n) * itemsize,
            storage=np.fromiter(
                [t.untyped_storage().data_ptr() for t in tensors], dtype=np.uint64, count=n
            ),
            device=np.fromiter(map(torch.Tensor.get_device, tensors), dtype=np.int64, count=n),
            lazy=lazy,
            dense=contiguous & ~lazy,
            flags=flags,
        )

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Per tensor: the bytes from element 0 to one past the last byte it reaches, and
        whether it is gathered (copied element by element into a dense block of its own: gaps
        between its elements, or a lazy conjugate or negation)."""
        extent = self.nbytes.copy()
        gather = np.zeros(len(extent), dtype=bool)
        for i in np.flatnonzero(~self.dense & (self.numel > 0)).tolist():
            size = int(self.itemsize[i])
            extent[i] = size + sum(
                (d - 1) * s * size for d, s in zip(self.shapes[i], self.strides[i], strict=True)
            )
            gather[i] = extent[i] > self.nbytes[i] or self.lazy[i]
        return extent, gather


@dataclasses.dataclass
class _Blocks:
    """The slot's blocks: tensors sharing a storage (tied weights, views) are staged once, as one
    block spanning every byte any of them reaches; a gathered tensor gets a block of its own.
    Blocks keep first-seen order and start aligned in the slot."""

    gather: np.ndarray  # per tensor: gathered
    staged: np.ndarray  # indices of the tensors with data (the others have no block)
    group: np.ndarray  # the block of each tensor in `staged`
    first_member: np.ndarray  # per block: the tensor that opened it
    lo: np.ndarray  # per block: where it starts in its storage (16-byte aligned)
    block_bytes: np.ndarray
    block_offset: np.ndarray  # per block: where it starts in the slot
    padded: np.ndarray  # block_bytes rounded up to the alignment
    offset: np.ndarray  # per tensor: bytes from the slot start to element 0 of its view
    block: np.ndarray  # per tensor: its block, -1 without data
    size: int  # bytes of the slot in use
    align: int

    @classmethod
    def of(cls, columns: _Columns, align: int) -> _Blocks:
        start = columns.start
        extent, gather = columns.extents()
        n = len(start)
        group_key = columns.storage.copy()
        group_key[gather] = np.uint64(1) << np.uint64(63) | np.flatnonzero(gather).astype(np.uint64)
        staged = np.flatnonzero(columns.numel > 0)
        keys, first, inverse = np.unique(group_key[staged], return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # group ids in order of first appearance
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        group = rank[inverse.reshape(-1)]
        m = len(keys)
        # Blocks start 16-byte aligned within their storage, so members of different dtypes keep
        # their alignment relative to each other; a gathered block starts at its element 0.
        lo = np.full(m, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(lo, group, start[staged])
        lo &= ~np.int64(15)
        hi = np.zeros(m, dtype=np.int64)
        np.maximum.at(hi, group, (start + extent)[staged])
        first_member = staged[first[order]]
        gathered = gather[first_member]
        lo[gathered] = start[first_member][gathered]
        block_bytes = np.where(gathered, columns.nbytes[first_member], hi - lo)
        padded = (block_bytes + align - 1) & ~np.int64(align - 1)
        block_offset = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
        offset = np.zeros(n, dtype=np.int64)
        block = np.full(n, -1, dtype=np.int64)
        block[staged] = group
        offset[staged] = np.where(
            gather[staged], block_offset[group], block_offset[group] + start[staged] - lo[group]
        )
        return cls(
            gather=gather,
            staged=staged,
            group=group,
            first_member=first_member,
            lo=lo,
            block_bytes=block_bytes,
            block_offset=block_offset,
            padded=padded,
            offset=offset,
            block=block,
            size=int(block_offset[-1] + block_bytes[-1]) if m else 0,
            align=align,
        )

    def table(self) -> np.ndarray:
        """The manifest's (m, 2) table: offset in the slot and bytes of each block."""
        if not len(self.block_bytes):
            return np.empty((0, 2), np.int64)
        return np.stack([self.block_offset, self.block_bytes], axis=1)

    @property
    def copied(self) -> np.ndarray:
        """Per block: whether it is copied by bytes (a row), not gathered by torch."""
        return ~self.gather[self.first_member]


def _dense_strides(
    columns: _Columns, gather: np.ndarray, tensors: list[torch.Tensor]
) -> tuple[list[Any], list[int], list[tuple[int, torch.Tensor]]]:
    """The strides the staged views have (a gathered tensor's are dense), per tensor and
    concatenated, and the gathers: (tensor index, source) for torch to copy."""
    flat_strides = [s for stride in columns.strides for s in stride]
    if not gather.any():
        return columns.strides, flat_strides, []
    view_strides = list(columns.strides)
    positions = np.concatenate([[0], np.cumsum(columns.ndim, dtype=np.int64)[:-1]]).tolist()
    gathers = []
    for i in np.flatnonzero(gather).tolist():
        pos = positions[i]
        dense = contiguous_stride(tuple(columns.shapes[i]))
        flat_strides[pos : pos + len(dense)] = dense
        view_strides[i] = dense
        gathers.append((i, tensors[i]))
    return view_strides, flat_strides, gathers


def _copy_rows(columns: _Columns, blocks: _Blocks) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """The rows (source address, slot offset, nbytes) that fill the slot: per device, the blocks
    copied by bytes; on the host, those of host tensors, then the zeroed alignment gaps."""
    first = blocks.first_member
    copied = blocks.copied
    rows = (
        np.stack(
            [
                columns.storage[first] + blocks.lo.astype(np.uint64),
                blocks.block_offset.astype(np.uint64),
                blocks.block_bytes.astype(np.uint64),
            ],
            axis=1,
        )[copied]
        if len(first)
        else np.empty((0, 3), dtype=np.uint64)
    )
    block_device = columns.device[first][copied]
    # The slot must not keep bytes of an earlier stage in the gaps, as they would reach
    # checkpoint files that mirror the slot: host copies from a zero buffer, whatever the
    # blocks' devices are.
    gaps = _gap_rows(blocks.block_offset, blocks.block_bytes, blocks.padded, blocks.align)
    host = np.concatenate([rows[block_device < 0], gaps])
    devices = {
        int(d): np.ascontiguousarray(rows[block_device == d])
        # (a set, not np.unique, which imports numpy.ma on its first call)
        for d in sorted(set(block_device[block_device >= 0].tolist()))
    }
    return host, devices


@dataclasses.dataclass
class BlockMap:
    """Where each block of a layout reads from, and what a later state dict must match to be
    laid out the same way: a full plan less its tensors (a Planner must not keep training memory
    alive)."""

    signature: Signature  # see tensor_signature
    flags: Signature  # see tensor_flags
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

    @classmethod
    def of(
        cls,
        columns: _Columns,
        blocks: _Blocks,
        dtensors: dict[int, Any],
        host: np.ndarray,
        device: dict[int, np.ndarray],
    ) -> BlockMap:
        copied = blocks.copied
        first = blocks.first_member[copied]
        member = ~blocks.gather[blocks.staged]
        return cls(
            signature=columns.signature,
            flags=columns.flag_columns,
            dtensors=frozenset(dtensors),
            start=columns.start.astype(np.uint64),
            member=blocks.staged[member],
            member_block=np.searchsorted(np.flatnonzero(copied), blocks.group[member]),
            block_first=first,
            block_lo=blocks.lo[copied].astype(np.uint64),
            block_device=columns.device[first],
            storage=columns.storage[first],
            host=host,
            device=device,
            gathers=np.flatnonzero(blocks.gather),
        )

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
