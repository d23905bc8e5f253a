"""CUDA staging (marked gpu: skipped without a GPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import pyshmckpt
from pyshmckpt import _C, ShmStager

from helpers import child_env

pytestmark = pytest.mark.gpu


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def test_device_to_host_staging_is_bitwise_equal():
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(256, 256, device="cuda", generator=g)
    source = {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "fp8": base.to(torch.float8_e4m3fn),
        "i64": torch.arange(1000, device="cuda"),
        "strided": base[:, ::3],
        "transposed": base.t(),
        "tied": base,
        "empty": torch.empty(0, 4, device="cuda"),
        "scalar": torch.tensor(3.5, device="cuda"),
        "cpu": torch.ones(7),
    }
    with ShmStager() as s:
        staged = s.stage(source)
        for key, value in source.items():
            assert staged[key].device.type == "cpu"
            assert same_bytes(staged[key], value.cpu()), key
        assert staged["tied"] is staged["f32"]
        assert staged["transposed"].data_ptr() == staged["f32"].data_ptr()


def test_arena_is_pinned():
    with ShmStager(capacity_bytes=8 << 20) as s:
        assert s.arena.pinned
        for slot in s.arena.slots:
            assert _C.is_pinned(slot.segment.address + slot.offset)


def test_pending_kernel_on_current_stream_finishes_before_the_copy():
    x = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    stream = torch.cuda.current_stream()
    with ShmStager(capacity_bytes=300 << 20) as s:
        for value in (1.0, 2.0, 3.0):
            torch.cuda._sleep(50_000_000)  # keep the stream busy so the fill is still queued
            x.fill_(value)
            staged = s.stage({"x": x})
            assert float(staged["x"][0]) == value
            assert float(staged["x"][-1]) == value
            del staged
        stream.synchronize()


def test_async_staging_of_cuda_tensors():
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    with ShmStager(async_staging=True) as s:
        staged = s.stage({"x": x}).result(timeout=60)
        assert same_bytes(staged["x"], x.cpu())


def test_cuda_available_is_true_on_a_gpu():
    assert pyshmckpt.cuda_available()
    assert _C.cuda_driver_status()["usable"]
    assert _C.cuda_device_count() >= 1


def test_a_cuda_tensor_where_pyshmckpt_cannot_load_the_driver_is_a_typed_error(tmp_path):
    """torch sees the GPU, but the driver pyshmckpt is told to load does not exist: staging a
    CUDA tensor names its key path and why, and stages nothing."""
    code = textwrap.dedent(
        """
        import torch, pyshmckpt
        state = {"model": {"w": torch.ones(4, device="cuda")}}
        try:
            with pyshmckpt.ShmStager() as stager:
                stager.stage(state)
        except pyshmckpt.CudaUnavailableError as exc:
            print("PATH", exc.path)
            print("REASON", exc.reason)
        """
    )
    env = {**child_env(), "PYSHMCKPT_CUDA_DRIVER": str(tmp_path / "missing-libcuda.so.1")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "PATH state_dict['model']['w']" in done.stdout, done.stdout
    assert "no CUDA driver" in done.stdout, done.stdout
