"""NumPy and CuPy arrays as leaves of a state dict: staged as the tensors that view them.

An ``np.ndarray`` is viewed as a CPU tensor over the memory it views, an object with
``__cuda_array_interface__`` (CuPy, and any other CUDA array library) as a CUDA tensor, both
without a copy; the layout then treats them as any tensor, and the manifest marks their rows
(`manifest.NUMPY`, `manifest.CUPY`) so that rebuilding gives arrays back. NumPy arrays that view
one buffer are viewed over one storage spanning that buffer, so they share a block of the slot
and come back sharing memory, as tensors of one storage do.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import CudaUnavailableError, UnsupportedValueError
from ..shm import cuda
from .manifest import CUPY, NUMPY

# NumPy dtypes torch has, by (kind, itemsize) of a native, unstructured dtype.
NUMPY_TO_TORCH: dict[tuple[str, int], torch.dtype] = {
    ("b", 1): torch.bool,
    ("u", 1): torch.uint8,
    ("i", 1): torch.int8,
    ("i", 2): torch.int16,
    ("i", 4): torch.int32,
    ("i", 8): torch.int64,
    ("f", 2): torch.float16,
    ("f", 4): torch.float32,
    ("f", 8): torch.float64,
    ("c", 8): torch.complex64,
    ("c", 16): torch.complex128,
}
for _bits in (16, 32, 64):  # unsigned dtypes torch has had since 2.3
    if hasattr(torch, f"uint{_bits}"):
        NUMPY_TO_TORCH[("u", _bits // 8)] = getattr(torch, f"uint{_bits}")


def array_flag(obj: Any) -> int:
    """NUMPY for an ``np.ndarray``, CUPY for another object with ``__cuda_array_interface__``
    (a tensor is neither), else 0."""
    cls = type(obj)
    if cls is np.ndarray:
        return NUMPY
    if hasattr(cls, "__cuda_array_interface__") and not isinstance(obj, torch.Tensor):
        return CUPY
    return 0


def numpy_problem(a: np.ndarray) -> str | None:
    """Why torch cannot view `a`, or None."""
    dtype = a.dtype
    if (
        not dtype.isnative
        or dtype.fields is not None
        or (dtype.kind, dtype.itemsize) not in NUMPY_TO_TORCH
    ):
        return (
            f"a NumPy array of dtype {dtype.str!r} ({dtype}) has no torch dtype (object, "
            "structured, string, datetime and non-native byte order arrays cannot be staged)"
        )
    if a.size:
        if any(s < 0 for s in a.strides):
            return (
                "a NumPy array with negative strides cannot be viewed by torch; stage "
                "np.ascontiguousarray(...) of it instead"
            )
        itemsize = dtype.itemsize
        if any(s % itemsize for s, d in zip(a.strides, a.shape, strict=True) if d > 1):
            return "a NumPy array whose strides are not multiples of its element size"
    return None


def device_array_problem(obj: Any) -> str | None:
    """Why an object with ``__cuda_array_interface__`` cannot be staged here (CUDA cannot be
    used in this process), or None; whether torch can view it is known only by trying."""
    reason = cuda.unavailable_reason()
    if reason is None:
        return None
    cls = type(obj)
    return f"a CUDA array ({cls.__module__}.{cls.__qualname__}) needs CUDA to be staged: {reason}"


class _Span:
    """A byte range of an array's memory, as an object NumPy views (``__array_interface__``);
    it holds the array, so that the tensor made over it keeps the memory alive."""

    __slots__ = ("owner", "__array_interface__")

    def __init__(self, owner: Any, address: int, nbytes: int) -> None:
        self.owner = owner
        # Declared writable so that torch.from_numpy does not warn for a read-only array: the
        # tensor over it is only ever a copy source.
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _byte_bounds(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, address: int
) -> tuple[int, int]:
    """The lowest address an array (with elements) reaches and one past its highest, from its
    shape, byte strides, item size and the address of its element 0."""
    lo = hi = address
    for d, s in zip(shape, strides, strict=True):
        if s < 0:
            lo += (d - 1) * s
        else:
            hi += (d - 1) * s
    return lo, hi + itemsize


class ArrayTensors:
    """Makes the tensors that view a state dict's arrays, for one walk of it.

    Arrays whose memory lies in one root buffer (the array at the end of their ``base`` chain,
    or the tensor whose memory ``tensor.numpy()`` views) get tensors over one storage: the
    storage of that tensor, or one made once per root over the root's bytes.
    """

    def __init__(self) -> None:
        # id(root) -> (root, its storage, the storage's start address); the root is kept so
        # that its id stays its own for the walk.
        self._roots: dict[int, tuple[Any, torch.UntypedStorage, int]] = {}
        self._cuda_checked = False  # CUDA found usable for the walk's first CUDA array

    def numpy(self, a: np.ndarray) -> torch.Tensor:
        """A CPU tensor viewing `a` (which `numpy_problem` passed): same dtype, shape, strides
        and memory."""
        dtype = NUMPY_TO_TORCH[(a.dtype.kind, a.dtype.itemsize)]
        if not a.size:
            return torch.empty(a.shape, dtype=dtype)
        itemsize = a.itemsize
        address = int(a.__array_interface__["data"][0])
        storage, start = self._storage(a, address)
        if (address - start) % itemsize:  # off the root's grid of elements: a storage of its own
            storage, start = self._span(a, address)
        stride = tuple(s // itemsize if s % itemsize == 0 else 1 for s in a.strides)
        offset = (address - start) // itemsize
        return torch.empty(0, dtype=dtype).set_(storage, offset, a.shape, stride)

    def _storage(self, a: np.ndarray, address: int) -> tuple[torch.UntypedStorage, int]:
        """The storage `a` is viewed over, and its start address."""
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        owner = root.base
        if isinstance(owner, torch.Tensor):  # the memory of a tensor (tensor.numpy())
            storage = owner.untyped_storage()
            start = storage.data_ptr()
            if start <= address < start + storage.nbytes():
                return storage, start
        cached = self._roots.get(id(root))
        if cached is not None:
            return cached[1], cached[2]
        storage, start = self._span(root, int(root.__array_interface__["data"][0]))
        self._roots[id(root)] = (root, storage, start)
        return storage, start

    @staticmethod
    def _span(root: np.ndarray, address: int) -> tuple[torch.UntypedStorage, int]:
        """A storage over every byte `root` (whose element 0 is at `address`) reaches."""
        lo, hi = _byte_bounds(root.shape, root.strides, root.itemsize, address)
        view = np.asarray(_Span(root, lo, hi - lo))
        return torch.from_numpy(view).untyped_storage(), lo

    def device(self, obj: Any) -> torch.Tensor:
        """A CUDA tensor viewing `obj` (an object with ``__cuda_array_interface__``), ordered
        after the stream the interface names; UnsupportedValueError (its path left to the
        caller) when torch cannot view it, CudaUnavailableError when CUDA cannot be used."""
        if not self._cuda_checked:
            problem = device_array_problem(obj)
            if problem is not None:
                raise CudaUnavailableError("a CUDA array", problem)
            self._cuda_checked = True
        try:
            interface = obj.__cuda_array_interface__
            if interface.get("mask") is not None:
                raise UnsupportedValueError("a CUDA array", "masked CUDA arrays cannot be staged")
            tensor = torch.as_tensor(obj)
        except UnsupportedValueError:
            raise
        except Exception as exc:
            raise UnsupportedValueError(
                "a CUDA array", f"torch cannot view {type(obj).__qualname__}: {exc}"
            ) from exc
        if not tensor.is_cuda or (tensor.numel() and tensor.data_ptr() != interface["data"][0]):
            raise UnsupportedValueError(
                "a CUDA array",
                f"torch made a copy of {type(obj).__qualname__} instead of viewing its memory",
            )
        _wait_for_producer(interface.get("stream"), tensor.device)
        return self._over_device_root(obj, tensor)

    def _over_device_root(self, obj: Any, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (viewing `obj`) moved onto one storage over the bytes of `obj`'s root (the
        end of its ``base`` chain), so that CUDA arrays viewing one buffer stay tied; `tensor`
        itself where `obj` has no such root or lies off the root's grid of elements."""
        root = obj
        while getattr(root, "base", None) is not None and hasattr(
            type(root.base), "__cuda_array_interface__"
        ):
            root = root.base
        if root is obj or not tensor.numel():
            return tensor
        cached = self._roots.get(id(root))
        if cached is None:
            interface = root.__cuda_array_interface__
            lo, hi = _device_bounds(interface)
            span = _DeviceSpan(root, lo, hi - lo)
            cached = self._roots[id(root)] = (root, torch.as_tensor(span).untyped_storage(), lo)
        _, storage, start = cached
        address, itemsize = tensor.data_ptr(), tensor.element_size()
        if not start <= address < start + storage.nbytes() or (address - start) % itemsize:
            return tensor
        view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return view.set_(storage, (address - start) // itemsize, tensor.shape, tensor.stride())


class _DeviceSpan:
    """A byte range of a CUDA array's memory, as an object torch views
    (``__cuda_array_interface__``); it holds the array, so that its memory stays alive."""

    __slots__ = ("owner", "__cuda_array_interface__")

    def __init__(self, owner: Any, address: int, nbytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "strides": None,
            "stream": None,  # ordering was done for the array this span is made for
            "version": 3,
        }


def _device_bounds(interface: dict[str, Any]) -> tuple[int, int]:
    """The lowest address a CUDA array interface reaches and one past its highest."""
    itemsize = np.dtype(interface["typestr"]).itemsize
    shape = tuple(interface["shape"])
    strides = interface.get("strides")
    if strides is None:  # C-contiguous
        step, contiguous = itemsize, list[int]()
        for d in reversed(shape):
            contiguous.insert(0, step)
            step *= d
        strides = contiguous
    return _byte_bounds(shape, tuple(strides), itemsize, int(interface["data"][0]))


def _wait_for_producer(stream: Any, device: torch.device) -> None:
    """Order torch's current stream on `device` (which the staging copies wait for) after the
    stream a CUDA array interface names (version 3: None for none, 1 and 2 the default
    streams, else a stream handle)."""
    if type(stream) is not int or stream == 0:
        return
    current = torch.cuda.current_stream(device)
    if current.cuda_stream == stream or (current.cuda_stream in (0, 1) and stream == 1):
        return
    current.wait_stream(torch.cuda.ExternalStream(stream, device=device))
