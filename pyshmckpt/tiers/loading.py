"""`pyshmckpt.load`: a checkpoint directory, or a root's newest checkpoint from the nearest tier.

A path that names one checkpoint (its directory or a file of it) is read from disk by `reader`. A
checkpoint root is restored from wherever its newest checkpoint is (`restore` chooses: this
node's memory, another node's, or disk) and, in a job of several ranks, agreed on by every rank.
Object storage (``s3://``, ``gs://``) is read through `object_files`: a committed checkpoint, or a root's
newest, agreed on by every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    PyshmckptError,
    RestoreError,
)
from ..staging import guards
from ..storage import commit, locations, object_commit, object_files, reader
from ..storage.object_store import ObjectPath
from ..storage.rank_files import OpenedRank, checkpoint_dir, open_rank
from ..storage.safetensors_writer import file_names
from . import restore


def load(
    path: str | os.PathLike[str] | ObjectPath,
    *,
    map_location: str | torch.device | None = "cpu",
    verify: bool = True,
    allow_pickle: bool = False,
    rank: int | None = None,
    into: Any = None,
    mmap: bool | None = None,
    cupy_as: str = "cupy",
    source: str = "auto",
    process_group: Any = None,
    missing_ok: bool = False,
    mirror: str | ObjectPath | None = None,
) -> Any:
    """Load a checkpoint written by pyshmckpt's safetensors writer.

    Returns the nested state dict with container types and tied-storage aliases restored.
    NumPy arrays that were saved come back as NumPy arrays (over the memory the tensors would
    have, so arrays and tensors that shared memory still do), CuPy arrays as CuPy arrays on
    the GPU (`map_location`'s device when it is a CUDA device, else CuPy's current one; those
    that shared memory share it there too), or as NumPy arrays with ``cupy_as="numpy"``.
    Nothing in the files is trusted: every CRC32C is checked (when `verify`), every tensor must
    lie inside its file entry, and pickled values are only loaded with ``allow_pickle=True``.

    By default (``mmap=None`` with a CPU `map_location`) each file entry is read once into memory
    of its own (views of one storage still share it) by the native thread pool, each entry's
    checksum computed from its bytes as they land. With ``mmap=True`` (the default for another
    device, so that the host holds no second copy) CPU tensors are zero-copy copy-on-write maps
    of the file: pages are read when used, and the file's disk space stays in use while they
    live, also after the checkpoint is deleted.

    With `into` (a state dict of the same structure), the values are copied into its tensors in
    place (any device) and `into` is returned (after an overlapped save of this process in flight
    has finished copying, see ``Checkpointer(overlap=True)``): a contiguous CPU tensor of the saved dtype that
    owns its whole storage is read straight from the file into its memory, others are copied
    from a map of the file. Its leaves that are neither tensors nor containers (a learning rate,
    a step count) take the checkpoint's values. A corrupt entry or a mismatch is found once its
    bytes are read, so the target may be partly overwritten when that raises. A NumPy (or CuPy)
    array of the target is filled in place like a tensor.

    Sharded checkpoints (DTensors saved on several ranks): without `into`, the tensors of rank
    `rank`'s file are its local shards, as plain tensors. With `into`, each DTensor of the target
    (any mesh, any number of ranks) gets its local shard filled from whichever saved shards
    overlap it, and a plain tensor the whole global tensor; only the file entries holding those
    bytes are read, and their checksums verified. Other leaves come from rank `rank`'s file.
    A copy held in memory holds one rank's shards only: it fills DTensors sharded as when it was
    saved, and refuses (`NotSupportedError`) a target that needs other ranks' shards.

    A checkpoint root loads the newest checkpoint this rank can restore: the one held in shared
    memory for this root and rank (a trainer that died, see the memory tier in `Checkpointer`),
    when it is newer than the newest on disk or is that one, every CRC32C checked as it is read
    (a copy that fails is passed over, on every rank, with a warning); else the newest on disk.
    A writer whose trainer died and that is still finishing the saves it was handed (a restart
    that came quickly) is waited for first, up to ``PYSHMCKPT_ORPHAN_WAIT`` seconds: what it
    will hold may be the newest. With torch.distributed initialized on several ranks, loading a
    root (``source`` "auto" or "memory") is collective, whatever `rank` says (it only says whose
    files): every rank calls it, and the ranks agree, over a gloo group of their own, on the
    newest checkpoint every rank can restore, from its own memory, from another node's (a
    replica, see ``Checkpointer(replicate=True)``, fetched over an authenticated connection and
    checked), or from disk; a rank whose copy is missing or corrupt makes all of them take an
    older one, with a `MemoryTierWarning` naming the rank and why. No two ranks ever restore
    different steps: a rank that does not take part fails the restore on every rank
    (`RestoreError`). Load a checkpoint directory, or ``source="disk"``, to read files without
    the other ranks.

    Object storage (``s3://bucket/prefix`` or ``gs://...``, a Checkpointer's root there, or one
    checkpoint ``s3://bucket/prefix/name``) is read with parallel ranged GETs, each object on condition
    that it is still the one its commit record names: each entry straight into the tensor that
    holds it (``into=`` too), every CRC32C computed from the landed bytes; resharding reads only
    the entries holding the shards the target needs. A root there is loaded collectively with
    torch.distributed on several ranks (its newest checkpoint, as rank 0 finds it, on every
    rank; `RestoreError` on every rank when one of them cannot load it).

    Args:
        path: a checkpoint directory, a file in it, or a checkpoint root (the newest checkpoint
            in memory or on disk, see above); or object storage, as above.
        map_location: the device the tensors are placed on (None: the CPU).
        verify: check the CRC32C of every file entry, also those the target does not use.
        allow_pickle: load values that were stored pickled (trusted sources only).
        rank: whose files to read (and, resharding, whose shards `into` holds); None: this
            process's rank in torch.distributed (0 without it).
        into: a state dict to fill in place instead of building a new one.
        mmap: map the file instead of reading it into memory (None: by `map_location`). For a
            checkpoint held in memory, the tensors are then copy-on-write views of the held
            memory (nothing copied), which no later save changes; a held checkpoint that a
            `Checkpointer` took over as a slot is copied instead.
        cupy_as: what saved CuPy arrays come back as: ``"cupy"`` (needs CuPy and a CUDA
            device) or ``"numpy"``. Not used with `into`, whose arrays are filled as they are.
        source: for a checkpoint root, where from: ``"auto"`` (the newest of memory and disk),
            ``"memory"`` (only a checkpoint held in memory) or ``"disk"``.
        process_group: the group ranks agree over (None: a gloo group made for it, bounded by
            ``PYSHMCKPT_RESTORE_TIMEOUT``).
        mirror: for a checkpoint root, the object storage root its checkpoints are mirrored
            to (``Checkpointer(root, mirror=...)``): its newest committed checkpoint is a
            choice too, for every rank (the newest of memory, disk and the mirror is restored;
            each rank reads it from the nearest place that holds it).
        missing_ok: for a checkpoint root that holds nothing to restore (no rank has a
            checkpoint in memory or on disk, or the root does not exist: a job's first start),
            return None instead of raising `CheckpointNotFoundError`. Every rank agrees on it.

    Returns:
        The state dict, or `into` once filled; None when nothing is found and `missing_ok`.

    Raises:
        CheckpointNotFoundError: a root with nothing to restore on any rank (from `source`),
            unless `missing_ok`.
        CheckpointCorruptError: a file is missing, damaged, or does not match its manifest
            (naming the file and tensor), or it holds pickled values without `allow_pickle`;
            a root with nothing every rank can restore (from `source`).
        CheckpointMismatchError: `into` differs from the checkpoint in structure, shape or dtype,
            or holds an array that cannot be filled in place (read-only, a dtype torch lacks).
        CupyUnavailableError: the checkpoint holds CuPy arrays, `cupy_as` is ``"cupy"``, and
            CuPy is not installed or sees no CUDA device (nothing is read).
        ConfigError: `cupy_as` is neither ``"cupy"`` nor ``"numpy"``, `source` is not one of
            the three, or ``"memory"`` with a path that is not a root.
        NotSupportedError: a checkpoint written in a newer format version than this pyshmckpt
            reads; or a checkpoint held in memory loaded `into` DTensors (or tensors)
            that need bytes of other ranks' shards (another world size or sharding: a memory
            copy holds only this rank's shards; nothing is written then).
        PyshmckptOSError: a file exists but cannot be opened or mapped.
        RestoreError: several ranks load a root and another rank could not restore the agreed
            checkpoint (its reason is in the message; that rank raises its own error), or one
            did not take part in the agreement (failed, left, or did not call `load` within
            ``PYSHMCKPT_RESTORE_TIMEOUT``).
        ConfigTypeError: `rank` is not an int, or `path` is not a str or path.
        UnsupportedLocationError: `path` is a URL other than ``s3://`` and ``gs://`` (``az://``,
            ``https://`` ...), or an ``s3://`` URL a Path collapsed (a `NotSupportedError`).
        ObjectStoreError: object storage refused or failed a request
            (`BucketNotFoundError`, `ObjectStoreAccessError`, `ObjectStoreUnavailableError`).
        StagingTimeoutError: with `into`, an overlapped save of this process did not finish
            copying the state within its bound.
    """
    if cupy_as not in ("cupy", "numpy"):
        raise ConfigError(f"cupy_as must be 'cupy' or 'numpy', not {cupy_as!r}")
    where = locations.location(path, "checkpoint path")
    if into is not None:  # never fill tensors an overlapped save of this process still reads
        guards.wait_all("load(into=...)")
    kwargs = {"map_location": map_location, "allow_pickle": allow_pickle, "into": into,
              "mmap": mmap, "cupy_as": cupy_as}  # fmt: skip
    if rank is not None:
        rank = restore.files_rank(rank)
    if isinstance(where, ObjectPath):
        try:
            return _load_object(where, rank, source, process_group, verify, kwargs)
        except CheckpointNotFoundError:
            if missing_ok:
                return None
            raise
    path = where
    stored = None if mirror is None else locations.object_root(mirror)
    try:
        agreeing = source in restore.SOURCES and (source != "disk" or stored is not None)
        if agreeing and restore.agreeing(path):
            return _load_agreed(path, source, process_group, verify, kwargs, rank, stored)
        opened, memory, rank, others = _open(path, rank, source, process_group, stored)
    except CheckpointNotFoundError:  # found before anything is read or filled
        if missing_ok:
            return None
        raise
    if memory != "unverified":  # from disk, or a memory copy whose every checksum was checked
        return reader.load_opened(
            opened, rank, verify=verify and not memory, memory=bool(memory), others=others,
            **kwargs,
        )  # fmt: skip
    try:  # one pass over the held bytes: checked as they are copied out
        return reader.load_opened(opened, rank, verify=True, memory=True, **kwargs)
    except CheckpointCorruptError as exc:
        if source == "memory":
            raise
        restore.unusable(rank, str(exc))
    return reader.load_opened(open_rank(path, rank), rank, verify=verify, memory=False, **kwargs)


def _load_object(
    path: ObjectPath,
    rank: int | None,
    source: str,
    process_group: Any,
    verify: bool,
    kwargs: dict[str, Any],
) -> Any:
    """`load` from object storage: a committed checkpoint, or a root's newest. A root loaded
    with torch.distributed on several ranks is collective: rank 0 finds the newest checkpoint,
    every rank loads that one (a commit between two ranks' looks never splits them), and every
    rank learns whether the others could."""
    if source not in restore.SOURCES:
        raise ConfigError(f"source must be one of {restore.SOURCES}, not {source!r}")
    if source == "memory":
        raise ConfigError(
            "source='memory' needs a checkpoint root on this node, not object storage"
        )
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if initialized else 0
    record = object_commit.record_of(path) if path.key else None
    if record is not None or not (initialized and dist.get_world_size() > 1):
        checkpoint, record = (path, record) if record is not None else object_files.newest(path)
        return _load_stored(checkpoint, record, rank, me, verify, kwargs)
    group = process_group if process_group is not None else restore.gloo_group()
    try:
        found: tuple[str, Any] = ("", None)
        if me == 0:
            try:
                checkpoint, record = object_files.newest(path)
                found = ("found", checkpoint.key)
            except PyshmckptError as exc:
                found = ("failed", exc)
        kind, value = restore.gather_all(group, found)[0]
        if kind == "failed":
            raise value
        checkpoint = dataclasses.replace(path, key=value)
        result, failure, own = None, None, None
        try:
            record = record if me == 0 else object_commit.record_of(checkpoint)
            if record is None:
                raise CheckpointNotFoundError(str(checkpoint), "removed before this rank read it")
            result = _load_stored(checkpoint, record, rank, me, verify, kwargs)
        except (PyshmckptError, OSError) as exc:
            failure, own = f"{type(exc).__name__}: {exc}", exc
        failed = restore.confirm(group, me, failure, False)
    finally:
        if process_group is None:
            dist.destroy_process_group(group)
        group = None  # not kept alive by an error's traceback (see _load_agreed)
    if own is not None:
        raise own
    if failed:
        r, (why, _) = min(failed.items())
        raise RestoreError(f"rank {r} cannot restore {checkpoint}: {why}")
    return result


def _load_stored(
    checkpoint: ObjectPath,
    record: dict[str, Any],
    rank: int | None,
    me: int,
    verify: bool,
    kwargs: dict[str, Any],
) -> Any:
    """Load rank `rank`'s files (None: this process's rank `me` where the checkpoint has its
    files, else rank 0's) of a committed checkpoint in object storage (its record `record`)."""
    opened, used, others = _open_stored(checkpoint, rank, me, record)
    return reader.load_opened(opened, used, verify=verify, memory=False, others=others, **kwargs)


def _load_agreed(
    path: str | os.PathLike[str],
    source: str,
    process_group: Any,
    verify: bool,
    kwargs: dict[str, Any],
    files: int | None,
    mirror: ObjectPath | None = None,
) -> Any:
    """`load` of a root by every rank at once: the ranks agree on a checkpoint, each loads its
    part (rank `files`'s files, None: its own), checking a copy from this node's memory as it
    reads it (one pass), and they confirm; when a memory copy failed its checks, every rank
    chooses and loads again without it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    explicit = files is not None
    whose = files if files is not None else rank
    group = process_group if process_group is not None else restore.gloo_group()
    distrust: dict[int, str] = {}
    try:
        while True:
            choice = restore.choose(
                path, whose, source=source, process_group=group, distrust=distrust, me=rank,
                mirror=mirror,
            )  # fmt: skip
            result, failure, again = None, None, False
            own: BaseException | None = None  # what this rank met, raised as it is
            memory = choice.opened is not None
            used = whose
            others = None
            try:
                if choice.opened is not None:
                    opened = choice.opened
                elif choice.stored is not None:
                    opened, used, others = _open_stored(
                        choice.stored, whose if explicit else None, rank
                    )
                else:
                    if choice.directory is not None and not explicit:
                        used = _saved_rank(choice.directory, rank)
                    opened = restore.open_choice(choice, used)
                check = (not choice.verified) if memory else verify
                result = reader.load_opened(
                    opened, used, verify=check, memory=memory, others=others, **kwargs
                )
            except CheckpointCorruptError as exc:
                again = memory and not choice.verified
                what = f"its memory copy of {choice.name}" if again else choice.name
                failure = restore.unusable(whose, f"{what}: {exc}") if again else str(exc)
                own = None if again else exc
            except (PyshmckptError, OSError) as exc:  # into= that does not fit, a file unreadable
                failure, own = f"{type(exc).__name__}: {exc}", exc
            failed = restore.confirm(group, rank, failure, again)  # every rank learns it
            if not failed:
                return result
            fatal = {r: why for r, (why, retry) in failed.items() if not retry or r in distrust}
            if fatal:
                if own is not None:
                    raise own
                r, why = min(fatal.items())
                raise RestoreError(f"rank {r} cannot restore {path}: {why}")
            distrust.update({r: why for r, (why, _) in failed.items()})
    finally:
        if process_group is None:
            dist.destroy_process_group(group)
        # This frame may outlive the call in a cycle with the error raised from it (the error's
        # traceback holds the frame): it must not keep the group, whose gloo threads would then
        # be torn down at interpreter exit, aborting the process.
        group = None


Others = tuple[list[int], Callable[[int], OpenedRank]] | None  # see reader.load_opened


def _open(
    path: str | os.PathLike[str],
    rank: int | None,
    source: str,
    process_group: Any,
    mirror: ObjectPath | None = None,
) -> tuple[OpenedRank, str, int, Others]:
    """The rank's files to load, where they are ("" on disk or in the mirror, "verified" or
    "unverified" in memory: checked already, or to be checked as they are read), the rank, and
    how to open other ranks' files (None: beside them on disk)."""
    explicit = rank is not None
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not restore.is_root(path):
        if source == "memory":
            raise ConfigError("source='memory' needs a checkpoint root, not one checkpoint")
        rank = rank if explicit else _saved_rank(checkpoint_dir(path), rank)
        return open_rank(path, rank), "", rank, None
    if source == "disk" and mirror is None:
        directory = checkpoint_dir(path)
        nothing = directory == Path(path) and not (directory / file_names(0)[1]).exists()
        if nothing and not commit.has_checkpoints(Path(path)):  # damaged ones are not nothing
            raise CheckpointNotFoundError(str(path), "checkpoint missing: none committed")
        rank = rank if explicit else _saved_rank(directory, rank)
        return open_rank(path, rank), "", rank, None
    choice = restore.choose(
        path, rank, source=source, process_group=process_group, agree=not explicit,
        mirror=mirror,
    )  # fmt: skip
    if choice.stored is not None:
        opened, used, others = _open_stored(choice.stored, rank if explicit else None, rank)
        return opened, "", used, others
    if choice.opened is None:
        if not explicit and choice.directory is not None:
            rank = _saved_rank(choice.directory, rank)
        return restore.open_choice(choice, rank), "", rank, None
    return choice.opened, "verified" if choice.verified else "unverified", rank, None


def _open_stored(
    checkpoint: ObjectPath, rank: int | None, me: int, record: dict[str, Any] | None = None
) -> tuple[OpenedRank, int, Others]:
    """Rank `rank`'s files (None: `me`'s where the checkpoint has them, else rank 0's) of a
    committed checkpoint in object storage (its commit record read unless given), and how to
    open the other ranks'."""
    record = record if record is not None else object_commit.record_of(checkpoint)
    if record is None:
        raise CheckpointNotFoundError(str(checkpoint), "removed before it could be read")
    saved = object_files.ranks(record)
    used = rank if rank is not None else (me if me in saved else 0)
    opener = functools.partial(object_files.open_rank, checkpoint, record)
    return opener(used), used, (saved, opener)


def _saved_rank(directory: Path, rank: int) -> int:
    """This process's rank where the checkpoint holds its files, else rank 0 (a checkpoint
    saved by fewer ranks, or by rank 0 alone: resharding reads every rank's files anyway)."""
    return rank if (directory / file_names(rank)[1]).exists() else 0
