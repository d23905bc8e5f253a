"""torch's formats as writers (`StateDictWriter`s): torch.save and DCP checkpoint directories with
the same atomic commit as the default, and torch.save to a file path a framework chose."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..errors import NotSupportedError
from . import commit, directory_commit, entries, file_output

logger = logging.getLogger(__name__)


class TorchSaveWriter:
    """torch.save with torch's layout (``checkpoint_{rank}.pt``, what torch's CheckpointReader
    reads), committed atomically. Reports its progress (see `file_output`)."""

    reports_progress = True

    def __init__(
        self, rank_info: Any = None, *, keep_last: int | None = None, barrier_timeout: float = 600.0
    ) -> None:
        self.rank, self.world_size = commit.rank_and_world(rank_info)
        self.keep_last = keep_last
        self.barrier_timeout = float(barrier_timeout)

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        def fill(temp: Path) -> list[Path]:
            file = temp / f"checkpoint_{self.rank}.pt"
            try:
                with entries.open_new_file(file) as out:
                    torch.save(state_dict, file_output.progress_file(out))
            except BaseException:
                file.unlink(missing_ok=True)  # free the space before other ranks are told
                raise
            return [file]

        directory_commit.commit_directory(
            path, fill, self.keep_last, rank=self.rank, world_size=self.world_size,
            attempt=kwargs.get("attempt"), barrier_timeout=self.barrier_timeout,
            replace=bool(kwargs.get("replace", False)),
            link_latest=bool(kwargs.get("link_latest", True)),
        )  # fmt: skip

    def close(self) -> None:
        _wait_for_deletions()


class DcpWriter:
    """torch.distributed.checkpoint format (single process), committed atomically."""

    def __init__(self, rank_info: Any = None, *, keep_last: int | None = None) -> None:
        if commit.rank_and_world(rank_info)[1] != 1:
            raise NotSupportedError(
                "the DCP writer is single-process: DCP across ranks plans the save collectively over "
                "torch.distributed, which a writer subprocess does not join (use "
                "torch.distributed.checkpoint.async_save with pyshmckpt.ShmStager instead)"
            )
        self.keep_last = keep_last

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        import torch.distributed.checkpoint as dcp

        def fill(temp: Path) -> None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state_dict, checkpoint_id=os.fspath(temp), no_dist=True)

        directory_commit.commit_directory(
            path, fill, self.keep_last, replace=bool(kwargs.get("replace", False)),
            link_latest=bool(kwargs.get("link_latest", True)),
        )  # fmt: skip

    def close(self) -> None:
        _wait_for_deletions()


class TorchFileWriter:
    """torch.save to exactly the file `path` names, atomically: into a temporary file beside it,
    fsynced, renamed over `path`, then the directory and its parent fsynced (so that a directory
    made just before, such as a DeepSpeed tag directory, is durable too). For frameworks that
    name their own files; the directory must exist. A reader sees the old file or the whole new
    one, never part of one; a write cut short leaves only a temporary (`temporaries`). Reports
    its progress (see `file_output`), unless a subclass's `serialize` writes otherwise."""

    reports_progress = True

    def __init__(self, rank_info: Any = None) -> None:
        pass  # every rank writes the files it is given: nothing depends on the rank

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        target = Path(path)
        commit.write_file(
            target, lambda file: self.serialize(state_dict, file), _temp_prefix(target)
        )
        commit.fsync_path(target.parent.parent)

    def serialize(self, state_dict: Any, file: BinaryIO) -> None:
        """Write `state_dict` into the open temporary `file`: torch.save (override for another
        format)."""
        torch.save(state_dict, file_output.progress_file(file))

    @staticmethod
    def temporaries(path: str | os.PathLike[str]) -> list[Path]:
        """Temporary files that writes of `path` cut short (a killed writer) left beside it."""
        target = Path(path)
        prefix = _temp_prefix(target)
        try:
            return [p for p in target.parent.iterdir() if p.name.startswith(prefix)]
        except FileNotFoundError:
            return []


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _wait_for_deletions() -> None:
    if not commit.wait_for_deletions(60.0):
        logger.warning("old checkpoints were still being deleted after 60 s")
