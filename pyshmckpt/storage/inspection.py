"""Checking and describing a committed checkpoint without loading it (the CLI's `verify` and
`describe`): nothing is unpickled, and the file maps are closed before returning."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ..errors import PickleNotAllowedError
from ..staging.dtensors import ShardInfo
from . import locations, object_files, tree_codec
from .object_store import ObjectPath
from .rank_files import check_crcs, mapped_opened, mapped_rank, ranks, tensors_of
from .safetensors_writer import file_names


@contextlib.contextmanager
def _mapped(
    path: str | os.PathLike[str] | ObjectPath, rank: int
) -> Iterator[tuple[Any, Any, Any, memoryview]]:
    """`rank_files.mapped_rank`, for object storage too (its bytes read into memory)."""
    where = locations.location(path, "checkpoint path")
    if not isinstance(where, ObjectPath):
        with mapped_rank(where, rank) as opened:
            yield opened
        return
    checkpoint, record = object_files.resolve(where)
    stored = object_files.open_rank(checkpoint, record, rank)
    stored.remote.fetch_all()
    with mapped_opened(stored) as opened:
        yield opened


def pinned(path: str | os.PathLike[str] | ObjectPath) -> str | os.PathLike[str] | ObjectPath:
    """`path`, or for a root in object storage its newest checkpoint, found once: every rank's
    files then come from one checkpoint, whatever is committed meanwhile."""
    where = locations.location(path, "checkpoint path")
    return object_files.resolve(where)[0] if isinstance(where, ObjectPath) else path


def saved_ranks(path: str | os.PathLike[str] | ObjectPath) -> list[int]:
    """The ranks whose files a checkpoint (or a root's newest) holds, on a disk or in object
    storage (see `rank_files.ranks`)."""
    where = locations.location(path, "checkpoint path")
    if isinstance(where, ObjectPath):
        return object_files.ranks(object_files.resolve(where)[1])
    return ranks(where)


def verify(path: str | os.PathLike[str] | ObjectPath, rank: int = 0) -> int:
    """Check a checkpoint without loading it: every checksum, every tensor inside its file
    entry, and the structure (pickled parts are checked for presence, never unpickled).

    Args:
        path: a checkpoint directory, a file in it, or a checkpoint root (its newest); or a
            checkpoint or root in object storage (``s3://bucket/prefix``, ``gs://...``).
        rank: whose files to check.

    Returns:
        The number of tensors in the rank's file.

    Raises:
        CheckpointCorruptError: a file is missing, damaged or does not match its manifest.
        PyshmckptOSError: a file exists but cannot be opened or mapped.
        CheckpointNotFoundError: nothing is committed at an object storage location.
        ObjectStoreError: (a subclass) object storage failed or refused a request.
    """
    with _mapped(path, rank) as (st_path, described, header, view):
        check_crcs(st_path, view, header, described.get("entries"))
        tensors = tensors_of(st_path, view, header, described.get("tensors"))
        # The structure too; pickled parts are only checked for presence, never unpickled.
        with contextlib.suppress(PickleNotAllowedError):
            tree_codec.decode(
                described.get("tree"),
                tensors,
                allow_pickle=False,
                where=str(st_path.parent / file_names(rank)[1]),
            )
        count = len(tensors)
        del tensors  # they view the map, which is closed next
    return count


def describe(path: str | os.PathLike[str] | ObjectPath, rank: int = 0) -> list[dict[str, Any]]:
    """What a rank's file holds, one row per tensor (the CLI's `describe`).

    Args:
        path: a checkpoint directory, a file in it, or a checkpoint root (its newest); or a
            checkpoint or root in object storage (``s3://bucket/prefix``, ``gs://...``).
        rank: whose file to describe.

    Returns:
        Per tensor a dict: name, dtype, shape, nbytes, the file entry holding it, and for a
        DTensor's local shard its `ShardInfo` (else None) under "dtensor".

    Raises:
        CheckpointCorruptError: a file is missing or a description is malformed.
        PyshmckptOSError: a file exists but cannot be opened or mapped.
    """
    with _mapped(path, rank) as (st_path, described, header, view):
        tensors_of(st_path, view, header, described.get("tensors"))  # validates every description
    return [
        {
            "name": t.get("name", "?"),
            "dtype": t["dtype"],
            "shape": t["shape"],
            "nbytes": int(t.get("nbytes", 0)),
            "entry": t["entry"],
            "dtensor": None
            if t.get("dtensor") is None
            else ShardInfo.from_json(t["dtensor"], str(st_path), t.get("name")),
        }
        for t in described["tensors"]
    ]
