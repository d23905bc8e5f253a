"""The writer's side of replication: send each held checkpoint to the writer of a rank on
another node, and keep the replicas other nodes' writers send here.

Why writer to writer over TCP: a replica must be finished, and kept, after the trainer's death,
so both ends live in the writer processes, which outlive their trainers, not in the trainers'
process group (whose collectives die with any rank). A TCP connection between two writers needs
nothing from torch.distributed once the addresses and the job's secret are known, and the bytes
go from the slot's segment to the socket with ``sendfile`` and from the socket into a new
segment with ``recv_into`` (`wire`, `replicas`).

Each writer listens on its node's address, on a port its trainer reserved (and announced to the
other ranks through the process group) so that a restarted writer listens on the same one. A
connection must prove it knows the job's secret before anything is read from it or sent to it.

Received replicas are checked (the CRC32C of every entry) before they count, replace the older
replica of the same rank, and are held as the newest checkpoint is when the trainer dies (see
`holding`): their records, ``<prefix>-replica-<key>-<pid>``, are published at once so that a
restore on this node finds them while the writer runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, PyshmckptError, ReplicationError
from ..shm.native import Segment
from ..shm.stale import SHM_DIR
from . import records, replicas, wire

logger = logging.getLogger(__name__)

# Seconds an accepted connection has to authenticate.
_AUTH_TIMEOUT = 10.0
# Seconds a closing writer waits for replicas still arriving.
_CLOSE_WAIT = 5.0


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """What a save tells its writer about replication.

    listen: (address, port) this writer listens on for replicas from other nodes.
    buddy: (address, port) of the writer this rank's checkpoints are replicated to (None: no
        other node). buddy_rank: that writer's rank. secret: the job's secret (hex).
    timeout: seconds one replication may take, its connection included.
    hold_timeout, agent: how long replicas received here are held after the trainer's death,
        and the launcher whose end ends that hold (as `HoldInfo`'s).
    """

    listen: tuple[str, int]
    buddy: tuple[str, int] | None
    buddy_rank: int | None
    secret: str
    timeout: float
    hold_timeout: float
    agent: tuple[int, int] | None


class ReplicaServer:
    """Receives replicas from other nodes' writers and keeps the newest of each rank."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._kept: dict[tuple[str, int], tuple[Path, dict[str, Any]]] = {}
        # Segments of replicas a newer one replaced, pages in place: the next ones land there.
        self._spares: list[Segment] = []
        self._receiving: set[threading.Thread] = set()
        self._stopped = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self._sock.bind(config.listen)
            self._sock.listen(16)
        except OSError:
            self._sock.close()
            raise
        threading.Thread(target=self._serve, name="pyshmckpt-replicas", daemon=True).start()
        logger.debug("listening for replicas on %s:%d", *config.listen)

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed: the trainer is gone, or the writer is closing
            thread = threading.Thread(
                target=self._receive, args=(conn,), name="pyshmckpt-replica-in", daemon=True
            )
            with self._lock:
                self._receiving.add(thread)
            thread.start()

    def _receive(self, conn: socket.socket) -> None:
        try:
            with conn:
                if not wire.accept(conn, self.config.secret, _AUTH_TIMEOUT):
                    logger.warning("a connection that did not authenticate was refused")
                    return
                deadline = wire.Deadline(self.config.timeout)
                try:
                    record, segment = replicas.receive(conn, deadline, self._spare)
                except CheckpointCorruptError as exc:
                    logger.warning("rejected a replica that failed its checksums: %s", exc)
                    with contextlib.suppress(OSError, ReplicationError):
                        wire.send_message(conn, {"ok": False, "reason": str(exc)})
                    return
                segment.disown()  # the record names it now; `release` removes it
                segment.close()
                replaced = self._keep(record)
                with contextlib.suppress(OSError):
                    wire.send_message(conn, {"ok": True})
                if replaced is not None:  # after the answer: the sender waits for nothing more
                    self._keep_spare(replaced)
        except (OSError, PyshmckptError) as exc:
            logger.warning("receiving a replica failed: %s", exc)
        finally:
            with self._lock:
                self._receiving.discard(threading.current_thread())

    def _keep(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Publish a verified replica; the record of the one of ours it replaces, if any."""
        key = (str(record["root"]), int(record["rank"]))
        record["replica"] = True
        path = replicas.replica_path(key[0], key[1], os.getpid())
        with self._lock:
            old = self._kept.get(key)
            records.publish(record, os.getpid(), None, None, path)
            self._kept[key] = (path, record)
        # Older replicas of that rank held by other processes (a writer whose trainer died).
        for other, found in replicas.replicas_of(*key):
            if other != path:
                records.release(other, found)
        logger.debug("holding a replica of %s rank %d (%s)", key[0], key[1], record.get("name"))
        return old[1] if old is not None else None

    def _spare(self, nbytes: int) -> Segment | None:
        """A spare segment of at least `nbytes` (the smallest), given over; None if none."""
        with self._lock:
            fits = [s for s in self._spares if s.size >= nbytes]
            if not fits:
                return None
            chosen = min(fits, key=lambda s: s.size)
            self._spares.remove(chosen)
            return chosen

    def _keep_spare(self, record: dict[str, Any]) -> None:
        """Keep the segment of a replaced replica for the next one (one spare: the others go)."""
        try:
            info = record["segment"]
            segment = Segment.attach(
                str(info["name"]), int(info["size"]), bytes.fromhex(info["token"]), map_pages=True
            )
        except (OSError, KeyError, TypeError, ValueError):
            with contextlib.suppress(OSError, KeyError, TypeError):
                (SHM_DIR / str(record["segment"]["name"])).unlink()
            return
        with self._lock:
            self._spares.append(segment)
            extra = self._spares[:-1] if not self._stopped.is_set() else self._spares
            self._spares = self._spares[-1:] if not self._stopped.is_set() else []
        for other in extra:  # one spare is enough; none once the writer stops
            _free(other)

    def stop(self, wait: float) -> list[tuple[Path, dict[str, Any]]]:
        """Stop accepting; let replicas being received finish (up to `wait` seconds); the
        replicas kept, to hold."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            receiving = list(self._receiving)
        for thread in receiving:
            thread.join(wait)
        with self._lock:
            spares, self._spares = self._spares, []
            kept = list(self._kept.values())
        for segment in spares:
            _free(segment)
        return kept

    def release_all(self) -> None:
        """Free every replica kept here (the writer is closing)."""
        for path, record in self.stop(_CLOSE_WAIT):
            records.release(path, record)
        with self._lock:
            self._kept.clear()


def _free(segment: Segment) -> None:
    with contextlib.suppress(OSError):
        segment.unlink()
    segment.close()


_server: ReplicaServer | None = None
_server_lock = threading.Lock()


def listen(config: ReplicaConfig) -> int:
    """Listen for replicas as `config` says (once per writer process); returns the port.
    Called in the writer (``CheckpointProcess.call``) when the Checkpointer starts, and by each
    replicated save (a restarted writer listens again on the same port)."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ReplicaServer(config)
        return _server.config.listen[1]


def stop() -> tuple[list[tuple[Path, dict[str, Any]]], tuple[float, tuple[int, int] | None]]:
    """The trainer is gone: stop receiving (replicas on their way are finished first, bounded
    by the replication timeout); the replicas to hold, and their (hold timeout, agent)."""
    if _server is None:
        return [], (0.0, None)
    config = _server.config
    return _server.stop(config.timeout), (config.hold_timeout, config.agent)


def release_all() -> None:
    """Free every replica received here (the writer is closing, or nothing is held)."""
    if _server is not None:
        _server.release_all()


def send(config: ReplicaConfig, record: dict[str, Any]) -> None:
    """Replicate the held checkpoint `record` describes to the buddy writer; returns once the
    buddy holds it, every checksum checked there.

    Raises:
        ReplicationError: the buddy cannot be reached, did not authenticate, broke off, or
            rejected the replica, within the config's timeout.
    """
    if config.buddy is None:
        return
    deadline = wire.Deadline(config.timeout)
    try:
        with wire.connect(config.buddy, config.secret, deadline) as sock:
            replicas.send(sock, record, deadline)
            reply = wire.recv_message(sock)
    except TimeoutError:
        raise ReplicationError(
            f"replication to rank {config.buddy_rank} took over {config.timeout:g} s"
        ) from None
    if not reply.get("ok"):
        raise ReplicationError(
            f"rank {config.buddy_rank}'s writer rejected the replica: {reply.get('reason')}"
        )


class Replication:
    """One checkpoint's replication, run on a thread beside its persist."""

    def __init__(self, config: ReplicaConfig, record: dict[str, Any]) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(config, record), name="pyshmckpt-replica-out", daemon=True
        )
        self._thread.start()

    def _run(self, config: ReplicaConfig, record: dict[str, Any]) -> None:
        try:
            send(config, record)
        except BaseException as exc:  # noqa: BLE001 - reported by `wait`
            self.error = exc

    def wait(self) -> str | None:
        """Wait for it (bounded by the config's timeout); None, or why it failed."""
        self._thread.join()
        if self.error is None:
            return None
        if isinstance(self.error, (OSError, PyshmckptError)):
            return f"{type(self.error).__name__}: {self.error}"
        return repr(self.error)
