"""Lightning: `ShmCheckpointIO`, a CheckpointIO that saves through pyshmckpt asynchronously.

    trainer = Trainer(plugins=[ShmCheckpointIO()], callbacks=[ModelCheckpoint(...)])

Each checkpoint path Lightning picks (``epoch=0-step=4.ckpt``, ``last.ckpt``) becomes a
pyshmckpt checkpoint directory of that name, written by a writer process per directory of
checkpoints: ``save_checkpoint`` returns once the state is staged in shared memory and the
training loop goes on while the write persists and commits. A path may also be in object
storage (``s3://bucket/run/last.ckpt``: a checkpoint of that name under the root
``s3://bucket/run``), and a local ``dirpath`` can be mirrored there (``mirror=``). Lightning's checkpoint dict carries
hyper-parameters, callback and loop state, which may be any objects: leaves that are not plain
data are pickled, as Lightning's own format pickles everything (``load_checkpoint`` unpickles
them unless Lightning asks for ``weights_only=True``). Tensors are stored as safetensors, so
``pyshmckpt verify`` checks each checkpoint and ``pyshmckpt.load`` reads it without Lightning.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import pickle
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ..checkpointer import Checkpointer
from ..errors import (
    CheckpointCorruptError,
    ConfigError,
    ConfigTypeError,
    NotSupportedError,
    PathNotFoundError,
    PyshmckptError,
    WriteTimeoutError,
    as_writer_error,
    from_os_error,
)
from ..storage import commit, locations, object_commit, writer_spec
from ..storage.object_store import ObjectPath
from ..tiers import load

logger = logging.getLogger(__name__)


class ShmCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing pyshmckpt checkpoints in the background.

    Pass it as ``Trainer(plugins=[ShmCheckpointIO()])``. Each checkpoint path Lightning picks
    becomes a pyshmckpt checkpoint directory of that name, written by a `Checkpointer` per
    directory of checkpoints.

    Args:
        dirpath: the directory checkpoints go to (ModelCheckpoint's ``dirpath``), when known:
            its writer process starts now, in the background, instead of at the first save
            (whose write then waits for the writer to start). Other directories work as well,
            and so do ``s3://`` prefixes (as `Checkpointer` roots).
        mirror: an object storage root (``s3://bucket/prefix``) that every checkpoint saved
            under the local `dirpath` is copied to in the background once it is durable, under
            the same name (``Checkpointer(dirpath, mirror=...)``); a checkpoint removed there is
            removed from the mirror too. `load_checkpoint` of a path under `dirpath` that is
            not on this node's disk (a new node) reads the mirror's copy. Needs `dirpath`.
        write_timeout: seconds ``load_checkpoint`` waits for a pending write of its path before
            raising (``teardown`` waits for each write up to the writer's own write timeout,
            ``config.write_timeout_secs``).
        **checkpointer_options: passed to each `pyshmckpt.Checkpointer`: ``slots``,
            ``capacity_bytes``, ``direct_io``, ``config``, ``writer`` (a safetensors writer).
            ``allow_pickle`` is on; retention is ModelCheckpoint's, not ``keep_last``.

    Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only, so the
    checkpoints are written by rank 0's writer process alone (under DDP every rank holds the
    same state). A write that fails is raised by the next call into this object (as Lightning's
    ``AsyncCheckpointIO`` does) and by ``teardown()``. No need to wrap this in Lightning's
    ``AsyncCheckpointIO``: it is asynchronous already, and the wrapper would clone every tensor
    on the training thread first.

    Raises:
        ConfigTypeError: ``write_timeout`` is not a number, or ``dirpath`` not a path.
        NotSupportedError: an option other than those above, or a writer that is not a
            safetensors writer.
        UnsupportedLocationError: ``dirpath`` or ``mirror`` is a URL pyshmckpt does not
            write (``az://``, ``https://``), or ``s3://``/``gs://`` without its extra.
        ConfigError: an unknown writer, a ``mirror`` without a local ``dirpath`` or not in
            object storage, or (with ``dirpath``, on global rank 0) an option value a
            `Checkpointer` refuses.
        PyshmckptOSError: (with ``dirpath``, on global rank 0) ``dirpath`` cannot be created or
            written.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        mirror: str | None = None,
        write_timeout: float = 600.0,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(write_timeout, bool) or not isinstance(write_timeout, (int, float)):
            raise ConfigTypeError(f"write_timeout must be a number, not {write_timeout!r}")
        refused = sorted(set(checkpointer_options) - _OPTIONS)
        if refused:
            raise NotSupportedError(
                f"{type(self).__name__} takes {sorted(_OPTIONS)}, not {refused} (Lightning saves "
                "on rank 0 alone, ModelCheckpoint decides what is kept, and load_checkpoint reads "
                "the safetensors format)"
            )
        if not writer_spec(checkpointer_options.get("writer", "safetensors")).needs_plain_leaves:
            raise NotSupportedError("ShmCheckpointIO needs a safetensors writer (load reads it)")
        self._options = {"allow_pickle": True, **checkpointer_options}
        self._write_timeout = float(write_timeout)
        self._checkpointers: dict[Path | ObjectPath, Checkpointer] = {}
        self._pending: dict[Path | ObjectPath, Future[Path | ObjectPath]] = {}
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._dirpath = None if dirpath is None else _where(dirpath)
        self._mirror = _mirror_of(self._dirpath, mirror)
        self._prestart()

    def _prestart(self) -> None:
        """Start the writer of the known checkpoint directory (on global rank 0 only: the other
        ranks never save)."""
        if self._dirpath is not None and _global_rank_zero():
            self._checkpointer(self._dirpath)

    def __getstate__(self) -> dict[str, Any]:
        """Its settings only (Lightning's ddp_spawn pickles the Trainer for each process)."""
        return {
            "dirpath": None if self._dirpath is None else str(self._dirpath),
            "mirror": None if self._mirror is None else str(self._mirror),
            "write_timeout": self._write_timeout,
            "options": self._options,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = {k: v for k, v in state["options"].items() if k != "allow_pickle"}
        self.__init__(  # type: ignore[misc]
            state["dirpath"], mirror=state["mirror"], write_timeout=state["write_timeout"],
            **options,
        )  # fmt: skip

    # -- Lightning's CheckpointIO ----------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage `checkpoint` and return; it is written to the directory `path` in the background.

        Blocks while the state is copied into shared memory. An earlier pyshmckpt checkpoint at
        `path` is replaced atomically once this one is durable. A write that fails is raised by
        the next call into this object.

        Args:
            checkpoint: Lightning's checkpoint dict.
            path: the checkpoint's path (a local or mounted filesystem, ``file://`` accepted,
                or ``s3://bucket/prefix/name``).
            storage_options: must be None.

        Raises:
            NotSupportedError: `storage_options` is given.
            UnsupportedLocationError: `path` is a URL pyshmckpt does not write.
            ConfigTypeError: `path` is not a str or path.
            PyshmckptError: an earlier write that failed, not raised yet (itself when it is a
                pyshmckpt error, else as a `WriterError`); this checkpoint is then not saved.
            ConfigError: the last part of `path` is not a valid checkpoint name (it starts
                with '.' or is "latest").
            PathExistsError: `path` exists and is not a pyshmckpt checkpoint.
            UnsupportedValueError: a value of `checkpoint` cannot be staged.
            SlotsBusyError: no slot became free within the slot timeout.
            PyshmckptOSError: the directory of `path` cannot be created or written, or a slot
                cannot be created (``/dev/shm`` full).
            ObjectStoreError: (an ``s3://`` path, its first save there) the bucket is missing
                or the credentials are refused.
        """
        if storage_options is not None:
            raise NotSupportedError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r})"
            )
        self._raise_failure()
        target = _where(path)
        checkpointer = self._checkpointer(target.parent)
        future = checkpointer.save(checkpoint, target.name, overwrite=True)
        with self._lock:
            self._pending[target] = future
        future.add_done_callback(lambda f: self._finished(target, f))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint dict Lightning saved at `path`, after its write if pending.

        Tensors are loaded into memory (not left mapped to the files, whose disk space a later
        replacement would otherwise keep in use). A ``.ckpt`` file (Lightning's own format,
        from a run without this plugin) is read with ``torch.load`` as Lightning would.

        Args:
            path: the checkpoint's path (local, or ``s3://``). With a `mirror`, a path under
                `dirpath` that this node's disk does not hold is read from the mirror.
            map_location: the device tensors are loaded to (a string or torch.device; None:
                the CPU).
            weights_only: True: refuse pickled leaves; otherwise they are unpickled.

        Returns:
            The checkpoint dict.

        Raises:
            WriteTimeoutError: the pending write of `path` did not finish within
                ``write_timeout``.
            PyshmckptError: a write that failed, not raised yet (as in `save_checkpoint`).
            NotSupportedError: `map_location` is not a device.
            UnsupportedLocationError: `path` is a URL pyshmckpt does not read.
            ConfigTypeError: `path` is not a str or path, or the checkpoint is not a dict.
            CheckpointCorruptError: a file or object is damaged, the checkpoint holds pickled
                leaves and `weights_only` is True, or ``torch.load`` of a ``.ckpt`` failed.
            CheckpointNotFoundError: nothing is at `path` (nor in the mirror).
            PyshmckptOSError: a file cannot be read.
            ObjectStoreError: object storage failed or refused a request.
        """
        target = _where(path)
        self._wait_for(target)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise NotSupportedError(
                f"map_location must be a device (str or torch.device), not {map_location!r}"
            )
        mirrored = self._mirrored(target)
        if mirrored is not None and not _on_disk(target):
            target = mirrored  # a new node: its disk does not hold it
        if isinstance(target, Path) and target.is_file():
            with _os_errors(f"cannot load {target}"):
                try:
                    state = torch.load(target, map_location=map_location, weights_only=weights_only)
                except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
                    raise CheckpointCorruptError(str(target), f"torch.load failed: {exc}") from exc
        else:
            state = load(
                target,
                map_location=map_location,
                allow_pickle=weights_only is not True,
                mmap=False,
            )
        if not isinstance(state, dict):
            raise ConfigTypeError(f"{target} holds a {type(state).__name__}, not a checkpoint dict")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at `path` without waiting for its files to be deleted.

        Done at once (renamed away, its files deleted in the background), or, while its write
        is pending, by the writer process right after that write is committed: the training
        thread never waits for it, and the removal happens even if the trainer dies first
        (ModelCheckpoint's top-k stays k). In object storage, and for a mirrored `dirpath`, the
        writer process removes it (from the mirror as well) after the saves handed to it
        before. A checkpoint that does not exist is logged, not raised.

        Args:
            path: the checkpoint's path.

        Raises:
            ConfigTypeError: `path` is not a str or path.
            UnsupportedLocationError: `path` is a URL pyshmckpt does not write.
            PyshmckptOSError: it cannot be removed.
            ObjectStoreError: (``s3://``, no writer for its root) object storage failed.
            WriterDiedError: its write is pending and the writer process died, its restarts
                spent.
            PyshmckptError: a write (or removal) that failed, not raised yet (as in
                `save_checkpoint`).
        """
        target = _where(path)
        with self._lock:
            pending = self._pending.get(target)
            checkpointer = self._checkpointers.get(target.parent)
        in_writer = isinstance(target, ObjectPath) or self._mirrored(target) is not None
        if checkpointer is not None and (pending is not None or in_writer):
            removal = checkpointer.remove(target.name)
            removal.add_done_callback(lambda f: self._removed(target, f))
        else:
            self._remove_now(target)
        self._raise_failure()

    def teardown(self) -> None:
        """Finish every pending write (and removal waiting for one) and stop the writers.

        Blocks until they are done, each write bounded by the writer's write timeout. A later
        save starts a writer process again.

        Raises:
            CleanupError: a writer process could not be cleaned up.
            PyshmckptError: the first write (or removal) that failed, not raised yet.
        """
        with self._lock:
            checkpointers = list(self._checkpointers.values())
            self._checkpointers.clear()
        errors: list[BaseException] = []
        for checkpointer in checkpointers:
            try:
                checkpointer.close()
            except PyshmckptError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        self._raise_failure()

    # -- internals -------------------------------------------------------------------------------

    def _checkpointer(self, root: Path | ObjectPath) -> Checkpointer:
        with self._lock:
            checkpointer = self._checkpointers.get(root)
        if checkpointer is None:
            mirror = self._mirror if root == self._dirpath else None
            # No `latest` link: the directory holds Lightning's entries alone.
            checkpointer = Checkpointer(
                root, rank=0, world_size=1, link_latest=False, mirror=mirror, **self._options
            )
            with self._lock:
                self._checkpointers[root] = checkpointer
        return checkpointer

    def _mirrored(self, target: Path | ObjectPath) -> ObjectPath | None:
        """Where the mirror holds `target` (None: not a checkpoint of the mirrored dirpath)."""
        if self._mirror is None or target.parent != self._dirpath:
            return None
        return self._mirror / target.name

    def _finished(self, target: Path | ObjectPath, future: Future[Path | ObjectPath]) -> None:
        with self._lock:
            if self._pending.get(target) is future:
                del self._pending[target]
        error = future.exception()
        if error is not None:
            self._fail(f"checkpoint {target} failed", error)

    def _fail(self, what: str, error: BaseException) -> None:
        logger.error("%s: %s", what, error)
        with self._lock:
            if self._failure is None:
                self._failure = error

    def _removed(self, target: Path | ObjectPath, removal: Future[None]) -> None:
        error = removal.exception()
        if error is not None and not _write_failed_first(error):
            self._fail(f"could not remove checkpoint {target}", error)

    def _remove_now(self, target: Path | ObjectPath) -> None:
        if isinstance(target, ObjectPath):  # no writer of ours for its root: remove it here
            try:
                object_commit.remove(target.parent, target.name)
            except PathNotFoundError:
                logger.warning("remove_checkpoint(%s): no such checkpoint", target)
            return
        with _os_errors(f"cannot remove checkpoint {target}"):
            if target.is_dir() and not target.is_symlink():
                # Whatever Lightning asks to remove, as its own CheckpointIO removes it (a
                # directory another strategy wrote too), but atomically.
                commit.remove(target.parent, target.name, background=True)
            elif target.exists() or target.is_symlink():
                target.unlink()  # a file Lightning wrote before this plugin was in use
            else:
                logger.warning(
                    "remove_checkpoint(%s): no such checkpoint (wrapped in AsyncCheckpointIO, its "
                    "save may still be queued in the wrapper's thread: %s needs no wrapper)",
                    target, type(self).__name__,
                )  # fmt: skip

    def _wait_for(self, target: Path | ObjectPath) -> None:
        with self._lock:
            future = self._pending.get(target)
        if future is not None:
            try:
                future.exception(timeout=self._write_timeout)  # its failure is raised below
            except concurrent.futures.TimeoutError:  # the builtin TimeoutError from 3.11 on
                raise WriteTimeoutError(
                    f"checkpoint {target} was still being written after {self._write_timeout:g} s"
                ) from None
        self._raise_failure()

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise as_writer_error(failure, "a checkpoint write failed")


def _write_failed_first(error: BaseException) -> bool:
    """Whether a removal failed only because the write it followed failed (nothing of that
    name was committed): that write's failure is what is reported."""
    return isinstance(error, OSError) and error.errno == errno.ENOENT


def _global_rank_zero() -> bool:
    """Whether this process is global rank 0 by what launchers set (torchrun, SLURM, LSF,
    Lightning's own launcher: a process without them is)."""
    variables = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
    return all(os.environ.get(v, "0") in ("", "0") for v in variables)


_OPTIONS = frozenset({"slots", "capacity_bytes", "direct_io", "config", "writer"})


@contextlib.contextmanager
def _os_errors(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise from_os_error(exc, what) from exc


def _mirror_of(dirpath: Path | ObjectPath | None, mirror: Any) -> ObjectPath | None:
    if mirror is None:
        return None
    if not isinstance(dirpath, Path):
        raise ConfigError(
            f"mirror copies the checkpoints of a local dirpath to object storage, not {dirpath}"
        )
    return locations.object_root(mirror)


def _on_disk(target: Path | ObjectPath) -> bool:
    return isinstance(target, Path) and (target.exists() or target.is_symlink())


def _where(path: Any, what: str = "checkpoint path") -> Path | ObjectPath:
    where = locations.location(path, what)
    return where.absolute() if isinstance(where, Path) else where
