"""The writer process itself: build the user's writer, then persist what the trainer staged.

`writer_main` runs the init function, builds the writer (a `SlotWriter` or a `StateDictWriter`),
and serves requests: it attaches each slot segment once, and for a WRITE hands the writer the
mapped slot and manifest, or the staged state dict rebuilt as zero-copy CPU tensors over the
slot. Its log records go to the trainer over the channel.

Writes the trainer made while this process was starting wait in the spool (`spool.SpoolReader`),
served first once the trainer says how many there are (ADOPT).

If the trainer dies (noticed by the pidfd of the parent, PR_SET_PDEATHSIG and channel EOF), the
writes it had handed over are complete snapshots in shared memory: by default (`OrphanPolicy`)
the writer reads every request left in the spool and the pipe, finishes those writes (each bounded by the
write timeout, the commit included), then unlinks the trainer's segments and exits. With
``finish=False`` it unlinks them and exits at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import logging
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ..errors import ProtocolError, PyshmckptError, PyshmckptOSError
from ..shm import AttachedSegments
from ..staging import SlotViews
from ..storage import SlotWriter, progress, writer_kind
from ..tiers import holding, records, replication
from ..tiers.records import HoldInfo
from ..tiers.replication import ReplicaConfig
from . import logs
from .channel import Kind, ManifestRef, Request, Response, send
from .keeper import Kept
from .spool import SpoolReader

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Sent to the writer by the kernel when the thread that spawned it exits. That thread need not be
# the whole trainer, so the handler checks that the trainer is really gone before acting.
_PARENT_DEATH_SIGNAL = signal.SIGUSR2


class RankInfo:
    """What torch's RankInfo gives a writer (its two fields), for callers without torch's."""

    def __init__(self, global_rank: int = 0, global_world_size: int = 1) -> None:
        self.global_rank = global_rank
        self.global_world_size = global_world_size


def no_init() -> None:
    """A writer process's init function that does nothing."""


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


@dataclasses.dataclass(frozen=True)
class OrphanPolicy:
    """What the writer does with the writes it was handed when the trainer dies.

    finish: finish them (and their commits) before exiting; False: abandon them at once.
    write_timeout: seconds each of them may take (None: no limit); the writer exits after that.
    """

    finish: bool = True
    write_timeout: float | None = None


# How long an orphaned writer waits for the rest of a request that was being sent when the
# trainer died (another process may hold the trainer's end of the pipe open).
_ORPHAN_IDLE_LIMIT = 10.0
# How long the writer waits, after the channel's EOF, for its trainer's death to show.
_EOF_GRACE = 2.0
# How long a second notice of the trainer's death waits for the first to take effect.
_NOTICE_WAIT = 5.0


class _TrainerWatch:
    """Notices the trainer's death and decides what follows (see OrphanPolicy)."""

    def __init__(
        self,
        parent_pid: int,
        policy: OrphanPolicy,
        attached: AttachedSegments,
        spool: SpoolReader | None = None,
    ) -> None:
        self.parent_pid = parent_pid
        self.policy = policy
        self.attached = attached
        self.kept = Kept()  # the trainer's segments handed over by descriptor (see keeper)
        self.spool = SpoolReader(None) if spool is None else spool
        self.dead = threading.Event()
        self.wake_r, self._wake_w = os.pipe()
        # Who noticed first (the watch thread, or the main thread on the channel's EOF): next()
        # on it is one C call, atomic under the GIL.
        self._notices = itertools.count()
        self._busy_since: float | None = None  # a write in progress, since
        self._progress = time.monotonic()

    def parent_gone(self) -> bool:
        return os.getppid() != self.parent_pid

    def died(self) -> None:
        """The trainer is gone (called from the watch thread or the main loop, never from a
        signal handler: only the first call acts; another waits, bounded, until it has). From
        `dead` on, the writer's records go to stderr too: what the orphan logs is never lost to a
        channel nobody reads."""
        if next(self._notices):
            self.dead.wait(_NOTICE_WAIT)
            return
        self._progress = time.monotonic()  # the orphan's idle limit counts from here
        logs.to_stderr()  # before `dead`: whoever acts on it logs to stderr already
        self.dead.set()
        if not self.policy.finish:
            self.exit(1)
        # A restart may come while the writes handed over are still being finished: say at once
        # that a newer checkpoint may be held here, so that its restore waits for it.
        holding.HOLDER.announce()
        # Wake the main loop and bound what follows before logging, which forwards the record
        # over the channel and may wait for a send in progress.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        threading.Thread(
            target=self._watchdog, name="pyshmckpt-orphan-watchdog", daemon=True
        ).start()
        logger.warning(
            "the trainer (pid %d) is gone: finishing the writes it handed over, then exiting",
            self.parent_pid,
        )

    def handed_over(self) -> None:
        """The trainer left on an error and handed its memory over (TERMINATE asking to
        hold): from here on this writer is on its own as after a death, and the trainer's later
        exit is not another one."""
        if next(self._notices):  # its death was noticed first, and acted on
            self.dead.wait(_NOTICE_WAIT)
            return
        logs.to_stderr()  # nobody reads the channel any more
        self.dead.set()
        logger.info("the trainer (pid %d) handed its memory over", self.parent_pid)

    def serving(self) -> bool:
        return self._busy_since is not None

    def busy(self, writing: bool) -> None:
        self._busy_since = time.monotonic() if writing else None
        self._progress = time.monotonic()

    def exit(self, code: int) -> None:
        for request in self.spool.read():  # writes still spooled name segments too
            self.attached.note(n for n, _, _ in request.payload.get("segments", ()))
        self.kept.close()  # what is still needed is attached: held by the mapping
        if self.dead.is_set():  # the newest checkpoint stays in memory for a new trainer
            replicas: list[Any] = []
            limits = None
            try:
                replicas, limits = replication.stop()
            except Exception:
                logger.exception("stopping the replica listener failed: its replicas are freed")
            if holding.HOLDER.hold(self.attached, replicas, limits):  # logs its own failure
                os._exit(code)  # the hold ended: its segment was freed, or a new trainer's
        holding.HOLDER.withdraw()
        try:
            self.attached.unlink_all()
        except Exception:
            logger.exception("removing the trainer's segments failed (collected as stale later)")
        try:
            replication.release_all()
        except Exception:
            logger.exception("freeing the replicas held here failed (collected as stale later)")
        os._exit(code)

    def _watchdog(self) -> None:
        limit = self.policy.write_timeout
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            since = self._busy_since
            if since is not None and limit is not None and now - since > limit:
                logger.error("an orphaned write ran past its %ss timeout: abandoning it", limit)
                self.exit(1)
            if since is None and now - self._progress > _ORPHAN_IDLE_LIMIT:
                logger.error("the rest of a request never arrived: exiting")
                self.exit(1)

    def arm(self) -> None:
        """Watch for the trainer's death on a thread: its pidfd, and the parent-death signal.

        The signal's handler only wakes that thread. It runs on the main thread, between any two
        bytecodes: acting there (logging, which forwards over the channel) waited for locks the
        main thread itself held, such as the one around sending a reply (a writer left sleeping
        with the trainer's segments).
        """
        signal_r, signal_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

        def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
            with contextlib.suppress(OSError):  # full: the thread has a wake-up pending already
                os.write(signal_w, b"x")

        signal.signal(_PARENT_DEATH_SIGNAL, handler)
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(_PARENT_DEATH_SIGNAL), 0, 0, 0)
        poller = select.poll()
        poller.register(signal_r, select.POLLIN)
        pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(self.parent_pid)
            poller.register(pidfd, select.POLLIN)
        except ProcessLookupError:
            self.died()
        except (OSError, AttributeError):
            pass  # no pidfd here: the death signal and the channel EOF still work
        if self.parent_gone():  # died before the signal was armed
            self.died()

        def watch() -> None:
            while not self.dead.is_set():
                ready = {fd for fd, _ in poller.poll()}
                if pidfd in ready or self.parent_gone():
                    self.died()
                    return
                # The signal is sent when the thread that spawned this process exits, which need
                # not be the whole trainer: drain it and keep watching.
                with contextlib.suppress(OSError):
                    os.read(signal_r, 64)

        threading.Thread(target=watch, name="pyshmckpt-parent-watch", daemon=True).start()


def writer_main(
    conn: Connection,
    spool_fd: int | None,
    parent_pid: int,
    log_levels: dict[str, int],
    orphans: OrphanPolicy,
    rank_info: Any,
    subprocess_init_fn: Callable[..., Any],
    subprocess_init_args: tuple[Any, ...],
    checkpoint_writer_init_fn: Callable[..., Any],
    checkpoint_writer_init_args: dict[str, Any],
) -> None:
    """Entry point of the writer subprocess.

    It runs in a session (and process group) of its own, and ignores SIGINT: what is sent to the
    trainer's process group (a terminal's Ctrl-C; torchrun's elastic agent stopping a worker
    group, which signals each worker's group) does not reach it. It is the trainer that decides
    what happens to pending writes (close() finishes them, close(abort=True) drops them; on the
    trainer's death, see OrphanPolicy).
    """
    if os.getpid() != os.getsid(0):  # the launcher starts it in a session of its own already
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spool = SpoolReader(spool_fd)
    outbox = _Outbox(conn)
    logs.install(log_levels, outbox.log)
    attached = AttachedSegments()
    watch = _TrainerWatch(parent_pid, orphans, attached, spool)
    watch.arm()
    watch.busy(True)  # an orphaned writer's init is bounded like a write
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
        if watch.dead.is_set():  # orphaned: the segments its spooled writes name go too
            watch.exit(1)
        return
    watch.busy(False)
    reports_progress = bool(getattr(writer, "reports_progress", False))
    outbox.send(
        Response(
            Kind.INIT, 0, ok=True,
            payload={"pid": os.getpid(), "reports_progress": reports_progress},
        )
    )  # fmt: skip
    if reports_progress:
        threading.Thread(
            target=_report_progress, args=(watch, outbox), name="pyshmckpt-progress", daemon=True
        ).start()
    logger.debug("writer process %d serves %s", os.getpid(), type(writer).__qualname__)
    views = SlotViews()
    while True:
        try:
            wait([conn, watch.wake_r])
            if watch.dead.is_set():
                break
            request: Request = conn.recv()
        except (EOFError, OSError):
            # A dying trainer's pipe closes before it is reparented away: give the watcher a
            # moment to see it go before taking the EOF for a channel closed from outside.
            if not (watch.dead.wait(_EOF_GRACE) or watch.parent_gone()):
                # The trainer closed the channel: it restarts a writer if it needs one.
                replication.release_all()
                return
            watch.died()
            break
        if request.kind is Kind.KEEP:
            try:
                watch.kept.receive(conn, request)
            except ProtocolError:  # out of step with the trainer: it restarts a writer
                logger.exception("the control channel is out of step: this writer stops")
                replication.release_all()
                return
        elif request.kind in (Kind.WRITE, Kind.CALL):
            watch.busy(True)
            outbox.send(_serve(request, writer, attached, views))
            watch.busy(False)
            if request.kind is Kind.WRITE:  # attached now; the retired ones are let go
                watch.kept.retain(name for name, _, _ in request.payload["segments"])
        elif request.kind is Kind.ADOPT:
            for _ in range(int(request.payload["count"])):
                if watch.dead.is_set():
                    break  # the rest of the spool is finished as orphaned writes
                for spooled in spool.read(1):
                    watch.busy(True)
                    outbox.send(_serve(spooled, writer, attached, views))
                    watch.busy(False)
            else:
                spool.close()
        elif request.kind is Kind.TERMINATE:
            close = getattr(writer, "close", None)
            if request.payload.get("hold"):
                # The trainer leaves on an error: hold the newest checkpoint (and the replicas
                # held for other nodes) for the next trainer, as after its death; said before
                # the answer, so that a restore right after it waits for the hold. Answered
                # at once: the writer's own close() (which may take a while) comes after.
                holding.HOLDER.announce()
                outbox.send(
                    Response(Kind.TERMINATE, request.id, ok=True, payload={"holding": True})
                )
                watch.handed_over()
                if callable(close):
                    try:
                        close()
                    except Exception:
                        logger.exception("the writer's close() failed")
                watch.exit(0)
            error = None
            if callable(close):
                try:
                    close()
                except BaseException:
                    error = traceback.format_exc()
            try:  # the job ends: replicas held here too
                replication.release_all()
            except Exception:
                logger.exception("freeing the replicas held here failed (collected as stale later)")
            outbox.send(Response(Kind.TERMINATE, request.id, ok=error is None, error=error))
            # Done: skip the interpreter's teardown (with torch loaded it can outlast a short
            # shutdown timeout and draw a SIGTERM).
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(0)
        else:
            outbox.send(
                Response(
                    request.kind, request.id, ok=False, error=f"unknown request {request.kind}"
                )
            )

    _finish_orphaned(conn, spool, writer, attached, views, watch)


_PROGRESS_INTERVAL = 1.0


def _report_progress(watch: _TrainerWatch, outbox: _Outbox) -> None:
    """While a request is served, tell the trainer each time the writer's progress moved on
    (at most once per interval): what it judges a stalled write by."""
    last = progress.current()
    while not watch.dead.wait(_PROGRESS_INTERVAL):
        now = progress.current()
        if now != last and watch.serving():
            outbox.send(Response(Kind.PROGRESS, 0, ok=True, payload={"bytes": now[0]}))
        last = now


def _finish_orphaned(
    conn: Connection,
    spool: SpoolReader,
    writer: Any,
    attached: AttachedSegments,
    views: SlotViews,
    watch: _TrainerWatch,
) -> None:
    """The trainer is gone: finish every write (and call) left in the spool and the pipe, in the
    order they were made, then clean up and exit."""
    requests: list[Request] = list(spool.read())
    try:
        while conn.poll(0):
            request = conn.recv()
            if request.kind is Kind.KEEP:  # until its slots are attached, below
                watch.kept.receive(conn, request)  # raises when the rest is out of step
            requests.append(request)
    except Exception as exc:  # noqa: BLE001 - EOF, or a request cut short by the death
        logger.info("the rest of the channel is unreadable (cut short by the death): %r", exc)
    requests = [r for r in requests if r.kind in (Kind.WRITE, Kind.CALL)]
    held = [r.payload["kwargs"].get("hold") for r in requests if r.kind is Kind.WRITE]
    newest = max((h for h in held if h is not None), key=lambda h: h.staged_ns, default=None)
    if newest is not None:
        holding.HOLDER.announce(newest)
    # Attach every slot now: a restarted trainer may soon collect the dead one's segment names.
    try:
        attached.sync(
            {s for r in requests if r.kind is Kind.WRITE for s in r.payload["segments"]},
            close_others=False,  # the newest checkpoint may be in one the trainer retired
        )
    except Exception:
        logger.exception("attaching the dead trainer's slots failed: their writes will fail")
    failed = 0
    for request in requests:
        watch.busy(True)
        response = _serve(request, writer, attached, views, sync=False)
        watch.busy(False)
        what = (
            f"write of {request.payload.get('path')}"
            if request.kind is Kind.WRITE
            else f"call of {request.payload.get('method')}"
        )
        if response.ok:
            logger.warning("finished the orphaned %s", what)
        else:
            failed += 1
            logger.error("orphaned %s failed:\n%s", what, response.error)
    close = getattr(writer, "close", None)
    if callable(close):
        watch.busy(True)
        try:
            close()
        except Exception:
            failed += 1
            logger.exception("closing the writer after the trainer's death failed")
    watch.exit(1 if failed else 0)


def _serve(
    request: Request,
    writer: Any,
    attached: AttachedSegments,
    views: SlotViews,
    *,
    sync: bool = True,
) -> Response:
    if request.kind is Kind.CALL:
        return _serve_call(request, writer)
    return _serve_write(request, writer, attached, views, sync=sync)


def _serve_call(request: Request, writer: Any) -> Response:
    """Run what the trainer asked for (`CheckpointProcess.call`): a method of the writer, by
    name, or a function."""
    try:
        method = request.payload["method"]
        if isinstance(method, str):
            method = getattr(writer, method)
        result = method(**request.payload["kwargs"])
    except BaseException as exc:
        return Response(
            Kind.CALL, request.id, ok=False, error=traceback.format_exc(), payload=_describe(exc)
        )
    return Response(Kind.CALL, request.id, ok=True, payload={"result": result})


def _serve_write(
    request: Request,
    writer: Any,
    attached: AttachedSegments,
    views: SlotViews,
    *,
    sync: bool = True,
) -> Response:
    payload = request.payload
    replica: replication.Replication | None = None
    try:
        if sync:
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
        slot = attached.slot(address, manifest.size)
        hold: HoldInfo | None = payload["kwargs"].pop("hold", None)
        replicate: ReplicaConfig | None = payload["kwargs"].pop("replicate", None)
        if hold is not None:  # the newest checkpoint, held in memory if the trainer dies
            holding.HOLDER.note(address, manifest, hold)
            payload["kwargs"]["staged_ns"] = hold.staged_ns
            if replicate is not None:  # and in the memory of a rank on another node
                replica = _replicate(replicate, attached, address, manifest, hold)
        started = time.perf_counter()
        if hold is None or hold.persisted:
            if isinstance(writer, SlotWriter):  # persists straight from shared memory
                writer.write_slot(
                    path=payload["path"], slot=slot, manifest=manifest, **payload["kwargs"]
                )
            else:
                state_dict = views.rebuild(slot, manifest)
                writer.write(path=payload["path"], state_dict=state_dict, **payload["kwargs"])
                del state_dict
            logger.debug("wrote %s in %.3f s", payload["path"], time.perf_counter() - started)
        elapsed = time.perf_counter() - started
        failed = replica.wait() if replica is not None else None
        if failed is not None:
            logger.warning(
                "checkpoint %s was not replicated to another node: %s", payload["path"], failed
            )
        return Response(
            Kind.WRITE, request.id, ok=True, generation=request.generation,
            payload={"write_seconds": elapsed, "replica_error": failed},
        )  # fmt: skip
    except BaseException as exc:
        logger.debug("write of %s failed: %r", payload.get("path"), exc)
        if replica is not None:  # its copy finishes before the next save's can (bounded)
            replica.wait()
        return Response(
            Kind.WRITE, request.id, ok=False, generation=request.generation,
            error=traceback.format_exc(), payload=_describe(exc),
        )  # fmt: skip


def _replicate(
    config: ReplicaConfig,
    attached: AttachedSegments,
    address: Any,
    manifest: Any,
    hold: HoldInfo,
) -> replication.Replication | None:
    """Start replicating a held checkpoint to the buddy writer (None: nothing to replicate to,
    or it cannot be described; logged)."""
    try:
        replication.listen(config)  # a restarted writer listens again on the same port
    except (OSError, PyshmckptError) as exc:  # a ConfigError too: encryption asked, not here
        logger.warning("cannot listen for replicas on %s:%d: %s", *config.listen, exc)
    if config.buddy is None:
        return None
    slot = attached.slot(address, manifest.size)
    record = records.describe(manifest, slot, hold, (address.name, address.size, address.token))
    return replication.Replication(config, record)


def _describe(exc: BaseException) -> dict[str, Any]:
    """What the trainer needs to raise the matching error: the type and, for OSError, errno; a
    pyshmckpt error of ours (CommitError, CheckpointCorruptError, ...) itself, so that the caller
    receives the type the documentation names, whichever process found it."""
    described: dict[str, Any] = {"exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}"}
    if isinstance(exc, OSError) and not (  # TimeoutError is an OSError too
        isinstance(exc, PyshmckptError) and not isinstance(exc, PyshmckptOSError)
    ):
        described["errno"] = exc.errno
        described["strerror"] = exc.strerror
    elif isinstance(exc, PyshmckptError):
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - described by its type and traceback instead
            logger.debug("%r does not pickle; sent as a WriterError", exc)
        else:
            described["error"] = exc
    return described
