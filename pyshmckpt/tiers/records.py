"""Hold records: a checkpoint held in shared memory after its trainer died, found by root and rank.

A writer process whose trainer died keeps the newest checkpoint's slot segment and publishes a
*hold record*: a file ``/dev/shm/<prefix>-held-<key>-<token>`` (mode 0600, written under a
temporary name and renamed) whose key is a hash of the checkpoint root's real path and the rank,
and whose token is drawn by the holding process (no one else can predict the name and take it
first: ``/dev/shm`` is shared by every user of the node). The record holds what ``rankN.json``
would hold for that checkpoint on disk (its tensors, structure and the CRC32C of every entry,
laid out as an exact image of the slot) plus the segment's name, size and token, the
checkpoint's name and when it was staged, and who holds it. Reading it back is reading a
checkpoint whose data file is the segment (`held.open_held`): the same checks and code as from
disk.

The holder keeps an exclusive ``flock`` on its record for as long as it lives: a record whose lock
can be taken exclusively has no live holder (it died, or was SIGKILLed), which holds across PID
namespaces, unlike a pid. At its trainer's death the holder first publishes a *pending* record
(``"pending": true``: what it will hold, and that it is still finishing the writes it was
handed), then replaces it with the full record once those are done; a restore waits, bounded,
for a live pending holder of its root and rank (`wait_for_holders`) before choosing.

A record changes hands by rename, which only one process can win: a new trainer claims it
(`claim`), the holder releases it (`release`), `pyshmckpt gc` removes it. Only the user who owns
the segment can find, read or attach it (both are 0600 and checked for owner and mode).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import knobs
from .._gc import gc_paused
from ..shm.stale import SHM_DIR
from ..staging import Manifest
from ..storage import tree_codec
from ..storage.safetensors_header import build_header
from ..storage.safetensors_writer import FORMAT, FORMAT_VERSION, plan_file

logger = logging.getLogger(__name__)

RECORD_VERSION = 2
KINDS = ("held", "replica")
# Suffixes of a record's names while it is written, claimed or released.
_TRANSIENT = (".tmp", ".claimed", ".released")
# Drawn once per process: the token of every record name this process publishes.
_TOKEN = secrets.token_hex(16)
# How often a restore looks again at a pending holder of its root and rank.
_PENDING_POLL = 0.05
# Seconds a record's temporary (written, claimed or released) is left to its process.
_TRANSIENT_AGE = 60.0


def hold_key(root: str | os.PathLike[str], rank: int) -> str:
    """The key of (root, rank): 32 hex digits of a hash of the root's real path and the rank."""
    real = os.path.realpath(os.fspath(root))
    return hashlib.sha256(f"{real}\0{rank}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


def own_record_path(
    root: str | os.PathLike[str], rank: int, kind: str = "held", prefix: str | None = None
) -> Path:
    """Where this process publishes its record of (root, rank): `kind` "held" (its own rank's
    checkpoint) or "replica" (a copy of another node's rank)."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    return SHM_DIR / f"{prefix}-{kind}-{hold_key(root, rank)}-{_TOKEN}"


def record_paths(
    root: str | os.PathLike[str], rank: int, kind: str = "held", prefix: str | None = None
) -> list[Path]:
    """The published records of (root, rank) of `kind`, by any process of any user (check them
    with `read_record`, which takes only this user's)."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    with contextlib.suppress(FileNotFoundError):
        return sorted(
            path
            for path in SHM_DIR.glob(f"{prefix}-{kind}-{hold_key(root, rank)}-*")
            if not path.name.endswith(_TRANSIENT)
        )
    return []


@dataclasses.dataclass(frozen=True)
class HoldInfo:
    """What a save tells its writer so that it can hold the checkpoint after the trainer's death.

    root: the checkpoint root's real path. rank, world_size: the saving rank's place.
    name: the checkpoint's name. staged_ns: when it was staged (time.time_ns on the trainer).
    persisted: whether it is also being written to disk. timeout: seconds to hold it at most.
    agent: (pid, start ticks) of the launcher (torchrun's elastic agent) whose end ends the hold.
    allow_pickle: whether leaves that are not plain data may be pickled into the record.
    """

    root: str
    rank: int
    world_size: int
    name: str
    staged_ns: int
    persisted: bool
    timeout: float
    agent: tuple[int, int] | None
    allow_pickle: bool


def describe(
    manifest: Manifest, slot: Any, info: HoldInfo, segment: tuple[str, int, bytes]
) -> dict[str, Any]:
    """The hold record of a staged checkpoint: `slot` (a `SlotMapping` of the writer) holds it
    as `manifest` describes; `segment` is (name, data size, token) of the slot's segment. Every
    entry's CRC32C is computed now, from the bytes in shared memory."""
    plan = plan_file(manifest, mirror_slot=True)
    ranges = np.array(plan.sources, dtype=np.uint64).reshape(-1, 2)
    crcs = slot.checksums(ranges).tolist() if len(plan.sources) else []
    header = build_header(plan.entries, {"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    name, size, token = segment
    described = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "rank": info.rank,
        "world_size": info.world_size,
        "file": name,
        "entries": {e.name: {"crc32c": crc} for e, crc in zip(plan.entries, crcs, strict=True)},
        "tensors": plan.tensors,
        "tree": tree_codec.encode(manifest.tree, allow_pickle=info.allow_pickle),
    }
    return {
        **pending_record(info),
        "pending": False,
        # offset: where the slot's data starts, from the segment's first byte
        "segment": {"name": name, "size": size, "token": token.hex(), "offset": slot.offset},
        "data_bytes": int(manifest.size),
        "header": base64.b64encode(header).decode("ascii"),
        "described": described,
    }


def pending_record(info: HoldInfo) -> dict[str, Any]:
    """The record a writer publishes at its trainer's death, before the writes it was handed
    are finished: which checkpoint it holds so far (`info`), and that more may come (the fields
    every record has; `describe` adds what the held checkpoint is)."""
    return {
        "version": RECORD_VERSION,
        "root": info.root,
        "rank": info.rank,
        "world_size": info.world_size,
        "name": info.name,
        "staged_ns": info.staged_ns,
        "persisted": info.persisted,
        "pending": True,
    }


# The descriptors of the records this process published, each with an exclusive flock held
# while the record is ours (`holder_alive`), by name.
_LOCKED: dict[str, int] = {}
_LOCKED_LOCK = threading.Lock()


def publish(
    record: dict[str, Any],
    holder: int,
    agent: tuple[int, int] | None,
    timeout: float | None,
    path: Path | None = None,
) -> Path:
    """Write `record` as this process's hold record of its root and rank (or at `path`), held
    by this process (`holder`, its pid, for information) until `timeout` seconds from now (None:
    while its trainer runs) or the end of `agent`; returns its path. The record replaces the one
    this process published there before, atomically, and stays locked (alive) while this
    process lives or until `release`."""
    record = dict(record)
    record["holder"] = [holder, 0]
    record["agent"] = list(agent) if agent is not None else None
    record["deadline"] = None if timeout is None else time.time() + timeout
    path = own_record_path(record["root"], record["rank"]) if path is None else path
    temp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    data = json.dumps(record, separators=(",", ":")).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(temp, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # before anyone can see it; the only holder of it
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
        temp.rename(path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        os.close(fd)
        raise
    with _LOCKED_LOCK:
        previous = _LOCKED.pop(path.name, None)
        _LOCKED[path.name] = fd
    if previous is not None:
        os.close(previous)
    return path


def _unlock(path: Path) -> None:
    with _LOCKED_LOCK:
        fd = _LOCKED.pop(path.name, None)
    if fd is not None:
        os.close(fd)


def _open_own(path: str | os.PathLike[str]) -> int | None:
    """A descriptor for reading `path` if it is a regular file of this user's, else None: never
    through a link, never waiting on a FIFO (``/dev/shm`` is every user's)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():  # replaced meanwhile
        os.close(fd)
        return None
    return fd


def holder_alive(path: str | os.PathLike[str]) -> bool:
    """Whether the process that published the record at `path` still lives (it holds the
    record's lock while it does; a record that is gone, or not this user's, has no holder)."""
    fd = _open_own(path)
    if fd is None:
        return False
    try:
        # Shared: probes running at once never take each other for the holder.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the lock taken, if any
    return False


@gc_paused()
def read_record(path: Path) -> dict[str, Any] | None:
    """A hold (or replica) record, or None when `path` is missing, not a regular file of this
    user's, open to others or not a record."""
    fd = _open_own(path)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_mode & 0o077:
            logger.warning("ignoring hold record %s: open to other users", path)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None
    return record


def live_records(
    root: str | os.PathLike[str], rank: int, kind: str = "held"
) -> list[tuple[Path, dict[str, Any]]]:
    """This user's records of (root, rank) of `kind` whose holder lives, newest staged first."""
    found = []
    for path in record_paths(root, rank, kind):
        record = read_record(path)
        if record is not None and holder_alive(path):
            found.append((path, record))
    return sorted(found, key=lambda pr: staged_ns(pr[1]), reverse=True)


def staged_ns(record: dict[str, Any]) -> int:
    """When a record's checkpoint was staged (`time.time_ns` on its trainer; 0 when it does not
    say)."""
    try:
        return int(record.get("staged_ns", 0))
    except (TypeError, ValueError):
        return 0


# Records this process took over (`claim`) whose segment it still keeps as they were: found by
# `find` like a published record, until the slot is staged into (`forget`).
_TAKEN: dict[str, dict[str, Any]] = {}


def find(root: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """The newest complete hold record of (root, rank) with a live holder (one this process
    took over included), or None."""
    taken = _TAKEN.get(hold_key(root, rank))
    if taken is not None:
        return taken
    found = newest(root, rank)
    return found[1] if found is not None else None


def newest(root: str | os.PathLike[str], rank: int) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete hold record of (root, rank) with a live holder, and its path."""
    complete = [(p, r) for p, r in live_records(root, rank) if not r.get("pending")]
    return complete[0] if complete else None


def keep_taken(record: dict[str, Any]) -> None:
    """Keep a record this process took over findable while its segment is unchanged."""
    _TAKEN[hold_key(record["root"], record["rank"])] = record


def forget(record: dict[str, Any]) -> None:
    """The segment of a record this process took over is about to change: no longer findable."""
    _TAKEN.pop(hold_key(record["root"], record["rank"]), None)


def wait_for_holders(root: str | os.PathLike[str], rank: int, timeout: float) -> bool:
    """Wait until no live writer of (root, rank) is still finishing what its dead trainer
    handed it (a pending record), at most `timeout` seconds: the checkpoint it will hold may
    be newer than anything held or on disk now. False when one still was at the timeout (or
    its wait was given up: `timeout` 0), True otherwise."""
    deadline = time.monotonic() + timeout
    announced = False
    while True:
        pending = [p for p, r in live_records(root, rank) if r.get("pending")]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            logger.warning(
                "a writer of rank %d of %s is still finishing its dead trainer's checkpoints "
                "after %g s: choosing without it", rank, root, timeout,
            )  # fmt: skip
            return False
        if not announced:
            announced = True
            logger.info(
                "waiting (up to %g s) for the writer of rank %d of %s to finish its dead "
                "trainer's checkpoints", timeout, rank, root,
            )  # fmt: skip
        time.sleep(_PENDING_POLL)


def holds(prefix: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Every hold record of this user's in ``/dev/shm`` (pending ones included), replicas of
    other nodes' ranks included (their records say ``"replica": true``): (path, record)."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    out = []
    with contextlib.suppress(FileNotFoundError):
        for kind in KINDS:
            for path in sorted(SHM_DIR.glob(f"{prefix}-{kind}-*")):
                if path.name.endswith(_TRANSIENT):
                    continue
                record = read_record(path)
                if record is not None:
                    out.append((path, record))
    return out


def claim(path: Path) -> dict[str, Any] | None:
    """Take the hold record at `path` away from its holder, which then exits leaving the segment
    to the caller (attach it first: an attached segment is never collected); None when another
    process took or released it first."""
    taken = path.with_name(f"{path.name}.{secrets.token_hex(8)}.claimed")
    try:
        path.rename(taken)
    except FileNotFoundError:
        return None
    try:
        return read_record(taken)
    finally:
        with contextlib.suppress(OSError):
            taken.unlink()


def release(path: str | os.PathLike[str], record: dict[str, Any]) -> bool:
    """Free a held checkpoint (its record, then its segment); False when the record was claimed
    or released by someone else first (its segment is theirs then)."""
    path = Path(path)
    taken = path.with_name(f"{path.name}.{secrets.token_hex(8)}.released")
    try:
        path.rename(taken)
    except FileNotFoundError:
        _unlock(path)
        return False
    with contextlib.suppress(OSError, KeyError, TypeError):
        segment = str(record["segment"]["name"])
        if "/" not in segment:
            (SHM_DIR / segment).unlink()
    with contextlib.suppress(OSError):
        taken.unlink()
    _unlock(path)
    return True


def withdraw(path: str | os.PathLike[str]) -> None:
    """Remove a record this process published without freeing anything it names (a pending
    record whose holder ends up holding nothing)."""
    path = Path(path)
    taken = path.with_name(f"{path.name}.{secrets.token_hex(8)}.released")
    with contextlib.suppress(OSError):
        path.rename(taken)
        taken.unlink()
    _unlock(path)


def collect_stale(prefix: str | None = None, *, dry_run: bool = False) -> list[Path]:
    """Remove this user's records whose holder is gone (killed without releasing them), and the
    leftovers of a write, claim or release cut short; their segments are collected as stale
    segments (no live process holds them). Returns what was (or, with `dry_run`, would be)
    removed."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for kind in KINDS:
            for path in sorted(SHM_DIR.glob(f"{prefix}-{kind}-*")):
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                    continue
                young = time.time() - st.st_mtime < _TRANSIENT_AGE
                if (path.name.endswith(_TRANSIENT) and young) or holder_alive(path):
                    continue  # a record being published is locked only once it was created
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed.append(path)
    if removed and not dry_run:
        logger.info("removed %d hold record(s) of holders that are gone", len(removed))
    return removed
