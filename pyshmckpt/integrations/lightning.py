"""Lightning: `ShmCheckpointIO`, a CheckpointIO that saves through pyshmckpt asynchronously.

    trainer = Trainer(plugins=[ShmCheckpointIO()], callbacks=[ModelCheckpoint(...)])

Each checkpoint path Lightning picks (``epoch=0-step=4.ckpt``, ``last.ckpt``) becomes a
pyshmckpt checkpoint directory of that name, written by a writer process per directory of
checkpoints: ``save_checkpoint`` returns once the state is staged in shared memory and the
training loop goes on while the write persists and commits. Lightning's checkpoint dict carries
hyper-parameters, callback and loop state, which may be any objects: leaves that are not plain
data are pickled, as Lightning's own format pickles everything (``load_checkpoint`` unpickles
them unless Lightning asks for ``weights_only=True``). Tensors are stored as safetensors, so
``pyshmckpt verify`` checks each checkpoint and ``pyshmckpt.load`` reads it without Lightning.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ..checkpointer import Checkpointer
from ..errors import (
    ConfigTypeError,
    NotSupportedError,
    PyshmckptError,
    WriterError,
    WriteTimeoutError,
)
from ..storage import commit, load

logger = logging.getLogger(__name__)


class ShmCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing pyshmckpt checkpoints in the background.

    Args:
        write_timeout: seconds ``remove_checkpoint``, ``load_checkpoint`` and ``teardown`` wait
            for a pending write (of that path, or all of them) before raising.
        **checkpointer_options: passed to each `pyshmckpt.Checkpointer` (``slots``,
            ``capacity_bytes``, ``direct_io``, ``config``, ...). ``allow_pickle`` is on.

    Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only, so the
    checkpoints are written by rank 0's writer process alone (under DDP every rank holds the
    same state). A write that fails is raised by the next call into this object (as Lightning's
    ``AsyncCheckpointIO`` does) and by ``teardown()``. No need to wrap this in Lightning's
    ``AsyncCheckpointIO``: it is asynchronous already, and the wrapper would clone every tensor
    on the training thread first.
    """

    def __init__(self, *, write_timeout: float = 600.0, **checkpointer_options: Any) -> None:
        super().__init__()
        if isinstance(write_timeout, bool) or not isinstance(write_timeout, (int, float)):
            raise ConfigTypeError(f"write_timeout must be a number, not {write_timeout!r}")
        if "rank" in checkpointer_options or "world_size" in checkpointer_options:
            raise NotSupportedError("Lightning saves on rank 0 alone: rank/world_size are fixed")
        self._options = {"allow_pickle": True, **checkpointer_options}
        self._write_timeout = float(write_timeout)
        self._checkpointers: dict[Path, Checkpointer] = {}
        self._pending: dict[Path, Future[Path]] = {}
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    # -- Lightning's CheckpointIO ----------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage `checkpoint` and return; it is written to the directory `path` in the background
        (an earlier pyshmckpt checkpoint there is replaced atomically once this one is durable)."""
        if storage_options is not None:
            raise NotSupportedError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r})"
            )
        self._raise_failure()
        target = _local_path(path)
        checkpointer = self._checkpointer(target.parent)
        future = checkpointer.save(checkpoint, target.name, overwrite=True)
        with self._lock:
            self._pending[target] = future
        future.add_done_callback(lambda f: self._finished(target, f))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict Lightning saved at `path` (waiting for its write if pending).

        Tensors come back on the CPU unless `map_location` names a device (a string or
        torch.device); pickled leaves are loaded unless `weights_only` is True."""
        target = _local_path(path)
        self._wait_for(target)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise NotSupportedError(
                f"map_location must be a device (str or torch.device), not {map_location!r}"
            )
        state = load(target, map_location=map_location, allow_pickle=weights_only is not True)
        if not isinstance(state, dict):
            raise ConfigTypeError(f"{target} holds a {type(state).__name__}, not a checkpoint dict")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at `path`, after its pending write if any; it disappears at
        once (renamed away), and its files are deleted in the background."""
        target = _local_path(path)
        with self._lock:
            pending = target in self._pending
        if pending:
            self._wait_for(target)
        if target.is_dir() and not target.is_symlink():
            commit.check_replaceable(target)  # a directory of ours, never someone else's
            commit.remove(target.parent, target.name, background=True)
        elif target.exists() or target.is_symlink():
            target.unlink()  # a file Lightning wrote before this plugin was in use
        elif not pending:
            logger.warning(
                "remove_checkpoint(%s): no such checkpoint (wrapped in AsyncCheckpointIO, its save "
                "may still be queued in the wrapper's thread: %s needs no wrapper)",
                target, type(self).__name__,
            )  # fmt: skip
        self._raise_failure()

    def teardown(self) -> None:
        """Finish every pending write and stop the writer processes (started again by the next
        save); raises the first write that failed."""
        with self._lock:
            checkpointers = list(self._checkpointers.values())
            self._checkpointers.clear()
        for checkpointer in checkpointers:
            checkpointer.close()
        self._raise_failure()

    # -- internals -------------------------------------------------------------------------------

    def _checkpointer(self, root: Path) -> Checkpointer:
        with self._lock:
            checkpointer = self._checkpointers.get(root)
        if checkpointer is None:
            checkpointer = Checkpointer(root, rank=0, world_size=1, **self._options)
            with self._lock:
                self._checkpointers[root] = checkpointer
        return checkpointer

    def _finished(self, target: Path, future: Future[Path]) -> None:
        with self._lock:
            if self._pending.get(target) is future:
                del self._pending[target]
            error = future.exception()
            if error is not None and self._failure is None:
                self._failure = error
        if error is not None:
            logger.error("checkpoint %s failed: %s", target, error)

    def _wait_for(self, target: Path) -> None:
        with self._lock:
            future = self._pending.get(target)
        if future is not None:
            try:
                future.exception(timeout=self._write_timeout)  # its failure is raised below
            except TimeoutError:
                raise WriteTimeoutError(
                    f"checkpoint {target} was still being written after {self._write_timeout:g} s"
                ) from None
        self._raise_failure()

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if isinstance(failure, PyshmckptError):
            raise failure
        if failure is not None:
            raise WriterError(f"a checkpoint write failed: {failure!r}") from failure


def _local_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigTypeError(f"checkpoint path must be a str or path, not {type(path).__name__}")
    text = os.fspath(path)
    if "://" in str(text) and not str(text).startswith("file://"):
        raise NotSupportedError(f"{text}: pyshmckpt writes to local or mounted filesystems only")
    return Path(str(text).removeprefix("file://")).absolute()
