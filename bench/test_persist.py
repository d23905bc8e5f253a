"""Persisting benchmarks (issue: durable files): our safetensors writer against dd and torch.save.

    pytest bench/test_persist.py [--bench-dir DIR]

All three write 1 GiB (``--bench-gib``) to the same directory (default: pytest's tmp dir) and
fsync it. "ours, persist" is the writer subprocess's time for one checkpoint (header + writev
from shared memory + fsync + JSON manifest + atomic commit); "ours, save" is the trainer's
``Checkpointer.save(...).result()`` end to end (staging, handoff, persist).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import GIB, MEDIANS, make_state, record

import pyshmckpt

ROUNDS = 5


@pytest.fixture(scope="module")
def target_dir(request, tmp_path_factory) -> Path:
    chosen = request.config.getoption("--bench-dir", default=None)
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("persist")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def state(total_bytes):
    return make_state(total_bytes, 256)


def test_dd_with_fsync(benchmark, target_dir, total_bytes):
    benchmark.group = "persist 1 GiB"
    out = target_dir / "dd.bin"
    count = total_bytes // (16 << 20)

    def run() -> None:
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={out}", "bs=16M", f"count={count}", "conv=fsync"],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        out.unlink()

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, "persist_dd", count * (16 << 20))


def test_torch_save_with_fsync(benchmark, target_dir, state, total_bytes):
    benchmark.group = "persist 1 GiB"
    out = target_dir / "torch.pt"

    def run() -> None:
        torch.save(state, out)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        out.unlink()

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, "persist_torch_save", total_bytes)


def test_ours(benchmark, target_dir, state, total_bytes):
    benchmark.group = "persist 1 GiB"
    root = target_dir / "ours"
    root.mkdir(exist_ok=True)
    persist_times: list[float] = []
    with pyshmckpt.Checkpointer(root, keep_last=1, capacity_bytes=total_bytes + (8 << 20)) as ck:
        ck.save(state).result()  # warm: writer attached, caches built

        def run() -> None:
            ck.save(state).result()
            persist_times.append(ck._process.last_write_seconds)

        benchmark.pedantic(run, rounds=ROUNDS)
    shutil.rmtree(root)
    record(benchmark, "save_ours", total_bytes)
    persist_times.sort()
    median = persist_times[len(persist_times) // 2]
    MEDIANS["persist_ours"] = median
    benchmark.extra_info["persist_s_median"] = median
    benchmark.extra_info["persist_GiB/s"] = round(total_bytes / GIB / median, 3)
