"""Accelerate: ``accelerator.save_state()`` made asynchronous, through a pyshmckpt `Checkpointer`.

Use `ShmStateSaver` where you would call ``accelerator.save_state()`` / ``load_state()``:

    saver = ShmStateSaver(accelerator)       # after accelerator.prepare(...)
    saver.save_state()                       # returns once staged; training goes on
    saver.load_state()                       # on resume
    saver.close()                            # at the end: finishes pending writes

What becomes asynchronous: the model and optimizer state (the bytes that make a save slow) is
staged into shared memory and written by the writer process while training continues. What stays
Accelerate's: the small rest (schedulers, RNG states and ``step``, dataloader/sampler state, the
gradient scaler, registered custom objects) is produced and restored by Accelerate's own
``save_accelerator_state`` / ``load_accelerator_state`` / ``*_custom_state`` with its own file
names, synchronously (kilobytes), and carried byte for byte inside the same checkpoint.

Each ``save_state`` is one pyshmckpt checkpoint directory (``rank<r>.safetensors``,
``rank<r>.json``, ``commit.json``) that appears atomically once durable: a crash never leaves a
half-written one. Read it back with this class's ``load_state`` (``accelerator.load_state`` does
not know the format). Staged saves are finished even if the trainer dies, as the Checkpointer
does.
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import logging
import os
import re
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)
from accelerate.utils import DistributedType

from ..checkpointer import Checkpointer
from ..errors import (
    CheckpointAbortedError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    ClosedError,
    ConfigError,
    ConfigTypeError,
    NotSupportedError,
    WriteTimeoutError,
    as_writer_error,
    os_error,
)
from ..storage import locations, object_commit
from ..storage.inspection import saved_ranks
from ..storage.object_store import ObjectPath
from ..storage.roots import root_of
from ..storage.safetensors_writer import file_names
from ..tiers import load
from ..transport import CheckpointProcessConfig

logger = logging.getLogger(__name__)

# Where the model and optimizer state is each process's plain state dict (DDP or one process).
# FSDP, DeepSpeed and Megatron-LM save through their own engines; XLA tensors are not staged.
SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# What prepare() and register_for_checkpointing() took, Accelerate keeps in the lists _models,
# _optimizers, _schedulers, _dataloaders and _custom_objects, which its own save_state reads; it
# offers no public accessor, so this module reads them as well.
CHECKPOINTS = "checkpoints"  # Accelerate's folder under project_dir for automatic naming
_CUSTOM_FILE = re.compile(r"custom_checkpoint_\d+\.pkl")


class ShmStateSaver:
    """``save_state``/``load_state`` for an `Accelerator`, the model and optimizer state written
    asynchronously by a pyshmckpt `Checkpointer`.

    ``save_state(output_dir)`` saves what ``accelerator.save_state(output_dir)`` saves: every
    prepared model, optimizer, scheduler and dataloader, the scaler, RNG states, ``step`` and
    registered custom objects. It returns a Future once the state is staged (training may change
    it right after); the Future resolves to the checkpoint's path once it is durable.
    ``load_state(input_dir)`` first waits for pending saves, then restores all of it.

    Directories follow the accelerator's `ProjectConfiguration`: with automatic checkpoint naming,
    ``project_dir/checkpoints/checkpoint_<i>`` (``i`` is ``accelerator.save_iteration``, advanced
    by each save as Accelerate does; ``output_dir`` is ignored, as Accelerate ignores it), and
    ``total_limit`` keeps the newest committed checkpoints, an older one removed only after a
    newer one is durable (never one being written); ``load_state()`` loads the newest. Without
    it, ``output_dir`` is the checkpoint, created atomically; an existing one written by this
    class is replaced atomically once the new one is durable (anything else there is refused).
    One writer process runs at a time, for the parent directory of the last save (with automatic
    naming, ``project_dir/checkpoints``, started here): a save under another directory first
    finishes the pending writes of the previous one and stops its writer.

    Object storage: a directory (``output_dir``, ``input_dir``, ``project_dir``) may be an
    ``s3://bucket/prefix`` URL: each checkpoint is then committed in the bucket, as by a
    `Checkpointer` on that root (the processes meet there: no shared filesystem needed). Or,
    with automatic naming, the checkpoints of a local ``project_dir`` are mirrored there
    (``mirror``).

    A save that fails (a full disk, a writer error) is logged at once and raised, as a
    `PyshmckptError`, by the next ``save_state``, ``wait``, ``load_state`` or ``close``; the
    saver stays usable.

    Processes (DDP, one process per device): as with Accelerate, the main process writes the
    models and optimizers (replicated on every process); every process writes its own RNG state
    and whatever else Accelerate writes per process, each as its ``rank<r>`` files of one
    checkpoint on a filesystem every process shares, committed once all are durable. Every
    process must call ``save_state`` and ``load_state`` (and, with automatic naming, construct
    the saver) together. A process without a file of its own in the checkpoint (more processes
    than saved it) takes the main process's files, and keeps its RNG state, as Accelerate does.

    Not covered: FSDP, DeepSpeed, Megatron-LM and XLA (`NotSupportedError`: use
    ``accelerator.save_state``), ``save_on_each_node`` with several processes, and hooks
    registered with ``register_save_state_pre_hook``/``register_load_state_pre_hook`` (not
    called). Accelerate's small files are loaded as Accelerate loads them (custom objects
    unpickled): load only checkpoints you trust, as with ``accelerator.load_state``.

    Args:
        accelerator: the `Accelerator` whose prepared objects are saved.
        slots: passed to the `Checkpointer` (see there).
        allow_pickle: passed to the `Checkpointer`, and applies to loading too. Optimizer state
            is plain data; a model or optimizer holding other objects needs allow_pickle=True.
        direct_io: passed to the `Checkpointer`.
        capacity_bytes: passed to the `Checkpointer`.
        config: passed to the `Checkpointer`.
        barrier_timeout: passed to the `Checkpointer`.
        mirror: an object storage root (``s3://bucket/prefix``, ``gs://...``) that the
            checkpoints under ``project_dir/checkpoints`` (automatic naming, a local
            ``project_dir``) are copied to in the background, under their names
            (``Checkpointer(root, mirror=...)``; ``total_limit`` applies there too).
            ``load_state()`` loads the mirror's newest when the local directory holds none (a
            new node), and ``load_state(input_dir)`` of a checkpoint of that directory that is
            missing reads its copy in the mirror.

    Raises:
        ConfigTypeError: `accelerator` is not an ``accelerate.Accelerator``.
        NotSupportedError: the accelerator runs FSDP, DeepSpeed, Megatron-LM or XLA, or
            ``save_on_each_node`` with several processes.
        ConfigError: automatic checkpoint naming without a ``project_dir``, a ``mirror`` not
            in object storage or without automatic naming in a local ``project_dir``, or
            (with automatic naming, where the `Checkpointer` is made here) an option it
            refuses.
        UnsupportedLocationError: ``project_dir`` or ``mirror`` is a URL pyshmckpt does not
            write (``az://``, ``https://``), or ``s3://``/``gs://`` without its extra.
        PyshmckptOSError: (with automatic naming) ``project_dir/checkpoints`` cannot be
            created or written.
        ObjectStoreError: (automatic naming in object storage, or a ``mirror``) the bucket is
            missing or the credentials are refused.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        *,
        slots: int = 2,
        allow_pickle: bool = False,
        direct_io: bool = False,
        capacity_bytes: int | None = None,
        config: CheckpointProcessConfig | Any = None,
        barrier_timeout: float = 600.0,
        mirror: str | None = None,
    ) -> None:
        self._checkpointer: Checkpointer | None = None
        self._closed = True
        if not isinstance(accelerator, Accelerator):
            raise ConfigTypeError(
                f"accelerator must be an accelerate.Accelerator, not {type(accelerator).__name__}"
            )
        if accelerator.distributed_type not in SUPPORTED:
            raise NotSupportedError(
                f"ShmStateSaver does not save {accelerator.distributed_type.value} state "
                "(supported: one process, DDP): use accelerator.save_state"
            )
        project = accelerator.project_configuration
        if project.save_on_each_node and accelerator.num_processes > 1:
            raise NotSupportedError(
                "save_on_each_node: ShmStateSaver writes one checkpoint on a filesystem every "
                "process shares"
            )
        if project.automatic_checkpoint_naming and project.project_dir is None:
            raise ConfigError("automatic_checkpoint_naming needs a project_dir")
        self._accelerator = accelerator
        self._mirror = _mirror_root(mirror)
        if self._mirror is not None and not (
            project.automatic_checkpoint_naming and isinstance(self._automatic_root(), Path)
        ):
            raise ConfigError(
                "mirror copies the checkpoints of automatic naming under a local project_dir "
                "(project_dir/checkpoints) to object storage"
            )
        self._allow_pickle = bool(allow_pickle)
        self._options: dict[str, Any] = {
            "slots": slots, "allow_pickle": allow_pickle, "direct_io": direct_io,
            "capacity_bytes": capacity_bytes, "config": config, "barrier_timeout": barrier_timeout,
        }  # fmt: skip
        self._pending: list[Future[Path | ObjectPath]] = []  # what wait() waits for
        self._unsettled: dict[
            Future[Path | ObjectPath], Path | ObjectPath
        ] = {}  # saves whose outcome is not recorded yet
        self._failure: BaseException | None = None  # the first failed save not raised yet
        self._lock = threading.Lock()
        self._closed = False
        if project.automatic_checkpoint_naming:
            self._checkpointer_under(self._automatic_root())

    def save_state(
        self, output_dir: str | os.PathLike[str] | ObjectPath | None = None
    ) -> Future[Path | ObjectPath]:
        """Save the accelerator's state as ``accelerator.save_state(output_dir)`` would.

        Blocks while the state is gathered and staged (Accelerate's small files are written
        and read back synchronously); the model and optimizer state is then written in the
        background. Every process must call it together.

        Args:
            output_dir: the checkpoint directory, or ``s3://bucket/prefix/name`` (ignored with
                automatic checkpoint naming).

        Returns:
            A Future that resolves to the checkpoint directory once it is durable, or fails
                with the write's error (as `Checkpointer.save`'s Future).

        Raises:
            ClosedError: the saver is closed.
            ConfigError: no `output_dir` without automatic naming, or its name is not a valid
                checkpoint name.
            ConfigTypeError: `output_dir` is not a path.
            UnsupportedLocationError: `output_dir` is a URL pyshmckpt does not write.
            PyshmckptError: an earlier save that failed, not raised yet; nothing is saved.
            PathExistsError: ``checkpoint_<i>`` exists already, or `output_dir` exists and was
                not written by this class.
            UnsupportedValueError: a model or optimizer holds values that are not plain data
                and ``allow_pickle`` is False, or a value cannot be staged.
            SlotsBusyError: no slot became free within the slot timeout.
            PyshmckptOSError: the directory cannot be created or written, or a slot cannot be
                created (``/dev/shm`` full).
        """
        self._check_open()
        accelerator = self._accelerator
        project = accelerator.project_configuration
        root: Path | ObjectPath
        if project.automatic_checkpoint_naming:
            root = self._automatic_root()
            name = f"checkpoint_{accelerator.save_iteration}"
        else:
            if output_dir is None:
                raise ConfigError("no output_dir given and automatic checkpoint naming is off")
            path = _where(output_dir, "output_dir")
            root, name = path.parent, path.name
        # Accelerate writes into an existing output_dir (it refuses an existing checkpoint_<i>):
        # one of ours is replaced atomically, anything else is refused.
        overwrite = not project.automatic_checkpoint_naming
        checkpointer = self._checkpointer_under(root)
        self._raise_failure()
        state: dict[str, Any] = {"accelerate_files": self._accelerate_files()}
        if accelerator.process_index == 0:
            state["models"] = [
                accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models
            ]
            state["optimizers"] = [optimizer.state_dict() for optimizer in accelerator._optimizers]
        future = checkpointer.save(state, name, overwrite=overwrite)
        project.iteration += 1
        target = root / name
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]
            self._unsettled[future] = target
        future.add_done_callback(self._settle)
        logger.info("staged the accelerator's state for %s", target)
        return future

    def load_state(
        self, input_dir: str | os.PathLike[str] | ObjectPath | None = None
    ) -> Path | ObjectPath:
        """Restore what `save_state` saved, as ``accelerator.load_state(input_dir)`` would.

        Blocks: waits for pending saves first (each bounded by its write timeout), then loads.
        The numbers of models, optimizers and custom objects are checked before anything of
        the accelerator changes. Every process must call it together.

        Args:
            input_dir: the checkpoint directory (or ``s3://`` URL); None (with automatic
                naming): the newest committed checkpoint (with a ``mirror``, the mirror's
                newest when the local directory holds none).

        Returns:
            The directory (or `ObjectPath`) loaded.

        Raises:
            ClosedError: the saver is closed.
            PyshmckptError: a pending save that failed, not raised yet.
            ConfigError: no `input_dir` without automatic naming.
            ConfigTypeError: `input_dir` is not a path.
            PathNotFoundError: `input_dir` is not a directory, or (automatic naming) there is
                no committed checkpoint.
            CheckpointNotFoundError: nothing is committed at an ``s3://`` `input_dir`.
            ObjectStoreError: object storage failed or refused a request.
            CheckpointCorruptError: the directory was not written by this class, a file is
                damaged, or it holds pickled values and ``allow_pickle`` is False.
            CheckpointMismatchError: the accelerator holds other numbers of models,
                optimizers or custom objects than were saved.
        """
        self._check_open()
        self.wait()  # each write is bounded by its write timeout
        directory = self._source(input_dir)
        accelerator = self._accelerator
        rank = accelerator.process_index
        main = self._read(directory, 0)
        own = (
            main if rank == 0 or rank not in saved_ranks(directory) else self._read(directory, rank)
        )
        # A process's own files (its RNG state) over the main process's (schedulers, ...).
        files = {**main["accelerate_files"], **own["accelerate_files"]}
        self._check_fits(directory, main, files)  # before anything changes
        for model, model_state in zip(accelerator._models, main["models"], strict=True):
            model.load_state_dict(model_state)
        for optimizer, optimizer_state in zip(
            accelerator._optimizers, main["optimizers"], strict=True
        ):
            # Optimizers keep the tensors they are given: copies, not maps of the file (which
            # would keep a removed checkpoint's disk space in use).
            optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        self._restore_accelerate_files(files)
        self._continue_naming(directory, input_dir)
        logger.info("loaded the accelerator's state from %s", directory)
        return directory

    def wait(self, timeout: float | None = None) -> list[Path | ObjectPath]:
        """Wait for the last save and those pending then; returns their paths.

        Args:
            timeout: seconds to wait at most, for all of them together (None: no limit).

        Returns:
            The checkpoint directories, oldest first.

        Raises:
            PyshmckptError: the first save that failed, not raised yet.
            WriteTimeoutError: they were not all durable within `timeout` (they go on).
        """
        with self._lock:
            pending = list(self._pending)
        _, unfinished = concurrent.futures.wait(pending, timeout)
        self._raise_failure()
        if unfinished:
            raise WriteTimeoutError(
                f"{len(unfinished)} checkpoint(s) still being written after {timeout:g} s"
            )
        return [future.result() for future in pending]

    def close(self, abort: bool = False) -> None:
        """Finish (or abandon) the pending saves and stop the writer process. Idempotent.

        Blocks until the pending saves are done (each bounded by its write timeout).

        Args:
            abort: abandon the pending saves instead: the writer is killed at once.

        Raises:
            PyshmckptError: the first save that failed, not raised yet.
            CleanupError: the writer process could not be cleaned up.
        """
        if self._closed:
            return
        self._closed = True
        checkpointer, self._checkpointer = self._checkpointer, None
        try:
            if checkpointer is not None:
                checkpointer.close(abort=abort)
        finally:
            self._raise_failure()

    def __enter__(self) -> ShmStateSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("ShmStateSaver is closed")

    def _mirrors(self, root: Path | ObjectPath) -> bool:
        """Whether checkpoints under `root` are mirrored (those of automatic naming)."""
        project = self._accelerator.project_configuration
        return (
            self._mirror is not None
            and project.automatic_checkpoint_naming
            and root == self._automatic_root()
        )

    def _automatic_root(self) -> Path | ObjectPath:
        project = self._accelerator.project_configuration
        return _where(project.project_dir, "project_dir") / CHECKPOINTS

    def _checkpointer_under(self, root: Path | ObjectPath) -> Checkpointer:
        """The Checkpointer writing under `root`: the open one, or a new one once the previous
        root's is closed (its pending writes finished). With several processes, every process
        gets here together: starting one is a collective call."""
        self._check_open()
        previous = self._checkpointer
        if previous is not None and previous.root == root:
            return previous
        self._checkpointer = None
        if previous is not None:
            logger.info("finishing the writes under %s before saving under %s", previous.root, root)
            previous.close()  # its failures are recorded by their Futures' callbacks
        project = self._accelerator.project_configuration
        total_limit = project.total_limit if project.automatic_checkpoint_naming else None
        self._checkpointer = Checkpointer(
            root,
            # Accelerate keeps the new checkpoint even with total_limit=0.
            keep_last=None if total_limit is None else max(total_limit, 1),
            rank=self._accelerator.process_index,
            world_size=self._accelerator.num_processes,
            link_latest=False,  # the directory holds Accelerate's entries alone
            mirror=self._mirror if self._mirrors(root) else None,
            **self._options,
        )
        return self._checkpointer

    def _settle(self, future: Future[Path | ObjectPath]) -> None:
        """Record the outcome of a finished save once (its done-callback, or whoever sees it
        finished first): a failure is logged, and kept to be raised if it is the first."""
        with self._lock:
            target = self._unsettled.pop(future, None)
            error = None if target is None else future.exception()
            if error is None or isinstance(error, CheckpointAbortedError):
                return  # succeeded, settled already, or abandoned by close(abort=True)
            if future in self._pending:
                self._pending.remove(future)  # raised once, never again by wait()
            if self._failure is None:
                self._failure = error
            # Logged before anyone can raise it, so that the log never lags behind the error.
            logger.error("saving the accelerator's state to %s failed: %s", target, error)

    def _raise_failure(self) -> None:
        """Raise the first failed save not raised yet (as a PyshmckptError), and forget it."""
        with self._lock:
            finished = [future for future in self._unsettled if future.done()]
        for future in finished:  # their callbacks may not have run yet
            self._settle(future)
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise as_writer_error(failure, "saving the accelerator's state failed")

    def _source(self, input_dir: str | os.PathLike[str] | ObjectPath | None) -> Path | ObjectPath:
        if input_dir is not None:
            directory = _where(input_dir, "input_dir")
            if isinstance(directory, ObjectPath) or directory.is_dir():
                return directory
            if self._mirror is not None and self._mirrors(directory.parent):  # a new node
                return self._mirror / directory.name
            raise os_error(errno.ENOENT, f"no checkpoint directory {directory}", str(directory))
        project = self._accelerator.project_configuration
        if not project.automatic_checkpoint_naming:
            raise ConfigError("no input_dir given and automatic checkpoint naming is off")
        root = self._automatic_root()
        newest = root_of(root).latest()
        if newest is None and self._mirror is not None:
            newest = object_commit.latest(self._mirror)  # a new node: the mirror's newest
        if newest is None:
            raise os_error(errno.ENOENT, f"no committed checkpoint in {root}", str(root))
        return newest

    def _continue_naming(self, directory: Path | ObjectPath, input_dir: Any) -> None:
        """After loading checkpoint_<i> by automatic naming, the next save is checkpoint_<i+1>
        (Accelerate's own load_state leaves the iteration at 0, and its next save_state then
        refuses the existing checkpoint_0)."""
        project = self._accelerator.project_configuration
        number = re.fullmatch(r"checkpoint_(\d+)", directory.name)
        if input_dir is None and project.automatic_checkpoint_naming and number:
            project.iteration = max(project.iteration, int(number.group(1)) + 1)

    def _check_fits(
        self, directory: Path | ObjectPath, main: dict[str, Any], files: dict[str, bytes]
    ) -> None:
        """Raise CheckpointMismatchError unless the checkpoint holds as many models, optimizers
        and custom objects as the accelerator."""
        accelerator = self._accelerator
        counts = {
            "models": (len(main["models"]), len(accelerator._models)),
            "optimizers": (len(main["optimizers"]), len(accelerator._optimizers)),
            "custom objects": (
                sum(1 for name in files if _CUSTOM_FILE.fullmatch(name)),
                len(accelerator._custom_objects),
            ),
        }
        for kind, (saved, held) in counts.items():
            if saved != held:
                raise CheckpointMismatchError(
                    f"{directory} holds {saved} {kind}, the accelerator {held}"
                )

    def _read(self, directory: Path | ObjectPath, rank: int) -> dict[str, Any]:
        if isinstance(directory, Path) and not (directory / file_names(0)[1]).exists():
            raise CheckpointCorruptError(
                str(directory),
                "not a checkpoint written by ShmStateSaver (one of accelerator.save_state loads "
                "with accelerator.load_state)",
            )
        state = load(directory, rank=rank, allow_pickle=self._allow_pickle)
        lists = {"models", "optimizers"} if rank == 0 else set()
        files = state.get("accelerate_files") if isinstance(state, dict) else None
        if (
            not isinstance(files, dict)
            or set(state) != {"accelerate_files", *lists}
            or not all(isinstance(state[key], list) for key in lists)
            or not all(_plain_file_name(n) and type(d) is bytes for n, d in files.items())
        ):
            raise CheckpointCorruptError(
                str(directory / file_names(rank)[1]), "not a checkpoint written by ShmStateSaver"
            )
        return state

    def _accelerate_files(self) -> dict[str, bytes]:
        """The files Accelerate writes for the small state, by name (its own writers)."""
        accelerator = self._accelerator
        with tempfile.TemporaryDirectory(prefix="pyshmckpt-accelerate-") as scratch:
            save_accelerator_state(
                scratch, [], [], accelerator._schedulers, accelerator._dataloaders,
                accelerator.process_index, accelerator.step, accelerator.scaler,
            )  # fmt: skip
            for index, obj in enumerate(accelerator._custom_objects):
                save_custom_state(obj, scratch, index)
            return {p.name: p.read_bytes() for p in sorted(Path(scratch).iterdir())}

    def _restore_accelerate_files(self, files: dict[str, bytes]) -> None:
        """Hand the saved files to Accelerate's own loaders, as its checkpoint directory."""
        accelerator = self._accelerator
        with tempfile.TemporaryDirectory(prefix="pyshmckpt-accelerate-") as scratch:
            for name, data in files.items():
                Path(scratch, name).write_bytes(data)
            overrides = load_accelerator_state(
                scratch, [], [], accelerator._schedulers, accelerator._dataloaders,
                accelerator.process_index, accelerator.scaler,
            )  # fmt: skip
            if "step" in overrides:
                accelerator.step = overrides["step"]
            for index, obj in enumerate(accelerator._custom_objects):
                load_custom_state(obj, scratch, index)


def _plain_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\0" not in name
        and name not in (".", "..")
    )


def _where(value: Any, what: str) -> Path | ObjectPath:
    where = locations.location(value, what)
    return where.expanduser().resolve() if isinstance(where, Path) else where


def _mirror_root(mirror: Any) -> ObjectPath | None:
    if mirror is None:
        return None
    return locations.object_root(mirror)
