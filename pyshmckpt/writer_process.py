"""The writer subprocess: spawned once, maps the slots, persists what the trainer staged.

Parent side: `WriterProcess` spawns the child, waits for its initialisation (bounded), sends one
WRITE request per checkpoint and resolves a Future per request from a dispatcher thread. The
dispatcher waits on the pipe, the process sentinel and a wake-up pipe together, so a dead writer
fails its pending writes at once, and a write that overruns its deadline gets the writer killed
(and reaped) before its future fails, so that its slot is never reused while it might be read.

Child side: `writer_main` runs the user's init function, builds the user's writer, then serves
requests: it attaches each slot segment once, rebuilds the staged state dict as zero-copy CPU
tensors over the slot and calls ``writer.write(path=..., state_dict=..., **kwargs)``. If the
trainer dies, the child notices (pidfd of the parent, channel EOF, PR_SET_PDEATHSIG), unlinks the
trainer's segments it knows of, and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import multiprocessing as mp
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from . import _C, commit, layout
from .channel import (
    ChannelClosed,
    CheckpointAbortedError,
    Kind,
    ProtocolError,
    Request,
    Response,
    WriterDiedError,
    describe_exit,
    receive,
    send,
    wakeup_pipe,
)

_PR_SET_PDEATHSIG = 1
# Sent to the writer by the kernel when the thread that spawned it exits. That thread need not be
# the whole trainer, so the handler checks that the trainer is really gone before acting.
_PARENT_DEATH_SIGNAL = signal.SIGUSR2


# --------------------------------------------------------------------------------------------
# child side
# --------------------------------------------------------------------------------------------


class _AttachedSegments:
    """Segments the writer has mapped, by name, and every name it was told of (for cleanup)."""

    def __init__(self) -> None:
        self.segments: dict[str, _C.Segment] = {}
        self.known: set[str] = set()
        # Reentrant: the parent-death signal handler runs on the main thread and may interrupt
        # the main thread while it already holds the lock (in unlink_all on channel EOF).
        self.lock = threading.RLock()

    def sync(self, described: list[tuple[str, int, bytes]]) -> None:
        """Attach newly described segments; close those no longer described (retired arenas)."""
        names = {name for name, _, _ in described}
        with self.lock:
            self.known = names | set(self.segments)
            for name in list(self.segments):
                if name not in names:
                    self.segments.pop(name).close()
            for name, size, token in described:
                if name not in self.segments:
                    self.segments[name] = _C.Segment.attach(name, size, token)

    def get(self, name: str) -> _C.Segment:
        return self.segments[name]

    def unlink_all(self) -> None:
        """The trainer is gone: remove its segments so nothing is left in /dev/shm."""
        with self.lock:
            for name in self.known | set(self.segments):
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{name}")


@dataclasses.dataclass(frozen=True)
class ManifestRef:
    """Sent instead of a full manifest when the writer already holds one of the same layout for
    that slot: only the structure (keys, leaves) travels."""

    tree: Any
    layout_key: bytes


class _StagedViews:
    """Rebuilds staged state dicts over attached slots, reusing tensors when the layout repeats.

    Steady-state checkpoints have the same layout every time, so the tensor views built for a slot
    are kept and only the containers and leaves are rebuilt. Each block gets a tensor of its own
    (a zero-copy view of the block), so torch.save of a tensor writes that block, not the slot.
    """

    def __init__(self) -> None:
        self.cache: dict[str, tuple[layout.Manifest, list[torch.Tensor] | None]] = {}

    def manifest(self, segment: _C.Segment, manifest: layout.Manifest | ManifestRef) -> layout.Manifest:
        """The full manifest of this write (a reference is resolved against the slot's cache)."""
        cached = self.cache.get(segment.name)
        if isinstance(manifest, ManifestRef):
            if cached is None or cached[0].layout_key != manifest.layout_key:
                raise ProtocolError(
                    f"the writer holds no layout {manifest.layout_key.hex()} for slot {segment.name}"
                )
            return dataclasses.replace(cached[0], tree=manifest.tree)
        if cached is None or cached[0].layout_key != manifest.layout_key:
            self.cache[segment.name] = (manifest, None)
        return manifest

    def rebuild(self, segment: _C.Segment, offset: int, manifest: layout.Manifest) -> Any:
        cached_manifest, tensors = self.cache[segment.name]
        if tensors is None:
            tensors = self._tensors(segment, offset, manifest)
            self.cache[segment.name] = (cached_manifest, tensors)
        return layout.build(manifest.tree, tensors)

    @staticmethod
    def _tensors(segment: _C.Segment, offset: int, manifest: layout.Manifest) -> list[torch.Tensor]:
        view = memoryview(segment)
        blocks = manifest.blocks.tolist()
        bases: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int]] = {}

        def base(block: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
            if block < 0:
                return torch.empty(0, dtype=dtype), 0
            found = bases.get((block, dtype))
            if found is None:
                start, nbytes = blocks[block]
                count = nbytes // dtype.itemsize
                tensor = torch.frombuffer(view, dtype=dtype, count=count, offset=offset + start)
                found = bases[(block, dtype)] = (tensor, start)
            return found

        return layout.make_tensors(manifest, base)

    def drop(self, name: str) -> None:
        self.cache.pop(name, None)


def _watch_parent(parent_pid: int, on_death: Callable[[], None]) -> None:
    """Call on_death() and exit as soon as the trainer process is gone."""

    def die() -> None:
        with contextlib.suppress(Exception):
            on_death()
        os._exit(1)

    def parent_gone() -> bool:
        return os.getppid() != parent_pid

    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
        if parent_gone():
            die()

    signal.signal(_PARENT_DEATH_SIGNAL, handler)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(_PARENT_DEATH_SIGNAL), 0, 0, 0)
    if parent_gone():  # died before the signal was armed
        die()

    def watch() -> None:
        try:
            fd = os.pidfd_open(parent_pid)
        except ProcessLookupError:
            die()
            return
        except (OSError, AttributeError):
            return  # no pidfd here: the channel EOF and the death signal still work
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            if poller.poll():
                die()

    threading.Thread(target=watch, name="pyshmckpt-parent-watch", daemon=True).start()


def writer_main(
    conn: Connection,
    parent_pid: int,
    rank_info: Any,
    subprocess_init_fn: Callable[..., Any],
    subprocess_init_args: tuple[Any, ...],
    checkpoint_writer_init_fn: Callable[..., Any],
    checkpoint_writer_init_args: dict[str, Any],
) -> None:
    """Entry point of the writer subprocess.

    It ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and it is the
    trainer that decides what happens to pending writes (close() finishes them, close(abort=True)
    drops them; the trainer's death stops the writer either way).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    attached = _AttachedSegments()
    _watch_parent(parent_pid, attached.unlink_all)
    try:
        subprocess_init_fn(*subprocess_init_args)
        writer_args = dict(checkpoint_writer_init_args)
        writer_args.setdefault("rank_info", rank_info)
        writer = checkpoint_writer_init_fn(**writer_args)
    except BaseException:
        with contextlib.suppress(ChannelClosed):
            send(conn, Response(Kind.INIT, 0, ok=False, error=traceback.format_exc()))
        return
    send(conn, Response(Kind.INIT, 0, ok=True, payload={"pid": os.getpid()}))
    views = _StagedViews()
    while True:
        try:
            request: Request = conn.recv()
        except (EOFError, OSError):
            attached.unlink_all()  # the trainer is gone
            return
        if request.kind is Kind.WRITE:
            send(conn, _serve_write(request, writer, attached, views))
        elif request.kind is Kind.TERMINATE:
            error = None
            commit.wait_for_deletions(60.0)  # old checkpoints being freed in the background
            close = getattr(writer, "close", None)
            if callable(close):
                try:
                    close()
                except BaseException:
                    error = traceback.format_exc()
            send(conn, Response(Kind.TERMINATE, request.id, ok=error is None, error=error))
            return
        else:
            send(conn, Response(request.kind, request.id, ok=False, error=f"unknown request {request.kind}"))


def _serve_write(
    request: Request, writer: Any, attached: _AttachedSegments, views: _StagedViews
) -> Response:
    payload = request.payload
    try:
        attached.sync(payload["segments"])
        for name in set(views.cache) - set(attached.segments):
            views.drop(name)
        name, offset = payload["slot"]
        segment = attached.get(name)
        manifest = views.manifest(segment, payload["manifest"])
        started = time.perf_counter()
        write_slot = getattr(writer, "write_slot", None)
        if callable(write_slot):
            # Writers that persist straight from shared memory get the slot, not tensors.
            write_slot(path=payload["path"], segment=segment, offset=offset, manifest=manifest, **payload["kwargs"])
        else:
            state_dict = views.rebuild(segment, offset, manifest)
            writer.write(path=payload["path"], state_dict=state_dict, **payload["kwargs"])
            del state_dict
        elapsed = time.perf_counter() - started
        return Response(
            Kind.WRITE, request.id, ok=True, generation=request.generation,
            payload={"write_seconds": elapsed},
        )  # fmt: skip
    except BaseException:
        return Response(
            Kind.WRITE, request.id, ok=False, generation=request.generation,
            error=traceback.format_exc(),
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------


class WriterError(RuntimeError):
    """The user's writer raised in the subprocess; the message carries its traceback."""


@dataclasses.dataclass
class _Pending:
    future: Future[Any]
    kind: Kind
    generation: int
    deadline: float | None  # time.monotonic() deadline, None for no limit
    slot: str | None = None


class WriterProcess:
    """One spawned writer subprocess and the dispatcher that resolves its requests."""

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
    ) -> None:
        self._target_args = (
            rank_info, subprocess_init_fn, tuple(subprocess_init_args),
            checkpoint_writer_init_fn, dict(checkpoint_writer_init_args),
        )  # fmt: skip
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
        # Layout last sent in full per slot: the child keeps the views it built for it.
        self._sent_layouts: dict[str, bytes] = {}
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
        """Spawn the child and wait for it to initialise (bounded by the init timeout).

        Raises TimeoutError ("Timed out ...") when it does not acknowledge in time and
        RuntimeError carrying the child's traceback when initialisation raised.
        """
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=writer_main,
            args=(child_conn, os.getpid(), *self._target_args),
            name="pyshmckpt-writer",
            daemon=True,
        )
        process.start()
        child_conn.close()
        with self._lock:
            self._process, self._conn, self.pid = process, parent_conn, process.pid
            closing = self._closing
        if closing:  # close() ran while this was spawning: do not leave the child behind
            self._failure = WriterDiedError("the checkpoint writer process was closed while starting")
            self._reap()
            raise self._failure
        try:
            message = receive(parent_conn, process.sentinel, self._init_timeout)
        except ChannelClosed:
            self._join(self._shutdown_timeout)
            self._failure = RuntimeError(
                "checkpoint writer process exited during initialization "
                f"({describe_exit(self.exitcode)})"
            )
            self._reap()
            raise self._failure from None
        if self._closing:
            self._failure = WriterDiedError("the checkpoint writer process was closed while starting")
            self._reap()
            raise self._failure
        if message is None:
            self._failure = TimeoutError(
                f"Timed out after {self._init_timeout}s waiting for checkpoint subprocess to "
                "initialize"
            )
            self._reap()
            raise self._failure
        if message.kind is not Kind.INIT or not message.ok:
            self._failure = RuntimeError(
                f"checkpoint writer process failed to initialize:\n{message.error}"
            )
            self._reap()
            raise self._failure
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="pyshmckpt-writer-dispatch", daemon=True
        )
        self._dispatcher.start()

    @property
    def alive(self) -> bool:
        return self._failure is None and self._alive()

    @property
    def exitcode(self) -> int | None:
        if self._process is None:
            return None
        with self._reap_lock:
            return self._process.exitcode  # type: ignore[no-any-return]

    def submit_write(self, generation: int, payload: dict[str, Any], timeout: float | None) -> Future[Any]:
        """Queue one WRITE; the Future resolves when the writer answers (or fails)."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closing:
                raise WriterDiedError("the checkpoint writer process is closed")
            if not self.alive:
                raise self._dead_error()
            request_id = next(self._ids)
            deadline = None if timeout is None else time.monotonic() + timeout
            slot_name = payload["slot"][0]
            manifest = payload["manifest"]
            if self._sent_layouts.get(slot_name) == manifest.layout_key:
                payload = {**payload, "manifest": ManifestRef(manifest.tree, manifest.layout_key)}
            else:
                self._sent_layouts[slot_name] = manifest.layout_key
            self._pending[request_id] = _Pending(future, Kind.WRITE, generation, deadline, slot_name)
            try:
                send(self._conn, Request(Kind.WRITE, request_id, generation, payload))  # type: ignore[arg-type]
            except ChannelClosed:
                self._pending.pop(request_id, None)
                self._join(1.0)  # it is exiting: learn how
                self._failure = self._dead_error()
                raise self._failure from None
            except BaseException:  # unpicklable kwargs and the like: nothing was queued
                self._pending.pop(request_id, None)
                self._sent_layouts.pop(slot_name, None)
                raise
        self._wake()
        return future

    def close(self, *, abort: bool = False) -> list[BaseException]:
        """Stop the writer: TERMINATE, join, SIGTERM, join, SIGKILL (abort: SIGKILL at once).

        Idempotent and bounded. Pending writes that did not finish fail (CheckpointAbortedError
        on abort). Returns the errors met while cleaning up, for the caller to report.
        """
        errors: list[BaseException] = []
        with self._lock:
            if self._closing:
                return errors
            self._closing = True
        process = self._process
        terminated: Future[Any] | None = None
        if process is not None:
            if abort:
                self._fail_pending(CheckpointAbortedError("the write was abandoned by close(abort=True)"))
                process.kill()
                self._join(1.0)
            else:
                terminated = self._terminate(process, errors)
        self._wake()
        if self._dispatcher is not None and self._dispatcher is not threading.current_thread():
            self._dispatcher.join(self._shutdown_timeout + 1.0)
        if terminated is not None and terminated.done():
            close_error = terminated.exception()
            if close_error is not None:
                errors.append(close_error)  # the user's writer.close() raised
        self._fail_pending(WriterDiedError(self._exit_text("the checkpoint writer process was closed")))
        self._reap()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
        return errors

    def kill(self) -> None:
        """SIGKILL the writer and reap it (used for hung writers)."""
        process = self._process
        if process is not None and self._alive():
            process.kill()
            self._join(5.0)

    # -- internals ------------------------------------------------------------------------

    def _terminate(self, process: Any, errors: list[BaseException]) -> Future[Any] | None:
        """TERMINATE, join, SIGTERM, join, SIGKILL; returns the TERMINATE request's future."""
        terminated: Future[Any] | None = None
        if self._alive() and self._conn is not None:
            with self._lock:
                request_id = next(self._ids)
                terminated = Future()
                self._pending[request_id] = _Pending(terminated, Kind.TERMINATE, -1, None)
                try:
                    send(self._conn, Request(Kind.TERMINATE, request_id))
                except ChannelClosed:
                    self._pending.pop(request_id, None)
                    terminated = None
        if not self._join(self._shutdown_timeout):
            errors.append(
                TimeoutError(
                    f"checkpoint writer {process.pid} did not exit within "
                    f"{self._shutdown_timeout}s of TERMINATE; sent SIGTERM"
                )
            )
            process.terminate()
            if not self._join(self._shutdown_timeout):
                errors.append(
                    TimeoutError(f"checkpoint writer {process.pid} ignored SIGTERM; sent SIGKILL")
                )
                process.kill()
                self._join(5.0)
        return terminated

    def _reap(self) -> None:
        process = self._process
        if process is not None:
            if self._alive():
                process.kill()
                self._join(5.0)

        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _exit_text(self, what: str) -> str:
        pid = self.pid
        return f"{what} (pid {pid}, {describe_exit(self.exitcode)})"

    def _dead_error(self) -> BaseException:
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
        while True:
            with self._lock:
                deadlines = [p.deadline for p in self._pending.values() if p.deadline is not None]
            timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            ready = wait([conn, process.sentinel, self._wake_r], timeout)
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            while conn.poll(0):
                try:
                    response = conn.recv()
                except (EOFError, OSError):
                    break
                if not self._resolve(response):
                    return
            if process.sentinel in ready or not self._alive():
                self._join(1.0)
                died = WriterDiedError(
                    self._exit_text("the checkpoint writer process died with writes pending")
                )
                if self._failure is None:
                    self._failure = died
                self._fail_pending(died)
                return
            if self._expire():
                return
            # Otherwise run until the child exits: close() may still be waiting for its reply to
            # TERMINATE (and the error of the user's writer.close() it may carry).

    def _resolve(self, response: Response) -> bool:
        """Complete the request `response` answers; False when the protocol is broken."""
        with self._lock:
            item = self._pending.get(response.id)
            if item is not None and item.kind is response.kind and item.generation == response.generation:
                del self._pending[response.id]
            else:
                item = None
        if item is None:
            # A reply to nothing we asked, or for another slot generation: the writer can no
            # longer be trusted about which slot it reads. Stop it before failing anything.
            self.kill()
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
            item.future.set_exception(WriterError(f"checkpoint writer raised:\n{response.error}"))
        return True

    def _expire(self) -> bool:
        """Kill the writer if a write overran its deadline; True when that happened."""
        now = time.monotonic()
        with self._lock:
            expired = [p for p in self._pending.values() if p.deadline is not None and p.deadline <= now]
        if not expired:
            return False
        self.kill()  # reaped before anything fails: its slots are not read any more
        timeout = TimeoutError(
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
                    WriterDiedError(self._exit_text("the writer was killed because another write timed out"))
                )
        return True
