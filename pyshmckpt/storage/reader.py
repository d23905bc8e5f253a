"""Reading a rank's files of a checkpoint written by pyshmckpt, with verification that never
trusts the files (`tiers.loading.load` chooses which checkpoint and where from)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .._gc import gc_paused
from .._unfilled import unfilled
from ..errors import (
    CheckpointCorruptError,
    CupyUnavailableError,
    PickleNotAllowedError,
    from_os_error,
)
from ..shm import mapped
from ..shm.native import read_file_ranges
from ..staging.manifest import ARRAY, CUPY
from . import resharding, tree_codec
from .rank_files import (
    OpenedRank,
    check_crcs,
    entry_tensor,
    open_rank,
    ranks,
    tensors_of,
)
from .safetensors_header import expected_crcs

logger = logging.getLogger(__name__)


@gc_paused()
def load_opened(
    opened: OpenedRank,
    rank: int,
    *,
    verify: bool,
    memory: bool,
    map_location: str | torch.device | None,
    allow_pickle: bool,
    into: Any,
    mmap: bool | None,
    cupy_as: str,
    others: tuple[list[int], Callable[[int], OpenedRank]] | None = None,
) -> Any:
    """Load one rank's opened files (see `pyshmckpt.load`; from memory when `memory`: a held copy
    holds this rank's shards only). `others`: the checkpoint's ranks and how to open another
    rank's files, for resharding (None: the files beside `opened`'s, on a filesystem)."""
    with opened.file:
        directory = opened.json_path.parent
        if into is not None and (_sharded(opened.described) or resharding.holds_dtensors(into)):
            if memory:  # this rank's shards only: enough for a target sharded as they were
                _shards_into(opened, into, rank, verify=verify, allow_pickle=allow_pickle)
                logger.debug("loaded rank %d's shards from memory into the target", rank)
            else:
                _reshard_into(
                    opened, into, rank, verify=verify, allow_pickle=allow_pickle, others=others
                )
            return into
        if into is not None:
            _load_into(opened, into, rank, verify=verify, allow_pickle=allow_pickle)
            logger.debug("loaded %s (rank %d) into the target state dict", directory, rank)
            return into
        device = torch.device("cpu" if map_location is None else map_location)
        in_memory = device.type == "cpu" if mmap is None else not mmap
        if memory and not in_memory and not mapped.keep_unwritten(opened.file.fileno()):
            in_memory = True  # a trainer took the segment over and will write it: copied
        arrays = _ArrayMaker(_cupy(opened, cupy_as), device)
        file = _rank_file(
            opened, rank, allow_pickle, verify_all=verify, in_memory=in_memory, arrays=arrays
        )
    logger.debug("loaded %s (rank %d)", directory, rank)
    state = file.state
    if device.type != "cpu":
        state = _move(state, device)
    return state


def _sharded(described: dict[str, Any]) -> bool:
    rows = described.get("tensors")
    return isinstance(rows, list) and any(
        isinstance(row, dict) and row.get("dtensor") is not None for row in rows
    )


def _rank_file(
    opened: OpenedRank,
    rank: int,
    allow_pickle: bool,
    *,
    verify_all: bool = False,
    in_memory: bool = False,
    arrays: _ArrayMaker | None = None,
    lazy: bool = False,
) -> resharding.RankFile:
    """A rank's opened files with their tensors (file maps, or copies in memory) and decoded
    structure; with verify_all, every checksum is checked first. With `arrays`, the structure
    holds the arrays it makes of the rows that were arrays (else those rows' tensors). From
    object storage, the map's bytes are read in full first, unless `lazy`: then the caller
    has each entry read before it reads the entry's tensors (`RankFile.ready`)."""
    json_path, st_path, described, header, mapped, f, remote = opened
    view = memoryview(mapped)
    loaded = None

    def fetch(names: set[str]) -> None:
        if remote is not None:
            entries = [header.entries[name] for name in names if name in header.entries]
            remote.fetch([(header.data_start + e.begin, e.end - e.begin) for e in entries])

    if in_memory:
        loaded = _read_entries(
            st_path, f, header, described.get("entries"), verify=verify_all, remote=remote
        )
    else:
        if remote is not None and not lazy:
            remote.fetch_all()
        if verify_all:
            check_crcs(st_path, view, header, described.get("entries"))
    tensors = tensors_of(st_path, view, header, described.get("tensors"), loaded=loaded)
    values = tensors if arrays is None else arrays.values(tensors, described["tensors"])
    try:
        state = tree_codec.decode(
            described.get("tree"), values, allow_pickle=allow_pickle, where=str(json_path)
        )
    except PickleNotAllowedError as exc:
        raise CheckpointCorruptError(str(json_path), str(exc)) from None

    def verify_entries(names: set[str]) -> None:
        fetch(names)
        check_crcs(st_path, view, header, described.get("entries"), only=names)

    return resharding.RankFile(
        rank, st_path, described, tensors, state, verify_entries,
        fetch if remote is not None and not in_memory else None,
    )  # fmt: skip


def _cupy(opened: OpenedRank, cupy_as: str) -> Any:
    """CuPy, when the rank's file holds CuPy arrays that are to come back as CuPy arrays (else
    None); CupyUnavailableError, naming the first of them, when CuPy cannot make them here."""
    rows = opened.described.get("tensors")
    if cupy_as != "cupy" or not isinstance(rows, list):
        return None
    first = next(
        (
            row.get("name")
            for row in rows
            if isinstance(row, dict)
            and type(row.get("flags")) is int
            and row["flags"] & ARRAY == CUPY  # (other combinations: `tensors_of` refuses them)
        ),
        None,
    )
    if first is None:
        return None
    where = f"{opened.json_path}: the checkpoint holds CuPy arrays ({first!r} first)"
    instead = "or load with cupy_as='numpy' to have them as NumPy arrays"
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        raise CupyUnavailableError(
            f"{where} and CuPy cannot be imported ({exc}): install it (python -m pip install "
            f"'cupy-cuda12x>=13', the cupy extra) {instead}"
        ) from None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        reason = "CuPy sees no CUDA device"
    except Exception as exc:  # CuPy's CUDARuntimeError: no driver, no device
        count, reason = 0, f"CuPy finds no CUDA device ({exc})"
    if count < 1:
        raise CupyUnavailableError(f"{where} and {reason}: {instead}")
    return cupy


class _ArrayMaker:
    """Makes the arrays of a rank's rows that were arrays: NumPy arrays over their tensors'
    memory, and CuPy arrays on the GPU when `cupy` (the module) is given."""

    def __init__(self, cupy: Any, device: torch.device) -> None:
        self._cupy = cupy
        # map_location's CUDA device for CuPy arrays (None: CuPy's current device)
        self._device = device.index if device.type == "cuda" else None
        self._on_gpu: dict[int, Any] = {}  # storage address -> its bytes on the GPU

    def values(self, tensors: list[torch.Tensor], rows: list[Any]) -> list[Any]:
        """`tensors` with each row flagged NUMPY or CUPY (rows checked by `tensors_of`) replaced
        by its array."""
        flagged = [i for i, row in enumerate(rows) if int(row.get("flags", 0)) & ARRAY]
        if not flagged:
            return tensors
        out: list[Any] = list(tensors)
        for i in flagged:
            if self._cupy is not None and int(rows[i]["flags"]) & CUPY:
                out[i] = self._cupy_array(tensors[i])
            else:
                out[i] = tensors[i].numpy()
        return out

    def _cupy_array(self, t: torch.Tensor) -> Any:
        """A CuPy array with `t`'s dtype, shape, strides and values. Arrays whose tensors share
        a storage view one copy of it on the GPU."""
        cupy = self._cupy
        dtype = t.numpy().dtype
        device = cupy.cuda.Device(self._device) if self._device is not None else None
        with device if device is not None else contextlib.nullcontext():
            if not t.numel():
                return cupy.empty(tuple(t.shape), dtype=dtype)
            storage = t.untyped_storage()
            raw = self._on_gpu.get(storage.data_ptr())
            if raw is None:
                host = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
                raw = self._on_gpu[storage.data_ptr()] = cupy.asarray(host.numpy())
            itemsize = t.element_size()
            return cupy.ndarray(
                tuple(t.shape),
                dtype=dtype,
                memptr=raw.data + t.storage_offset() * itemsize,
                strides=tuple(s * itemsize for s in t.stride()),
            )


def _reshard_into(
    opened: OpenedRank,
    into: Any,
    rank: int,
    *,
    verify: bool,
    allow_pickle: bool,
    others: tuple[list[int], Callable[[int], OpenedRank]] | None,
) -> None:
    """Fill `into` (DTensors on any mesh, or plain tensors) from every rank's shards; `opened`
    is rank `rank`'s files, already open; `others` as for `load_opened`."""
    directory = opened.json_path.parent
    saved, open_other = others if others is not None else (ranks(directory), _beside(directory))
    if rank not in saved:
        raise CheckpointCorruptError(
            str(directory), f"rank {rank} is not among the checkpoint's ranks {saved}"
        )
    files = []
    for r in saved:
        if r == rank:
            files.append(_rank_file(opened, r, allow_pickle, lazy=True))
            continue
        other = open_other(r)
        with other.file:  # the file map stays; the descriptor is not needed
            files.append(_rank_file(other, r, allow_pickle, lazy=True))
    resharding.fill(into, files, saved.index(rank), verify, str(directory))
    logger.debug("resharded %s (%d ranks) into the target state dict", directory, len(saved))


def _beside(directory: Path) -> Callable[[int], OpenedRank]:
    return lambda r: open_rank(directory, r)


def _shards_into(
    opened: OpenedRank, into: Any, rank: int, *, verify: bool, allow_pickle: bool
) -> None:
    """Fill `into` (DTensors, plain tensors, leaves) from rank `rank`'s files alone: a memory
    copy, which holds this rank's shards and no other rank's. Each DTensor's local shard must lie
    within them (a target sharded as when it was saved): NotSupportedError otherwise, before
    anything is written. Eligible CPU tensors are read straight from the file, as `_load_into`
    reads them; every entry's checksum is checked when `verify`."""
    _, st_path, described, header, _, f, remote = opened
    expected = expected_crcs(st_path, header, described.get("entries")) if verify else None
    file = _rank_file(opened, rank, allow_pickle, lazy=True)
    direct = _DirectReads(st_path, f, header, file, expected, remote)
    saved = f", saved by {described['world_size']} ranks" if "world_size" in described else ""
    partial = (
        f"the checkpoint held in memory holds rank {rank}'s shards only{saved}; load it from "
        "disk (source='disk') to reshard it (another world size or sharding), or without into= "
        "for this rank's local shards as plain tensors"
    )
    where = f"held in memory for rank {rank} ({st_path})"
    resharding.fill(into, [file], 0, verify, where, direct=direct, partial=partial)
    direct.flush()
    if verify:
        file.verify_entries(set(header.entries))  # those the target does not use, too


def _read_ranges(
    st_path: Path,
    f: IO[bytes],
    header: Any,
    jobs: list[tuple[str, int]],
    expected: dict[str, int] | None,
    remote: Any = None,
) -> None:
    """pread each (entry name, destination address) job's entry straight to its address, in
    parallel (from object storage: ranged GETs, `remote`); with `expected`, check each entry's
    CRC32C computed from the bytes as they landed.

    The caller owns the destinations: each is writable for its entry's length, none overlap, and
    they stay alive until this returns (see `native.read_file_ranges`).
    """
    if not jobs:
        return
    rows = np.empty((len(jobs), 3), dtype=np.uint64)
    for i, (name, address) in enumerate(jobs):
        entry = header.entries[name]  # parse_header checked the range lies inside the file
        rows[i] = (header.data_start + entry.begin, address, entry.end - entry.begin)
    try:
        if remote is not None:
            crcs, got = remote.read_into(rows, checksums=expected is not None)
        else:
            crcs, got = read_file_ranges(
                f.fileno(), rows, checksums=expected is not None, path=str(st_path)
            )
    except OSError as exc:
        raise from_os_error(exc, f"cannot read {st_path}") from exc
    for i, (name, _) in enumerate(jobs):
        if int(got[i]) != int(rows[i, 2]):
            raise CheckpointCorruptError(
                str(st_path), f"the file ends inside the entry (read {int(got[i])} of "
                f"{int(rows[i, 2])} bytes; truncated while loading?)", tensor=name,
            )  # fmt: skip
        if expected is not None and int(crcs[i]) != expected[name]:
            raise CheckpointCorruptError(
                str(st_path),
                f"checksum mismatch ({int(crcs[i]):#010x} != {expected[name]:#010x})",
                tensor=name,
            )


def _read_entries(
    st_path: Path, f: IO[bytes], header: Any, recorded: Any, *, verify: bool, remote: Any = None
) -> dict[str, torch.Tensor]:
    """Every non-empty entry of the file read into memory of its own (`entry_tensor`: of the
    entry's dtype and shape), checksums verified from the landed bytes when `verify` (empty
    entries too: theirs must be 0)."""
    expected = expected_crcs(st_path, header, recorded) if verify else None
    loaded = {}
    for name, entry in header.entries.items():
        if entry.end > entry.begin:
            loaded[name] = entry_tensor(header, name)
        elif expected is not None and expected[name] != 0:
            raise CheckpointCorruptError(
                str(st_path), f"checksum mismatch (0x00000000 != {expected[name]:#010x})",
                tensor=name,
            )  # fmt: skip
    jobs = [(name, t.data_ptr()) for name, t in loaded.items()]
    _read_ranges(st_path, f, header, jobs, expected, remote)
    return loaded


class _DirectReads:
    """`into=`'s reads straight from the file into target tensors (`resharding.Direct`).

    A target qualifies when it is a contiguous CPU tensor of the saved dtype that owns its whole
    storage and its source is a whole file entry. Reads are batched and run by `flush`, which
    runs before anything else writes to a storage a pending read fills, so the order of writes
    is the order `fill` visits the targets in.
    """

    def __init__(
        self, st_path: Path, f: IO[bytes], header: Any, file: resharding.RankFile,
        expected: dict[str, int] | None, remote: Any = None,
    ) -> None:  # fmt: skip
        self._st_path, self._f, self._header, self._file = st_path, f, header, file
        self._remote = remote
        self._expected = expected
        self._pending: list[tuple[torch.Tensor, str]] = []
        self._seen: dict[int, tuple[str, int] | None] = {}  # target storage -> (entry, bytes)

    def __call__(self, target: torch.Tensor, source: torch.Tensor) -> bool:
        if not target.is_cpu:
            return False
        storage = target.untyped_storage()
        key = storage.data_ptr()
        entry = self._file.entry_of(source)
        length = -1 if entry is None else self._entry_length(entry)
        eligible = (
            length > 0
            and type(target) in (torch.Tensor, torch.nn.Parameter)
            and target.layout == torch.strided
            and not target.is_conj()
            and not target.is_neg()
            and target.dtype == source.dtype
            and target.is_contiguous()
            and target.storage_offset() == 0
            and storage.nbytes() == target.nbytes == length
            and source.is_contiguous()
            and source.storage_offset() == 0
            and source.untyped_storage().nbytes() == length
        )
        claim = (entry, length) if eligible and entry is not None else None
        if key in self._seen:
            if claim is not None and self._seen[key] == claim:
                return True  # the same storage from the same entry: already read (or pending)
            self.flush()
            return False
        self._seen[key] = claim
        if claim is None or entry is None:
            return False
        self._pending.append((target, entry))
        return True

    def _entry_length(self, name: str) -> int:
        entry = self._header.entries.get(name)
        return -1 if entry is None else entry.end - entry.begin

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        jobs = [(entry, target.data_ptr()) for target, entry in pending]
        _read_ranges(self._st_path, self._f, self._header, jobs, self._expected, self._remote)
        _bump_versions([target for target, _ in pending])  # as an in-place copy_ would
        if self._expected is not None:
            for _, entry in pending:
                self._file.mark_verified(entry)


def _bump_versions(targets: list[torch.Tensor]) -> None:
    """Bump the autograd version counter of every tensor of `targets`: in one call where torch
    takes a list (newer torch), else one by one (bumping one twice is harmless)."""
    try:
        torch.autograd.graph.increment_version(targets)
    except (TypeError, AttributeError):
        for target in targets:
            torch.autograd.graph.increment_version(target)


def _load_into(
    opened: OpenedRank, into: Any, rank: int, *, verify: bool, allow_pickle: bool
) -> None:
    """Fill `into` from rank `rank`'s file (no resharding): eligible CPU tensors straight from
    the file, the others copied from its map; every entry's checksum checked when `verify`."""
    _, st_path, described, header, _, f, remote = opened
    expected = expected_crcs(st_path, header, described.get("entries")) if verify else None
    file = _rank_file(opened, rank, allow_pickle, lazy=True)
    direct = _DirectReads(st_path, f, header, file, expected, remote)
    resharding.fill(into, [file], 0, verify, str(st_path.parent), direct=direct)
    direct.flush()
    if verify:
        file.verify_entries(set(header.entries))  # those the target does not use, too


def _move(state: Any, device: torch.device) -> Any:
    """Move every tensor to `device`; tensors that shared a storage share one there too."""
    storages: dict[int, Any] = {}

    def move_tensor(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        moved = storages.get(key)
        if moved is None:
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            moved = storages[key] = raw.to(device).untyped_storage()
        out = unfilled((0,), t.dtype, device)
        with torch.no_grad():
            out.set_(moved, t.storage_offset(), t.shape, t.stride())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out.requires_grad_(t.requires_grad) if t.requires_grad else out

    def visit(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return move_tensor(node)
        if isinstance(node, dict):
            out = copy.copy(node)  # same type, default_factory and attributes (_metadata)
            for k, v in node.items():
                out[k] = visit(v)
            return out
        if isinstance(node, list):
            return [visit(v) for v in node]
        if isinstance(node, tuple):
            values = [visit(v) for v in node]
            return type(node)(*values) if hasattr(node, "_fields") else tuple(values)
        return node

    return visit(state)
