"""Checking and describing a committed checkpoint without loading it (the CLI's `verify` and
`describe`): nothing is unpickled, and the file maps are closed before returning."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..errors import PickleNotAllowedError
from ..staging.dtensors import ShardInfo
from . import tree_codec
from .rank_files import check_crcs, mapped_rank, tensors_of


def verify(path: str | os.PathLike[str], rank: int = 0) -> int:
    """Check a checkpoint without loading it: every checksum, every tensor inside its file
    entry, and the structure (pickled parts are checked for presence, never unpickled).

    Args:
        path: a checkpoint directory, a file in it, or a checkpoint root (its newest).
        rank: whose files to check.

    Returns:
        The number of tensors in the rank's file.

    Raises:
        CheckpointCorruptError: a file is missing, damaged or does not match its manifest.
        PyshmckptOSError: a file exists but cannot be opened or mapped.
    """
    with mapped_rank(path, rank) as (st_path, described, header, view):
        check_crcs(st_path, view, header, described.get("entries"))
        tensors = tensors_of(st_path, view, header, described.get("tensors"))
        # The structure too; pickled parts are only checked for presence, never unpickled.
        with contextlib.suppress(PickleNotAllowedError):
            tree_codec.decode(
                described.get("tree"),
                tensors,
                allow_pickle=False,
                where=str(st_path.with_suffix(".json")),
            )
        count = len(tensors)
        del tensors  # they view the map, which is closed next
    return count


def describe(path: str | os.PathLike[str], rank: int = 0) -> list[dict[str, Any]]:
    """What a rank's file holds, one row per tensor (the CLI's `describe`).

    Args:
        path: a checkpoint directory, a file in it, or a checkpoint root (its newest).
        rank: whose file to describe.

    Returns:
        Per tensor a dict: name, dtype, shape, nbytes, the file entry holding it, and for a
        DTensor's local shard its `ShardInfo` (else None) under "dtensor".

    Raises:
        CheckpointCorruptError: a file is missing or a description is malformed.
        PyshmckptOSError: a file exists but cannot be opened or mapped.
    """
    with mapped_rank(path, rank) as (st_path, described, header, view):
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
