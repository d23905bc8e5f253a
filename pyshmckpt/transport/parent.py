"""The trainer's side of the writer process: spawn it, feed it, watch it, stop it.

`WriterProcess` spawns the child (`child.writer_main`), waits for its initialisation (bounded),
sends one WRITE request per checkpoint and resolves a Future per request from a dispatcher
thread. Writes submitted while the child is still starting go to its spool (`spool.Spool`), which
the child inherits, and are handed over (ADOPT) once it is ready. The dispatcher waits on the
pipe, the process sentinel and a wake-up pipe together, so a
dead writer fails its pending writes at once, and a write that overruns its deadline gets the
writer killed (and reaped) before its future fails, so that its slot is never reused while it
might be read. Log records the writer forwards are handed to the trainer's loggers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from ..errors import (
    CheckpointAbortedError,
    ProtocolError,
    PyshmckptError,
    WriterConnectionError,
    WriterDiedError,
    WriterError,
    WriterOSError,
    WriterShutdownTimeoutError,
    WriterStartError,
    WriterStartTimeoutError,
    WriteStalledError,
    WriteTimeoutError,
)
from . import keeper, launcher, logs, suspension
from .channel import (
    Closed,
    Kind,
    ManifestRef,
    Request,
    Response,
    describe_exit,
    receive,
    send,
    wakeup_pipe,
)
from .child import OrphanPolicy, writer_main
from .spool import Spool

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    future: Future[Any]
    kind: Kind
    generation: int
    deadline: float | None  # time.monotonic() deadline, None for no limit
    slot: str | None = None
    timeout: float | None = None  # a spooled write's limit, counted from its hand-over
    sent: float | None = None  # when the writer got it (None while spooled)


_QUEUED = (Kind.WRITE, Kind.CALL)  # requests close() lets the writer finish

_SPAWN_HINT = (
    ". It was started by multiprocessing's spawn, because its writer or init function is "
    "defined in the training script (__main__): spawn runs that script again in the writer, so a "
    'script without an `if __name__ == "__main__":` guard starts training (or a process group) '
    "there and the writer fails; guard the script, or define the writer in a module of its own"
)


# Longest wait of the dispatcher while a deadline is ahead: it looks at least that often
# whether this process was stopped (see `suspension`).
_TICK = 1.0


class WriterProcess:
    """One spawned writer subprocess and the dispatcher that resolves its requests.

    lean: start it with `launcher.launch` (a fresh interpreter that does not import the trainer's
    ``__main__``; the init function, writer factory and arguments must be importable by module
    name) instead of multiprocessing's spawn; its `process` is then a
    `launcher.InterpreterProcess`.
    """

    def __init__(
        self,
        rank_info: Any,
        subprocess_init_fn: Callable[..., Any],
        subprocess_init_args: tuple[Any, ...],
        checkpoint_writer_init_fn: Callable[..., Any],
        checkpoint_writer_init_args: dict[str, Any],
        *,
        init_timeout: float,
        shutdown_timeout: float,
        orphans: OrphanPolicy,
        lean: bool = False,
        stall_timeout: float | None = None,
    ) -> None:
        self._lean = lean
        self._stall_timeout = stall_timeout
        self._reports_progress = False  # what the writer said when it was ready
        self._activity = 0.0  # when the writer last said the work in hand moved on
        self._paused = 0.0  # seconds this process was not running since then (see _dispatch)
        self._target_args = (
            rank_info, subprocess_init_fn, tuple(subprocess_init_args),
            checkpoint_writer_init_fn, dict(checkpoint_writer_init_args),
        )  # fmt: skip
        self._orphans = orphans
        self._init_timeout = init_timeout
        self._shutdown_timeout = shutdown_timeout
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._process: Any = None
        self._conn: Connection | None = None
        self._dispatcher: threading.Thread | None = None
        self._wake_r, self._wake_w = wakeup_pipe()
        self._closing = False
        self._failure: BaseException | None = None  # why the process is no longer usable
        self.pid: int | None = None
        self._spool: Spool | None = None  # writes queued while the child starts
        self._ready = False  # the child initialized and adopted the spool: writes go to the pipe
        self._started = 0.0
        # Layout last sent in full per slot: the child keeps the views it built for it.
        self._sent_layouts: dict[str, bytes] = {}
        self._kept: set[str] = set()  # segments whose descriptors this writer was handed
        self._reap_lock = threading.Lock()

    # -- reaping ---------------------------------------------------------------------------
    # The dispatcher and close() (or write()) may both wait for the child. multiprocessing reaps
    # with waitpid(), and a thread that calls it after another thread reaped the child, but before
    # that thread stored the exit code, would see "still running". So waiting is done on the
    # sentinel, and every look at the exit code happens under one lock.

    def _join(self, timeout: float | None) -> bool:
        """Wait up to `timeout` s for the child to exit; True once it has (and is reaped)."""
        process = self._process
        if process is None:
            return True
        if not wait([process.sentinel], timeout):
            return False
        with self._reap_lock:
            # The sentinel closes a moment before the child can be reaped; join() then does a
            # blocking waitpid, which returns at once.
            process.join(1.0)
            return process.exitcode is not None

    def _alive(self) -> bool:
        process = self._process
        if process is None:
            return False
        with self._reap_lock:
            return bool(process.is_alive())

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the child and wait for it to initialise (see `spawn` and `wait_ready`)."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the child process; it initializes in the background. Writes submitted from now
        on are spooled until `wait_ready` hands them over."""
        if self._lean:
            self._spawn_lean(Spool())
            return
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        spool = Spool()
        process = ctx.Process(
            target=writer_main,
            args=(
                child_conn,
                spool.inheritable(),
                os.getpid(),
                logs.current_levels(),
                self._orphans,
                *self._target_args,
            ),
            name="pyshmckpt-writer",
            daemon=True,
        )
        self._started = time.monotonic()
        try:
            process.start()
        except BaseException:
            spool.close()
            raise
        finally:
            child_conn.close()
        logger.debug("spawned writer process %d", process.pid)
        with self._lock:
            self._process, self._conn, self.pid = process, parent_conn, process.pid
            self._spool = spool

    def _spawn_lean(self, spool: Spool) -> None:
        """`spawn` by `launcher.launch`: a fresh interpreter that imports only the writer's
        modules, not the trainer's ``__main__``."""
        self._started = time.monotonic()
        try:
            process, parent_conn = launcher.launch(
                (os.getpid(), logs.current_levels(), self._orphans, *self._target_args),
                spool_fd=spool.fd,
            )
        except BaseException:
            spool.close()
            raise
        logger.debug("started writer process %d", process.pid)
        with self._lock:
            self._process, self._conn, self.pid = process, parent_conn, process.pid
            self._spool = spool

    def wait_ready(self) -> None:
        """Wait for the spawned child to initialise (bounded by the init timeout), then hand it
        the spooled writes.

        Raises WriterStartTimeoutError ("Timed out ...", a TimeoutError) when it does not
        acknowledge in time and WriterStartError (a RuntimeError) carrying the child's traceback
        when initialisation raised or the child exited; WriterDiedError when it was killed by a
        signal while starting (a death like any other: a later write restarts it). Spooled
        writes fail with that error.
        """
        process, parent_conn = self._process, self._conn
        if process is None or parent_conn is None:
            raise WriterStartError("the checkpoint writer process was never spawned")
        if self._closing:  # close() ran while this was spawning: do not leave the child behind
            self._fail_start(
                WriterDiedError("the checkpoint writer process was closed while starting")
            )
        started = self._started
        message = self._receive_init(parent_conn, process.sentinel, started + self._init_timeout)
        if isinstance(message, Closed):
            self._join(self._shutdown_timeout)
            exitcode = self.exitcode
            if exitcode is not None and exitcode < 0:  # killed (OOM killer, an operator)
                self._fail_start(
                    WriterDiedError(
                        "checkpoint writer process was killed while starting "
                        f"({describe_exit(exitcode)}); the next write starts a new one"
                    )
                )
            hint = "" if self._lean else _SPAWN_HINT
            self._fail_start(
                WriterStartError(
                    "checkpoint writer process exited during initialization "
                    f"({describe_exit(exitcode)}){hint}"
                )
            )
        if self._closing:
            self._fail_start(
                WriterDiedError("the checkpoint writer process was closed while starting")
            )
        if message is None:
            self._fail_start(
                WriterStartTimeoutError(
                    f"Timed out after {self._init_timeout}s waiting for checkpoint subprocess to "
                    "initialize"
                )
            )
        if message.kind is not Kind.INIT or not message.ok:
            self._fail_start(
                WriterStartError(
                    f"checkpoint writer process failed to initialize:\n{message.error}"
                )
            )
        logger.info("writer process %d ready after %.2f s", process.pid, time.monotonic() - started)
        self._reports_progress = bool(message.payload.get("reports_progress"))
        self._adopt_spool(parent_conn)
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="pyshmckpt-writer-dispatch", daemon=True
        )
        self._dispatcher.start()

    def _adopt_spool(self, conn: Connection) -> None:
        """From now on writes go to the pipe; the child serves the spooled ones first."""
        with self._lock:
            self._ready = True
            spool, self._spool = self._spool, None
            count = 0 if spool is None else spool.count
            now = time.monotonic()
            for item in self._pending.values():  # a spooled write's time starts now
                item.sent = now
                if item.timeout is not None:
                    item.deadline = now + item.timeout
            # A failed send means the child died: the dispatcher, started next, reports that.
            send(conn, Request(Kind.ADOPT, 0, payload={"count": count}))
        if spool is not None:
            spool.close()
        if count:
            logger.debug("handed %d spooled write(s) to writer process %d", count, self.pid)

    @staticmethod
    def _receive_init(conn: Connection, sentinel: int, deadline: float) -> Response | Closed | None:
        """The INIT reply (None after the deadline); log records sent before it are emitted."""
        while True:
            message = receive(conn, sentinel, max(0.0, deadline - time.monotonic()))
            if not (isinstance(message, Response) and message.kind is Kind.LOG):
                return message
            logs.emit_forwarded(message.payload)

    def _fail_start(self, error: BaseException) -> NoReturn:
        self._failure = error
        self._reap()
        with self._lock:
            spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()
        self._fail_pending(error)  # spooled writes
        raise error

    @property
    def process(self) -> Any:
        """The multiprocessing Process of the writer (None before it is spawned)."""
        return self._process

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` s for the writer to exit; True once it has."""
        return self._join(timeout)

    @property
    def connection(self) -> Connection | None:
        """The trainer's end of the control channel (torch calls it ``_parent_end``)."""
        return self._conn

    @property
    def ready(self) -> bool:
        """True once the child initialized (and was handed the spooled writes)."""
        return self._ready

    @property
    def alive(self) -> bool:
        return self._failure is None and self._alive()

    @property
    def exitcode(self) -> int | None:
        if self._process is None:
            return None
        with self._reap_lock:
            return self._process.exitcode

    def submit_write(
        self,
        generation: int,
        payload: dict[str, Any],
        timeout: float | None,
        descriptors: dict[str, int] | None = None,
    ) -> Future[Any]:
        """Queue one WRITE; the Future resolves when the writer answers (or fails).
        `descriptors`: the open descriptor of each segment the trainer stages into, by name;
        those the writer was not handed yet are handed over first (see `keeper`)."""
        slot_name = payload["slot"].name
        manifest = payload["manifest"]
        if descriptors:
            self.hand_over(descriptors)
        with self._lock:
            known = self._sent_layouts.get(slot_name) == manifest.layout_key
            if known:
                payload = {**payload, "manifest": ManifestRef.of(manifest)}
            else:
                self._sent_layouts[slot_name] = manifest.layout_key
        try:
            return self._queue(Kind.WRITE, generation, payload, timeout, slot_name)
        except BaseException:
            if not known:
                with self._lock:
                    self._sent_layouts.pop(slot_name, None)
            raise

    def hand_over(self, descriptors: dict[str, int]) -> None:
        """Hand the child the descriptors of the segments (by name) it was not handed yet, so
        that they stay alive whatever happens to this process before the child reads a request
        naming them (see `keeper`). Nothing when the child is gone."""
        failure = None
        with self._lock:  # never inside another message on the channel
            self._kept &= set(descriptors)  # the others were retired (their names never return)
            new = {n: fd for n, fd in descriptors.items() if n not in self._kept}
            if not new or self._conn is None:
                return
            try:
                if keeper.hand_over(self._conn, new):
                    self._kept.update(new)
            except OSError as exc:  # nothing sent: the next write tries again
                logger.warning(
                    "cannot hand the writer its slots' descriptors (%s): a trainer's death "
                    "before the writer reads this write may let another job collect them", exc,
                )  # fmt: skip
            except ProtocolError as exc:
                failure = self._failure = self._connection_error(str(exc))
        if failure is not None:
            self._wake()
            self.kill(str(failure))
            raise failure

    def submit_call(
        self, method: str | Callable[..., Any], kwargs: dict[str, Any], timeout: float | None
    ) -> Future[Any]:
        """Queue one CALL of the writer's `method` (a name; or a function) with `kwargs`. It is
        served after every write queued before it, and also when the trainer dies first; the
        Future resolves to what the method returned."""
        answered = self._queue(Kind.CALL, -1, {"method": method, "kwargs": kwargs}, timeout)
        result: Future[Any] = Future()

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(f.result().get("result"))

        answered.add_done_callback(done)
        return result

    def _queue(
        self,
        kind: Kind,
        generation: int,
        payload: dict[str, Any],
        timeout: float | None,
        slot_name: str | None = None,
    ) -> Future[Any]:
        """Send one request (spool it while the child starts); the Future resolves when the
        writer answers (or fails)."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closing:
                raise WriterDiedError("the checkpoint writer process is closed")
            if not self.alive:
                raise self._dead_error()
            request_id = next(self._ids)
            request = Request(kind, request_id, generation, payload)
            if not self._ready and self._spool is not None:  # the child is starting
                self._spool.append(request)
                self._pending[request_id] = _Pending(
                    future, kind, generation, None, slot_name, timeout
                )
                return future
            now = time.monotonic()
            deadline = None if timeout is None else now + timeout
            self._pending[request_id] = _Pending(
                future, kind, generation, deadline, slot_name, sent=now
            )
            try:
                sent = send(self._conn, request)  # type: ignore[arg-type]
            except BaseException:  # unpicklable kwargs and the like: nothing was queued
                self._pending.pop(request_id, None)
                raise
            if not sent:
                self._pending.pop(request_id, None)
                if self._conn is not None and self._conn.closed:
                    self._failure = self._connection_error("it was closed from outside")
                elif self._join(1.0):  # it exited: say how
                    self._failure = self._dead_error()
                else:  # alive, but the channel is broken
                    self._failure = self._connection_error("the request could not be sent")
            failure = self._failure
        if failure is not None:
            self._wake()
            self.kill(str(failure))
            raise failure
        self._wake()
        return future

    def close(self, *, abort: bool = False) -> list[BaseException]:
        """Stop the writer. Idempotent and bounded.

        First every pending write finishes (each bounded by its own deadline: the dispatcher
        kills the writer when one overruns), then TERMINATE, join, SIGTERM, join, SIGKILL, each
        wait bounded by the shutdown timeout; an escalation is logged as a warning. abort=True:
        pending writes fail with CheckpointAbortedError and the writer is killed at once.
        Returns what could not be cleaned up (a process still alive after SIGKILL).
        """
        with self._lock:
            if self._closing:
                return []
            self._closing = True
        process = self._process
        if process is not None:
            if abort:
                self._fail_pending(
                    CheckpointAbortedError("the write was abandoned by close(abort=True)")
                )
                if self._alive():
                    logger.warning("close(abort=True): killing writer process %d", process.pid)
                process.kill()
                self._join(1.0)
            else:
                self._finish_writes()
                self._terminate(process)
        self._wake()
        if self._dispatcher is not None and self._dispatcher is not threading.current_thread():
            self._dispatcher.join(self._shutdown_timeout + 1.0)
        self._fail_pending(
            WriterDiedError(self._exit_text("the checkpoint writer process was closed"))
        )
        self._reap()
        with self._lock:  # never adopted (the start was cancelled or failed)
            spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()
        self._close_wake_pipe()
        if process is not None and self._alive():
            return [WriterShutdownTimeoutError(f"writer process {process.pid} survived SIGKILL")]
        return []

    def leave_holding(self) -> bool:
        """The trainer leaves on an error, not ending the job: finish the pending writes (each
        bounded as in `close`), then let the writer go on alone as after the trainer's death:
        it holds the newest checkpoint in memory for the next trainer and exits when that hold
        ends. The channel is closed; the process is not waited for.

        Returns:
            True when the writer took its memory over; False when it could not (dead, or no
            answer within the shutdown timeout): then it is stopped as by `close`.
        """
        with self._lock:
            if self._closing:
                return False
        process = self._process
        if process is None or not self._alive() or self._conn is None:
            return False
        self._finish_writes()
        held: Future[Any] = Future()
        with self._lock:
            self._closing = True
            request_id = next(self._ids)
            self._pending[request_id] = _Pending(held, Kind.TERMINATE, -1, None)
            sent = send(self._conn, Request(Kind.TERMINATE, request_id, payload={"hold": True}))
        taken = False
        if sent:
            with contextlib.suppress(Exception):  # not answered in time, or it died
                taken = bool(held.result(timeout=self._shutdown_timeout).get("holding"))
        if not taken:  # an unresponsive writer is not one to leave alone: stopped as by close()
            self.kill("it did not take the trainer's memory over")
            with self._lock:
                self._closing = False
            return False
        if self._dispatcher is not None and self._dispatcher is not threading.current_thread():
            self._dispatcher.join(self._shutdown_timeout + 1.0)  # it stops at that answer
        with contextlib.suppress(OSError):
            self._conn.close()
        self._close_wake_pipe()
        logger.info("writer process %d holds the newest checkpoint on its own", process.pid)
        return True

    def kill(self, reason: str) -> None:
        """SIGKILL the writer and reap it (used for hung writers); `reason` is logged."""
        process = self._process
        if process is not None and self._alive():
            logger.warning("killing writer process %d: %s", process.pid, reason)
            process.kill()
            self._join(5.0)

    # -- internals ------------------------------------------------------------------------

    def _finish_writes(self) -> None:
        """Wait for the pending writes and calls; the dispatcher resolves each (or kills the
        writer)."""
        with self._lock:
            writes = [p.future for p in self._pending.values() if p.kind in _QUEUED]
        if writes:
            logger.debug("close(): waiting for %d pending write(s)", len(writes))
        while writes:
            dispatcher = self._dispatcher
            if dispatcher is None or not dispatcher.is_alive():
                return  # nothing resolves them any more: close() fails them
            _, undone = concurrent.futures.wait(writes, timeout=1.0)
            writes = list(undone)

    def _terminate(self, process: Any) -> None:
        """TERMINATE, join, SIGTERM, join, SIGKILL; each step logged when it had to escalate."""
        terminated: Future[Any] | None = None
        if self._alive() and self._conn is not None:
            with self._lock:
                request_id = next(self._ids)
                terminated = Future()
                self._pending[request_id] = _Pending(terminated, Kind.TERMINATE, -1, None)
                if not send(self._conn, Request(Kind.TERMINATE, request_id)):
                    self._pending.pop(request_id, None)
                    terminated = None
        if not self._join(self._shutdown_timeout):
            logger.warning(
                "checkpoint writer %d did not exit within %ss of TERMINATE; sending SIGTERM",
                process.pid, self._shutdown_timeout,
            )  # fmt: skip
            process.terminate()
            if not self._join(self._shutdown_timeout):
                logger.warning(
                    "checkpoint writer %d ignored SIGTERM for %ss; sending SIGKILL",
                    process.pid, self._shutdown_timeout,
                )  # fmt: skip
                process.kill()
                self._join(5.0)
        if terminated is not None and terminated.done() and terminated.exception() is not None:
            logger.error("the writer's close() raised: %s", terminated.exception())

    def _reap(self) -> None:
        process = self._process
        if process is not None:
            if self._alive():
                process.kill()
                self._join(5.0)

        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()

    def _close_wake_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _exit_text(self, what: str) -> str:
        pid = self.pid
        return f"{what} (pid {pid}, {describe_exit(self.exitcode)})"

    def failure_text(self) -> str:
        """Why this writer is no longer usable, in a few words."""
        if self._failure is not None:
            return str(self._failure).splitlines()[0]
        return describe_exit(self.exitcode)

    def _dead_error(self) -> BaseException:
        if isinstance(self._failure, WriterConnectionError):
            return self._failure
        if self._failure is not None and not isinstance(self._failure, WriterDiedError):
            return WriterDiedError(f"the checkpoint writer process is not usable: {self._failure}")
        return WriterDiedError(self._exit_text("the checkpoint writer process died"))

    def _fail_pending(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for item in pending.values():
            if not item.future.done():
                item.future.set_exception(error)

    def _dispatch(self) -> None:
        conn, process = self._conn, self._process
        if conn is None or process is None:
            return
        stops = suspension.clock()  # ticking from now on: it sees the stops to come
        checked = time.monotonic()  # when deadlines were last checked
        while True:
            with self._lock:
                deadlines = [p.deadline for p in self._pending.values() if p.deadline is not None]
                stall = self._stall_deadline()
            if stall is not None:
                deadlines.append(stall)
            timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            if timeout is not None:  # wakes often enough to tell that this process was stopped
                timeout = min(timeout, _TICK)
            try:
                ready = wait([conn, process.sentinel, self._wake_r], timeout)
            except (OSError, ValueError) as exc:  # the connection was closed under us
                self._break_channel(f"it cannot be waited on ({exc})")
                return
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            while self._readable(conn):
                try:
                    response = conn.recv()
                except (EOFError, OSError) as exc:
                    if not self._join(1.0):  # the writer lives on: the channel itself broke
                        self._break_channel(f"reading from it failed ({exc!r})")
                        return
                    break
                if response.kind is Kind.LOG:
                    logs.emit_forwarded(response.payload)
                    continue
                self._activity, self._paused = time.monotonic(), 0.0
                if response.kind is Kind.PROGRESS:
                    continue
                if not self._resolve(response):
                    return
                if response.kind is Kind.TERMINATE and response.payload.get("holding"):
                    return  # the writer goes on alone (leave_holding): nothing more comes
            if process.sentinel in ready or not self._alive():
                self._join(1.0)
                died: WriterDiedError = WriterDiedError(
                    self._exit_text("the checkpoint writer process died with writes pending")
                )
                if self._failure is None and conn.closed:  # it left because of that
                    self._failure = self._connection_error("it was closed from outside")
                if isinstance(self._failure, WriterConnectionError):
                    died = self._failure
                if self._failure is None:
                    self._failure = died
                with self._lock:
                    writes = sum(1 for p in self._pending.values() if p.kind is Kind.WRITE)
                if writes:
                    logger.warning("%s: %d write(s) failed", died, writes)
                self._fail_pending(died)
                return
            if time.monotonic() - checked - (timeout or 0.0) > suspension.PAUSED:
                # Late, or woken from a wait without a deadline (a write handed over meanwhile):
                # this process may have been stopped (the clock's thread tells). Only a stop
                # while a request was out counts: an idle one delays nothing.
                with self._lock:
                    sent = [p.sent for p in self._pending.values() if p.sent is not None]
                if sent:
                    self._count_pause(stops.stopped_since(max(checked, min(sent))))
            if self._expire():
                return
            checked = time.monotonic()
            # Otherwise run until the child exits: close() may still be waiting for its reply to
            # TERMINATE (and the error of the user's writer.close() it may carry).

    @staticmethod
    def _readable(conn: Connection) -> bool:
        try:
            return conn.poll(0)
        except (OSError, ValueError):
            return True  # let recv() raise, and handle it there

    def _connection_error(self, what: str) -> WriterConnectionError:
        return WriterConnectionError(
            f"Child process terminated unexpectedly: the control channel to checkpoint writer "
            f"{self.pid} is broken ({what}); the writer is stopped and the next write starts a new one"
        )

    def _break_channel(self, what: str) -> None:
        """The channel is unusable while the writer may live: stop the writer, fail the work."""
        error = self._connection_error(what)
        self._failure = error
        self.kill(f"its control channel broke: {what}")
        self._fail_pending(error)

    def _resolve(self, response: Response) -> bool:
        """Complete the request `response` answers; False when the protocol is broken."""
        with self._lock:
            item = self._pending.get(response.id)
            if (
                item is not None
                and item.kind is response.kind
                and item.generation == response.generation
            ):
                del self._pending[response.id]
            else:
                item = None
        if item is None:
            # A reply to nothing we asked, or for another slot generation: the writer can no
            # longer be trusted about which slot it reads. Stop it before failing anything.
            self.kill(
                f"it answered request {response.id}, generation {response.generation}, which was not asked"
            )
            error = ProtocolError(
                f"checkpoint writer answered request {response.id} ({response.kind.value}, "
                f"generation {response.generation}) which does not match any pending request"
            )
            self._failure = error
            self._fail_pending(error)
            return False
        if response.ok:
            item.future.set_result(response.payload)
        else:
            if item.slot is not None:  # the child may not hold this slot's layout: resend in full
                with self._lock:
                    self._sent_layouts.pop(item.slot, None)
            item.future.set_exception(_writer_error(response))
        return True

    def _stall_deadline(self) -> float | None:
        """When the write in hand counts as hung unless the writer reports progress first (None:
        no write in hand, or a writer that does not report progress). Call with the lock held."""
        if self._stall_timeout is None or not self._reports_progress or not self._pending:
            return None
        in_hand = self._pending[min(self._pending)]  # the writer serves requests in order
        if in_hand.kind is not Kind.WRITE or in_hand.sent is None:
            return None
        return max(self._activity, in_hand.sent) + self._stall_timeout + self._paused

    def _count_pause(self, late: float) -> None:
        """This process was not running for `late` seconds (stopped by SIGSTOP, frozen with its
        job or node). Its writer was stopped with it as a rule (a job's, a node's suspension):
        that time counts against neither a write's deadline nor its stall timeout."""
        if late <= 0:
            return
        with self._lock:
            self._paused += late
            for item in self._pending.values():
                if item.deadline is not None:
                    item.deadline += late
        logger.info("this process was not running for %.1f s: the writer's deadlines move on", late)

    def _expire(self) -> bool:
        """Kill the writer if a write overran its deadline, or made no progress for the stall
        timeout; True when that happened."""
        now = time.monotonic()
        with self._lock:
            expired = [
                p for p in self._pending.values() if p.deadline is not None and p.deadline <= now
            ]
            stall = self._stall_deadline()
            stalled = stall is not None and stall <= now
            if stalled and not expired:
                expired = [self._pending[min(self._pending)]]
        if not expired:
            return False
        # Reaped before anything fails: its slots are not read any more.
        if stalled:
            with self._lock:
                in_hand = self._pending[min(self._pending)]
                quiet = now - max(self._activity, in_hand.sent or now)
                paused = self._paused
            self.kill(
                f"a write made no progress for {self._stall_timeout:g} s (last progress "
                f"{quiet:.1f} s ago, {paused:.1f} s of it with this process stopped)"
            )
            timeout: WriteTimeoutError = WriteStalledError(
                self._exit_text(
                    f"checkpoint write made no progress for {self._stall_timeout:g} s (a hung "
                    "filesystem or a stopped writer); the writer process was killed"
                )
            )
        else:
            self.kill(f"a write ran past its deadline ({len(expired)} expired)")
            timeout = WriteTimeoutError(
                self._exit_text("checkpoint write timed out; the writer process was killed")
            )
        self._failure = timeout
        with self._lock:
            pending, self._pending = self._pending, {}
        for item in pending.values():
            if item in expired:
                item.future.set_exception(timeout)
            else:
                item.future.set_exception(
                    WriterDiedError(
                        self._exit_text("the writer was killed because another write timed out")
                    )
                )
        return True


class _WriterTraceback(Exception):
    """The writer's traceback, as the cause of the error it raised (its text is the traceback)."""


def _writer_error(response: Response) -> PyshmckptError:
    """The error a failed write raises in the trainer: the writer's own pyshmckpt error when it
    raised one (a CommitError stays a CommitError), caused by the writer's traceback; a
    WriterOSError (an OSError too, with the writer's errno) when the writer failed with an
    OSError; else a WriterError."""
    message = f"checkpoint writer raised:\n{response.error}"
    own = response.payload.get("error")
    if isinstance(own, PyshmckptError):
        own.__cause__ = _WriterTraceback(message)
        return own
    exc_type = response.payload.get("exc_type")
    if "errno" in response.payload:
        return WriterOSError(
            message, exc_type, response.payload["errno"], response.payload.get("strerror")
        )
    return WriterError(message, exc_type)
