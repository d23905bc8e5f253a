"""The test double of the CUDA driver (cuda_driver_double.c): building it, loading it, fixtures.

The double is a small shared library the tests compile with the system C compiler; it implements the
few driver functions pyshmckpt loads at run time over host memory (see the header comment of
cuda_driver_double.c for its model and its ``PYSHMCKPT_DOUBLE_*`` settings). Tests point the
extension at it with ``PYSHMCKPT_CUDA_DRIVER=<path>`` and inspect it with ``double(path)``: the
dynamic loader gives both the same instance of a path, so what the extension did is visible there.
``fresh_double`` loads an instance of its own, for tests that need a first ``cuInit`` of theirs.

The fixtures are session-scoped; a test module gets them by importing them (``from cuda_double
import cuda_double_fixture``): a ``tests/native/conftest.py`` would take the module name
``conftest`` from tests/conftest.py, which test modules import from.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import uuid
from ctypes import POINTER, c_char_p, c_int, c_longlong, c_size_t, c_uint, c_uint64, c_ulonglong
from ctypes import c_void_p as ptr
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().with_name("cuda_driver_double.c")
COMPILE_TIMEOUT = 120  # seconds; it takes well under one

# Driver result codes the double returns (the real driver's values).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
CUDA_ERROR_LAUNCH_FAILED = 719
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_MEMORYTYPE_HOST = 1

# name: (restype, argtypes); driver functions return CUresult (int).
_PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    "cuInit": (c_int, [c_uint]),
    "cuDriverGetVersion": (c_int, [POINTER(c_int)]),
    "cuDeviceGetCount": (c_int, [POINTER(c_int)]),
    "cuDeviceGet": (c_int, [POINTER(c_int), c_int]),
    "cuDeviceGetName": (c_int, [c_char_p, c_int, c_int]),
    "cuDevicePrimaryCtxRetain": (c_int, [POINTER(ptr), c_int]),
    "cuCtxGetCurrent": (c_int, [POINTER(ptr)]),
    "cuCtxSetCurrent": (c_int, [ptr]),
    "cuMemHostRegister_v2": (c_int, [ptr, c_size_t, c_uint]),
    "cuMemHostUnregister": (c_int, [ptr]),
    "cuMemcpyDtoHAsync_v2": (c_int, [ptr, c_ulonglong, c_size_t, ptr]),
    "cuEventCreate": (c_int, [POINTER(ptr), c_uint]),
    "cuEventRecord": (c_int, [ptr, ptr]),
    "cuEventQuery": (c_int, [ptr]),
    "cuEventDestroy_v2": (c_int, [ptr]),
    "cuPointerGetAttribute": (c_int, [ptr, c_int, c_ulonglong]),
    "cuGetErrorName": (c_int, [c_int, POINTER(c_char_p)]),
    "cuGetErrorString": (c_int, [c_int, POINTER(c_char_p)]),
    "double_register_calls": (c_longlong, []),
    "double_unregister_calls": (c_longlong, []),
    "double_registered_ranges": (c_longlong, []),
    "double_registered_bytes": (c_size_t, []),
    "double_copy_calls": (c_longlong, []),
    "double_batch_calls": (c_longlong, []),
    "double_copy_log": (c_int, [POINTER(c_uint64), c_int]),
    "double_hold_copies": (None, [c_int]),
    "double_pending_copies": (c_longlong, []),
    "double_reset_counters": (None, []),
    "double_reconfigure": (c_int, []),
}


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


VARIANTS = {"": [], "old": ["-DDOUBLE_OLD_DRIVER"], "batch": ["-DDOUBLE_BATCH"]}


def build_double(tmp_dir: Path, variant: str = "") -> Path:
    """Compile the double into `tmp_dir` (reused when already built there from the same source).

    ``variant`` "old" builds the double without cuMemcpyDtoHAsync_v2 (a driver too old for it),
    "batch" the one with cuMemcpyBatchAsync_v2 (a CUDA 13 driver).
    Skips the test when no C compiler is installed; fails it when the source does not compile.
    """
    name = f"libcuda_double_{variant}.so" if variant else "libcuda_double.so"
    target = Path(tmp_dir) / name
    if target.exists() and target.stat().st_mtime >= SOURCE.stat().st_mtime:
        return target
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) to build the CUDA driver test double")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{name}.{uuid.uuid4().hex}")  # renamed: never half a library
    command = [compiler, "-std=c11", "-Wall", "-Wextra", "-shared", "-fPIC", "-O1", "-pthread"]
    command += VARIANTS[variant]
    command += ["-o", str(partial), str(SOURCE)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    if done.returncode != 0:
        pytest.fail(f"building the CUDA driver test double failed: {command}\n{done.stderr}")
    partial.replace(target)
    return target


def double(lib_path: Path) -> ctypes.CDLL:
    """The double at `lib_path` with every function's prototype set (the instance the extension
    uses, when it loaded the same path). The old-driver variant lacks cuMemcpyDtoHAsync_v2."""
    lib = ctypes.CDLL(str(lib_path))
    for name, (restype, argtypes) in _PROTOTYPES.items():
        if not hasattr(lib, name):
            continue
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def fresh_double(lib_path: Path, tmp_dir: Path) -> ctypes.CDLL:
    """An instance of the double of its own, not initialized yet (a copy under a new name: the
    dynamic loader shares one instance per file). Its idle worker thread lives until exit."""
    copy = Path(tmp_dir) / f"{Path(lib_path).stem}-{uuid.uuid4().hex}.so"
    shutil.copyfile(lib_path, copy)
    return double(copy)


def copy_log(lib: ctypes.CDLL) -> list[tuple[int, int, int]]:
    """(dst, src, bytes) of every copy call the double logged, in order."""
    n = lib.double_copy_log(None, 0)
    out = (c_uint64 * (3 * n))()
    n = min(n, lib.double_copy_log(out, n))
    return [(out[3 * i], out[3 * i + 1], out[3 * i + 2]) for i in range(n)]


def make_context_current(lib: ctypes.CDLL, device: int = 0) -> int:
    """Retain `device`'s primary context and make it current on this thread; returns it."""
    context = ptr()
    rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    if rc != CUDA_SUCCESS:
        pytest.fail(f"cuDevicePrimaryCtxRetain of the double returned {rc}")
    rc = lib.cuCtxSetCurrent(context)
    if rc != CUDA_SUCCESS:
        pytest.fail(f"cuCtxSetCurrent of the double returned {rc}")
    return int(context.value or 0)


def _build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "cuda-driver-double"


@pytest.fixture(scope="session", name="cuda_double")
def cuda_double_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the CUDA driver test double, built once per session (per worker under xdist)."""
    return build_double(_build_dir(tmp_path_factory))


@pytest.fixture(scope="session", name="cuda_double_old_driver")
def cuda_double_old_driver_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the double's variant without cuMemcpyDtoHAsync_v2 (a driver too old for it)."""
    return build_double(_build_dir(tmp_path_factory), "old")


@pytest.fixture(scope="session", name="cuda_double_batch")
def cuda_double_batch_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the double's variant with cuMemcpyBatchAsync_v2 (a CUDA 13 driver)."""
    return build_double(_build_dir(tmp_path_factory), "batch")
