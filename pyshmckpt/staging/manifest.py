"""The manifest: everything needed to rebuild a staged state dict from a slot's bytes.

A `Manifest` holds the structure tree (containers, keys, leaves, and the index of each tensor)
and per-tensor columns (dtype, shape, stride, byte offset in the slot, block). It is what crosses
to the writer process and what the storage layer writes down. `make_tensors` and `build` turn a
manifest and a buffer back into the same structure, with tensors that shared a storage viewing
one block again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import pickle
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._lazy import no_attribute
from ..errors import ConfigTypeError, ManifestIndexError

if TYPE_CHECKING:
    import torch

    from .dtensors import Sharding

    DTYPES: dict[str, torch.dtype]  # (module __getattr__, below)

# Node kinds of the structure tree. A tensor is a bare int (its index: ints are not tracked by the
# garbage collector, which matters with thousands of tensors); a value is a `Leaf`, a container a
# `Container`, each with its kind first.
# REDUCED covers every other dict or list type (OrderedDict, defaultdict, Counter, user
# subclasses): it is rebuilt the way pickle would, from the container's __reduce_ex__, so that
# constructor arguments and instance attributes (a module state dict's _metadata) survive.
# PICKLED holds a `Pickled` leaf: a value a slot cannot hold, carried beside it by value.
DICT, LIST, TUPLE, NAMED_TUPLE, LEAF, REDUCED, PICKLED = range(7)


class Leaf(NamedTuple):
    """A value of the tree that is neither a tensor nor a container."""

    kind: int  # LEAF (the value itself, a snapshot) or PICKLED (a `Pickled`)
    value: Any


class Container(NamedTuple):
    """A dict, list, tuple, named tuple or other dict or list type (REDUCED) of the tree."""

    kind: int  # DICT, LIST, TUPLE, NAMED_TUPLE or REDUCED
    keys: tuple[Any, ...] | None  # a DICT's keys, a REDUCED dict's; None for sequences
    children: tuple[Any, ...]  # a node or a tensor index per item
    # How to rebuild anything but a dict, list or tuple: a NAMED_TUPLE's class, or a REDUCED
    # container's reduce function with the arguments and state its __reduce_ex__ gave.
    factory: Any = None
    args: Any = None
    state: Any = None


class Pickled:
    """A leaf that a slot cannot hold (a sparse, nested, quantized or meta tensor, a tensor
    subclass), carried beside the slot as pickle bytes, the way torch's transport pickles it.

    `snapshot` pickles the value at once (by value, never through shared-memory handles, so it
    survives its trainer and later changes to the value are not seen); `value` unpickles it
    where it is used, once, so that a value that cannot be rebuilt fails the write using it.
    """

    __slots__ = ("data", "type_name", "_value")

    def __init__(self, data: bytes, type_name: str) -> None:
        self.data = data
        self.type_name = type_name  # of the value, for messages
        self._value: Any = _UNLOADED

    @classmethod
    def snapshot(cls, value: Any) -> Pickled:
        """A Pickled leaf of `value` as it is now: its pickle bytes, taken at once."""
        with quiet_storage_warnings():
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return cls(data, f"{type(value).__module__}.{type(value).__qualname__}")

    @property
    def value(self) -> Any:
        if self._value is _UNLOADED:
            self._value = pickle.loads(self.data)
        return self._value

    def __reduce__(self) -> tuple[Any, ...]:
        return Pickled, (self.data, self.type_name)

    def __deepcopy__(self, memo: dict[int, Any]) -> Pickled:
        return self


_UNLOADED = object()


@contextlib.contextmanager
def quiet_storage_warnings() -> Iterator[None]:
    """torch's own copy and pickle code for quantized tensors goes through TypedStorage and warns
    that it is deprecated; the warning is about torch's internals, not the caller's code."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        yield


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by name ("bfloat16"). Imports torch: this module does not otherwise, so
    that the writer process can read a manifest (and persist its slot) without loading torch."""
    import torch

    return {
        str(value).removeprefix("torch."): value
        for value in vars(torch).values()
        if isinstance(value, torch.dtype)
    }


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # torch's dtypes by name, loaded on first use (see torch_dtypes)
        return torch_dtypes()
    raise no_attribute(__name__, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One distinct tensor of a `Manifest`: where its element 0 lies in the slot and how to view
    it (`Manifest.entry` and `Manifest.entries` make them from the manifest's columns).

    Attributes:
        path: key path of its first occurrence in the state dict.
        dtype: torch dtype name, e.g. "bfloat16".
        shape: its shape.
        stride: its stride, in elements.
        offset: bytes from the slot start to element 0 of the view.
        nbytes: numel times the element size.
        block: index into `Manifest.blocks`; -1 for a tensor without elements.
        parameter: restored as a `torch.nn.Parameter`.
        requires_grad: restored with ``requires_grad=True``.
        array: ``"numpy"`` or ``"cupy"`` when the value was a NumPy or CuPy array (restored as
            an array), None for a tensor.
    """

    path: tuple[Any, ...]  # key path of its first occurrence
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    offset: int  # bytes from the slot start to element 0 of the view
    nbytes: int  # numel * itemsize
    block: int  # index into Manifest.blocks; -1 for a tensor without elements
    parameter: bool = False  # restore as torch.nn.Parameter
    requires_grad: bool = False
    array: str | None = None  # "numpy" or "cupy": restore as that kind of array


# Bits of the `flags` column (and of the "flags" of a tensor in a checkpoint's manifest).
PARAMETER = 1
REQUIRES_GRAD = 2
NUMPY = 4  # was an np.ndarray: given back as one
CUPY = 8  # was a CUDA array (__cuda_array_interface__): staged as NumPy, loaded as CuPy
ARRAY = NUMPY | CUPY
# The torch dtypes NumPy has (by name): the dtypes a row flagged NUMPY or CUPY can have.
ARRAY_DTYPES = frozenset(
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 float32 float64 complex64 "
    "complex128".split()
)


def array_kind(flags: int) -> str | None:
    """The kind of array a row with these flags was: "numpy", "cupy", or None (a tensor)."""
    if flags & NUMPY:
        return "numpy"
    if flags & CUPY:
        return "cupy"
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class Manifest:
    """Everything needed to rebuild a staged state dict from its slot's bytes; what crosses to the
    writer process with each save (`ShmStager.handle` gives a staged state dict's).

    Per-tensor data is stored column-wise in numpy arrays (tensor i is row i), so that a manifest
    of thousands of tensors pickles quickly; ``entry(i)`` gives one row as a `TensorEntry`.
    Offsets are bytes from the slot start. ``len(manifest)`` is the number of distinct tensors.

    Attributes:
        tree: the structure: `Container` and `Leaf` nodes, the int i where tensor i goes.
        dtypes: the dtype names the `dtype` column indexes.
        dtype: (n,) int16 array: each tensor's dtype, an index into `dtypes`.
        ndim: (n,) int16 array: each tensor's number of dimensions.
        shapes: int64 array of every tensor's shape, concatenated (``ndim`` entries each).
        strides: int64 array of every tensor's strides in elements, concatenated alike.
        offset: (n,) int64 array: bytes from the slot start to each tensor's element 0.
        nbytes: (n,) int64 array: each tensor's numel times its element size.
        block: (n,) int64 array: each tensor's row of `blocks` (-1 for a tensor without
            elements).
        flags: (n,) uint8 array: each tensor's flags (parameter, requires_grad, NumPy or CuPy
            array).
        blocks: (m, 2) int64 array: offset in the slot and bytes of each staged storage block.
        size: bytes of the slot in use (the end of the last block).
        sharding: which tensors are DTensors' local shards, with their placements (None: no
            DTensor).
    """

    tree: Any  # `Container` and `Leaf` nodes; the int i where tensor i goes
    dtypes: tuple[str, ...]  # dtype names; the `dtype` column indexes this
    dtype: np.ndarray  # (n,) int16
    ndim: np.ndarray  # (n,) int16
    shapes: np.ndarray  # (sum of ndim,) int64, all shapes concatenated
    strides: np.ndarray  # (sum of ndim,) int64, in elements
    offset: np.ndarray  # (n,) int64, bytes from the slot start to element 0 of the view
    nbytes: np.ndarray  # (n,) int64, numel * itemsize
    block: np.ndarray  # (n,) int64, row of `blocks`; -1 for tensors without elements
    flags: np.ndarray  # (n,) uint8, PARAMETER | REQUIRES_GRAD | NUMPY | CUPY
    blocks: np.ndarray  # (m, 2) int64: offset, nbytes of each staged storage block
    size: int  # bytes of the slot in use (end of the last block)
    # Tensors that are DTensors' local shards, with their placements (None: no DTensor).
    sharding: Sharding | None = None

    def __len__(self) -> int:
        return len(self.offset)

    @functools.cached_property
    def layout_key(self) -> bytes:
        """Digest of everything that places tensors (not of the tree, whose leaves may change).

        Two manifests with the same key describe the same tensors at the same places, so views
        built for one serve the other.
        """
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(self.dtypes).encode())
        for column in (
            self.dtype, self.ndim, self.shapes, self.strides, self.offset, self.block,
            self.flags, self.blocks,
        ):  # fmt: skip
            h.update(np.ascontiguousarray(column).tobytes())
        if self.sharding is not None:
            h.update(self.sharding.digest())
        return h.digest()

    @functools.cached_property
    def view_args(self) -> tuple[list[Any], list[Any], list[int], list[int], list[int]]:
        """Per tensor: shape, stride, dtype code, block (-1 without one) and byte offset from
        its block's start, as Python values, worked out once per layout for `make_tensors`."""
        bounds = np.concatenate([[0], np.cumsum(self.ndim, dtype=np.int64)]).tolist()
        shapes = self.shapes.tolist()
        strides = self.strides.tolist()
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        return (
            [tuple(shapes[a:b]) for a, b in spans],
            [tuple(strides[a:b]) for a, b in spans],
            self.dtype.tolist(),
            self.block.tolist(),
            offsets_in_blocks(self.offset, self.block, self.blocks).tolist(),
        )

    def __getstate__(self) -> dict[str, Any]:
        # view_args is as large as the columns and cheap to redo: it does not cross processes.
        state = dict(self.__dict__)
        state.pop("view_args", None)
        return state

    def with_tree(self, tree: Any, sharding: Sharding | None) -> Manifest:
        """A manifest with these columns (shared, not copied) and a new tree and sharding.

        For a state dict laid out as this one was (the caller checked it): the layout key, which
        does not depend on the tree, is carried over instead of being hashed again, so the
        sharding must have the same digest as this manifest's.
        """
        out = dataclasses.replace(self, tree=tree, sharding=sharding)
        for name in ("layout_key", "view_args"):  # cached_property values: same columns
            value = self.__dict__.get(name)
            if value is not None:
                out.__dict__[name] = value
        return out

    def paths(self) -> list[tuple[Any, ...]]:
        """Key path of the first occurrence of every tensor, in tensor order."""
        out: list[tuple[Any, ...] | None] = [None] * len(self)
        _collect_paths(self.tree, (), out)
        return out  # type: ignore[return-value]

    def entries(self) -> list[TensorEntry]:
        """Every tensor as a TensorEntry (convenient, slower than the columns)."""
        paths = self.paths()
        ndim = self.ndim.tolist()
        shapes = self.shapes.tolist()
        strides = self.strides.tolist()
        offsets = self.offset.tolist()
        nbytes = self.nbytes.tolist()
        blocks = self.block.tolist()
        flags = self.flags.tolist()
        dtypes = [self.dtypes[c] for c in self.dtype.tolist()]
        out = []
        pos = 0
        for i in range(len(self)):
            end = pos + ndim[i]
            out.append(
                TensorEntry(
                    paths[i],
                    dtypes[i],
                    tuple(shapes[pos:end]),
                    tuple(strides[pos:end]),
                    offsets[i],
                    nbytes[i],
                    blocks[i],
                    bool(flags[i] & PARAMETER),
                    bool(flags[i] & REQUIRES_GRAD),
                    array_kind(flags[i]),
                )  # fmt: skip
            )
            pos = end
        return out

    def entry(self, i: int) -> TensorEntry:
        """Row `i` as a TensorEntry (walks the tree for its path).

        Args:
            i: the tensor's index, from 0 to ``len(manifest) - 1``.

        Raises:
            ManifestIndexError: `i` is out of range.
        """
        if not 0 <= i < len(self):
            raise ManifestIndexError(f"tensor index {i} out of range for {len(self)} tensors")
        pos = int(self.ndim[:i].sum())
        end = pos + int(self.ndim[i])
        flags = int(self.flags[i])
        return TensorEntry(
            self.paths()[i], self.dtypes[int(self.dtype[i])],
            tuple(self.shapes[pos:end].tolist()), tuple(self.strides[pos:end].tolist()),
            int(self.offset[i]), int(self.nbytes[i]), int(self.block[i]),
            bool(flags & PARAMETER), bool(flags & REQUIRES_GRAD), array_kind(flags),
        )  # fmt: skip


def _collect_paths(node: Any, path: tuple[Any, ...], out: list[Any]) -> None:
    if type(node) is int:
        if out[node] is None:
            out[node] = path
        return
    if type(node) is Leaf:
        return
    if node.keys is not None:
        for key, child in zip(node.keys, node.children, strict=True):
            _collect_paths(child, (*path, key), out)
    else:
        for i, child in enumerate(node.children):
            _collect_paths(child, (*path, i), out)


def format_path(path: tuple[Any, ...]) -> str:
    return "state_dict" + "".join(f"[{key!r}]" for key in path)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def offsets_in_blocks(offset: np.ndarray, block: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Each tensor's byte offset from the start of its block (0 without a block)."""
    if not len(blocks):
        return np.zeros(len(offset), dtype=np.int64)
    return np.where(block >= 0, offset - blocks[np.maximum(block, 0), 0], 0)


def make_tensors(
    manifest: Manifest, storage: torch.UntypedStorage | None, slot_offset: int = 0
) -> list[Any]:
    """Create the manifest's tensors over `storage`, in which the slot starts at byte
    `slot_offset` (None only for a manifest without blocks).

    Every block gets a storage of its own, a slice of `storage` that shares its bytes (and keeps
    it alive), and each tensor views its block's storage: so torch.save, pickling and copying a
    tensor take its block's bytes and nothing else, and tensors that came from one source storage
    share one storage again. Tensors without elements get an empty storage of their own. Rows
    flagged NUMPY or CUPY are NumPy arrays over their tensor's memory (a CuPy array's host
    snapshot is a NumPy array, as a CUDA tensor's is a CPU tensor); each keeps its tensor alive.
    """
    import torch

    from .. import _torch_private
    from .._unfilled import empty_maker, unfilled_strided

    dtypes = [torch_dtypes()[name] for name in manifest.dtypes]
    sizes = [d.itemsize for d in dtypes]
    news = [empty_maker(d) for d in dtypes]
    if storage is None and len(manifest.blocks):
        raise ConfigTypeError("make_tensors needs the storage the manifest's blocks lie in")
    block_storages = [
        _torch_private.storage_slice(storage, start, start + nbytes)  # type: ignore[arg-type]
        for start, nbytes in (manifest.blocks + [slot_offset, 0]).tolist()
    ]
    out: list[Any] = []
    append = out.append
    with torch.no_grad():
        for shape, stride, code, block, offset in zip(*manifest.view_args, strict=True):
            if block < 0:
                append(unfilled_strided(shape, stride, dtypes[code]))
            else:
                append(
                    news[code]().set_(block_storages[block], offset // sizes[code], shape, stride)
                )
        flagged = np.flatnonzero(manifest.flags)
        for i, flag in zip(flagged.tolist(), manifest.flags[flagged].tolist(), strict=True):
            if flag & ARRAY:
                out[i] = out[i].numpy()
            elif flag & PARAMETER:
                out[i] = torch.nn.Parameter(out[i], requires_grad=bool(flag & REQUIRES_GRAD))
            else:
                out[i].requires_grad_(True)
    if manifest.sharding is not None:
        manifest.sharding.wrap(out)
    return out


def rebuild(manifest: Manifest, storage: torch.UntypedStorage | None, slot_offset: int) -> Any:
    """Rebuild the staged structure over `storage`, in which the slot starts at byte
    `slot_offset` (see `make_tensors`). Tensors that came from one source storage alias again;
    a tensor that appeared several times comes back as one object."""
    return build(manifest.tree, make_tensors(manifest, storage, slot_offset))


def tensor_steps(node: Any, index: int) -> list[Any] | None:
    """Keys / indices leading from the root of a tree to the first occurrence of tensor `index`,
    or None when it does not occur."""
    if type(node) is int:
        return [] if node == index else None
    if type(node) is Leaf:
        return None
    keys = node.keys
    for i, child in enumerate(node.children):
        rest = tensor_steps(child, index)
        if rest is not None:
            return [keys[i] if keys is not None else i, *rest]
    return None


def build(node: Any, tensors: list[Any]) -> Any:
    """The structure of `node` with tensor references replaced by `tensors[i]` (a tensor, or an
    array for a row flagged NUMPY or CUPY)."""
    if type(node) is int:
        return tensors[node]
    kind = node.kind
    if kind == LEAF:
        return node.value
    if kind == PICKLED:
        return node.value.value
    # Tensors are bare ints: resolve them inline, as most children of a state dict are tensors.
    values = [tensors[c] if type(c) is int else build(c, tensors) for c in node.children]
    if kind == DICT:
        return dict(zip(node.keys, values, strict=True))
    if kind == LIST:
        return values
    if kind == TUPLE:
        return tuple(values)
    if kind == NAMED_TUPLE:
        return node.factory(*values)
    return reconstruct(node, values)


def reconstruct(node: Container, values: list[Any]) -> Any:
    """Rebuild a REDUCED container as pickle would (see copy._reconstruct)."""
    keys, state = node.keys, node.state
    obj = node.factory(*node.args)
    if keys is not None:
        for key, value in zip(keys, values, strict=True):
            obj[key] = value
    else:
        for value in values:
            obj.append(value)
    if state is not None:
        setstate = getattr(obj, "__setstate__", None)
        if setstate is not None:
            setstate(copy.deepcopy(state))
        else:
            if isinstance(state, tuple) and len(state) == 2:
                state, slots = state
                for name, value in (slots or {}).items():
                    setattr(obj, name, copy.deepcopy(value))
            if state:
                obj.__dict__.update(copy.deepcopy(state))
    return obj
