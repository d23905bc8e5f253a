"""Stage + handoff + persist benchmarks (issue: writer subprocess), ours against torch's transport.

    pytest bench/test_handoff.py

One round is one checkpoint: stage the state dict, hand it to the writer subprocess and wait
until the writer has read one byte of every page of every tensor. Sides:

* ours, ShmStager: ``ShmStager.stage`` + ``pyshmckpt.CheckpointProcess.write`` (manifest only);
* ours, plain: ``pyshmckpt.CheckpointProcess.write`` of the plain state dict (staged inside);
* torch: ``DefaultStager`` (shared memory, synchronous) + torch's ``CheckpointProcess.write``,
  which pickles the state dict through its pipe (one file descriptor per storage).

Each side has its own freshly spawned writer process, created before timing starts. "Handoff
alone" is the time from write() of an already-staged state dict until the writer's no-op
``write`` has been called and has answered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_state, record
from torch.distributed.checkpoint._experimental.types import RankInfo

from pyshmckpt import CheckpointProcess, CheckpointProcessConfig, ShmStager

RANK = RankInfo(global_rank=0, global_world_size=1)
PAGE = 4096


def no_init() -> None:
    pass


class PageTouchingWriter:
    """Reads one byte of every page of every tensor, as a stand-in for a writer."""

    def __init__(self, rank_info: RankInfo) -> None:
        self.rank_info = rank_info

    def write(self, path: str, state_dict, **kwargs) -> None:
        # numpy views are the cheapest per-tensor access from Python; the concatenation reads the
        # first byte of every page of every tensor.
        pages = [t.numpy().reshape(-1).view(np.uint8)[::PAGE] for t in state_dict.values()]
        self.last = int(np.concatenate(pages).sum(dtype=np.int64))


class NoopWriter:
    def __init__(self, rank_info: RankInfo) -> None:
        self.rank_info = rank_info

    def write(self, path: str, state_dict, **kwargs) -> None:
        pass


@pytest.fixture(scope="module", params=[256, 8192], ids=lambda n: f"{n}tensors")
def state(request, total_bytes):
    yield request.param, make_state(total_bytes, request.param)


def _ours(writer):
    cp = CheckpointProcess(RANK, CheckpointProcessConfig(), no_init, (), writer, {})
    cp.process_creation_future.result()
    return cp


def _torch_process(writer):
    from torch.distributed.checkpoint._experimental.checkpoint_process import (
        CheckpointProcess as TorchProcess,
    )
    from torch.distributed.checkpoint._experimental.checkpoint_process import (
        CheckpointProcessConfig as TorchConfig,
    )

    cp = TorchProcess(RANK, TorchConfig(), no_init, (), writer, {})
    cp.process_creation_future.result()
    return cp


def _torch_stager():
    from torch.distributed.checkpoint._experimental.staging import (
        CheckpointStagerConfig,
        DefaultStager,
    )

    return DefaultStager(
        CheckpointStagerConfig(
            use_pinned_memory=False,
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


def test_ours_with_shm_stager(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"stage + handoff + persist: {count} tensors"
    cp = _ours(PageTouchingWriter)
    stager = ShmStager(capacity_bytes=total_bytes + (8 << 20))
    try:

        def save() -> None:
            cp.write(stager.stage(sd), "unused").result()

        benchmark.pedantic(save, rounds=5, warmup_rounds=2)
    finally:
        cp.close()
        stager.close()
    record(benchmark, f"e2e_ours_shm_{count}", total_bytes)


def test_ours_with_plain_state_dict(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"stage + handoff + persist: {count} tensors"
    cp = _ours(PageTouchingWriter)
    try:
        benchmark.pedantic(lambda: cp.write(sd, "unused").result(), rounds=5, warmup_rounds=2)
    finally:
        cp.close()
    record(benchmark, f"e2e_ours_plain_{count}", total_bytes)


def test_torch_checkpoint_process(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"stage + handoff + persist: {count} tensors"
    cp = _torch_process(PageTouchingWriter)
    stager = _torch_stager()
    try:

        def save() -> None:
            cp.write(stager.stage(sd), "unused").result()

        benchmark.pedantic(save, rounds=3, warmup_rounds=1)
    finally:
        cp.close()
        stager.close()
    record(benchmark, f"e2e_torch_{count}", total_bytes)


def test_handoff_alone_ours(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"handoff alone: {count} tensors"
    cp = _ours(NoopWriter)
    stager = ShmStager(capacity_bytes=total_bytes + (8 << 20))
    try:

        def setup():
            return (stager.stage(sd),), {}

        benchmark.pedantic(lambda staged: cp.write(staged, "unused").result(), setup=setup, rounds=20, warmup_rounds=2)
    finally:
        cp.close()
        stager.close()
    record(benchmark, f"handoff_ours_{count}", total_bytes)


def test_handoff_alone_torch(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"handoff alone: {count} tensors"
    cp = _torch_process(NoopWriter)
    stager = _torch_stager()
    try:
        staged = stager.stage(sd)
        benchmark.pedantic(lambda: cp.write(staged, "unused").result(), rounds=3, warmup_rounds=1)
    finally:
        cp.close()
        stager.close()
    record(benchmark, f"handoff_torch_{count}", total_bytes)


