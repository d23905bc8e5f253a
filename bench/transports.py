"""The two sides every benchmark compares, built the same way everywhere.

* ours: ``pyshmckpt.ShmStager`` + ``pyshmckpt.CheckpointProcess`` (the manifest goes through the
  pipe, the bytes stay in shared memory);
* torch: ``DefaultStager`` (shared memory, synchronous) + torch's ``_experimental``
  ``CheckpointProcess``, which pickles the state dict through its pipe (one file descriptor per
  storage).

Writers are stand-ins that do the same work on both sides: ``PageTouchingWriter`` reads one byte
of every page of every tensor (the writer has really received the data), ``NoopWriter`` does
nothing (the handoff alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
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

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        # numpy views are the cheapest per-tensor access from Python; the concatenation reads the
        # first byte of every page of every tensor.
        pages = [t.numpy().reshape(-1).view(np.uint8)[::PAGE] for t in state_dict.values()]
        self.last = int(np.concatenate(pages).sum(dtype=np.int64))


class NoopWriter:
    def __init__(self, rank_info: RankInfo) -> None:
        self.rank_info = rank_info

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        pass


def ours_process(writer: type) -> CheckpointProcess:
    """Our writer process, started (spawn finished) before any timing."""
    cp = CheckpointProcess(RANK, CheckpointProcessConfig(), no_init, (), writer, {})
    cp.process_creation_future.result()
    return cp


def torch_process(
    writer: type, writer_kwargs: dict[str, Any] | None = None, *, started: bool = True
) -> Any:
    """Torch's writer process, started before any timing (with `started`; else it starts in
    the background, as ours does in a Checkpointer)."""
    from torch.distributed.checkpoint._experimental.checkpoint_process import (
        CheckpointProcess as TorchProcess,
    )
    from torch.distributed.checkpoint._experimental.checkpoint_process import (
        CheckpointProcessConfig as TorchConfig,
    )

    cp = TorchProcess(RANK, TorchConfig(), no_init, (), writer, writer_kwargs or {})
    if started:
        cp.process_creation_future.result()
    return cp


def torch_stager() -> Any:
    """Torch's DefaultStager: shared memory on, synchronous; pinned memory and non-blocking
    copies only where CUDA is available (as torch recommends for GPU state)."""
    import torch
    from torch.distributed.checkpoint._experimental.staging import (
        CheckpointStagerConfig,
        DefaultStager,
    )

    cuda = torch.cuda.is_available()
    return DefaultStager(
        CheckpointStagerConfig(
            use_pinned_memory=cuda,
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


@contextlib.contextmanager
def side(name: str, writer: type, capacity_bytes: int) -> Iterator[tuple[Any, Any]]:
    """(writer process, stager) of one transport ("ours" or "torch"), both closed on exit."""
    if name == "ours":
        cp, stager = ours_process(writer), ShmStager(capacity_bytes=capacity_bytes)
    else:
        cp, stager = torch_process(writer), torch_stager()
    try:
        yield cp, stager
    finally:
        try:
            cp.close()
        finally:
            stager.close()
