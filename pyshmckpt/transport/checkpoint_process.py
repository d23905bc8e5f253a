"""A drop-in for torch's `_experimental` CheckpointProcess that moves state through shared memory.

Same constructor and methods as ``torch.distributed.checkpoint._experimental.checkpoint_process
.CheckpointProcess``; the state dict reaches the writer subprocess as a manifest over the pipe
while its bytes stay in a shared-memory slot, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import CleanupError, ClosedError, ConfigError, ConfigTypeError, WriterDiedError
from ..shm import collect_stale_segments
from ..staging import ShmStager, lease_staged
from .parent import WriterProcess

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointProcessConfig:
    """torch's two settings (same names and defaults) plus what the shared-memory path needs.

    Attributes:
        subprocess_init_timeout_secs: seconds to wait for the writer to initialize.
        subprocess_shutdown_timeout_secs: seconds close() waits after TERMINATE, and again after
            SIGTERM, before escalating.
        write_timeout_secs: seconds one write may take before the writer is killed and the write
            fails with TimeoutError (None: no limit).
        slots: slots of the internal arena that stages plain state dicts.
        capacity_bytes: bytes per internal slot, allocated up front (None: sized on first use).
        slot_timeout_secs: seconds write() waits for a slot while all are being written.
        max_restarts: how many times a dead writer is restarted by a later write().
        collect_stale_segments: remove segments of dead owners at start-up.
    """

    subprocess_init_timeout_secs: float = 30
    subprocess_shutdown_timeout_secs: float = 60
    write_timeout_secs: float | None = 1800.0
    slots: int = 2
    capacity_bytes: int | None = None
    slot_timeout_secs: float = 60.0
    max_restarts: int = 3
    collect_stale_segments: bool = True

    def __post_init__(self) -> None:
        for name in (
            "subprocess_init_timeout_secs",
            "subprocess_shutdown_timeout_secs",
            "slot_timeout_secs",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number, not {value!r}")
        timeout = self.write_timeout_secs
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ConfigError(
                f"write_timeout_secs must be a positive number or None, not {timeout!r}"
            )
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

    ``write(state_dict, path, **kwargs)`` returns a Future that resolves when the writer's
    ``write(path=..., state_dict=..., **kwargs)`` returned in the subprocess. A state dict staged
    by a ``ShmStager`` crosses as its manifest only; any other is first staged into an internal
    slot (one copy, before write() returns, so training may change the source right after). A
    Future of a state dict is resolved in the background.

    Failures: a writer that raises fails that write (``WriterError``, with its traceback); a
    writer that dies fails its writes at once with ``WriterDiedError`` naming the exit code or
    signal, and the next write() restarts it (up to ``max_restarts`` times); a write that overruns
    ``write_timeout_secs`` fails with TimeoutError after the writer was killed. A failed write
    frees its slot. ``close()`` is bounded and idempotent; ``close(abort=True)`` kills the writer
    at once and abandons pending writes.
    """

    def __init__(
        self,
        rank_info: Any,
        config: CheckpointProcessConfig,
        subprocess_init_fn: Callable[..., Any],
        subprocess_init_args: tuple[Any, ...],
        checkpoint_writer_init_fn: Callable[..., Any],
        checkpoint_writer_init_args: dict[str, Any],
    ) -> None:
        self._closed = True  # until construction finishes
        if not isinstance(config, CheckpointProcessConfig):
            raise ConfigTypeError(
                f"config must be a pyshmckpt.CheckpointProcessConfig, not {type(config).__name__}"
            )
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
        if config.collect_stale_segments:
            collect_stale_segments()
        self._stager = ShmStager(
            capacity_bytes=config.capacity_bytes,
            slots=config.slots,
            slot_timeout=config.slot_timeout_secs,
        )
        self._lock = threading.Lock()
        self._restarts = 0
        self.last_write_seconds: float | None = None  # time the writer spent in its last write
        # Every writer process started, the current one last; the finalizer closes them all.
        self._writers = [self._new_writer()]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyshmckpt-process")
        self.process_creation_future: Future[None] = self._executor.submit(self._writer.start)
        self._closed = False
        self._finalizer = weakref.finalize(
            self, CheckpointProcess._finalize, self._writers, self._stager, self._executor
        )

    # -- public API -------------------------------------------------------------------------

    @property
    def _writer(self) -> WriterProcess:
        return self._writers[-1]

    @property
    def pid(self) -> int | None:
        """The current writer process id (None before it is spawned)."""
        return self._writer.pid

    @property
    def stager(self) -> ShmStager:
        """The stager used for state dicts that were not staged by a ShmStager."""
        return self._stager

    def write(self, state_dict: Any, path: Any, **kwargs: Any) -> Future[None]:
        """Persist `state_dict` (or the result of a Future of one) at `path` in the writer."""
        self._check_open()
        if isinstance(state_dict, Future):
            outer: Future[None] = Future()

            def resolve() -> None:
                try:
                    inner = self._write_now(state_dict.result(), path, kwargs)
                except BaseException as exc:
                    outer.set_exception(exc)
                    return
                _chain(inner, outer)

            self._executor.submit(resolve)
            return outer
        return self._write_now(state_dict, path, kwargs)

    async def write_async(self, state_dict: Any, path: Any, **kwargs: Any) -> None:
        """``await`` form of write(); staging a plain state dict runs off the event loop."""
        loop = asyncio.get_running_loop()
        future = await loop.run_in_executor(None, lambda: self.write(state_dict, path, **kwargs))
        await asyncio.wrap_future(future)

    def close(self, abort: bool = False) -> None:
        """Shut the writer down (bounded) and free the shared memory. Idempotent.

        abort=True is the host-fault path: pending writes are abandoned and the writer is killed
        at once. Errors met while cleaning up are raised together afterwards (never from __del__).
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        errors = CheckpointProcess._finalize(self._writers, self._stager, self._executor, abort)
        if errors:
            raise CleanupError(errors)

    def __enter__(self) -> CheckpointProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("CheckpointProcess is closed")

    def _new_writer(self) -> WriterProcess:
        return WriterProcess(
            *self._writer_spec,
            init_timeout=self._config.subprocess_init_timeout_secs,
            shutdown_timeout=self._config.subprocess_shutdown_timeout_secs,
        )

    @staticmethod
    def _finalize(
        writers: list[WriterProcess],
        stager: ShmStager,
        executor: ThreadPoolExecutor,
        abort: bool = False,
    ) -> list[BaseException]:
        errors: list[BaseException] = []
        for writer in writers:
            try:
                errors.extend(writer.close(abort=abort))
            except Exception as exc:
                errors.append(exc)
        executor.shutdown(wait=not abort, cancel_futures=True)
        try:
            stager.close()
        except Exception as exc:
            errors.append(exc)
        return errors

    def _ensure_writer(self) -> WriterProcess:
        self.process_creation_future.result()  # raises the init error, if any (bounded)
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
            writer.close(abort=True)
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
            future = self._submit(handle.generation, payload)
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
                self.last_write_seconds = (f.result() or {}).get("write_seconds")
                result.set_result(None)

        future.add_done_callback(done)
        return result

    def _submit(self, generation: int, payload: dict[str, Any]) -> Future[Any]:
        timeout = self._config.write_timeout_secs
        writer = self._ensure_writer()
        try:
            return writer.submit_write(generation, payload, timeout)
        except WriterDiedError:
            if writer.alive:
                raise
            # It died between the liveness check and the send: restart it (within the budget).
            return self._ensure_writer().submit_write(generation, payload, timeout)


def _chain(inner: Future[Any], outer: Future[Any]) -> None:
    def copy(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(f.result())

    inner.add_done_callback(copy)


__all__ = ["CheckpointProcess", "CheckpointProcessConfig"]
