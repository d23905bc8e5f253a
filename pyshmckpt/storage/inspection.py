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
    """Check every checksum and that every tensor lies inside the file (nothing is unpickled).

    Returns the number of tensors; raises CheckpointCorruptError.
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
    """One row per tensor: name, dtype, shape, bytes, the file entry holding it, and for a
    DTensor's local shard its `ShardInfo` (else None)."""
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
