"""The CUDA driver *test double* itself (tests/native/cuda_driver_double.c), through ctypes.

These check the fixture that the control-flow tests stand on; no GPU and no real driver are
involved, and nothing here says anything about one. Each test loads an instance of the double of
its own (``fresh_double``), so its settings and state reach no other test.
"""

from __future__ import annotations

import ctypes
import time
from ctypes import byref, c_char_p, c_int, c_uint, c_void_p
from pathlib import Path

import pytest

from cuda_double import (
    CU_MEMORYTYPE_HOST,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
    copy_log,
    cuda_double_fixture,  # noqa: F401 (fixture)
    cuda_double_old_driver_fixture,  # noqa: F401 (fixture)
    double,
    fresh_double,
    make_context_current,
)

TIMEOUT = 30  # seconds a test may take; each takes well under one
POLL_LIMIT = 10.0  # seconds an event may take to complete before the test fails
DOUBLE_SETTINGS = (
    "DEVICES", "DRIVER_VERSION", "COPY_DELAY_MS", "FAIL_REGISTER_AT", "FAIL_COPY_AT", "FAIL_CODE",
)  # fmt: skip


@pytest.fixture
def new_double(cuda_double: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Loads an uninitialized instance of the double, with only the settings a test gives."""
    for setting in DOUBLE_SETTINGS:
        monkeypatch.delenv(f"PYSHMCKPT_DOUBLE_{setting}", raising=False)

    def load(**settings: int) -> ctypes.CDLL:
        for setting, value in settings.items():
            monkeypatch.setenv(f"PYSHMCKPT_DOUBLE_{setting.upper()}", str(value))
        return fresh_double(cuda_double, tmp_path)

    return load


def started(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` after cuInit, with device 0's primary context current on this thread."""
    assert lib.cuInit(0) == CUDA_SUCCESS
    make_context_current(lib)
    return lib


def record(lib: ctypes.CDLL) -> c_void_p:
    event = c_void_p()
    assert lib.cuEventCreate(byref(event), 0) == CUDA_SUCCESS
    assert lib.cuEventRecord(event, None) == CUDA_SUCCESS
    return event


def wait_event(lib: ctypes.CDLL, event: c_void_p) -> int:
    """Polls `event` until it is no longer NOT_READY; returns the result."""
    deadline = time.monotonic() + POLL_LIMIT
    while (rc := lib.cuEventQuery(event)) == CUDA_ERROR_NOT_READY:
        if time.monotonic() > deadline:
            pytest.fail(f"the double's event did not complete within {POLL_LIMIT}s")
        time.sleep(0.005)
    return rc


def source(data: bytes) -> ctypes.Array:
    """A buffer holding exactly `data` (create_string_buffer alone adds a NUL)."""
    return ctypes.create_string_buffer(data, len(data))


def address(buffer: ctypes.Array) -> int:
    return ctypes.addressof(buffer)


@pytest.mark.timeout(TIMEOUT)
def test_double_runs_a_delayed_copy_later_and_completes_its_event(new_double):
    lib = started(new_double(copy_delay_ms=300))
    src = source(b"staged bytes" * 100)
    dst = ctypes.create_string_buffer(len(src))
    assert lib.cuMemHostRegister_v2(dst, len(dst), 0) == CUDA_SUCCESS
    never_recorded = c_void_p()
    assert lib.cuEventCreate(byref(never_recorded), 0) == CUDA_SUCCESS
    assert lib.cuEventQuery(never_recorded) == CUDA_SUCCESS

    start = time.monotonic()
    assert lib.cuMemcpyDtoHAsync_v2(dst, address(src), len(src), None) == CUDA_SUCCESS
    event = record(lib)
    assert lib.cuEventQuery(event) == CUDA_ERROR_NOT_READY
    assert lib.double_pending_copies() == 1
    assert dst.raw == bytes(len(dst))

    assert wait_event(lib, event) == CUDA_SUCCESS
    assert time.monotonic() - start >= 0.3
    assert dst.raw == src.raw
    assert lib.double_pending_copies() == 0
    assert copy_log(lib) == [(address(dst), address(src), len(src))]
    for e in (event, never_recorded):
        assert lib.cuEventDestroy_v2(e) == CUDA_SUCCESS
    assert lib.cuMemHostUnregister(dst) == CUDA_SUCCESS


@pytest.mark.timeout(TIMEOUT)
def test_double_runs_no_held_copy_until_released(new_double):
    lib = started(new_double())
    src = source(b"x" * 4096)
    dst = ctypes.create_string_buffer(4096)
    lib.double_hold_copies(1)
    try:
        for _ in range(2):  # two copies behind one event: it waits for both
            assert lib.cuMemcpyDtoHAsync_v2(dst, address(src), 4096, None) == CUDA_SUCCESS
        event = record(lib)
        time.sleep(0.05)  # time the worker would have needed, were it not held
        assert lib.cuEventQuery(event) == CUDA_ERROR_NOT_READY
        assert lib.double_pending_copies() == 2
        assert dst.raw == bytes(4096)
    finally:
        lib.double_hold_copies(0)
    assert wait_event(lib, event) == CUDA_SUCCESS
    assert dst.raw == src.raw
    assert lib.double_copy_calls() == 2


@pytest.mark.timeout(TIMEOUT)
def test_double_fails_the_nth_registration_and_keeps_registered_ranges(new_double):
    lib = started(new_double(fail_register_at=2))
    chunks = [ctypes.create_string_buffer(4096) for _ in range(3)]
    results = [lib.cuMemHostRegister_v2(chunk, 4096, 0) for chunk in chunks]
    assert results == [CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS]
    assert (lib.double_registered_ranges(), lib.double_registered_bytes()) == (2, 8192)

    memory_type = c_uint(0)
    inside, failed = address(chunks[0]) + 4095, address(chunks[1])
    rc = lib.cuPointerGetAttribute(byref(memory_type), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, inside)
    assert (rc, memory_type.value) == (CUDA_SUCCESS, CU_MEMORYTYPE_HOST)
    rc = lib.cuPointerGetAttribute(byref(memory_type), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, failed)
    assert rc == CUDA_ERROR_INVALID_VALUE

    overlapping = ctypes.c_void_p(address(chunks[0]) + 100)
    assert lib.cuMemHostRegister_v2(overlapping, 16, 0) == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert lib.cuMemHostRegister_v2(chunks[1], 0, 0) == CUDA_ERROR_INVALID_VALUE
    assert lib.cuMemHostUnregister(chunks[1]) == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    assert lib.cuMemHostUnregister(overlapping) == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    for chunk in (chunks[0], chunks[2]):
        assert lib.cuMemHostUnregister(chunk) == CUDA_SUCCESS
    assert (lib.double_registered_ranges(), lib.double_registered_bytes()) == (0, 0)
    assert (lib.double_register_calls(), lib.double_unregister_calls()) == (5, 4)
    lib.double_reset_counters()
    assert (lib.double_register_calls(), lib.double_copy_calls()) == (0, 0)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("code", [CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_LAUNCH_FAILED])
def test_double_poisons_the_device_after_a_sticky_copy_failure(new_double, code):
    lib = started(new_double(fail_copy_at=2, fail_code=code))
    src = source(b"y" * 256)
    dst = ctypes.create_string_buffer(256)
    lib.double_hold_copies(1)
    try:
        assert lib.cuMemcpyDtoHAsync_v2(dst, address(src), 256, None) == CUDA_SUCCESS
        event = record(lib)
        assert lib.cuMemcpyDtoHAsync_v2(dst, address(src), 256, None) == code
        assert lib.cuEventQuery(event) == code  # pending, and now never reported done
        assert lib.cuMemHostRegister_v2(dst, 256, 0) == code
        assert lib.cuMemcpyDtoHAsync_v2(dst, address(src), 256, None) == code
    finally:
        lib.double_hold_copies(0)
    count = c_int(0)
    assert (lib.cuDeviceGetCount(byref(count)), count.value) == (CUDA_SUCCESS, 1)
    deadline = time.monotonic() + POLL_LIMIT
    while lib.double_pending_copies():  # a copy queued before the failure still writes
        if time.monotonic() > deadline:
            pytest.fail("the copy queued before the sticky failure never ran")
        time.sleep(0.005)
    assert dst.raw == src.raw
    assert lib.cuEventQuery(event) == code
    assert lib.double_copy_calls() == 3
    name = c_char_p()
    assert lib.cuGetErrorName(code, byref(name)) == CUDA_SUCCESS
    assert name.value.startswith(b"CUDA_ERROR_")
    assert lib.double_reconfigure() == CUDA_SUCCESS  # the environment still fails copy 2
    assert lib.cuEventQuery(event) == CUDA_SUCCESS


@pytest.mark.timeout(TIMEOUT)
def test_double_fails_one_copy_with_a_code_that_is_not_sticky(new_double):
    lib = started(new_double(fail_copy_at=1))
    src = source(b"z" * 64)
    dst = ctypes.create_string_buffer(64)
    assert lib.cuMemcpyDtoHAsync_v2(dst, address(src), 64, None) == CUDA_ERROR_INVALID_VALUE
    assert lib.double_pending_copies() == 0
    assert lib.cuMemcpyDtoHAsync_v2(dst, address(src), 64, None) == CUDA_SUCCESS
    assert wait_event(lib, record(lib)) == CUDA_SUCCESS
    assert dst.raw == src.raw
    assert len(copy_log(lib)) == 2  # failed calls are logged too


@pytest.mark.timeout(TIMEOUT)
def test_double_requires_cuinit_a_device_and_a_current_context(new_double):
    version = c_int(0)
    lib = new_double(driver_version=11040)
    assert (lib.cuDriverGetVersion(byref(version)), version.value) == (CUDA_SUCCESS, 11040)
    count = c_int(-1)
    assert lib.cuDeviceGetCount(byref(count)) == CUDA_ERROR_NOT_INITIALIZED
    assert lib.cuInit(0) == CUDA_SUCCESS
    assert lib.cuMemHostRegister_v2(byref(count), 4, 0) == CUDA_ERROR_INVALID_CONTEXT
    make_context_current(lib)
    assert lib.cuMemHostRegister_v2(byref(count), 4, 0) == CUDA_SUCCESS
    name = ctypes.create_string_buffer(64)
    assert lib.cuDeviceGetName(name, 64, 0) == CUDA_SUCCESS
    assert name.value

    no_gpu = new_double(devices=0)
    assert no_gpu.cuInit(0) == CUDA_ERROR_NO_DEVICE
    assert no_gpu.cuDeviceGetCount(byref(count)) == CUDA_ERROR_NOT_INITIALIZED
    text = c_char_p()
    assert no_gpu.cuGetErrorString(CUDA_ERROR_NO_DEVICE, byref(text)) == CUDA_SUCCESS
    assert text.value == b"no CUDA-capable device is detected"
    assert no_gpu.cuGetErrorName(12345, byref(text)) == CUDA_ERROR_INVALID_VALUE
    assert text.value is None


@pytest.mark.timeout(TIMEOUT)
def test_double_old_driver_variant_lacks_the_async_copy(cuda_double_old_driver):
    lib = double(cuda_double_old_driver)
    assert not hasattr(lib, "cuMemcpyDtoHAsync_v2")
    assert all(hasattr(lib, name) for name in ("cuInit", "cuEventQuery", "cuMemHostRegister_v2"))
