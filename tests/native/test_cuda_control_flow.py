"""Our CUDA control flow, run against the test double of the CUDA driver (cuda_driver_double.c):
loading the driver at run time, registering memory in chunks and unwinding a failure, copies
batched and split at chunk boundaries, events polled with a bound, sticky errors, and a slot that
is never unmapped while a copy may still land.

These test pyshmckpt's logic, not a GPU: the double copies host memory on a thread. Each scenario
runs in a child interpreter (the extension loads its driver once per process) with
``PYSHMCKPT_CUDA_DRIVER`` naming the double, and reports what it saw as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from cuda_double import (  # noqa: F401 (fixtures)
    cuda_double_batch_fixture,
    cuda_double_fixture,
    cuda_double_old_driver_fixture,
)
from helpers import child_env

TIMEOUT = 120
PAGE = 4096

# The child's prelude: the extension, the double it loaded (same path: same instance), helpers.
PRELUDE = """
import ctypes, json, logging, os, sys, time
import numpy as np
from pyshmckpt.shm import native
from pyshmckpt.shm.native import _C
import pyshmckpt
from cuda_double import copy_log, double
lib = double(os.environ["PYSHMCKPT_CUDA_DRIVER"])
logging.basicConfig(level=logging.WARNING)
out = {}
def report():
    print("RESULT " + json.dumps(out))
"""


def scenario(driver: Path, body: str, **settings: Any) -> dict[str, Any]:
    """Run `body` after the prelude in a child whose CUDA driver is `driver`; its `out` dict.

    The child runs in the double's directory: never in a checkout, whose unbuilt package would
    shadow the installed one."""
    env = {**child_env(), "PYSHMCKPT_CUDA_DRIVER": str(driver)}
    env.update({f"PYSHMCKPT_{k.upper()}": str(v) for k, v in settings.items()})
    code = PRELUDE + textwrap.dedent(body) + "\nreport()\n"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=driver.parent,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        pytest.fail(f"the scenario failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return dict(json.loads(results[-1][len("RESULT ") :]), stderr=done.stderr)


@pytest.mark.timeout(TIMEOUT)
def test_the_driver_is_loaded_at_run_time_from_the_configured_library(cuda_double):
    got = scenario(
        cuda_double,
        """
        status = _C.cuda_driver_status()
        out.update(status)
        from pyshmckpt.shm.cuda import cuda_info
        out["lines"] = cuda_info().lines()
        """,
    )
    assert got["usable"] is True, got
    assert Path(got["path"]).resolve() == cuda_double.resolve()
    assert got["version"] == 12080
    assert len(got["devices"]) == 1
    assert got["missing"] == []
    lines = got["lines"]
    assert f"driver: {got['path']} (version 12.8)" in lines, lines
    assert "pinning a test buffer: works" in lines, lines
    assert got["batched_copies"] == ""  # the double of a driver before 12.8
    assert "device-to-host copies: one cuMemcpyDtoHAsync per copy (the driver has no" in (
        "\n".join(lines)
    ), lines
    if torch.cuda.is_available():  # a GPU machine: the double stands in for its driver
        assert lines[-1] == "CUDA staging: usable", lines
    else:  # torch sees no CUDA: staging CUDA tensors cannot run, and says why
        assert lines[-1].startswith("CUDA staging: not usable: torch reports no CUDA"), lines


@pytest.mark.timeout(TIMEOUT)
def test_a_driver_without_a_device_or_too_old_is_reported_in_words(
    cuda_double, cuda_double_old_driver
):
    none = scenario(cuda_double, "out.update(_C.cuda_driver_status())", double_devices=0)
    assert none["usable"] is False
    assert none["reason"].startswith("no CUDA device"), none
    old = scenario(
        cuda_double_old_driver,
        """
        out.update(_C.cuda_driver_status())
        seg = native.Segment.create(4 * 4096)
        out["pinned"] = seg.pin(4096)
        out["pin_error"] = seg.pin_error
        try:
            seg.copy_from_device(np.zeros((1, 3), dtype=np.uint64), 0, 0)
        except pyshmckpt.CudaError as exc:
            out["copy_error"] = str(exc)
        seg.close()
        """,
    )
    assert old["usable"] is False
    assert old["missing"] == ["cuMemcpyDtoHAsync_v2"]
    assert "is too old for pyshmckpt: it lacks cuMemcpyDtoHAsync_v2" in old["reason"], old
    assert old["pinned"] is False
    assert "too old" in old["pin_error"], old
    assert "too old" in old["copy_error"], old


@pytest.mark.timeout(TIMEOUT)
def test_pinning_registers_in_chunks_and_unwinds_a_failure_midway(cuda_double):
    body = """
    seg = native.Segment.create(10 * 4096)
    out["pinned"] = seg.pin(4096 * 3)
    out["pin_error"] = seg.pin_error
    out["register_calls"] = lib.double_register_calls()
    out["unregister_calls"] = lib.double_unregister_calls()
    out["live_ranges"] = lib.double_registered_ranges()
    out["is_pinned"] = _C.is_pinned(seg.address)
    seg.close()
    out["live_after_close"] = lib.double_registered_ranges()
    """
    good = scenario(cuda_double, body)
    # 10 data pages + the header page in chunks of 3 pages: 4 registrations, all undone at close.
    assert good["pinned"] is True, good
    assert (good["register_calls"], good["live_ranges"]) == (4, 4), good
    assert good["is_pinned"] is True
    assert (good["unregister_calls"], good["live_after_close"]) == (0, 0), good
    failed = scenario(cuda_double, body, double_fail_register_at=3)
    assert failed["pinned"] is False
    assert "cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY" in failed["pin_error"], failed
    assert "at offset 24576" in failed["pin_error"], failed
    # The two chunks registered before the failure were unregistered, nothing is left.
    assert (failed["register_calls"], failed["unregister_calls"]) == (3, 2), failed
    assert failed["live_ranges"] == 0
    assert failed["is_pinned"] is False


# A batch of many small copies and a large one across chunk boundaries, on a stream (the double
# takes any non-null handle: it has one queue), checked where they landed.
BATCH = """
chunk = 3 * 4096
seg = native.Segment.create(32 * 4096)
if not seg.pin(chunk):
    raise SystemExit(seg.pin_error)
base = seg.data_offset
sources = [np.full(300, i % 251, dtype=np.uint8) for i in range(200)]
big = np.arange(8 * 4096, dtype=np.uint32).view(np.uint8)[: 7 * 4096 + 5]
rows = [(s.ctypes.data, base + 300 * i, 300) for i, s in enumerate(sources)]
rows.append((big.ctypes.data, base + 70000, big.nbytes))
rows = np.array(rows, dtype=np.uint64)

def stage(stream):
    seg.copy_from_device(rows, stream, 0).wait(30)
    view = np.frombuffer(seg, dtype=np.uint8)
    ok = all((view[base + 300 * i : base + 300 * (i + 1)] == i % 251).all() for i in range(200))
    ok = ok and bool((view[base + 70000 : base + 70000 + big.nbytes] == big).all())
    view[base : base + 80000] = 0  # for the next stage to fill again
    del view
    return ok

def counts():
    return {"batch": lib.double_batch_calls(), "copy": lib.double_copy_calls(),
            "logged": len(copy_log(lib))}
"""


@pytest.mark.timeout(TIMEOUT)
def test_copies_are_batched_across_tensors_and_split_at_chunk_boundaries(cuda_double):
    got = scenario(
        cuda_double,
        BATCH
        + textwrap.dedent(
            """
            out["ok"] = stage(0)
            out["log"] = [(dst - seg.address, src, n) for dst, src, n in copy_log(lib)]
            out["chunk"] = chunk
            seg.close()
            """
        ),
    )
    assert got["ok"] is True
    chunk = got["chunk"]
    log = got["log"]
    assert all(dst // chunk == (dst + n - 1) // chunk for dst, _, n in log), "a copy spans chunks"
    # One batch: 200 small copies (some split where they straddle a chunk) and the large one cut
    # at each chunk boundary it crosses.
    assert len(log) > 201
    assert sum(n for _, _, n in log) == 200 * 300 + 7 * 4096 + 5


@pytest.mark.timeout(TIMEOUT)
def test_waiting_for_a_copy_is_bounded_and_a_closed_slot_stays_mapped_until_it_lands(cuda_double):
    got = scenario(
        cuda_double,
        """
        from pyshmckpt.shm import Arena
        arena = Arena(8 * 4096, 1, pin=True)
        slot = arena.slots[0]
        source = np.full(4096, 7, dtype=np.uint8)
        lib.double_hold_copies(1)
        event = slot.copy_from_device(
            np.array([[source.ctypes.data, 0, 4096]], dtype=np.uint64), 0, 0
        )
        started = time.monotonic()
        out["waited"] = event.wait(0.3)
        out["wait_s"] = time.monotonic() - started
        out["pending"] = slot.copies_pending()
        address = slot.segment.address + slot.offset
        name = slot.segment.name
        started = time.monotonic()
        arena.close()  # the copy cannot land within PYSHMCKPT_DEVICE_COPY_TIMEOUT
        out["close_s"] = time.monotonic() - started
        out["kept_mapped"] = slot.segment.kept_mapped
        out["unlinked"] = not os.path.exists("/dev/shm/" + name)
        out["still_pinned"] = _C.is_pinned(address)
        lib.double_hold_copies(0)  # the late copy lands in memory that is still ours
        deadline = time.monotonic() + 10
        while lib.double_pending_copies() and time.monotonic() < deadline:
            time.sleep(0.01)
        out["late_copy_landed"] = ctypes.string_at(address, 4096) == bytes(source)
        """,
        device_copy_timeout=0.5,
    )
    assert got["waited"] is False
    assert got["pending"] is True
    assert 0.25 <= got["wait_s"] < 10, got
    assert 0.4 <= got["close_s"] < 10, got
    assert got["kept_mapped"] is True
    assert got["unlinked"] is True
    assert got["still_pinned"] is True, got
    assert got["late_copy_landed"] is True, got
    assert "may still land" in got["stderr"], got["stderr"]


@pytest.mark.timeout(TIMEOUT)
def test_a_sticky_error_midway_is_typed_and_keeps_the_segment_mapped(cuda_double):
    body = """
    seg = native.Segment.create(4 * 4096)
    source = np.ones(64, dtype=np.uint8)
    rows = np.array([[source.ctypes.data, seg.data_offset + 64 * i, 64] for i in range(3)],
                    dtype=np.uint64)
    try:
        seg.copy_from_device(rows, 0, 0)
    except pyshmckpt.CudaError as exc:
        out["error"] = str(exc)
        out["type"] = type(exc).__name__
    out["kept_mapped"] = seg.kept_mapped
    try:
        out["after"] = "copied" if seg.copy_from_device(rows[:1], 0, 0).wait(30) else "pending"
    except pyshmckpt.CudaError as exc:
        out["after"] = str(exc)
    seg.close()
    """
    sticky = scenario(cuda_double, body, double_fail_copy_at=2, double_fail_code=700)
    assert sticky["type"] == "CudaError", sticky
    assert "cuMemcpyDtoHAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS" in sticky["error"], sticky
    assert "sticky error" in sticky["error"], sticky
    assert sticky["kept_mapped"] is True  # the first copy was queued: it may still land
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in sticky["after"], sticky  # stays unusable
    first = scenario(cuda_double, body, double_fail_copy_at=1, double_fail_code=1)
    assert "CUDA_ERROR_INVALID_VALUE" in first["error"]
    assert "sticky" not in first["error"]
    assert first["kept_mapped"] is False  # nothing was queued: the segment unmaps normally
    assert first["after"] == "copied"


@pytest.mark.timeout(TIMEOUT)
def test_many_copies_go_in_one_batched_driver_call_where_the_driver_has_it(cuda_double_batch):
    got = scenario(
        cuda_double_batch,
        BATCH
        + textwrap.dedent(
            """
        out["ok"] = [stage(0x5000), stage(0x5000)]
        out["two_stages"] = counts()
        out["log"] = [(dst - seg.address, n) for dst, _, n in copy_log(lib)]
        out["chunk"] = chunk
        out["ok"].append(stage(0))  # the legacy default stream: batches never take it
        out["null_stream"] = counts()
        out.update(_C.cuda_driver_status())
        from pyshmckpt.shm.cuda import cuda_info
        out["lines"] = cuda_info().lines()
        seg.close()
        """
        ),
    )
    assert got["ok"] == [True, True, True]
    assert got["batched_copies"] == "cuMemcpyBatchAsync_v2"
    assert got["two_stages"]["batch"] == 2, got  # one call per stage, however many tensors
    assert got["two_stages"]["copy"] == 0, got
    pieces = got["two_stages"]["logged"] // 2
    assert pieces > 201  # 200 small copies, some split at a chunk boundary, and the large one cut
    chunk = got["chunk"]
    assert all(dst // chunk == (dst + n - 1) // chunk for dst, n in got["log"]), "spans chunks"
    assert got["null_stream"]["batch"] == 2, got
    assert got["null_stream"]["copy"] == pieces, got
    assert (
        "device-to-host copies: batched: one cuMemcpyBatchAsync_v2 per device and stage"
        in (got["lines"])
    ), got["lines"]


@pytest.mark.timeout(TIMEOUT)
def test_a_driver_that_refuses_batches_gets_one_call_per_copy_from_then_on(cuda_double_batch):
    got = scenario(
        cuda_double_batch,
        BATCH
        + textwrap.dedent(
            """
        out["ok"] = [stage(0x5000)]
        out["first"] = counts()
        out["ok"].append(stage(0x5000))
        out["second"] = counts()
        out["method"] = _C.cuda_driver_status()["copy_method"]
        seg.close()
        """
        ),
        double_fail_batch_code=801,  # CUDA_ERROR_NOT_SUPPORTED
    )
    assert got["ok"] == [True, True]
    assert got["first"]["batch"] == 1, got
    assert got["first"]["copy"] > 201, got
    assert got["second"]["batch"] == 1, got  # not tried again
    assert got["second"]["copy"] == 2 * got["first"]["copy"], got
    assert got["method"].startswith(
        "one cuMemcpyDtoHAsync per copy (the driver refused a batch: cuMemcpyBatchAsync_v2 failed"
    ), got["method"]


@pytest.mark.timeout(TIMEOUT)
def test_a_sticky_error_of_a_batch_is_typed_and_keeps_the_segment_mapped(cuda_double_batch):
    got = scenario(
        cuda_double_batch,
        BATCH
        + textwrap.dedent(
            """
        try:
            stage(0x5000)
        except pyshmckpt.CudaError as exc:
            out["error"] = str(exc)
        out["kept_mapped"] = seg.kept_mapped
        out["after"] = counts()
        seg.close()
        """
        ),
        double_fail_batch_code=700,  # CUDA_ERROR_ILLEGAL_ADDRESS
    )
    assert "cuMemcpyBatchAsync_v2 failed: CUDA_ERROR_ILLEGAL_ADDRESS" in got["error"], got
    assert "sticky error" in got["error"], got
    assert got["kept_mapped"] is True  # the driver gives no promise that nothing was queued
    assert got["after"]["copy"] == 0, got  # no fallback for an error that is not a refusal
