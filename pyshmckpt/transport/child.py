"""The writer process itself: build the user's writer, then persist what the trainer staged.

`writer_main` runs the init function, builds the writer (a `SlotWriter` or a `StateDictWriter`),
and serves requests: it attaches each slot segment once, and for a WRITE hands the writer the
mapped slot and manifest, or the staged state dict rebuilt as zero-copy CPU tensors over the
slot. Its log records go to the trainer over the channel. If the trainer dies, it notices (pidfd
of the parent, channel EOF, PR_SET_PDEATHSIG), unlinks the trainer's segments it knows of, and
exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..errors import ProtocolError
from ..shm import AttachedSegments
from ..staging import SlotViews
from ..storage import SlotWriter, writer_kind
from . import logs
from .channel import Kind, ManifestRef, Request, Response, send

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Sent to the writer by the kernel when the thread that spawned it exits. That thread need not be
# the whole trainer, so the handler checks that the trainer is really gone before acting.
_PARENT_DEATH_SIGNAL = signal.SIGUSR2


class _Outbox:
    """Sends to the trainer from any thread of the writer (replies, forwarded log records)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: Response) -> bool:
        with self._lock:
            return send(self._conn, message)

    def log(self, fields: dict[str, Any]) -> bool:
        return self.send(Response(Kind.LOG, 0, ok=True, payload=fields))


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
    log_levels: dict[str, int],
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
    outbox = _Outbox(conn)
    logs.install(log_levels, outbox.log)
    attached = AttachedSegments()
    _watch_parent(parent_pid, attached.unlink_all)
    try:
        subprocess_init_fn(*subprocess_init_args)
        writer_args = dict(checkpoint_writer_init_args)
        writer_args.setdefault("rank_info", rank_info)
        writer = checkpoint_writer_init_fn(**writer_args)
        if writer_kind(writer) is None:
            raise ProtocolError(
                f"{checkpoint_writer_init_fn!r} built a {type(writer).__qualname__}, which has neither "
                "write(path, state_dict, **kwargs) nor write_slot(path, slot, manifest, **kwargs)"
            )
    except BaseException:
        outbox.send(Response(Kind.INIT, 0, ok=False, error=traceback.format_exc()))
        return
    outbox.send(Response(Kind.INIT, 0, ok=True, payload={"pid": os.getpid()}))
    logger.debug("writer process %d serves %s", os.getpid(), type(writer).__qualname__)
    views = SlotViews()
    while True:
        try:
            request: Request = conn.recv()
        except (EOFError, OSError):
            attached.unlink_all()  # the trainer is gone
            return
        if request.kind is Kind.WRITE:
            outbox.send(_serve_write(request, writer, attached, views))
        elif request.kind is Kind.TERMINATE:
            error = None
            close = getattr(writer, "close", None)
            if callable(close):
                try:
                    close()
                except BaseException:
                    error = traceback.format_exc()
            outbox.send(Response(Kind.TERMINATE, request.id, ok=error is None, error=error))
            return
        else:
            outbox.send(
                Response(
                    request.kind, request.id, ok=False, error=f"unknown request {request.kind}"
                )
            )


def _serve_write(
    request: Request, writer: Any, attached: AttachedSegments, views: SlotViews
) -> Response:
    payload = request.payload
    try:
        attached.sync(payload["segments"])
        views.retain(attached.names())
        address = payload["slot"]
        manifest = payload["manifest"]
        if isinstance(manifest, ManifestRef):
            resolved = views.resolve(address.name, manifest.tree, manifest.layout_key)
            if resolved is None:
                raise ProtocolError(
                    f"the writer holds no layout {manifest.layout_key.hex()} for slot {address.name}"
                )
            manifest = resolved
        else:
            views.remember(address.name, manifest)
        slot = attached.slot(address)
        started = time.perf_counter()
        if isinstance(writer, SlotWriter):  # persists straight from shared memory
            writer.write_slot(
                path=payload["path"], slot=slot, manifest=manifest, **payload["kwargs"]
            )
        else:
            state_dict = views.rebuild(slot, manifest)
            writer.write(path=payload["path"], state_dict=state_dict, **payload["kwargs"])
            del state_dict
        elapsed = time.perf_counter() - started
        logger.debug("wrote %s in %.3f s", payload["path"], elapsed)
        return Response(
            Kind.WRITE, request.id, ok=True, generation=request.generation,
            payload={"write_seconds": elapsed},
        )  # fmt: skip
    except BaseException as exc:
        logger.debug("write of %s failed: %r", payload.get("path"), exc)
        return Response(
            Kind.WRITE, request.id, ok=False, generation=request.generation,
            error=traceback.format_exc(), payload=_describe(exc),
        )  # fmt: skip


def _describe(exc: BaseException) -> dict[str, Any]:
    """What the trainer needs to raise a matching WriterError: the type and, for OSError, errno."""
    described: dict[str, Any] = {"exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}"}
    if isinstance(exc, OSError):
        described["errno"] = exc.errno
        described["strerror"] = exc.strerror
    return described
