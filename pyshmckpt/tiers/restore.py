"""Which checkpoint a restore reads, and from where: the newest this rank (and, with several
ranks, every rank) can restore, from the memory tier when it holds it, else from disk.

Each rank lists what it could restore: the checkpoint held in this node's memory for its root
and rank, and the newest committed checkpoint on disk (and the held one's name, if that is on
disk too), and what its node holds for other ranks (see `peer_restore`). Ranks exchange their
lists over a gloo group of their own and take the newest name every rank has; a rank reads it
from its memory when that holds it, else from another node's memory, else from disk. Newest
means staged last: both the hold record and a persisted checkpoint's manifest record when the
save was staged.

A copy from this node's memory is checked as it is loaded (its every CRC32C computed as the
bytes are copied out: one pass); the ranks then `confirm`, and if one's copy failed, every rank
chooses again without it (`reader.load`). A copy fetched from another node is checked as it
arrives, and a failed fetch makes every rank choose again before anything is loaded.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from .. import knobs
from .._gc import gc_paused
from ..errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    ConfigTypeError,
    MemoryTierWarning,
    PyshmckptError,
    RestoreError,
    from_os_error,
)
from ..storage import commit, locations, object_commit
from ..storage.object_store import ObjectPath
from ..storage.rank_files import OpenedRank, open_rank
from ..storage.safetensors_writer import file_names
from . import peer_restore, records, wire
from .held import open_held

logger = logging.getLogger(__name__)

SOURCES = ("auto", "memory", "disk")
NONE_HELD = "none held in memory"  # a rank's status when no record of its root and rank exists
NOT_ASKED = "not asked"  # the status of a restore from disk only


class Option(NamedTuple):
    """A checkpoint a rank can restore: its name, when it was staged (0: not recorded), and
    whether this rank has it in memory."""

    name: str
    staged_ns: int
    memory: bool


class Choice(NamedTuple):
    """What a rank restores: the checkpoint's name and where from (an open rank, or the
    checkpoint directory on disk)."""

    name: str
    opened: OpenedRank | None  # from memory
    directory: Path | None  # from disk
    verified: bool = False  # the memory copy's checksums were checked already
    stored: ObjectPath | None = None  # from the mirror in object storage


def is_root(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a checkpoint root (not one checkpoint, nor a file of one).

    Raises:
        UnsupportedLocationError: `path` is a URL, not a local path.
    """
    p = locations.local_path(path, "checkpoint path")
    try:
        if p.is_file():
            return False
        return not (p.is_dir() and (p / commit.COMMIT_RECORD).exists())
    except OSError as exc:  # a directory on the way this user cannot search
        raise from_os_error(exc, f"cannot reach {p}") from None


def choose(
    root: str | os.PathLike[str],
    rank: int,
    *,
    source: str = "auto",
    process_group: Any = None,
    agree: bool = True,
    distrust: dict[int, str] | None = None,
    me: int | None = None,
    mirror: ObjectPath | None = None,
) -> Choice:
    """The checkpoint whose rank `rank` files this process restores from `root` (see the
    module); `me` is this process's rank among those that agree (None: `rank`).

    With `agree` and torch.distributed initialized with several ranks, every rank must call
    this (it is collective over `process_group`, or over a gloo group made for it). A copy in
    this node's memory is not checked here: it is checked as it is loaded (see `confirm`);
    `distrust` names the ranks (by `me`) whose own memory copy failed that check (and why).
    A writer of (root, rank) that is still finishing what its dead trainer handed it is
    waited for first (``PYSHMCKPT_ORPHAN_WAIT``): the checkpoint it will hold may be the newest.
    With a `mirror` (object storage the writers copy the root's checkpoints to), its newest
    committed checkpoint is a choice for every rank too (rank 0 looks it up), read from there
    by a rank that has it neither in memory nor on disk.

    Raises:
        CheckpointNotFoundError: no rank has a checkpoint to restore (from `source`).
        CheckpointCorruptError: no checkpoint every rank can restore (with `source` "memory":
            not every rank holds one in memory).
        ConfigError: `source` is not one of "auto", "memory", "disk".
        RestoreError: the other ranks did not all take part in the agreement.
    """
    if source not in SOURCES:
        raise ConfigError(f"source must be one of {', '.join(SOURCES)}, not {source!r}")
    root = Path(root)
    me = rank if me is None else me
    check = agree and _ranks() > 1
    settled = source == "disk" or records.wait_for_holders(root, rank, orphan_wait(check))
    held, record, status = _held(root, rank) if source != "disk" else (None, None, NOT_ASKED)
    if distrust and me in distrust:
        if held is not None:
            held.file.close()
        held, record, status = None, None, distrust[me]
    looks = mirror is not None and source != "memory" and (me == 0 or not check)
    stored = _stored(mirror) if looks and mirror is not None else []
    timed = check or record is not None or mirror is not None
    options = _options(root, rank, record, source, timed=timed)
    # Nothing at all (a first start), not merely nothing usable: no record, none pending, and
    # nothing of a checkpoint on disk, damaged ones included.
    empty = (
        settled
        and status in (NONE_HELD, NOT_ASKED)
        and (source == "memory" or not commit.has_checkpoints(root))
    )
    choice = None
    try:
        if check:
            mine = View(me, rank, options, status, [], None, empty, stored)
            choice = _agree(root, mine, held, source, process_group, mirror)
        else:
            view = View(me, rank, options, status, [], None, empty, stored)
            plan = _plan(root, source, [view], set())
            choice = _mine(plan, me, rank, held, source, root, mirror)
    finally:
        if held is not None and (choice is None or choice.opened is not held):
            held.file.close()
    return choice


def orphan_wait(collective: bool) -> float:
    """Seconds a restore waits for a writer still finishing its dead trainer's saves: the
    setting, within half the restore timeout when the ranks agree (the others wait for this
    rank meanwhile)."""
    wait = knobs.orphan_wait()
    return min(wait, knobs.restore_timeout() / 2) if collective else wait


def files_rank(value: Any) -> int:
    """`value` as whose files a restore reads.

    Raises:
        ConfigTypeError: not an int.
        ConfigError: negative.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"rank must be an int, not {type(value).__name__}")
    if value < 0:
        raise ConfigError(f"rank must be >= 0, not {value}")
    return value


class View(NamedTuple):
    """What one rank told the others: whose files it restores, what it can restore itself, why
    its memory copy is or is not usable, what its node holds for other ranks, and where it
    serves those."""

    rank: int
    files: int
    options: list[Option]
    status: str
    offers: list[peer_restore.Offer]
    server: tuple[str, int] | None
    empty: bool  # nothing at all to restore from its source: no record, no checkpoint on disk
    stored: list[Option] = []  # the mirror's newest checkpoint (rank 0 looks it up)


class Plan(NamedTuple):
    """The agreed checkpoint, and where each rank restores it from: ("memory", rank),
    ("peer", serving rank) or ("disk", rank)."""

    name: str
    sources: dict[int, tuple[str, int]]
    servers: dict[int, tuple[str, int]]


def _agree(
    root: Path,
    mine: View,
    held: OpenedRank | None,
    source: str,
    process_group: Any,
    mirror: ObjectPath | None,
) -> Choice:
    """Agree with the other ranks (see the module); copies from other nodes are fetched."""
    import torch.distributed as dist

    rank = mine.rank
    group = process_group if process_group is not None else gloo_group()
    server = None
    try:
        if source != "disk":
            offers = peer_restore.offers(root, dist.get_world_size(), mine.files)
            try:
                server = peer_restore.Server(root, wire.node_address())
            except OSError as exc:
                logger.warning("cannot serve this node's memory copies to other nodes: %s", exc)
            mine = mine._replace(offers=offers, server=server.address if server else None)
        gathered = gather_all(group, (tuple(mine), wire.new_secret()))
        views = [_view(v) for v, _ in gathered]
        whose = {v.rank: v.files for v in views}
        secret = str(gathered[0][1])
        failed: set[tuple[int, int]] = set()  # (rank, serving rank) whose fetch failed
        while True:
            plan = _plan(root, source, views, failed)
            wanted = {
                whose[r]: plan.name
                for r, (how, by) in plan.sources.items()
                if how == "peer" and by == rank
            }
            if server is not None:
                server.serve(wanted, secret, knobs.restore_timeout())
            choice, reason = _fetch_or_open(plan, mine, held, root, source, secret, mirror)
            outcomes = gather_all(group, (rank, reason))
            lost = {(r, plan.sources[r][1]): why for r, why in outcomes if why is not None}
            if not lost:
                return choice
            if choice.opened is not None and choice.opened is not held:
                choice.opened.file.close()
            for (r, by), why in lost.items():
                if r != rank:
                    logger.warning("rank %d could not fetch its copy from rank %d: %s", r, by, why)
            failed |= set(lost)
    finally:
        if server is not None:
            server.close()
        if process_group is None:
            dist.destroy_process_group(group)
        group = None  # not kept by this frame, should an error's traceback keep it (see load)


def _fetch_or_open(
    plan: Plan,
    mine: View,
    held: OpenedRank | None,
    root: Path,
    source: str,
    secret: str,
    mirror: ObjectPath | None,
) -> tuple[Choice, str | None]:
    """This rank's part of `plan`, and why it failed (None: it did not)."""
    how, by = plan.sources[mine.rank]
    files = mine.files
    if how != "peer":
        return _mine(plan, mine.rank, files, held, source, root, mirror), None
    try:
        record, segment = peer_restore.fetch(
            plan.servers[by], secret, files, knobs.restore_timeout(), name=plan.name
        )
        opened = peer_restore.open_fetched(record, segment)
    except (PyshmckptError, OSError) as exc:
        reason = unusable(files, f"its copy of {plan.name} held on rank {by}'s node: {exc}")
        return Choice(plan.name, None, None), reason
    logger.info("restoring %s (rank %d) from the memory of rank %d's node", plan.name, files, by)
    return Choice(plan.name, opened, None, verified=True), None


def _mine(
    plan: Plan,
    me: int,
    files: int,
    held: OpenedRank | None,
    source: str,
    root: Path,
    mirror: ObjectPath | None = None,
) -> Choice:
    how, _ = plan.sources[me]
    if how == "memory" and held is not None:
        logger.info("restoring %s (rank %d) from memory", plan.name, files)
        return Choice(plan.name, held, None)
    if how == "stored" and mirror is not None:
        logger.info("restoring %s (rank %d) from %s", plan.name, files, mirror)
        return Choice(plan.name, None, None, stored=mirror / plan.name)
    if source == "memory":
        raise CheckpointCorruptError(str(root), f"rank {files} holds no checkpoint in memory")
    return Choice(plan.name, None, root / plan.name)


def _plan(root: Path, source: str, views: list[View], failed: set[tuple[int, int]]) -> Plan:
    """The newest checkpoint every rank can restore (from its memory, another node's, or disk),
    and where each rank takes it from; warns when one held in memory is passed over.

    Raises:
        CheckpointNotFoundError: no rank has any checkpoint to restore.
        CheckpointCorruptError: no checkpoint every rank can restore.
    """
    servers = {v.rank: v.server for v in views if v.server is not None}
    where: dict[int, dict[str, tuple[str, int]]] = {v.rank: {} for v in views}
    staged: dict[str, int] = {}
    for v in views:  # its own memory first, then another node's, then disk
        for o in sorted(v.options, key=lambda o: not o.memory):
            where[v.rank].setdefault(o.name, ("memory" if o.memory else "disk", v.rank))
            staged[o.name] = max(staged.get(o.name, 0), o.staged_ns)
    needing: dict[int, list[int]] = {}  # whose files -> the ranks that restore them
    for v in views:
        needing.setdefault(v.files, []).append(v.rank)
    for v in sorted(views, key=lambda v: v.rank):
        if v.server is None:
            continue
        for offer in v.offers:
            for r in needing.get(offer.rank, ()):
                if (r, v.rank) in failed:
                    continue
                here = where[r].get(offer.name)
                if here is None or here[0] == "disk":
                    where[r][offer.name] = ("peer", v.rank)
                staged[offer.name] = max(staged.get(offer.name, 0), offer.staged_ns)
    for v in views:  # the mirror, for every rank that has it nowhere nearer
        for o in v.stored:
            for names in where.values():
                names.setdefault(o.name, ("stored", v.rank))
            staged[o.name] = max(staged.get(o.name, 0), o.staged_ns)
    common = set.intersection(*(set(names) for names in where.values()))
    if not common:
        reasons = "; ".join(f"rank {v.rank}: {v.status}" for v in views)
        nothing = all(v.empty and not v.offers and not v.stored for v in views)  # a first start
        raise (CheckpointNotFoundError if nothing else CheckpointCorruptError)(
            str(root),
            f"checkpoint missing: none that every rank can restore from {source} ({reasons})",
        )
    name = max(common, key=lambda n: (staged[n], n))
    in_memory = {
        n for names in where.values() for n, (how, _) in names.items() if how in ("memory", "peer")
    }
    newest = max(in_memory, key=lambda n: (staged[n], n)) if in_memory else None
    if newest is not None and staged[newest] > staged[name]:
        status = {v.rank: v.status for v in views}
        lacking = [
            f"rank {r} ({status[r]})"
            for r, names in where.items()
            if names.get(newest, ("disk",))[0] == "disk"
        ]
        message = (
            f"restoring {name} from {root}, not {newest}, which is held in memory but not "
            f"for every rank: {', '.join(lacking)}"
        )
        logger.warning("%s", message)
        warnings.warn(message, MemoryTierWarning, stacklevel=4)
    return Plan(name, {r: names[name] for r, names in where.items()}, servers)


def _ranks() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _held(root: Path, rank: int) -> tuple[OpenedRank | None, dict[str, Any] | None, str]:
    """This rank's checkpoint held in this node's memory, opened, and its hold record; or None,
    None and why not."""
    record = peer_restore.held_here(root, rank)
    if record is None:
        return None, None, NONE_HELD
    try:
        opened = open_held(record)
    except (PyshmckptError, OSError) as exc:  # gone, damaged, or not to be mapped here
        return None, None, unusable(rank, f"its memory copy of {record.get('name')}: {exc}")
    return opened, record, f"holds {record.get('name')} in memory"


def confirm(group: Any, rank: int, failure: str | None, again: bool) -> dict[int, tuple[str, bool]]:
    """After each rank loaded what `choose` chose: the ranks that failed, why, and whether
    choosing again without their memory copy can do better (collective over `group`)."""
    gathered = gather_all(group, (rank, failure, again))
    return {int(r): (str(why), bool(retry)) for r, why, retry in gathered if why is not None}


def agreeing(path: str | os.PathLike[str]) -> bool:
    """Whether loading `path` without a rank is collective: a root, with torch.distributed
    initialized on several ranks."""
    return _ranks() > 1 and is_root(path)


def gloo_group() -> Any:
    """A gloo group of every rank for one restore, bounded by ``PYSHMCKPT_RESTORE_TIMEOUT``."""
    import torch.distributed as dist

    return dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=knobs.restore_timeout())
    )


def unusable(rank: int, reason: str) -> str:
    """Warn that rank `rank`'s memory copy cannot be used (and why); the reason, for the other
    ranks."""
    message = f"rank {rank}: {reason}; restoring from disk"
    logger.warning("%s", message)
    warnings.warn(message, MemoryTierWarning, stacklevel=4)
    return reason


def _options(
    root: Path, rank: int, record: dict[str, Any] | None, source: str, *, timed: bool
) -> list[Option]:
    """What this rank can restore: the newest committed checkpoint, and the held checkpoint.

    A manifest on disk is read for when its checkpoint was staged only where that is compared
    (`timed`: a checkpoint is held, or several ranks agree), and never the held checkpoint's own
    (its hold record says): a manifest of 8,192 tensors takes tens of milliseconds to parse."""
    held = str(record.get("name", "")) if record is not None else None
    out: list[Option] = []
    if source != "memory" and root.is_dir():
        names = [name for _, name in commit.committed(root)]
        out = [
            Option(n, _staged_ns(root / n, rank) if timed else 0, False)
            for n in names[-1:]
            if n != held
        ]
    if record is not None and held:
        out.append(Option(held, records.staged_ns(record), True))
    return out


@gc_paused()
def _staged_ns(directory: Path, rank: int) -> int:
    """When a committed checkpoint was staged (0 where its manifest does not say)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        return int(json.loads((directory / file_names(rank)[1]).read_text()).get("staged_ns", 0))
    return 0


def gather_all(group: Any, mine: Any) -> list[Any]:
    """Every rank's `mine`.

    Raises:
        RestoreError: a rank did not take part (it failed, left, or did not call the restore
            within the group's timeout).
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, mine, group=group)
    except (RuntimeError, ValueError) as exc:  # gloo's timeouts and broken connections
        raise RestoreError(
            f"the ranks could not agree on a checkpoint to restore (every rank of the job must "
            f"load the root together, within PYSHMCKPT_RESTORE_TIMEOUT): {exc}"
        ) from exc
    return gathered


def _view(raw: Any) -> View:
    rank, files, options, status, offers, server, empty, stored = raw
    return View(
        int(rank), int(files), [Option(*o) for o in options], str(status),
        [peer_restore.Offer(*o) for o in offers], tuple(server) if server else None,
        bool(empty), [Option(*o) for o in stored],
    )  # fmt: skip


def _stored(mirror: ObjectPath) -> list[Option]:
    """The mirror's newest committed checkpoint, as an option (none: nothing there)."""
    found = object_commit.newest(mirror)
    if found is None:
        return []
    checkpoint, record = found
    staged = record.get("staged_ns")
    return [Option(checkpoint.name, staged if type(staged) is int else 0, False)]


def open_choice(choice: Choice, rank: int) -> OpenedRank:
    """The rank's files of the chosen checkpoint, open."""
    if choice.opened is not None:
        return choice.opened
    if choice.directory is None:
        raise CheckpointCorruptError(choice.name, "nothing to open")
    return open_rank(choice.directory, rank)
