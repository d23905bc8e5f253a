"""A drop-in for torch's `_experimental` CheckpointProcess that moves state through shared memory.

Same constructor and methods as ``torch.distributed.checkpoint._experimental.checkpoint_process
.CheckpointProcess``; the state dict reaches the writer subprocess as a manifest over the pipe
while its bytes stay in a shared-memory slot, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import (
    CleanupError,
    ClosedError,
    ConfigError,
    ConfigTypeError,
    ReplicationWarning,
    WriterConnectionError,
    WriterDiedError,
    WriterStartTimeoutError,
    WriteTimeoutError,
)
from ..shm import collect_stale_segments
from ..staging import SlotStager, lease_staged
from ..tiers import records
from . import launcher
from .child import OrphanPolicy, RankInfo, no_init
from .parent import WriterProcess

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointProcessConfig:
    """Settings of a `CheckpointProcess`: torch's two (same names and defaults) and pyshmckpt's.

    A dataclass; every field is checked when it is made (also by ``dataclasses.replace``).

    Attributes:
        subprocess_init_timeout_secs: seconds to wait for the writer to initialize.
        subprocess_shutdown_timeout_secs: seconds close() waits after TERMINATE, and again after
            SIGTERM, before escalating.
        write_timeout_secs: seconds one write may take before the writer is killed and the write
            fails with `WriteTimeoutError` (None: no limit).
        write_stall_timeout_secs: seconds a write of a writer that reports its progress
            (pyshmckpt's own) may go without any before it counts as hung: the writer is killed
            and the write fails with `WriteStalledError` (None: only the write timeout). A slow
            write that keeps moving is never cut short by it. Default 120: pyshmckpt's writers
            report every 64 MiB that reaches the disk (and each poll while they wait for other
            ranks that are alive), so two minutes without one is a filesystem that hangs or a
            stopped process, not a slow disk; a user's writer without progress reports keeps
            the write timeout alone.
        slots: slots of the internal arena that stages plain state dicts.
        capacity_bytes: bytes per internal slot, allocated up front (None: sized on first use).
        slot_timeout_secs: seconds write() waits for a slot while all are being written.
        max_restarts: how many times a dead writer is restarted by a later write().
        collect_stale_segments: remove segments no process holds, and records of holders that
            are gone, at start-up and when a dead writer is replaced.
        on_trainer_death: "finish" (the writer finishes and commits the writes it was handed,
            each bounded by write_timeout_secs, then exits) or "abandon" (it exits at once).
        wait_for_start: True: write() first waits for the writer process to be ready (torch's
            behaviour). False: the writer starts in the background and writes made meanwhile are
            spooled in memory the writer process holds (so they are finished even if the trainer
            dies first) and handed over once it is ready; a start that fails fails them. None:
            the owner decides (CheckpointProcess waits, Checkpointer does not).

    Raises:
        ConfigError: a timeout is negative (``write_timeout_secs`` and
            ``write_stall_timeout_secs``: not positive), ``slots`` is below 1, ``max_restarts``
            below 0, or ``on_trainer_death`` is neither "finish" nor "abandon".
        ConfigTypeError: ``wait_for_start`` is neither a bool nor None.
    """

    subprocess_init_timeout_secs: float = 30
    subprocess_shutdown_timeout_secs: float = 60
    write_timeout_secs: float | None = 1800.0
    write_stall_timeout_secs: float | None = 120.0
    slots: int = 2
    capacity_bytes: int | None = None
    slot_timeout_secs: float = 60.0
    max_restarts: int = 3
    collect_stale_segments: bool = True
    on_trainer_death: str = "finish"
    wait_for_start: bool | None = None

    @classmethod
    def of(cls, config: Any) -> CheckpointProcessConfig:
        """Convert a config to pyshmckpt's.

        Args:
            config: pyshmckpt's config (returned as it is), torch's ``CheckpointProcessConfig``,
                or any object with some of these fields (the others keep their defaults).

        Returns:
            The config as a `CheckpointProcessConfig`.

        Raises:
            ConfigTypeError: `config` has none of these fields.
            ConfigError: a field it has holds a value not accepted.
        """
        if isinstance(config, cls):
            return config
        given = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(cls)
            if hasattr(config, f.name)
        }
        if not given:
            raise ConfigTypeError(
                f"config must be a CheckpointProcessConfig (pyshmckpt's or torch's), not "
                f"{type(config).__name__}"
            )
        return cls(**given)

    @classmethod
    def starting_in_background(cls, config: Any) -> CheckpointProcessConfig:
        """`config` with ``wait_for_start=False`` unless it says otherwise.

        What front doors whose first save must not wait for the writer use.

        Args:
            config: None (the defaults), pyshmckpt's or torch's config (see `of`).

        Returns:
            The converted config.

        Raises:
            ConfigTypeError: as `of`.
            ConfigError: as `of`.
        """
        converted = cls() if config is None else cls.of(config)
        if converted.wait_for_start is None:
            converted = dataclasses.replace(converted, wait_for_start=False)
        return converted

    def __post_init__(self) -> None:
        if self.wait_for_start is not None and not isinstance(self.wait_for_start, bool):
            raise ConfigTypeError(
                f"wait_for_start must be a bool or None, not {type(self.wait_for_start).__name__}"
            )
        if self.on_trainer_death not in ("finish", "abandon"):
            raise ConfigError(
                f'on_trainer_death must be "finish" or "abandon", not {self.on_trainer_death!r}'
            )
        for name in (
            "subprocess_init_timeout_secs",
            "subprocess_shutdown_timeout_secs",
            "slot_timeout_secs",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number, not {value!r}")
        for name in ("write_timeout_secs", "write_stall_timeout_secs"):
            timeout = getattr(self, name)
            if timeout is not None and (
                isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
            ):
                raise ConfigError(f"{name} must be a positive number or None, not {timeout!r}")
        for name in ("slots", "max_restarts"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (1 if name == "slots" else 0)
            ):
                raise ConfigError(
                    f"{name} must be an int >= {1 if name == 'slots' else 0}, not {value!r}"
                )


class CheckpointProcess:
    """A writer subprocess fed through shared memory; drop-in for torch's CheckpointProcess.

    `write` returns a Future that resolves when the writer's
    ``write(path=..., state_dict=..., **kwargs)`` returned in the subprocess. A state dict staged
    by a ``SlotStager`` (a ``ShmStager`` is one) crosses as its manifest only; any other is first
    staged into an internal slot (one copy, before write() returns, so training may change the
    source right after). A Future of a state dict is resolved in the background.

    Failures: a writer that raises fails that write (``WriterError``, with its traceback); a
    writer that dies fails its writes at once with ``WriterDiedError`` naming the exit code or
    signal, and the next write() restarts it (up to ``max_restarts`` times); a write that overruns
    ``write_timeout_secs`` fails with `WriteTimeoutError` after the writer was killed, and so
    does one that makes no progress for ``write_stall_timeout_secs`` (`WriteStalledError`, for
    writers that report progress: pyshmckpt's own). A failed write frees its slot. `close` is
    bounded and idempotent; ``close(abort=True)`` kills the writer at once and abandons pending
    writes.

    The writer process never runs the training script: where the init function, the writer
    factory and their arguments are importable by module name (torch's ``CheckpointWriter``, a
    writer in a module of the user's), it starts as a fresh interpreter that imports only them,
    and ``process.processes[0]`` is a ``launcher.InterpreterProcess`` (pid, sentinel, is_alive,
    exitcode, join, kill, terminate). Only where one of them is defined in the trainer's
    ``__main__`` is it started by multiprocessing's spawn, which runs that script again in the
    writer (so the script needs an ``if __name__ == "__main__":`` guard). ``lean_writer`` (not in
    torch's API) forces the choice: True, a fresh interpreter; False, spawn.

    It owns the writer process and an internal `SlotStager`; `close` (or the end of a ``with``
    block) stops the one and frees the other, as do garbage collection and interpreter exit
    (their errors then logged).

    Args:
        rank_info: torch's ``RankInfo`` (``global_rank``, ``global_world_size``), handed to the
            writer.
        config: the settings: pyshmckpt's `CheckpointProcessConfig`, torch's, or an object with
            some of its fields.
        subprocess_init_fn: called with `subprocess_init_args` in the writer process, before
            the writer is built.
        subprocess_init_args: its positional arguments.
        checkpoint_writer_init_fn: builds the writer in the writer process, called with
            `checkpoint_writer_init_args` (and ``rank_info=`` unless given); the writer has
            ``write(path, state_dict, **kwargs)`` or pyshmckpt's
            ``write_slot(path, slot, manifest, **kwargs)``.
        checkpoint_writer_init_args: its keyword arguments.
        lean_writer: True: start the writer as a fresh interpreter; False: by multiprocessing's
            spawn; None: spawn only when a function or argument is defined in the trainer's
            ``__main__`` (or does not pickle).

    Attributes:
        process_creation_future: a Future that resolves once the first writer process is
            ready, or fails with its start error (as torch's).
        last_write_seconds: seconds the writer spent in its last successful write, as the
            writer process reported them (None before one).

    Raises:
        ConfigTypeError: a function is not callable, `subprocess_init_args` is not a tuple,
            `checkpoint_writer_init_args` not a dict, or `config` of another type.
        ConfigError: `config` holds a value not accepted, or a ``PYSHMCKPT_*`` variable is
            invalid.
        PyshmckptOSError: the internal slots of ``capacity_bytes`` cannot be created.
    """

    def __init__(
        self,
        rank_info: Any,
        config: CheckpointProcessConfig,
        subprocess_init_fn: Callable[..., Any],
        subprocess_init_args: tuple[Any, ...],
        checkpoint_writer_init_fn: Callable[..., Any],
        checkpoint_writer_init_args: dict[str, Any],
        *,
        lean_writer: bool | None = None,
    ) -> None:
        self._closed = True  # until construction finishes
        config = CheckpointProcessConfig.of(config)
        if not callable(subprocess_init_fn) or not callable(checkpoint_writer_init_fn):
            raise ConfigTypeError(
                "subprocess_init_fn and checkpoint_writer_init_fn must be callable"
            )
        if not isinstance(subprocess_init_args, tuple):
            raise ConfigTypeError("subprocess_init_args must be a tuple")
        if not isinstance(checkpoint_writer_init_args, dict):
            raise ConfigTypeError("checkpoint_writer_init_args must be a dict")
        self._rank_info = rank_info
        self._config = config
        self._writer_spec = (
            rank_info, subprocess_init_fn, subprocess_init_args,
            checkpoint_writer_init_fn, checkpoint_writer_init_args,
        )  # fmt: skip
        if lean_writer is None:
            lean_writer = not launcher.needs_main(*self._writer_spec)
        self._lean_writer = bool(lean_writer)
        if config.collect_stale_segments:
            _collect_stale()
        self._stager = SlotStager(
            capacity_bytes=config.capacity_bytes,
            slots=config.slots,
            slot_timeout=config.slot_timeout_secs,
            pickle_unsupported=True,
        )
        self._lock = threading.Lock()
        self._restarts = 0
        self.last_write_seconds: float | None = None  # time the writer spent in its last write
        # Every writer process started, the current one last; the finalizer closes them all.
        self._writers = [self._new_writer()]
        self._process_handle = WriterProcesses(self._writers)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyshmckpt-process")
        self._wait_for_start = config.wait_for_start is not False
        if self._wait_for_start:
            self.process_creation_future: Future[None] = self._executor.submit(self._writer.start)
        else:  # spawned now, so that writes can be spooled for it from the first one on
            try:
                self._writer.spawn()
            except BaseException:
                CheckpointProcess._finalize(self._writers, self._stager, self._executor, True)
                raise
            self.process_creation_future = self._executor.submit(self._writer.wait_ready)
        self._closed = False
        self._finalizer = weakref.finalize(
            self, CheckpointProcess._finalize_quietly, self._writers, self._stager, self._executor
        )

    # -- public API -------------------------------------------------------------------------

    @property
    def _writer(self) -> WriterProcess:
        return self._writers[-1]

    @property
    def process(self) -> WriterProcesses:
        """torch's handle of the current writer process.

        ``process.processes[0]`` is the process (``pid``, ``is_alive()``, ``exitcode``,
        ``kill()``); ``process.join(timeout)`` is True once it exited.
        """
        return self._process_handle

    @property
    def _parent_end(self) -> Any:
        """The trainer's end of the current writer's control channel (torch's name)."""
        return self._writer.connection

    @property
    def pid(self) -> int | None:
        """The current writer process id (None before it is spawned); it changes when a writer
        process that died is replaced."""
        return self._writer.pid

    @property
    def stager(self) -> SlotStager:
        """The stager used for state dicts that were not staged by a stager of pyshmckpt."""
        return self._stager

    def write(self, state_dict: Any, path: Any, **kwargs: Any) -> Future[None]:
        """Persist `state_dict` (or the result of a Future of one) at `path` in the writer.

        A state dict staged by a `SlotStager` (a `ShmStager` is one) crosses as its manifest; any
        other is first copied into an internal slot, before this returns (blocking; the caller
        may change the source right after). A Future of a state dict is awaited in the background (bounded by
        ``write_timeout_secs``). A writer process that died is restarted first (within
        ``max_restarts``). As torch's, a writer that failed to start raises here: after
        waiting for its start (bounded by the init timeout) unless ``wait_for_start=False``,
        and then only once its start has failed.

        Args:
            state_dict: a state dict (staged by a `SlotStager` or not), or a Future of one.
            path: where the writer writes it (handed to the writer as it is).
            **kwargs: passed to the writer's ``write`` (they must pickle).

        Returns:
            A Future that resolves to None once the writer's ``write`` returned, or fails
                with: what staging into the internal slot raised (`UnsupportedValueError`,
                `SlotsBusyError`, `StagingTimeoutError`, `PyshmckptOSError`), `SlotStateError`
                (`state_dict` is being written by an earlier write), `WriterError` or
                `WriterOSError` (the writer raised; a pyshmckpt error it raised, such as
                `CommitError`, as itself), `WriterDiedError` (it died; or it died and its restarts
                are spent), `WriteTimeoutError` or `WriteStalledError`, `ProtocolError`,
                `WriterStartError` (its start failed while the write waited for it, with
                ``wait_for_start=False``), `CheckpointAbortedError` (``close(abort=True)``), or
                what the Future of a state dict failed with (`WriteTimeoutError` when it did not
                resolve within ``write_timeout_secs``).

        Raises:
            ClosedError: the CheckpointProcess is closed.
            WriterStartError: the writer process cannot be started (its init function or
                writer raised, or it exited while starting).
            WriterStartTimeoutError: with ``wait_for_start`` True (the default here), it did
                not initialize within ``subprocess_init_timeout_secs``.
        """
        self._check_open()
        self._check_started()
        if isinstance(state_dict, Future):
            outer: Future[None] = Future()
            wait = self._config.write_timeout_secs

            def resolve() -> None:
                try:
                    resolved = _result(state_dict, wait)
                    inner = self._write_now(state_dict=resolved, path=path, kwargs=kwargs)
                except BaseException as exc:
                    outer.set_exception(exc)
                    return
                _chain(inner, outer)

            self._executor.submit(resolve)
            return outer
        try:
            return self._write_now(state_dict, path, kwargs)
        except Exception as exc:
            logger.debug("write to %s failed before it reached the writer: %r", path, exc)
            failed: Future[None] = Future()
            failed.set_exception(exc)
            return failed

    def call(self, method: str | Callable[..., Any], **kwargs: Any) -> Future[Any]:
        """Run a function or a method of the writer in the writer process (not in torch's API).

        It runs after every write handed over before it. Like a write, it is served even when
        the trainer dies first (``on_trainer_death="finish"``) and bounded by the write
        timeout. Does not block (beyond a writer start, as `write`).

        Args:
            method: the name of a method of the writer, run as ``writer.method(**kwargs)``, or
                a function the writer process imports by module and name, run as
                ``method(**kwargs)``.
            **kwargs: its keyword arguments (they must pickle).

        Returns:
            A Future that resolves to what it returned (it must pickle), or fails with the
                error it raised, given as a write's are (`WriterError`, `WriterOSError`, a
                pyshmckpt error as itself), or with the failures of the writer process a write
                meets (`WriterDiedError`, `WriteTimeoutError`, `CheckpointAbortedError`).

        Raises:
            ClosedError: the CheckpointProcess is closed.
            WriterStartError: the writer process cannot be started (`WriterStartTimeoutError`
                as for `write`).
            WriterDiedError: the writer process died and its restarts are spent, or its
                control channel broke (`WriterConnectionError`).
        """
        self._check_open()
        self._check_started()
        timeout = self._config.write_timeout_secs
        return self._submit(lambda writer: writer.submit_call(method, kwargs, timeout))

    def hand_over(self, descriptors: dict[str, int]) -> None:
        """Hand the writer process the open descriptors of shared-memory segments (by name) that
        must stay alive should this process die before a request naming them reaches it (a
        write hands over those of its stager itself; not in torch's API). See
        `pyshmckpt.transport.keeper`.

        Raises:
            ClosedError: the CheckpointProcess is closed.
            WriterStartError: the writer process cannot be started.
            WriterDiedError: the writer process died and its restarts are spent.
        """
        self._check_open()
        self._ensure_writer().hand_over(descriptors)

    async def write_async(self, state_dict: Any, path: Any, **kwargs: Any) -> None:
        """``await`` form of `write`; staging a plain state dict runs off the event loop.

        Args:
            state_dict: as for `write`.
            path: as for `write`.
            **kwargs: as for `write`.

        Raises:
            PyshmckptError: what `write` raises, or what its Future fails with.
        """
        loop = asyncio.get_running_loop()
        future = await loop.run_in_executor(None, lambda: self.write(state_dict, path, **kwargs))
        await asyncio.wrap_future(future)

    def close(self, abort: bool = False) -> None:
        """Finish every pending write, shut the writer down and free the shared memory.

        Blocks: each pending write is bounded by its write timeout, then TERMINATE, join,
        SIGTERM, join, SIGKILL, each bounded by the shutdown timeout (an escalation is logged as
        a warning and fails any write it cut short). Returns once the writer is gone and the
        memory freed. Never raises from the garbage collector or at exit. Idempotent.

        Args:
            abort: the host-fault path: pending writes fail with `CheckpointAbortedError` and
                the writer is killed at once.

        Raises:
            CleanupError: what could not be cleaned up (a process alive after SIGKILL, a
                segment not removed); everything else was closed.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        errors = CheckpointProcess._finalize(self._writers, self._stager, self._executor, abort)
        if errors:
            raise CleanupError(errors)

    def leave_holding(self) -> bool:
        """The trainer leaves on an error without ending: finish the pending writes, then let
        the writer go on alone as after the trainer's death (it holds the newest checkpoint in
        memory for the next trainer); the slots are left to it. Where it cannot (no writer
        alive, no answer in time), this is `close`. Idempotent.

        Returns:
            True when the writer took the memory over.

        Raises:
            CleanupError: as `close`, when it fell back to it.
        """
        if self._closed:
            return False
        self._executor.shutdown(wait=True)  # writes waiting for a state dict's Future go first
        *retired, writer = self._writers
        if not writer.leave_holding():
            self.close()
            return False
        self._closed = True
        self._finalizer.detach()
        for old in retired:  # dead already: reaped
            for error in old.close():
                logger.warning("while closing a replaced writer: %s", error)
        self._stager.detach()
        return True

    def leave(self) -> None:
        """The trainer is ending without a close (an uncaught exception at exit): leave the
        writer process to notice its death and do what it does then (finish the writes it was
        handed; hold the newest checkpoint in memory). Nothing is closed or freed here."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        if self._stager is not None:
            self._stager.detach()

    def __enter__(self) -> CheckpointProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("CheckpointProcess is closed")

    def _check_started(self) -> None:
        """Raise the error of a start that cannot succeed (the writer's init or import failed,
        or it never answered); wait for the start first unless writes may be spooled. A writer
        killed while starting is not one: a death like any other, restarted by the next write
        (within max_restarts)."""
        future = self.process_creation_future
        if self._wait_for_start or future.done():
            error = future.exception()
            if error is not None and not self._restartable(error):
                raise error

    def _restartable(self, start_error: BaseException) -> bool:
        """Whether a failed start is a death the next write restarts: the writer was killed while
        starting; or, when writes are spooled during the start (``wait_for_start=False``), it
        never answered in time (stopped, or starved on a busy machine: it was killed, and a new
        one may well start). torch's behaviour, with ``wait_for_start=True``, keeps a start
        timeout for good."""
        if isinstance(start_error, WriterDiedError):
            return True
        return isinstance(start_error, WriterStartTimeoutError) and not self._wait_for_start

    def _new_writer(self) -> WriterProcess:
        return WriterProcess(
            *self._writer_spec,
            init_timeout=self._config.subprocess_init_timeout_secs,
            stall_timeout=self._config.write_stall_timeout_secs,
            shutdown_timeout=self._config.subprocess_shutdown_timeout_secs,
            orphans=OrphanPolicy(
                finish=self._config.on_trainer_death == "finish",
                write_timeout=self._config.write_timeout_secs,
            ),
            lean=self._lean_writer,
        )

    @staticmethod
    def _finalize(
        writers: list[WriterProcess],
        stager: SlotStager,
        executor: ThreadPoolExecutor,
        abort: bool = False,
    ) -> list[BaseException]:
        errors: list[BaseException] = []
        # Writes waiting for a Future of a state dict reach the writer first (unless aborting).
        executor.shutdown(wait=not abort, cancel_futures=abort)
        for writer in list(writers):
            try:
                errors.extend(writer.close(abort=abort))
            except Exception as exc:
                errors.append(exc)
        try:
            stager.close()
        except Exception as exc:
            errors.append(exc)
        return errors

    @staticmethod
    def _finalize_quietly(
        writers: list[WriterProcess], stager: SlotStager, executor: ThreadPoolExecutor
    ) -> None:
        """close() for the garbage collector and interpreter exit: what fails is logged."""
        for error in CheckpointProcess._finalize(writers, stager, executor):
            logger.warning("while closing the checkpoint process: %s", error)

    def _ensure_writer(self) -> WriterProcess:
        self._check_started()  # raises the init error, if any (bounded)
        writer = self._writer
        if not (writer.alive or writer.ready) and self._writers[0] is writer:
            # The first writer exited while starting: wait for its start to fail (the writes
            # spooled for it fail with it). Its error is this write's too, unless it was killed.
            error = self.process_creation_future.exception()
            if error is not None and not self._restartable(error):
                raise error
        with self._lock:
            writer = self._writer
            if writer.alive:
                return writer
            if self._restarts >= self._config.max_restarts:
                raise WriterDiedError(
                    f"the checkpoint writer process died and the restart budget "
                    f"({self._config.max_restarts}) is spent"
                )
            self._restarts += 1
            logger.warning(
                "the checkpoint writer process %s is gone (%s); starting a new one (restart %d of %d)",
                writer.pid, writer.failure_text(), self._restarts, self._config.max_restarts,
            )  # fmt: skip
            for error in writer.close(abort=True):
                logger.warning("while replacing the writer: %s", error)
            if self._config.collect_stale_segments:  # what the dead writer held (its replicas)
                _collect_stale()
            writer = self._new_writer()
            self._writers.append(writer)
        writer.start()
        return writer

    def _write_now(self, state_dict: Any, path: Any, kwargs: dict[str, Any]) -> Future[None]:
        self._ensure_writer()
        handle = lease_staged(state_dict)
        if handle is None:
            handle = self._stager.stage_leased(state_dict)  # one copy, into an internal slot
        payload = {
            "path": path,
            "kwargs": kwargs,
            "manifest": handle.manifest,
            "slot": handle.address,
            "segments": handle.segments(),
        }
        try:
            timeout = self._config.write_timeout_secs
            descriptors = handle.descriptors()
            future = self._submit(
                lambda writer: writer.submit_write(handle.generation, payload, timeout, descriptors)
            )
        except BaseException:
            handle.give_back()
            raise
        result: Future[None] = Future()

        def done(f: Future[Any]) -> None:
            # The writer has answered, died or been killed: it no longer reads the slot.
            handle.give_back()
            exc = f.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                answer = f.result() or {}
                self.last_write_seconds = answer.get("write_seconds")
                if answer.get("replica_error"):  # the save stands: on this node only
                    warnings.warn(
                        f"checkpoint {path} was not replicated to another node: "
                        f"{answer['replica_error']}",
                        ReplicationWarning, stacklevel=2,
                    )  # fmt: skip
                result.set_result(None)

        future.add_done_callback(done)
        return result

    def _submit(self, send: Callable[[WriterProcess], Future[Any]]) -> Future[Any]:
        """`send` a request to the current writer (restarted first if it died)."""
        writer = self._ensure_writer()
        try:
            return send(writer)
        except WriterDiedError as exc:
            if writer.alive or isinstance(exc, WriterConnectionError):
                raise
            # It died between the liveness check and the send: restart it (within the budget).
            return send(self._ensure_writer())


def _collect_stale() -> None:
    """Remove the hold and replica records of holders that are gone, then the segments no
    process holds (theirs among them): what a dead writer or a crashed node left."""
    records.collect_stale()
    collect_stale_segments()


class WriterProcesses:
    """What torch's ``CheckpointProcess.process`` is (the context ``mp.spawn`` returns), for the
    current writer: ``processes`` lists its multiprocessing Process (empty before it is spawned),
    ``pids()`` its pid, and ``join(timeout)`` waits for it to exit, True once it has."""

    def __init__(self, writers: list[WriterProcess]) -> None:
        self._writers = writers  # the CheckpointProcess's list, the current writer last

    @property
    def processes(self) -> list[Any]:
        process = self._writers[-1].process
        return [] if process is None else [process]

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        return self._writers[-1].join(timeout)


def _result(future: Future[Any], timeout: float | None) -> Any:
    """The state dict a Future resolves to, waiting at most `timeout` s."""
    done, _ = concurrent.futures.wait([future], timeout=timeout)
    if not done:
        raise WriteTimeoutError(f"the Future of the state dict did not resolve within {timeout}s")
    return future.result()


def _chain(inner: Future[Any], outer: Future[Any]) -> None:
    def copy(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(f.result())

    inner.add_done_callback(copy)


__all__ = ["CheckpointProcess", "CheckpointProcessConfig", "RankInfo", "WriterProcesses", "no_init"]
