"""The default writer: a standard .safetensors file per rank written straight from the slot.

Runs in the writer subprocess (a `SlotWriter`). For each staged storage block the file gets one entry: the
tensor itself when one tensor covers the block exactly (the common case: safetensors readers see
the model's tensors by name), otherwise the block's raw bytes (U8) under a reserved name. Views,
aliases (tied weights), dtypes safetensors lacks, the container structure and non-tensor leaves
are described in a JSON manifest beside it, with a CRC32C per entry. NumPy and CuPy arrays are
entries like tensors; the "flags" of their rows in the manifest say which they were (the
`staging.manifest` bits: PARAMETER 1, REQUIRES_GRAD 2, NUMPY 4, CUPY 8). Tensor bytes go from shared
memory to the file with writev, with no intermediate copy; the directory is committed atomically
(see commit.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._log import warn_once
from ..errors import NotSupportedError
from ..shm import SlotMapping
from ..staging import Manifest
from ..staging.manifest import contiguous_stride
from . import (
    commit,
    directory_commit,
    file_output,
    mirror,
    object_commit,
    object_store,
    object_upload,
    progress,
    tree_codec,
)
from .entries import create_file, open_new_file
from .object_store import ObjectPath
from .safetensors_header import NAME_TO_CODE, HeaderEntry, build_header, code_itemsize

logger = logging.getLogger(__name__)

FORMAT = "pyshmckpt"
FORMAT_VERSION = 1
BLOCK_PREFIX = "__pyshmckpt_block_"


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
    tensors: list[
        dict[str, Any]
    ]  # per tensor: entry, offset within it, dtype, shape, stride, flags


def plan_file(manifest: Manifest, *, mirror_slot: bool = False) -> FilePlan:
    """Lay the slot's blocks out as safetensors entries (naturally aligned, no gaps).

    By default entries with larger items come first, so the data needs no padding. With
    `mirror_slot`, the data is an exact image of the slot's first `manifest.size` bytes (blocks
    in slot order, the alignment gaps between them as raw padding entries), so it can be written
    as one range (with O_DIRECT: the file and the slot keep the same alignment).
    """
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
        shape, stride = dims[i]
        if (
            offsets[i] == blocks[b][0]
            and nbytes[i] == blocks[b][1]
            and dtypes[i] in NAME_TO_CODE
            and stride == contiguous_stride(shape)
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
        return code_itemsize(NAME_TO_CODE[dtypes[owner[b]]]) if b in owner else 1

    if mirror_slot:
        order = sorted(range(len(blocks)), key=lambda b: blocks[b][0])
    else:
        order = sorted(range(len(blocks)), key=lambda b: -itemsize_of(b))
    entries: list[HeaderEntry] = []
    sources: list[tuple[int, int]] = []
    entry_of_block: dict[int, str] = {}
    cursor = 0
    for b in order:
        start, size = blocks[b]
        if mirror_slot and start > cursor:  # the alignment gap before this block
            gap = start - cursor
            entries.append(
                HeaderEntry(f"{BLOCK_PREFIX}pad{len(entries)}", "U8", (gap,), cursor, start)
            )
            sources.append((cursor, gap))
            cursor = start
        if b in owner:
            i = owner[b]
            name = unique(tensor_name(paths[i]))
            code, shape = NAME_TO_CODE[dtypes[i]], dims[i][0]
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
    if manifest.sharding is not None:  # DTensors' local shards: where they lie globally
        for i, info in manifest.sharding.infos.items():
            tensors[i]["dtensor"] = info.to_json()
    return FilePlan(entries, sources, tensors)


def _coalesce(view: memoryview, sources: list[tuple[int, int]]) -> list[memoryview]:
    """Slices of the slot for each source range, merging ranges that are adjacent in the slot."""
    merged: list[list[int]] = []
    for start, size in sources:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += size
        else:
            merged.append([start, size])
    return [view[start : start + size] for start, size in merged]


DIRECT_IO_BLOCK = 4096  # O_DIRECT alignment of file offsets, lengths and memory (safe for 512 too)
DIRECT_IO_CHUNK = 32 << 20  # bytes per O_DIRECT pwrite
DIRECT_IO_THREADS = 4  # pwrites in flight


class SafetensorsWriter:
    """Writes rank files into ``path`` (a checkpoint directory) and commits it atomically.

    A `SlotWriter`, used in the writer subprocess of ``pyshmckpt.CheckpointProcess``:
    ``write_slot`` receives the slot itself, so tensor bytes go from shared memory to the file
    without a copy.

    With ``direct_io=True`` the file's data is an image of the slot (see ``plan_file``) starting
    at a 4 KiB boundary, and its 4 KiB-aligned bulk is written with O_DIRECT (bypassing the page
    cache: no cache pollution, no writeback burst at fsync); the header and the unaligned tail go
    through the page cache. Where the filesystem refuses O_DIRECT (tmpfs, some network
    filesystems: EINVAL or EOPNOTSUPP at open or first write), the writer falls back to buffered
    writes; a later chunk whose O_DIRECT write is refused or short is completed with a buffered
    write, so the save still succeeds.
    ``last_direct_bytes`` tells how many bytes the last write sent with O_DIRECT.
    Buffered writes go out in bounded pieces with write-behind (`file_output`); the writer
    reports its progress, so a stalled write is told from a slow one.
    """

    reports_progress = True

    def __init__(
        self,
        rank_info: Any = None,
        *,
        keep_last: int | None = None,
        allow_pickle: bool = False,
        barrier_timeout: float = 600.0,
        direct_io: bool = False,
        mirror: str | None = None,
    ) -> None:
        self.rank, self.world_size = commit.rank_and_world(rank_info)
        self.mirror = object_store.parse(mirror) if mirror else None
        self.keep_last = keep_last
        self.allow_pickle = allow_pickle
        self.barrier_timeout = float(barrier_timeout)
        self.direct_io = bool(direct_io)
        self.last_direct_bytes = 0

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        raise NotSupportedError(
            "SafetensorsWriter writes straight from shared memory: use it with "
            "pyshmckpt.CheckpointProcess (or pyshmckpt.Checkpointer)"
        )

    def write_slot(self, path: str, slot: SlotMapping, manifest: Manifest, **kwargs: Any) -> None:
        tree = tree_codec.encode(manifest.tree, allow_pickle=self.allow_pickle)
        staged_ns = kwargs.get("staged_ns")
        commit_options: dict[str, Any] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "attempt": kwargs.get("attempt"),
            "barrier_timeout": self.barrier_timeout,
            "replace": bool(kwargs.get("replace", False)),
            "link_latest": bool(kwargs.get("link_latest", True)),
        }
        stored = dict(commit_options, files=file_names(self.rank), staged_ns=staged_ns)
        if object_store.is_url(str(path)):
            object_commit.save(
                object_store.parse(str(path)),
                lambda target: self._upload_files(target, slot, manifest, tree, staged_ns),
                self.keep_last,
                background_retention=True,  # the save is answered once committed
                **stored,
            )
            return
        committed = directory_commit.commit_directory(
            path,
            lambda temp: self._write_files(temp, slot, manifest, tree, staged_ns),
            self.keep_last,
            **commit_options,
        )
        if self.mirror is not None:  # uploaded in the background; the save is answered now
            mirror.MIRROR.put(
                committed, self.mirror / committed.name, keep_last=self.keep_last, **stored
            )

    def close(self) -> None:
        """Wait (bounded) for the checkpoints queued for the mirror, and for old checkpoints
        that retention is deleting in the background."""
        if self.mirror is not None and not mirror.drain(mirror.DRAIN_TIMEOUT):
            logger.warning("checkpoints were still being mirrored after %g s", mirror.DRAIN_TIMEOUT)
        if not commit.wait_for_deletions(60.0):
            logger.warning("old checkpoints were still being deleted after 60 s")

    def _write_files(
        self, directory: Path, slot: SlotMapping, manifest: Manifest, tree: Any, staged_ns: Any
    ) -> list[Path]:
        try:
            return self._write_rank_files(directory, slot, manifest, tree, staged_ns)
        except BaseException:
            # Free the space at once (a full disk): other ranks may still write into this directory.
            for name in file_names(self.rank):
                with contextlib.suppress(OSError):
                    (directory / name).unlink()
            raise

    def _write_rank_files(
        self, directory: Path, slot: SlotMapping, manifest: Manifest, tree: Any, staged_ns: Any
    ) -> list[Path]:
        direct = self.direct_io and slot.address % DIRECT_IO_BLOCK == 0
        if self.direct_io and not direct:
            warn_once(logger, "unaligned slot", "slot %s is not %d-byte aligned: writing without O_DIRECT",
                      slot.name, DIRECT_IO_BLOCK)  # fmt: skip
        plan = plan_file(manifest, mirror_slot=direct)
        ranges = np.array(plan.sources, dtype=np.uint64).reshape(-1, 2)
        st_name, json_name = file_names(self.rank)
        metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
        header = build_header(plan.entries, metadata, alignment=DIRECT_IO_BLOCK if direct else 8)
        view = slot.memoryview()
        self.last_direct_bytes = 0
        # Checksums (GIL released, thread pool) run while the file is written.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyshmckpt-crc") as pool:
            checksums = pool.submit(slot.checksums, ranges)
            try:
                st_path = directory / st_name
                fd = create_file(st_path)
                try:
                    if direct:
                        data = view[: manifest.size]
                        self.last_direct_bytes = _write_direct(
                            st_path, fd, memoryview(header), data
                        )
                    else:
                        file_output.write_all(
                            fd, [memoryview(header), *_coalesce(view, plan.sources)]
                        )
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                view.release()
            crcs = checksums.result().tolist()
        json_path = directory / json_name
        with open_new_file(json_path) as f:
            f.write(self._described(plan, crcs, tree, staged_ns))
            f.flush()
            os.fsync(f.fileno())
        return []  # both files are fsynced already

    def _described(self, plan: FilePlan, crcs: list[int], tree: Any, staged_ns: Any) -> bytes:
        """The rank's JSON manifest."""
        st_name = file_names(self.rank)[0]
        described = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "file": st_name,
            "entries": {e.name: {"crc32c": crc} for e, crc in zip(plan.entries, crcs, strict=True)},
            "tensors": plan.tensors,
            "tree": tree,
        }
        if isinstance(staged_ns, int):  # when the save was staged: restore compares it
            described["staged_ns"] = staged_ns
        return json.dumps(described, separators=(",", ":")).encode()

    def _upload_files(
        self, target: ObjectPath, slot: SlotMapping, manifest: Manifest, tree: Any, staged_ns: Any
    ) -> dict[str, dict[str, Any]]:
        """Upload the rank's files as objects under `target`: the data straight from the slot
        (its image, so the parts are views of the slot but the first, which holds the header),
        then the manifest. Returns the objects: name -> {"etag", "size"}, and for the data
        object ``"header"``, the bytes of its header (its length field included), which a load
        reads first."""
        plan = plan_file(manifest, mirror_slot=True)
        ranges = np.array(plan.sources, dtype=np.uint64).reshape(-1, 2)
        st_name, json_name = file_names(self.rank)
        metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
        header = build_header(plan.entries, metadata)
        view = slot.memoryview()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyshmckpt-crc") as pool:
            checksums = pool.submit(slot.checksums, ranges)
            try:
                data = view[: manifest.size]
                etag, size = object_upload.upload(target / st_name, [memoryview(header), data])
                data.release()
            finally:
                view.release()
            crcs = checksums.result().tolist()
        described = self._described(plan, crcs, tree, staged_ns)
        json_etag = object_store.put(target / json_name, described)
        return {
            st_name: {"etag": etag, "size": size, "header": len(header)},
            json_name: {"etag": json_etag, "size": len(described)},
        }


# errnos with which a filesystem refuses O_DIRECT (at open or at a write): tmpfs, some network and
# FUSE filesystems. The writer then writes those bytes through the page cache instead.
_DIRECT_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP})


def _write_direct(path: Path, fd: int, header: memoryview, data: memoryview) -> int:
    """Write header + data to the new file `fd`: the header and the unaligned tail through the
    page cache, the aligned bulk with O_DIRECT from the caller's (page-aligned) memory.

    Returns the bytes written with O_DIRECT: 0 when the filesystem refused O_DIRECT at open or at
    the first write (everything then goes through `fd`), less than the bulk when some chunks
    were written partly or wholly through `fd` (see `_pwrite_chunks`).
    """
    start = len(header)  # a multiple of DIRECT_IO_BLOCK
    file_output.pwrite_all(fd, header, 0)
    bulk = len(data) - len(data) % DIRECT_IO_BLOCK
    covered = direct = 0  # bytes of data written by _pwrite_chunks; of those, with O_DIRECT
    if bulk:
        try:
            dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in _DIRECT_REFUSED:
                raise
            _refused(exc, "at open")
            dfd = -1
        if dfd >= 0:
            try:
                written = _pwrite_chunks(dfd, fd, data[:bulk], start)
            finally:
                os.close(dfd)
            if written is not None:
                covered, direct = bulk, written
    file_output.pwrite_all(fd, data[covered:], start + covered)
    return direct


def _pwrite_chunks(dfd: int, fd: int, data: memoryview, start: int) -> int | None:
    """Write `data` at file offset `start` in DIRECT_IO_CHUNK pieces, a few in flight, with the
    O_DIRECT descriptor `dfd`; returns the bytes that went with O_DIRECT.

    Returns None, with nothing written, when the filesystem refuses the first O_DIRECT write
    (EINVAL, EOPNOTSUPP). After that, a chunk whose O_DIRECT write is refused or short has the
    rest written through the buffered descriptor `fd`, so the save does not fail for it.
    """
    chunks = [
        (pos, data[pos : pos + DIRECT_IO_CHUNK]) for pos in range(0, len(data), DIRECT_IO_CHUNK)
    ]
    first_pos, first = chunks[0]
    try:
        direct = os.pwrite(dfd, first, start + first_pos)
    except OSError as exc:
        if exc.errno not in _DIRECT_REFUSED:
            raise
        _refused(exc, "at the first write")
        return None
    progress.advance(direct)
    file_output.pwrite_all(fd, first[direct:], start + first_pos + direct)
    with ThreadPoolExecutor(
        max_workers=DIRECT_IO_THREADS, thread_name_prefix="pyshmckpt-dio"
    ) as pool:
        futures = [
            pool.submit(_pwrite_chunk, dfd, fd, chunk, start + pos) for pos, chunk in chunks[1:]
        ]
        for done in futures:
            direct += done.result()
    return direct


def _pwrite_chunk(dfd: int, fd: int, chunk: memoryview, position: int) -> int:
    """One O_DIRECT pwrite of `chunk` at `position`; what it leaves (a short write, or all of it
    when O_DIRECT is refused) goes through `fd`. Returns the bytes written with O_DIRECT."""
    try:
        direct = os.pwrite(dfd, chunk, position)
    except OSError as exc:
        if exc.errno not in _DIRECT_REFUSED:
            raise
        _refused(exc, "for a later chunk")
        direct = 0
    progress.advance(direct)
    file_output.pwrite_all(fd, chunk[direct:], position + direct)
    return direct


def _refused(exc: OSError, when: str) -> None:
    reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    warn_once(logger, f"O_DIRECT refused {when}: {reason}",
              "O_DIRECT was refused %s (%s): writing through the page cache instead", when, reason)  # fmt: skip


__all__ = ["SafetensorsWriter", "file_names", "plan_file"]
