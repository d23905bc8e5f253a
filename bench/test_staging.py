"""Staging benchmarks (issue: foundation): ShmStager against a single copy and torch's stager.

    pytest bench/test_staging.py --benchmark-columns=median,iqr,rounds

Steady state: the arena exists and the previous staged copy was dropped. First stage: a stager
built with ``capacity_bytes`` (so arena creation is not part of the timing), its first stage.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from pyshmckpt import ShmStager

from conftest import record
from transports import torch_stager

ROUNDS = 7


def test_numpy_copyto_single_copy(benchmark, total_bytes):
    benchmark.group = "staging: single-copy reference"
    src = np.ones(total_bytes, dtype=np.uint8)
    dst = np.zeros(total_bytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault in the destination: we compare against a warm copy
    benchmark.pedantic(np.copyto, args=(dst, src), rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, "copyto", total_bytes)


def test_ours_steady_state(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"staging steady state: {count} tensors"
    with ShmStager(capacity_bytes=total_bytes + (8 << 20)) as stager:

        def stage() -> None:
            stager.stage(sd)  # the staged copy is dropped at once: its slot is reused

        benchmark.pedantic(stage, rounds=ROUNDS, warmup_rounds=2)
    record(benchmark, f"ours_steady_{count}", total_bytes)


def test_ours_first_stage(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"staging first stage: {count} tensors"
    stagers: list[ShmStager] = []

    def setup():
        while stagers:
            stagers.pop().close()
        gc.collect()
        stagers.append(ShmStager(capacity_bytes=total_bytes + (8 << 20)))
        return (stagers[-1],), {}

    def stage(stager: ShmStager) -> None:
        stager.stage(sd)

    try:
        benchmark.pedantic(stage, setup=setup, rounds=3)
    finally:
        while stagers:
            stagers.pop().close()
    record(benchmark, f"ours_first_{count}", total_bytes)


def test_torch_default_stager_steady_state(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"staging steady state: {count} tensors"
    stager = torch_stager()
    try:
        benchmark.pedantic(lambda: stager.stage(sd), rounds=ROUNDS, warmup_rounds=1)
    finally:
        stager.close()
    record(benchmark, f"torch_steady_{count}", total_bytes)


def test_torch_default_stager_first_stage(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"staging first stage: {count} tensors"
    stagers = []

    def setup():
        while stagers:
            stagers.pop().close()
        gc.collect()
        stagers.append(torch_stager())
        return (stagers[-1],), {}

    try:
        benchmark.pedantic(lambda s: s.stage(sd), setup=setup, rounds=3)
    finally:
        while stagers:
            stagers.pop().close()
    record(benchmark, f"torch_first_{count}", total_bytes)


@pytest.mark.gpu
def test_device_to_host_staging(benchmark, total_bytes):
    """D2H of one tensor into the pinned arena (GPU machines only)."""
    benchmark.group = "staging: device to host, one tensor"
    x = torch.rand(total_bytes // 4, device="cuda")
    with ShmStager(capacity_bytes=total_bytes + (8 << 20)) as stager:
        benchmark.pedantic(lambda: stager.stage({"x": x}), rounds=ROUNDS, warmup_rounds=2)
    record(benchmark, "ours_d2h_1", total_bytes)
