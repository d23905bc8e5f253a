"""Our pieces inside torch's own: torch's `_experimental` AsyncCheckpointer assembled from mixes
of stagers (ShmStager, blocking or asynchronous, and torch's DefaultStager), checkpoint processes
(pyshmckpt's and torch's) and writers (torch's CheckpointWriter and our TorchSaveWriter), such
that every pair of pieces meets in at least one of them.

Each combination saves, through one AsyncCheckpointer: a 16 MiB state, then a small one with
mixed dtypes (a BatchNorm's int64 counter beside float32 weights) several times back to back
(torch waits for each write before staging the next; the staged dicts it drops stay in reference
cycles of its Futures), then a final one followed at once by AsyncCheckpointer.close(), which
closes the stager before the process. Every file must hold what was saved, the small ones only
their own bytes. The final save survives with our CheckpointProcess; torch's cancels a write its
thread has not started yet when it is closed (``shutdown(cancel_futures=True)``, whatever the
stager: torch's own pieces lose it too on a busy machine), so there it is written whole or, if
cancelled, not at all.
"""

from __future__ import annotations

from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._experimental.checkpoint_process import (
    CheckpointProcess as TorchCheckpointProcess,
)
from torch.distributed.checkpoint._experimental.checkpoint_process import (
    CheckpointProcessConfig as TorchProcessConfig,
)
from torch.distributed.checkpoint._experimental.checkpoint_reader import CheckpointReader
from torch.distributed.checkpoint._experimental.checkpointer import AsyncCheckpointer
from torch.distributed.checkpoint._experimental.staging import (
    CheckpointStagerConfig,
    DefaultStager,
)
from torch.distributed.checkpoint._experimental.types import RankInfo

import pyshmckpt
from pyshmckpt.storage import TorchSaveWriter

from helpers import SAVE_TIMEOUT, assert_same_tree, bounded_config
from writer_side import no_init, torch_writer

RANK = RankInfo(global_rank=0, global_world_size=1)
SMALL_SAVES = 4  # more than the two slots a ShmStager has


STAGERS = {
    "shm": lambda: pyshmckpt.ShmStager(slot_timeout=10),
    "shm-async": lambda: pyshmckpt.ShmStager(async_staging=True, slot_timeout=10),
    "torch": lambda: DefaultStager(
        CheckpointStagerConfig(
            use_pinned_memory=False,
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )  # fmt: skip
    ),
}
WRITERS = {"torch": torch_writer, "ours": TorchSaveWriter}


def make_process(kind: str, writer: str) -> Any:
    args = (no_init, (), WRITERS[writer], {"rank_info": RANK})
    if kind == "ours":
        return pyshmckpt.CheckpointProcess(RANK, bounded_config(), *args)
    config = TorchProcessConfig(
        subprocess_init_timeout_secs=120, subprocess_shutdown_timeout_secs=60
    )
    return TorchCheckpointProcess(RANK, config, *args)


# (stager, process, writer): every pair of pieces meets in at least one combination, none of
# them torch's pieces alone (each combination costs a writer process start).
COMBINATIONS = [
    ("shm", "ours", "torch"),
    ("shm", "torch", "ours"),
    ("shm-async", "ours", "ours"),
    ("shm-async", "torch", "torch"),
    ("torch", "ours", "torch"),
    ("torch", "torch", "ours"),
]


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    model(torch.randn(8, 32))  # BatchNorm's num_batches_tracked (int64) becomes 1
    return model


def saved(path: Path) -> Any:
    return torch.load(path / "checkpoint_0.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stager", "process", "writer"), COMBINATIONS)
def test_torch_async_checkpointer_with_our_pieces(tmp_path, stager, process, writer):
    checkpointer = AsyncCheckpointer(
        STAGERS[stager](), make_process(process, writer), CheckpointReader(RANK)
    )
    closed = False
    try:
        model = small_model()
        states = [{"big": torch.randn(4 << 20)}]  # 16 MiB: the slots are sized from it
        for step in range(SMALL_SAVES):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            states.append({"model": model.state_dict(), "step": step})
        states = [
            {k: v if not isinstance(v, dict) else {n: t.clone() for n, t in v.items()}
             for k, v in s.items()}
            for s in states
        ]  # fmt: skip
        for i, state in enumerate(states):
            _, write = checkpointer.save(str(tmp_path / f"save{i}"), state)
        write.result(timeout=SAVE_TIMEOUT)
        final = {"model": small_model().state_dict(), "step": "final"}
        _, last = checkpointer.save(str(tmp_path / "final"), final)
        checkpointer.close()  # at once: torch's closes the stager, then the process
        closed = True
        try:
            last.result(timeout=SAVE_TIMEOUT)
        except CancelledError:
            assert process == "torch", "our CheckpointProcess cancelled a write at close()"
            assert not (tmp_path / "final").exists()
        else:
            assert_same_tree(final, saved(tmp_path / "final"))
    finally:
        if not closed:
            checkpointer.close()

    for i, state in enumerate(states):
        assert_same_tree(state, saved(tmp_path / f"save{i}"))
    small = (tmp_path / "save1" / "checkpoint_0.pt").stat().st_size
    state_bytes = sum(t.nbytes for t in states[1]["model"].values())
    assert small < state_bytes + 16384  # its own bytes, not the 16 MiB slot it was staged in


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stager_first", [True, False])
@pytest.mark.parametrize("stager", ["shm", "shm-async"])
def test_the_last_save_survives_either_close_order(tmp_path, stager, stager_first):
    shm_stager = STAGERS[stager]()
    process = make_process("ours", "torch")
    checkpointer = AsyncCheckpointer(shm_stager, process, CheckpointReader(RANK))
    final = {"model": small_model().state_dict(), "step": 9}
    _, last = checkpointer.save(str(tmp_path / "final"), final)
    for piece in (shm_stager, process) if stager_first else (process, shm_stager):
        piece.close()
    last.result(timeout=SAVE_TIMEOUT)
    assert_same_tree(final, saved(tmp_path / "final"))
