"""Hold records: a checkpoint held in shared memory after its trainer died, found by root and rank.

A writer process whose trainer died keeps the newest checkpoint's slot segment and publishes a
*hold record*: a file ``/dev/shm/<prefix>-held-<key>`` (mode 0600, written under a temporary name
and renamed) whose key is a hash of the checkpoint root's real path and the rank. The record holds
what ``rankN.json`` would hold for that checkpoint on disk (its tensors, structure and the CRC32C
of every entry, laid out as an exact image of the slot) plus the segment's name, size and token,
the checkpoint's name and when it was staged, and who holds it. Reading it back is reading a
checkpoint whose data file is the segment (`held.open_held`): the same checks and code as from
disk.

A record changes hands by rename, which only one process can win: a new trainer claims it
(`claim`), the holder releases it (`release`), `pyshmckpt gc` removes it. Only the user who owns
the segment can find, read or attach it (both are 0600 and checked for owner and mode).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import knobs
from .._gc import gc_paused
from ..shm.stale import SHM_DIR, process_start_ticks
from ..staging import Manifest
from ..storage import tree_codec
from ..storage.safetensors_header import build_header
from ..storage.safetensors_writer import FORMAT, FORMAT_VERSION, plan_file

logger = logging.getLogger(__name__)

RECORD_VERSION = 1


def hold_key(root: str | os.PathLike[str], rank: int) -> str:
    """The key of (root, rank): 32 hex digits of a hash of the root's real path and the rank."""
    real = os.path.realpath(os.fspath(root))
    return hashlib.sha256(f"{real}\0{rank}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


def record_path(root: str | os.PathLike[str], rank: int, prefix: str | None = None) -> Path:
    """Where the hold record of (root, rank) lives."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    return SHM_DIR / f"{prefix}-held-{hold_key(root, rank)}"


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
        "version": RECORD_VERSION,
        "root": info.root,
        "rank": info.rank,
        "world_size": info.world_size,
        "name": info.name,
        "staged_ns": info.staged_ns,
        "persisted": info.persisted,
        # offset: where the slot's data starts, from the segment's first byte
        "segment": {"name": name, "size": size, "token": token.hex(), "offset": slot.offset},
        "data_bytes": int(manifest.size),
        "header": base64.b64encode(header).decode("ascii"),
        "described": described,
    }


def publish(
    record: dict[str, Any],
    holder: int,
    agent: tuple[int, int] | None,
    timeout: float | None,
    path: Path | None = None,
) -> Path:
    """Write `record` as the hold record of its root and rank (or at `path`), held by process
    `holder` until `timeout` seconds from now (None: while its trainer runs) or the end of
    `agent`; returns its path."""
    record = dict(record)
    ticks = process_start_ticks(holder)
    record["holder"] = [holder, ticks or 0]
    record["agent"] = list(agent) if agent is not None else None
    record["deadline"] = None if timeout is None else time.time() + timeout
    path = record_path(record["root"], record["rank"]) if path is None else path
    temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    data = json.dumps(record, separators=(",", ":")).encode()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
        temp.rename(path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    finally:
        os.close(fd)
    return path


@gc_paused()
def read_record(path: Path) -> dict[str, Any] | None:
    """A hold (or replica) record, or None when `path` is missing, not this user's, open to others or not a
    record."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            logger.warning("ignoring hold record %s: not this user's, or open to others", path)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None
    return record


# Records this process took over (`claim`) whose segment it still keeps as they were: found by
# `find` like a published record, until the slot is staged into (`forget`).
_TAKEN: dict[str, dict[str, Any]] = {}


def find(root: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """The hold record of (root, rank) (one this process took over included), or None."""
    path = record_path(root, rank)
    taken = _TAKEN.get(str(path))
    return taken if taken is not None else read_record(path)


def keep_taken(record: dict[str, Any]) -> None:
    """Keep a record this process took over findable while its segment is unchanged."""
    _TAKEN[str(record_path(record["root"], record["rank"]))] = record


def forget(record: dict[str, Any]) -> None:
    """The segment of a record this process took over is about to change: no longer findable."""
    _TAKEN.pop(str(record_path(record["root"], record["rank"])), None)


def holds(prefix: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Every hold record of this user's in ``/dev/shm``, replicas of other nodes' ranks
    included (their records say ``"replica": true``): (path, record)."""
    prefix = knobs.segment_prefix() if prefix is None else prefix
    out = []
    with contextlib.suppress(FileNotFoundError):
        for kind in ("held", "replica"):
            for path in sorted(SHM_DIR.glob(f"{prefix}-{kind}-*")):
                if path.name.endswith((".tmp", ".claimed", ".released")):
                    continue
                record = read_record(path)
                if record is not None:
                    out.append((path, record))
    return out


def claim(root: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """Take the hold record of (root, rank) away from its holder, which then exits leaving the
    segment to the caller; None when there is none (or another process won it)."""
    path = record_path(root, rank)
    taken = path.with_name(f"{path.name}.{os.getpid()}.claimed")
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
    taken = path.with_name(f"{path.name}.{os.getpid()}.released")
    try:
        path.rename(taken)
    except FileNotFoundError:
        return False
    with contextlib.suppress(OSError):
        (SHM_DIR / record["segment"]["name"]).unlink()
    with contextlib.suppress(OSError):
        taken.unlink()
    return True


def holder_alive(record: dict[str, Any]) -> bool:
    """Whether the process the record names as its holder still runs."""
    try:
        pid, ticks = (int(x) for x in record["holder"])
    except (KeyError, TypeError, ValueError):
        return False
    now = process_start_ticks(pid)
    return now is not None and (not ticks or now == ticks)
