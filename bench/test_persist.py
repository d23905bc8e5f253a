"""Persisting benchmarks (issue: durable files): our safetensors writer against dd and torch.save.

    pytest bench/test_persist.py [--bench-dir DIR]

Each round writes 1 GiB (``--bench-gib``) five ways to the same directory, one after the other,
so that all three see the same disk (shared virtual disks drift a lot from minute to minute):

* ``dd if=<1 GiB of random bytes in /dev/shm> bs=16M conv=fsync``, and the same with
  ``oflag=direct`` (the reference for our O_DIRECT option);
* ``torch.save`` of the state dict (256 float32 tensors) followed by fsync;
* ``pyshmckpt.Checkpointer.save(state).result()``: staging, handoff, the writer's persist (header
  + writev straight from shared memory + fsync + JSON manifest + atomic commit), end to end. The
  writer subprocess's own time for the persist step is recorded separately.
* the same with ``Checkpointer(direct_io=True)`` (the data written with O_DIRECT).

Medians over the rounds go to the summary table; pytest-benchmark's own timing is of one whole
round and is not a figure we quote.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch

import pyshmckpt
from pyshmckpt.storage.commit import fsync_path

from conftest import GIB, MEDIANS, make_state

ROUNDS = 7


@pytest.fixture(scope="module")
def target_dir(request, tmp_path_factory) -> Path:
    chosen = request.config.getoption("--bench-dir", default=None)
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("persist")
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_persist_against_dd_and_torch_save(benchmark, target_dir, total_bytes):
    benchmark.group = "persist 1 GiB (one round = dd x2 + torch.save + ours x2)"
    state = make_state(total_bytes, 256)
    source = Path("/dev/shm") / f"bench-random-{os.getpid()}.bin"
    source.write_bytes(os.urandom(total_bytes))
    count = total_bytes // (16 << 20)
    times: dict[str, list[float]] = {
        "persist_dd": [], "persist_dd_direct": [], "persist_torch_save": [], "save_ours": [], "persist_ours": [],
        "save_ours_direct": [], "persist_ours_direct": [],
    }  # fmt: skip
    checkpointers = {}
    for suffix, direct in (("", False), ("_direct", True)):
        root = target_dir / f"ours{suffix}"
        root.mkdir(exist_ok=True)
        checkpointers[suffix] = pyshmckpt.Checkpointer(
            root, keep_last=1, capacity_bytes=total_bytes + (8 << 20), direct_io=direct
        )

    def one_round() -> None:
        for name, flags in (("persist_dd", []), ("persist_dd_direct", ["oflag=direct"])):
            out = target_dir / "dd.bin"
            started = time.perf_counter()
            subprocess.run(
                ["dd", f"if={source}", f"of={out}", "bs=16M", f"count={count}", "conv=fsync", *flags],
                check=True, capture_output=True, timeout=600,
            )  # fmt: skip
            times[name].append(time.perf_counter() - started)
            out.unlink()

        out = target_dir / "torch.pt"
        started = time.perf_counter()
        torch.save(state, out)
        fsync_path(out)
        times["persist_torch_save"].append(time.perf_counter() - started)
        out.unlink()

        for suffix, checkpointer in checkpointers.items():
            started = time.perf_counter()
            checkpointer.save(state).result()
            times[f"save_ours{suffix}"].append(time.perf_counter() - started)
            times[f"persist_ours{suffix}"].append(checkpointer._process.last_write_seconds)

    try:
        for checkpointer in checkpointers.values():
            checkpointer.save(state).result()  # warm: writer attached, page tables built
        benchmark.pedantic(one_round, rounds=ROUNDS)
    finally:
        for checkpointer in checkpointers.values():
            checkpointer.close()
        source.unlink()
    for name, values in times.items():
        median = statistics.median(values)
        MEDIANS[name] = median
        benchmark.extra_info[f"{name}_median_s"] = round(median, 4)
        benchmark.extra_info[f"{name}_GiB/s"] = round(total_bytes / GIB / median, 3)
        benchmark.extra_info[f"{name}_all_s"] = [round(v, 4) for v in values]
