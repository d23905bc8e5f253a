"""The other writers selectable by name, with the same atomic commit as the default one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import commit


def _rank(rank_info: Any) -> tuple[int, int]:
    rank = int(getattr(rank_info, "global_rank", 0) or 0)
    world = int(getattr(rank_info, "global_world_size", 1) or 1)
    if world != 1:
        raise NotImplementedError("multi-rank commits need a barrier and are not supported yet")
    return rank, world


class TorchSaveWriter:
    """torch.save with torch's layout (``checkpoint_{rank}.pt``, what torch's CheckpointReader
    reads), committed atomically."""

    def __init__(self, rank_info: Any = None, *, keep_last: int | None = None) -> None:
        self.rank, _ = _rank(rank_info)
        self.keep_last = keep_last

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        def fill(temp: Path) -> None:
            torch.save(state_dict, temp / f"checkpoint_{self.rank}.pt")

        commit.commit_directory(path, fill, self.keep_last)


class DcpWriter:
    """torch.distributed.checkpoint format (single process), committed atomically."""

    def __init__(self, rank_info: Any = None, *, keep_last: int | None = None) -> None:
        _rank(rank_info)
        self.keep_last = keep_last

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        import warnings

        import torch.distributed.checkpoint as dcp

        def fill(temp: Path) -> None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state_dict, checkpoint_id=os.fspath(temp), no_dist=True)

        commit.commit_directory(path, fill, self.keep_last)
