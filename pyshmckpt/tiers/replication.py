"""The writer's side of replication: send each held checkpoint to the writer of a rank on another
node, and keep the replicas other nodes' writers send here.

Why writer to writer over TCP: a replica must be finished, and kept, after the trainer's death,
so both ends live in the writer processes, which outlive their trainers, not in the trainers'
process group (whose collectives die with any rank). A TCP connection between two writers needs
nothing from torch.distributed once the addresses and the job's secret are known, and the bytes
go from the slot's segment to the socket with ``sendfile`` and from the socket into a new
segment with ``recv_into`` (`wire`, `replicas`).

Each writer listens on its node's address, on a port its trainer reserved (and announced to the
other ranks through the process group) so that a restarted writer listens on the same one. A
connection must prove it knows the job's secret before anything is read from it or sent to it,
and every message after that is authenticated (`wire`); connections still in their handshake,
and transfers, are bounded in number and in time, so that whoever can reach the port cannot stop
replication.

**Replication never costs the writer.** The trainer's dispatcher kills a writer whose write makes
no progress for the stall timeout, and a save waits for its replica. So a replication reports
progress as its bytes leave, gives up once nothing has moved for under half the stall timeout
(its connection and handshake included), and ends by the replica timeout whatever the peer
does (silent, trickling, stopped); a buddy that failed is tried again only after a pause that
doubles with each further failure (`_Retries`). A save whose replica cannot be made stands on
this node alone, with a `ReplicationWarning`.

Received replicas are checked (the CRC32C of every entry) before they count, and held as the
newest checkpoint is when the trainer dies (see `holding`): their records,
``<prefix>-replica-<key>-<token>``, are published at once so that a restore on this node finds
them while the writer runs. Of the copies of one rank, the one staged last is kept, whatever the
order they arrive in (an older arrival is dropped, and its sender told), here and against the
replicas other processes of this node hold. The server keeps every replica's segment open while
it holds it (an open segment is a live one), and closes it once the replica is freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import CheckpointCorruptError, PyshmckptError, ReplicationError
from ..shm.native import Segment
from ..shm.stale import SHM_DIR
from ..storage import progress
from . import records, replicas, wire

logger = logging.getLogger(__name__)

# Seconds a closing writer waits for replicas still arriving.
_CLOSE_WAIT = 5.0
# Seconds a replication may go with nothing moving, at most (a link that moved nothing for that
# long is broken; the writer's stall timeout may set a shorter limit).
_IDLE_MAX = 30.0
# Seconds past its timeout a save waits for its replication's thread.
_WAIT_MARGIN = 5.0
# Connections to a writer's replica port in their handshake at once, and transfers at once.
_PENDING = 64
_SESSIONS = 16
# Replicas one writer holds at most (of distinct roots and ranks; a buddy sends one rank's).
_MAX_KEPT = 64
# How often the server looks for replicas of its that were freed (by a newer copy elsewhere on
# the node, the end of a hold, or `pyshmckpt gc`), to close their segments.
_PRUNE_EVERY = 1.0


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """What a save tells its writer about replication.

    listen: (address, port) this writer listens on for replicas from other nodes.
    buddy: (address, port) of the writer this rank's checkpoints are replicated to (None: no
        other node). buddy_rank: that writer's rank. secret: the job's secret (hex; not shown
        by repr).
    timeout: seconds one replication may take, its connection included.
    hold_timeout, agent: how long replicas received here are held after the trainer's death,
        and the launcher whose end ends that hold (as `HoldInfo`'s).
    stall_timeout: seconds the trainer lets the writer's write go without progress before it
        kills the writer (``write_stall_timeout_secs``; None: no such limit): a replication
        gives up once nothing has moved for under half of it.
    """

    listen: tuple[str, int]
    buddy: tuple[str, int] | None
    buddy_rank: int | None
    secret: str = dataclasses.field(repr=False)
    timeout: float
    hold_timeout: float
    agent: tuple[int, int] | None
    stall_timeout: float | None = None

    def idle(self) -> float:
        """Seconds a replication may go with nothing moving: its connection and handshake
        together, any one wait of the transfer, and the wait for the answer."""
        limit = min(self.timeout, _IDLE_MAX)
        if self.stall_timeout is not None and self.stall_timeout > 0:
            limit = min(limit, self.stall_timeout / 2)
        return limit


def _listener_identity(address: tuple[str, int]) -> str:
    return wire.identity("replicas", address=address)


class _Kept(NamedTuple):
    """A replica this server holds: its record's path, the record, its segment (open)."""

    path: Path
    record: dict[str, Any]
    segment: Segment


class ReplicaServer:
    """Receives replicas from other nodes' writers and keeps the newest of each rank."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._kept: dict[tuple[str, int], _Kept] = {}
        # Segments of replicas a newer one replaced, pages in place: the next ones land there.
        self._spares: list[Segment] = []
        self._stopped = threading.Event()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(config.listen)
            sock.listen(128)
            self._listener = wire.Listener(
                sock, config.secret, _listener_identity(config.listen), self._receive,
                name="pyshmckpt-replicas", pending=_PENDING, sessions=_SESSIONS,
            )  # fmt: skip
        except BaseException:
            sock.close()
            raise
        threading.Thread(target=self._prune, name="pyshmckpt-replicas-prune", daemon=True).start()
        logger.debug("listening for replicas on %s:%d", *config.listen)

    def _receive(self, channel: wire.Channel) -> None:
        deadline = wire.Deadline(self.config.timeout, idle=self.config.idle())
        try:
            record, segment = replicas.receive(channel, deadline, self._spare)
        except (CheckpointCorruptError, ReplicationError) as exc:
            logger.warning("refused a replica from %s: %s", channel.peer, exc)
            self._answer(channel, deadline, {"ok": False, "reason": str(exc)})
            return
        try:
            refused = self._keep(record, segment)
        except BaseException as exc:
            _free(segment)
            if not isinstance(exc, (OSError, PyshmckptError)):
                raise
            logger.warning("cannot hold a replica from %s: %s", channel.peer, exc)
            self._answer(channel, deadline, {"ok": False, "reason": str(exc)})
            return
        if refused is not None:
            _free(segment)
            logger.info("dropped a replica from %s: %s", channel.peer, refused)
            self._answer(channel, deadline, {"ok": False, "superseded": True, "reason": refused})
            return
        self._answer(channel, deadline, {"ok": True})

    @staticmethod
    def _answer(channel: wire.Channel, deadline: wire.Deadline, answer: dict[str, Any]) -> None:
        with contextlib.suppress(ReplicationError):  # the sender is gone: it learns nothing
            channel.send_message(answer, deadline)

    def _keep(self, record: dict[str, Any], segment: Segment) -> str | None:
        """Publish a verified replica, unless a copy of its rank staged later is held on this
        node (why not, then; the caller frees the segment). Frees the older copies."""
        key = (str(record["root"]), int(record["rank"]))
        staged = int(record["staged_ns"])
        path = replicas.replica_path(*key)
        with self._lock:
            if self._stopped.is_set():
                return "this writer is closing"
            mine = self._kept.get(key)
            others = [(p, r) for p, r in replicas.replicas_of(*key) if p != path]
            held = [r for _, r in others] + ([mine.record] if mine is not None else [])
            newest = max(held, key=records.staged_ns, default=None)
            if newest is not None and records.staged_ns(newest) > staged:
                return (
                    f"this node holds rank {key[1]}'s {newest.get('name')!r}, staged after "
                    f"{record.get('name')!r}"
                )
            if mine is None and len(self._kept) >= _MAX_KEPT:
                return f"this writer holds {_MAX_KEPT} replicas already"
            record["replica"] = True
            records.publish(record, os.getpid(), None, None, path)
            self._kept[key] = _Kept(path, record, segment)
        for other, found in others:  # older copies held by other processes (dead trainers')
            records.release(other, found)
        if mine is not None:
            self._keep_spare(mine.segment)
        logger.debug("holding a replica of %s rank %d (%s)", key[0], key[1], record.get("name"))
        return None

    def _spare(self, nbytes: int) -> Segment | None:
        """A spare segment of at least `nbytes` (the smallest), given over; None if none."""
        with self._lock:
            fits = [s for s in self._spares if s.size >= nbytes]
            if not fits:
                return None
            chosen = min(fits, key=lambda s: s.size)
            self._spares.remove(chosen)
            return chosen

    def _keep_spare(self, segment: Segment) -> None:
        """Keep the segment of a replaced replica for the next one (one spare: the others go;
        none once the writer stops)."""
        with self._lock:
            if self._stopped.is_set():
                extra = [segment]
            else:
                extra, self._spares = self._spares, [segment]
        for other in extra:
            _free(other)

    def _prune(self) -> None:
        """Close the segments of replicas freed by others (their names are gone), until the
        server is stopped and holds nothing."""
        while True:
            time.sleep(_PRUNE_EVERY)
            with self._lock:
                if self._stopped.is_set() and not self._kept:
                    return
                gone = [k for k, kept in self._kept.items() if not _named(kept.segment)]
                dropped = [self._kept.pop(k) for k in gone]
            for kept in dropped:
                with contextlib.suppress(OSError):
                    kept.segment.disown()  # its name is someone else's business now
                    kept.segment.close()

    def stop(self, wait: float) -> list[tuple[Path, dict[str, Any]]]:
        """Stop accepting; let replicas being received finish (up to `wait` seconds); the
        replicas kept, to hold (their segments stay open here)."""
        self._listener.close(wait)
        with self._lock:
            self._stopped.set()
            spares, self._spares = self._spares, []
            kept = [(k.path, k.record) for k in self._kept.values()]
        for segment in spares:
            _free(segment)
        return kept

    def release_all(self) -> None:
        """Free every replica kept here (the writer is closing)."""
        self.stop(_CLOSE_WAIT)
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for item in kept:
            records.release(item.path, item.record)
            with contextlib.suppress(OSError):
                item.segment.disown()
                item.segment.close()


def _named(segment: Segment) -> bool:
    return (SHM_DIR / segment.name).exists()


def _free(segment: Segment) -> None:
    with contextlib.suppress(OSError):
        segment.unlink()
    segment.close()


_server: ReplicaServer | None = None
_server_lock = threading.Lock()


def listen(config: ReplicaConfig) -> int:
    """Listen for replicas as `config` says (once per writer process); returns the port.
    Called in the writer (``CheckpointProcess.call``) when the Checkpointer starts, and by each
    replicated save (a restarted writer listens again on the same port).

    Raises:
        OSError: the port cannot be listened on.
        ConfigError: encryption is required (``PYSHMCKPT_REPLICA_ENCRYPT``) without the
            `cryptography` package.
    """
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


def _exchange(
    config: ReplicaConfig, buddy: tuple[str, int], record: dict[str, Any]
) -> dict[str, Any]:
    """Send the checkpoint `record` describes to the writer at `buddy`; its answer. Progress is reported
    as the connection is made and as bytes leave; nothing may stand still for `config.idle()`.

    Raises:
        ReplicationError: the buddy cannot be reached, did not authenticate, broke off, or
            did not answer, within the config's bounds.
        OSError: the checkpoint's segment is gone.
    """
    idle = config.idle()
    deadline = wire.Deadline(config.timeout, idle=idle)
    me = wire.identity("writer", address=config.listen, rank=int(record["rank"]))
    with wire.connect(
        buddy, config.secret, deadline.within(idle), client=me,
        server=_listener_identity(buddy),
    ) as channel:  # fmt: skip
        progress.advance()
        replicas.send(channel, record, deadline, progress.advance)
        answer = channel.recv_message(deadline)
        progress.advance()
    return answer


def send(config: ReplicaConfig, record: dict[str, Any]) -> None:
    """Replicate the held checkpoint `record` describes to the buddy writer; returns once the
    buddy holds it, every checksum checked there.

    Raises:
        ReplicationError: the buddy cannot be reached, did not authenticate, broke off, or
            refused the replica, within the config's bounds.
    """
    if config.buddy is not None:
        _check(config, _exchange(config, config.buddy, record))


def _check(config: ReplicaConfig, answer: dict[str, Any]) -> None:
    if not answer.get("ok"):
        raise ReplicationError(
            f"rank {config.buddy_rank}'s writer did not keep the replica: {answer.get('reason')}"
        )


class _Retries:
    """When a buddy that failed is tried again: `FIRST` seconds after its failure, and twice
    as long after each further failure in a row, up to `LONGEST`; at once after a success."""

    FIRST = 10.0
    LONGEST = 120.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: dict[tuple[str, int], tuple[int, float, str]] = {}

    def not_yet(self, buddy: tuple[str, int]) -> str | None:
        """Why `buddy` is not tried now (None: it is)."""
        with self._lock:
            failed = self._failed.get(buddy)
        if failed is None:
            return None
        count, retry_at, why = failed
        left = retry_at - time.monotonic()
        if left <= 0:
            return None
        return f"it failed {count} time(s) in a row (last: {why}); tried again in {left:.0f} s"

    def failed(self, buddy: tuple[str, int], why: str) -> None:
        with self._lock:
            count = self._failed.get(buddy, (0, 0.0, ""))[0] + 1
            pause = min(self.LONGEST, self.FIRST * 2 ** (count - 1))
            self._failed[buddy] = (count, time.monotonic() + pause, why)

    def succeeded(self, buddy: tuple[str, int]) -> None:
        with self._lock:
            self._failed.pop(buddy, None)


_RETRIES = _Retries()


class Replication:
    """One checkpoint's replication, run on a thread beside its persist (none while the buddy
    waits out a pause after failing: see `_Retries`)."""

    def __init__(self, config: ReplicaConfig, record: dict[str, Any]) -> None:
        self.error: BaseException | None = None
        self._config = config
        self._thread: threading.Thread | None = None
        if config.buddy is None:
            return
        later = _RETRIES.not_yet(config.buddy)
        if later is not None:
            self.error = ReplicationError(
                f"rank {config.buddy_rank}'s writer was not tried: {later}"
            )
            return
        self._thread = threading.Thread(
            target=self._run, args=(config, config.buddy, record), name="pyshmckpt-replica-out",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _run(self, config: ReplicaConfig, buddy: tuple[str, int], record: dict[str, Any]) -> None:
        try:
            answer = _exchange(config, buddy, record)
        except (OSError, PyshmckptError) as exc:
            _RETRIES.failed(buddy, f"{type(exc).__name__}: {exc}")
            self.error = exc
            return
        except BaseException as exc:  # noqa: BLE001 - reported by `wait`
            self.error = exc
            return
        _RETRIES.succeeded(buddy)  # it answered: what it said is about this copy only
        try:
            _check(config, answer)
        except ReplicationError as exc:
            self.error = exc

    def wait(self) -> str | None:
        """Wait for it (bounded: the config's timeout, and a margin); None, or why it failed."""
        if self._thread is not None:
            self._thread.join(self._config.timeout + _WAIT_MARGIN)
            if self._thread.is_alive():
                return (
                    f"replication to rank {self._config.buddy_rank} still ran after "
                    f"{self._config.timeout + _WAIT_MARGIN:g} s: left to end on its own"
                )
        if self.error is None:
            return None
        if isinstance(self.error, (OSError, PyshmckptError)):
            return f"{type(self.error).__name__}: {self.error}"
        return repr(self.error)
