"""Which checkpoint a restore reads, and from where: the newest this rank (and, with several
ranks, every rank) can restore, from the memory tier when it holds it, else from disk.

Each rank lists what it could restore: the checkpoint held in memory for its root and rank (its
every CRC32C checked first: a copy that fails is left out, with the reason), and the newest
committed checkpoint on disk (and the held one's name, if that is on disk too). Ranks exchange
their lists over a gloo group of their own and take the newest name every rank has; a rank
reads it from memory when its memory holds it, else from disk. Newest means staged last: both
the hold record and a persisted checkpoint's manifest record when the save was staged.
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
from ..errors import CheckpointCorruptError, ConfigError, MemoryTierWarning, from_os_error
from . import commit, memory_tier
from .rank_files import OpenedRank, open_rank
from .safetensors_writer import file_names

logger = logging.getLogger(__name__)

SOURCES = ("auto", "memory", "disk")


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


def is_root(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a checkpoint root (not one checkpoint, nor a file of one)."""
    p = Path(path)
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
) -> Choice:
    """The checkpoint rank `rank` restores from `root` (see the module).

    With `agree` and torch.distributed initialized with several ranks, every rank must call
    this (it is collective over `process_group`, or over a gloo group made for it).

    Raises:
        CheckpointCorruptError: nothing to restore (no checkpoint held or committed, or, with
            `source` "memory", not every rank holds one in memory).
        ConfigError: `source` is not one of "auto", "memory", "disk".
    """
    if source not in SOURCES:
        raise ConfigError(f"source must be one of {', '.join(SOURCES)}, not {source!r}")
    root = Path(root)
    # Several ranks agree on what every rank can restore: each memory copy is checked first.
    # Alone, a rank checks its copy as it reads it (one pass), falling back to disk if it fails.
    check = agree and _ranks() > 1
    held, record, status = (
        _held(root, rank, check=check) if source != "disk" else (None, None, "not asked")
    )
    options = _options(root, rank, record, source)
    everyone = _gather(rank, options, status, process_group) if check else None
    views = everyone if everyone is not None else [(rank, options, status)]
    common = set.intersection(*({o.name for o in opts} for _, opts, _ in views))
    if not common:
        if held is not None:
            held.file.close()
        reasons = "; ".join(f"rank {r}: {s}" for r, _, s in views)
        raise CheckpointCorruptError(
            str(root),
            f"checkpoint missing: none that every rank can restore from {source} ({reasons})",
        )
    staged = {o.name: o.staged_ns for _, opts, _ in views for o in opts}
    name = max(common, key=lambda n: (staged[n], n))
    in_memory = [o for _, opts, _ in views for o in opts if o.memory]
    newest = max(in_memory, key=lambda o: o.staged_ns) if in_memory else None
    if newest is not None and newest.staged_ns > staged[name]:
        lacking = [
            f"rank {r} ({s})"
            for r, opts, s in views
            if not any(o.memory and o.name == newest.name for o in opts)
        ]
        message = (
            f"restoring {name} from {root}, not {newest.name}, which is held in memory but not "
            f"by every rank: {', '.join(lacking)}"
        )
        logger.warning("%s", message)
        warnings.warn(message, MemoryTierWarning, stacklevel=3)
    if held is not None and any(o.memory and o.name == name for o in options):
        logger.info("restoring %s (rank %d) from memory", name, rank)
        return Choice(name, held, None, verified=check)
    if held is not None:
        held.file.close()
    if source == "memory":
        raise CheckpointCorruptError(str(root), f"rank {rank} holds no checkpoint in memory")
    return Choice(name, None, root / name)


def _ranks() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _held(
    root: Path, rank: int, *, check: bool
) -> tuple[OpenedRank | None, dict[str, Any] | None, str]:
    """This rank's checkpoint held in memory, opened (with `check`, every CRC32C checked), and
    its hold record; or None, None and why not."""
    record = memory_tier.find(root, rank)
    if record is None:
        return None, None, "none held in memory"
    try:
        opened = memory_tier.open_held(record)
    except CheckpointCorruptError as exc:
        return None, None, unusable(rank, f"its memory copy of {record.get('name')}: {exc}")
    if check:
        try:
            memory_tier.check(record, opened)
        except CheckpointCorruptError as exc:
            opened.file.close()
            return None, None, unusable(rank, f"its memory copy of {record.get('name')}: {exc}")
    return opened, record, f"holds {record.get('name')} in memory"


def unusable(rank: int, reason: str) -> str:
    """Warn that rank `rank`'s memory copy cannot be used (and why); the reason, for the other
    ranks."""
    message = f"rank {rank}: {reason}; restoring from disk"
    logger.warning("%s", message)
    warnings.warn(message, MemoryTierWarning, stacklevel=4)
    return reason


def _options(root: Path, rank: int, record: dict[str, Any] | None, source: str) -> list[Option]:
    """What this rank can restore: the newest committed checkpoint (and the held one's name when
    it is committed too), and the held checkpoint."""
    held = str(record.get("name", "")) if record is not None else None
    out: list[Option] = []
    if source != "memory" and root.is_dir():
        names = [name for _, name in commit.committed(root)]
        wanted = names[-1:] + ([held] if held in names else [])
        out = [Option(n, _staged_ns(root / n, rank), False) for n in dict.fromkeys(wanted)]
    if record is not None and held:
        out = [o for o in out if o.name != held]
        out.append(Option(held, int(record.get("staged_ns", 0)), True))
    return out


def _staged_ns(directory: Path, rank: int) -> int:
    """When a committed checkpoint was staged (0 where its manifest does not say)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        return int(json.loads((directory / file_names(rank)[1]).read_text()).get("staged_ns", 0))
    return 0


def _gather(
    rank: int, options: list[Option], status: str, process_group: Any
) -> list[tuple[int, list[Option], str]] | None:
    """Every rank's options and memory status, or None without several ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    group = process_group
    if group is None:
        timeout = datetime.timedelta(seconds=knobs.restore_timeout())
        group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (rank, [tuple(o) for o in options], status), group=group)
    finally:
        if process_group is None:
            dist.destroy_process_group(group)
    return [(r, [Option(*o) for o in opts], s) for r, opts, s in gathered]


def open_choice(choice: Choice, rank: int) -> OpenedRank:
    """The rank's files of the chosen checkpoint, open."""
    if choice.opened is not None:
        return choice.opened
    if choice.directory is None:
        raise CheckpointCorruptError(choice.name, "nothing to open")
    return open_rank(choice.directory, rank)
