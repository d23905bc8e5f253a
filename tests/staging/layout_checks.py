"""Checks shared by the layout and planner tests: running a plan into an ordinary byte buffer
(``execute`` does what the stager does: byte copies for the host rows, torch copies for the
gathers, then ``rebuild``), comparing what comes back with what went in, and the state dicts the
property tests draw.

Every check raises explicitly (``check``/``same``) instead of using ``assert``, so the suites still
check something under ``python -O`` (PYTHONOPTIMIZE=1).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import warnings
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from pyshmckpt import knobs
from pyshmckpt.staging import layout
from pyshmckpt.staging.manifest import (
    DTYPES,
    Manifest,
    contiguous_stride,
    rebuild,
)

SLOT_OFFSET = 192  # where the slot starts in the helper's buffer (64-aligned, like a real slot)


COMPLEX_DTYPES = [torch.complex32, torch.complex64, torch.complex128]


def check(condition: Any, message: str = "check failed") -> None:
    if not condition:
        raise AssertionError(message)


def same(got: Any, want: Any, what: str = "value") -> None:
    if not (got == want):
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


@contextlib.contextmanager
def quiet():
    """Silence torch's prototype/beta/deprecation warnings while making exotic tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of every element in logical order, shape (*t.shape, itemsize), as uint8.

    Works for any dtype and any strides without torch copying elements of that dtype (which it
    cannot do for sub-byte and quantized dtypes); lazy conj/neg bits are resolved first.
    """
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    n = t.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(
        t.untyped_storage(),
        t.storage_offset() * n,
        (*t.shape, n),
        (*(s * n for s in t.stride()), 1),
    )


def assert_tensor(got: Any, want: torch.Tensor, where: str = "tensor") -> None:
    check(isinstance(got, torch.Tensor), f"{where}: {type(got)} is not a tensor")
    same(type(got), type(want), f"{where} type")
    same(got.dtype, want.dtype, f"{where} dtype")
    same(tuple(got.shape), tuple(want.shape), f"{where} shape")
    same(got.device, torch.device("cpu"), f"{where} device")
    same(got.requires_grad, want.requires_grad, f"{where} requires_grad")
    check(
        not got.is_conj() and not got.is_neg(), f"{where}: staged tensor kept a lazy conj/neg bit"
    )
    check(
        torch.equal(element_bytes(got), element_bytes(want)),
        f"{where}: bytes differ\n got {element_bytes(got).flatten().tolist()[:64]}\n"
        f"want {element_bytes(want).flatten().tolist()[:64]}",
    )


def leaf_equal(got: Any, want: Any) -> bool:
    if type(got) is not type(want):
        return False
    if isinstance(want, float) and math.isnan(want):
        return math.isnan(got)
    if isinstance(want, np.ndarray):
        return got.dtype == want.dtype and np.array_equal(got, want)
    return bool(got == want)


def assert_same(got: Any, want: Any, where: str = "state_dict") -> None:
    """Same structure, container types, keys (in order), leaves and tensor bytes."""
    same(type(got), type(want), f"{where} type")
    if isinstance(want, torch.Tensor):
        assert_tensor(got, want, where)
    elif isinstance(want, dict):
        same(list(got.keys()), list(want.keys()), f"{where} keys")
        if isinstance(want, collections.defaultdict):
            check(got.default_factory is want.default_factory, f"{where}: default_factory lost")
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        same(len(got), len(want), f"{where} length")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        check(leaf_equal(got, want), f"{where}: leaf {got!r} != {want!r}")


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """Tensors in the walk order of plan() (dict values in order, sequences in order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensor_leaves(v)]
    return []


def assert_identity_and_aliasing(got: Any, want: Any, plan: layout.StagingPlan) -> None:
    """Repeated tensor objects come back identical; storage-sharing tensors keep their placement.

    Tensors staged as raw bytes (not gathered) that shared a source storage share one block, so
    the distance between their data pointers is the same as in the source.
    """
    got_t, want_t = tensor_leaves(got), tensor_leaves(want)
    same(len(got_t), len(want_t), "number of tensor positions")
    gathered = {id(source) for _, source in plan.gathers}
    for i in range(len(want_t)):
        for j in range(i + 1, len(want_t)):
            a, b = want_t[i], want_t[j]
            same(got_t[i] is got_t[j], a is b, f"identity of tensor positions {i} and {j}")
            if (
                a is not b
                and a.numel()
                and b.numel()
                and id(a) not in gathered
                and id(b) not in gathered
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            ):
                same(
                    got_t[i].data_ptr() - got_t[j].data_ptr(),
                    a.data_ptr() - b.data_ptr(),
                    f"relative placement of aliasing tensors {i} and {j}",
                )


def execute(plan: layout.StagingPlan, slot_offset: int = SLOT_OFFSET) -> tuple[Any, torch.Tensor]:
    """Fill a byte buffer as the stager fills a slot, and rebuild the state dict from it."""
    manifest = plan.manifest
    check(plan.device == {}, "CPU tensors produced device copy entries")
    # A poison pattern rather than zeros: bytes that no entry fills are noticed.
    buf = torch.full((slot_offset + manifest.size + 4096,), 0xA5, dtype=torch.uint8)
    for src, dst, nbytes in plan.host.tolist():
        ctypes.memmove(buf.data_ptr() + slot_offset + dst, src, nbytes)
    with torch.no_grad():
        for index, source in plan.gathers:
            stride = contiguous_stride(tuple(source.shape))
            element = (slot_offset + int(manifest.offset[index])) // source.dtype.itemsize
            target = torch.empty(0, dtype=source.dtype)
            target.set_(buf.untyped_storage(), element, source.shape, stride).copy_(source)
    return rebuild(manifest, buf.untyped_storage(), slot_offset), buf


def extent_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    if math.prod(shape) == 0:
        return 0
    return itemsize * (1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True)))


def check_plan(plan: layout.StagingPlan) -> None:
    """Invariants of a plan and its manifest that hold for every state dict."""
    m = plan.manifest
    n = len(m)
    for name in ("dtype", "ndim", "offset", "nbytes", "block", "flags"):
        same(len(getattr(m, name)), n, f"length of column {name}")
    same(len(m.shapes), int(m.ndim.sum()), "length of shapes")
    same(len(m.strides), int(m.ndim.sum()), "length of strides")
    same(len(plan.sources), n, "number of sources")
    same(m.blocks.shape, (m.blocks.shape[0], 2), "blocks shape")
    check(all(0 <= c < len(m.dtypes) for c in m.dtype.tolist()), "dtype code out of range")
    same(len(set(m.dtypes)), len(m.dtypes), "duplicate dtype names")

    # Blocks: aligned, in slot order, disjoint, and the last one ends at manifest.size.
    align = knobs.alignment()
    end = 0
    for offset, nbytes in m.blocks.tolist():
        same(offset % align, 0, f"alignment of block at {offset}")
        check(nbytes > 0, f"empty block at {offset}")
        check(offset >= end, f"block at {offset} overlaps the previous one (ending at {end})")
        end = offset + nbytes
    same(m.size, end, "manifest.size")

    # Blocks are numbered in order of the first tensor that uses them.
    used = [b for b in m.block.tolist() if b >= 0]
    same(list(dict.fromkeys(used)), list(range(len(m.blocks))), "blocks in first-seen order")

    # Every tensor with elements lies inside its block, aligned for its dtype.
    for i, entry in enumerate(m.entries()):
        itemsize = DTYPES[entry.dtype].itemsize
        source = plan.sources[i]
        same(entry.nbytes, source.numel() * itemsize, f"nbytes of tensor {i}")
        if entry.nbytes == 0:
            same(entry.block, -1, f"block of empty tensor {i}")
            continue
        check(0 <= entry.block < len(m.blocks), f"tensor {i} has block {entry.block}")
        block_offset, block_bytes = m.blocks[entry.block].tolist()
        same(entry.offset % itemsize, 0, f"offset alignment of tensor {i}")
        check(block_offset <= entry.offset, f"tensor {i} starts before its block")
        check(
            entry.offset + extent_bytes(entry.shape, entry.stride, itemsize)
            <= block_offset + block_bytes,
            f"tensor {i} reaches past its block",
        )

    # Each block is filled exactly once: by one host copy, or by one gather. The other host rows
    # copy zeros into the alignment gaps between blocks.
    block_bytes_at = dict(m.blocks.tolist())
    block_rows = [row for row in plan.host.tolist() if row[1] in block_bytes_at]
    gap_rows = [row for row in plan.host.tolist() if row[1] not in block_bytes_at]
    host_dst = [dst for _, dst, _ in block_rows]
    gather_dst = [int(m.blocks[int(m.block[i]), 0]) for i, _ in plan.gathers]
    same(sorted(host_dst + gather_dst), m.blocks[:, 0].tolist(), "blocks filled")
    for _, dst, nbytes in block_rows:
        same(nbytes, block_bytes_at[dst], f"bytes copied into block at {dst}")

    # Together the entries write every byte of [0, manifest.size) exactly once: the blocks, and
    # the gaps between them (each shorter than the alignment) from a source of zeros.
    spans = sorted([*m.blocks.tolist(), *[[dst, nbytes] for _, dst, nbytes in gap_rows]])
    end = 0
    for offset, nbytes in spans:
        same(offset, end, "start of the next block or gap")
        end = offset + nbytes
    same(end, m.size, "end of what the plan writes")
    for src, dst, nbytes in gap_rows:
        check(0 < nbytes < align, f"gap of {nbytes} bytes at {dst} (alignment {align})")
        same(ctypes.string_at(src, nbytes), bytes(nbytes), f"source of the gap at {dst}")
    for index, source in plan.gathers:
        check(plan.sources[index] is source, f"gather {index} is not source {index}")
        entry = m.entry(index)
        same(entry.stride, contiguous_stride(entry.shape), f"stride of gathered {index}")
        same(int(m.blocks[entry.block, 1]), entry.nbytes, f"block bytes of gathered {index}")
        same(entry.offset, int(m.blocks[entry.block, 0]), f"offset of gathered {index}")

    # Block copies read from inside the source storages: plan() copies nothing itself.
    storages = [
        (s.untyped_storage().data_ptr(), s.untyped_storage().nbytes()) for s in plan.sources
    ]
    for src, _, nbytes in block_rows:
        check(
            any(ptr <= src and src + nbytes <= ptr + size for ptr, size in storages),
            f"host copy from {src:#x} (+{nbytes}) is outside every source storage",
        )


def assert_manifests_equal(a: Manifest, b: Manifest) -> None:
    same(a.tree, b.tree, "manifest tree")
    same(a.dtypes, b.dtypes, "manifest dtypes")
    same(a.size, b.size, "manifest size")
    for name in (
        "dtype",
        "ndim",
        "shapes",
        "strides",
        "offset",
        "nbytes",
        "block",
        "flags",
        "blocks",
    ):
        x, y = getattr(a, name), getattr(b, name)
        same(x.dtype, y.dtype, f"dtype of column {name}")
        check(np.array_equal(x, y), f"column {name}: {x!r} != {y!r}")


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of random *bytes* (NaN payloads, subnormals and all); bool is 0/1."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (math.prod(shape) * dtype.itemsize,), generator=g, dtype=torch.uint8
    )
    if dtype is torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(shape)


Point = collections.namedtuple("Point", ["x", "y"])


HYPOTHESIS_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


VIEWS = (
    "step",
    "conj",
    "same",
    "transpose",
    "imag",
    "alias",
    "expand",
    "rows",
    "permute",
    "scalar",
)


def apply_view(t: torch.Tensor, how: str) -> torch.Tensor:
    """A view of `t` (or `t` itself where the view does not apply)."""
    if how == "alias":
        return t.view(t.shape)
    if how == "transpose" and t.dim() >= 2:
        return t.transpose(0, -1)
    if how == "step" and t.dim() >= 1:
        return t[::2]
    if how == "rows" and t.dim() >= 1:
        return t[1:]
    if how == "expand":
        return t.unsqueeze(0).expand(2, *t.shape)
    if how == "permute" and t.dim() >= 2:
        return t.permute(*reversed(range(t.dim())))
    if how == "conj" and t.is_complex():
        return t.conj()
    if how == "imag" and t.is_complex():
        return t.conj().imag  # a lazy neg view
    if how == "scalar" and t.numel() > 0:
        return t.reshape(-1)[t.numel() - 1] if t.is_contiguous() else t
    return t


LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5)
    | st.binary(max_size=5)
    | st.sampled_from([torch.float32, torch.Size([1, 2]), torch.device("cpu")])
)


KEYS = st.text(max_size=4) | st.integers(-5, 5) | st.tuples(st.integers(0, 3), st.text(max_size=2))


CONTAINERS = ("list", "tuple", "dict", "ordered", "point")


DIM_SIZES = (3, 2, 4, 1, 5, 0)  # mostly non-empty; hypothesis shrinks towards the first


@st.composite
def state_dicts(draw: Any) -> Any:
    """Random nested dict/list/tuple/namedtuple/OrderedDict trees of tensors and leaves.

    Tensors come from a small pool of random base tensors, each used as itself or through a view
    (transpose, step slice, offset slice, expand, permute, conj, neg, 0-d element), so repeated
    objects, tensors sharing a storage, lazy conj/neg views and gathers all show up.
    """
    pool = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(HYPOTHESIS_DTYPES + COMPLEX_DTYPES[1:]))  # complex x2
        ndim = draw(st.sampled_from((2, 1, 3, 0)))
        shape = tuple(draw(st.sampled_from(DIM_SIZES)) for _ in range(ndim))
        pool.append(random_tensor(dtype, shape, draw(st.integers(0, 2**16))))
    kinds = st.sampled_from(("tensor", "container", "tensor", "leaf", "tensor", "container"))

    def node(depth: int) -> Any:
        kind = draw(kinds)
        if kind == "tensor":
            return apply_view(draw(st.sampled_from(pool)), draw(st.sampled_from(VIEWS)))
        if kind == "leaf" or depth >= 3:
            return draw(LEAVES)
        container = draw(st.sampled_from(CONTAINERS))
        if container == "point":
            return Point(node(depth + 1), node(depth + 1))
        if container in ("list", "tuple"):
            items = [node(depth + 1) for _ in range(draw(st.integers(0, 3)))]
            return items if container == "list" else tuple(items)
        keys = draw(st.lists(KEYS, max_size=3, unique=True))
        mapping = {key: node(depth + 1) for key in keys}
        return mapping if container == "dict" else collections.OrderedDict(mapping)

    keys = draw(st.lists(KEYS, min_size=2, max_size=6, unique=True))
    return {key: node(1) for key in keys}
