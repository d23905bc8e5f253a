"""The default writer: a standard .safetensors file per rank written straight from the slot.

Runs in the writer subprocess. For each staged storage block the file gets one entry: the
tensor itself when one tensor covers the block exactly (the common case: safetensors readers see
the model's tensors by name), otherwise the block's raw bytes (U8) under a reserved name. Views,
aliases (tied weights), dtypes safetensors lacks, the container structure and non-tensor leaves
are described in a JSON manifest beside it, with a CRC32C per entry. Tensor bytes go from shared
memory to the file with writev, with no intermediate copy; the directory is committed atomically
(see commit.py).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _C, commit, layout, tree_codec
from .safetensors_format import DTYPE_TO_CODE, HeaderEntry, build_header

FORMAT = "pyshmckpt"
FORMAT_VERSION = 1
BLOCK_PREFIX = "__pyshmckpt_block_"
IOV_MAX = 1024


def file_names(rank: int) -> tuple[str, str]:
    """(safetensors file, JSON manifest) names of a rank."""
    return f"rank{rank}.safetensors", f"rank{rank}.json"


def tensor_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path) or "tensor"


@dataclass
class FilePlan:
    """Where each block goes in the file and how each tensor is described."""

    entries: list[HeaderEntry]
    sources: list[tuple[int, int]]  # per entry: (offset in slot, nbytes)
    tensors: list[dict[str, Any]]  # per tensor: entry, offset within it, dtype, shape, stride, flags


def plan_file(manifest: layout.Manifest) -> FilePlan:
    """Lay the slot's blocks out as safetensors entries (naturally aligned, no gaps)."""
    rows = manifest.entries()
    n = len(rows)
    paths = [r.path for r in rows]
    dtypes = [r.dtype for r in rows]
    offsets = [r.offset for r in rows]
    nbytes = [r.nbytes for r in rows]
    block_of = [r.block for r in rows]
    flags = manifest.flags.tolist()
    blocks = manifest.blocks.tolist()
    dims = [(r.shape, r.stride) for r in rows]

    # The tensor that covers each block exactly, if any, names the block's entry.
    owner: dict[int, int] = {}
    for i in range(n):
        b = block_of[i]
        if b < 0 or b in owner:
            continue
        dtype = layout.DTYPES[dtypes[i]]
        shape, stride = dims[i]
        if (
            offsets[i] == blocks[b][0]
            and nbytes[i] == blocks[b][1]
            and dtype in DTYPE_TO_CODE
            and stride == layout.contiguous_stride(shape)
        ):
            owner[b] = i

    used: set[str] = set()

    def unique(name: str) -> str:
        # Reserved names (raw blocks, safetensors' metadata) and names that are not valid UTF-8
        # (lone surrogates) get an escaped spelling; the JSON manifest keeps the real key path.
        if name.startswith(BLOCK_PREFIX) or name == "__metadata__":
            name = "_" + name
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
        candidate, k = name, 1
        while candidate in used:
            k += 1
            candidate = f"{name}#{k}"
        used.add(candidate)
        return candidate

    # Natural alignment without padding: entries with larger items first, raw blocks last.
    def itemsize_of(b: int) -> int:
        return layout.DTYPES[dtypes[owner[b]]].itemsize if b in owner else 1

    order = sorted(range(len(blocks)), key=lambda b: -itemsize_of(b))
    entries: list[HeaderEntry] = []
    sources: list[tuple[int, int]] = []
    entry_of_block: dict[int, str] = {}
    cursor = 0
    for b in order:
        start, size = blocks[b]
        if b in owner:
            i = owner[b]
            name = unique(tensor_name(paths[i]))
            code, shape = DTYPE_TO_CODE[layout.DTYPES[dtypes[i]]], dims[i][0]
        else:
            name = f"{BLOCK_PREFIX}{b}"
            used.add(name)
            code, shape = "U8", (size,)
        entries.append(HeaderEntry(name, code, tuple(shape), cursor, cursor + size))
        sources.append((start, size))
        entry_of_block[b] = name
        cursor += size

    tensors = []
    for i in range(n):
        b = block_of[i]
        shape, stride = dims[i]
        tensors.append(
            {
                "entry": entry_of_block.get(b),
                "offset": offsets[i] - blocks[b][0] if b >= 0 else 0,
                "dtype": dtypes[i],
                "shape": list(shape),
                "stride": list(stride),
                "nbytes": nbytes[i],
                "flags": flags[i],
                "name": tensor_name(paths[i]),
            }
        )
    return FilePlan(entries, sources, tensors)


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """writev every buffer completely (in batches of IOV_MAX, resuming partial writes)."""
    pending = [b for b in buffers if len(b)]
    while pending:
        batch = pending[:IOV_MAX]
        written = os.writev(fd, batch)
        consumed = 0
        while consumed < len(batch) and written >= len(batch[consumed]):
            written -= len(batch[consumed])
            consumed += 1
        rest = pending[consumed:]
        if written:
            rest[0] = rest[0][written:]
        pending = rest


def _coalesce(view: memoryview, base: int, sources: list[tuple[int, int]]) -> list[memoryview]:
    """Slices of the slot for each source range, merging ranges that are adjacent in the slot."""
    merged: list[list[int]] = []
    for start, size in sources:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += size
        else:
            merged.append([start, size])
    return [view[base + start : base + start + size] for start, size in merged]


class SafetensorsWriter:
    """Writes rank files into ``path`` (a checkpoint directory) and commits it atomically.

    Used in the writer subprocess of ``pyshmckpt.CheckpointProcess``: ``write_slot`` receives
    the slot itself, so tensor bytes go from shared memory to the file without a copy.
    """

    def __init__(self, rank_info: Any = None, *, keep_last: int | None = None, allow_pickle: bool = False) -> None:
        self.rank = int(getattr(rank_info, "global_rank", 0) or 0)
        self.world_size = int(getattr(rank_info, "global_world_size", 1) or 1)
        if self.world_size != 1:
            raise NotImplementedError(
                "SafetensorsWriter commits a checkpoint directory from one rank; multi-rank commits "
                "need a barrier and are not supported yet"
            )
        self.keep_last = keep_last
        self.allow_pickle = allow_pickle

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        raise TypeError(
            "SafetensorsWriter writes straight from shared memory: use it with "
            "pyshmckpt.CheckpointProcess (or pyshmckpt.Checkpointer)"
        )

    def write_slot(
        self, path: str, segment: _C.Segment, offset: int, manifest: layout.Manifest, **kwargs: Any
    ) -> None:
        tree = tree_codec.encode(manifest.tree, allow_pickle=self.allow_pickle)
        commit.commit_directory(
            path, lambda temp: self._write_files(temp, segment, offset, manifest, tree), self.keep_last
        )

    def _write_files(
        self, directory: Path, segment: _C.Segment, offset: int, manifest: layout.Manifest, tree: Any
    ) -> None:
        plan = plan_file(manifest)
        ranges = np.array([[offset + s, n] for s, n in plan.sources], dtype=np.uint64).reshape(-1, 2)
        st_name, json_name = file_names(self.rank)
        header = build_header(plan.entries, {"format": FORMAT, "format_version": str(FORMAT_VERSION)})
        view = memoryview(segment)
        # Checksums (GIL released, thread pool) run while the file is written.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyshmckpt-crc") as pool:
            checksums = pool.submit(segment.checksums, ranges)
            try:
                fd = os.open(directory / st_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    _write_all(fd, [memoryview(header), *_coalesce(view, offset, plan.sources)])
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                view.release()
            crcs = checksums.result().tolist()
        described = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "file": st_name,
            "entries": {e.name: {"crc32c": crc} for e, crc in zip(plan.entries, crcs)},
            "tensors": plan.tensors,
            "tree": tree,
        }
        json_path = directory / json_name
        with json_path.open("w") as f:
            json.dump(described, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())


__all__ = ["SafetensorsWriter", "file_names", "plan_file"]
