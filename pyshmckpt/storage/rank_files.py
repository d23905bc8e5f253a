"""A rank's files of a committed checkpoint, opened and checked against what its manifest says:
the data file's header, every tensor inside its entry, the recorded CRC32C of every entry.
`reader` loads from them, `inspection` verifies and describes them; neither trusts the files.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch

from .._gc import gc_paused
from .._unfilled import unfilled
from ..errors import CheckpointCorruptError, NotSupportedError, from_os_error
from ..shm.native import copy_threads, crc32c
from ..staging.manifest import ARRAY, ARRAY_DTYPES, DTYPES, PARAMETER, REQUIRES_GRAD
from . import commit, locations
from .safetensors_header import CODE_TO_DTYPE, expected_crcs, parse_header
from .safetensors_writer import FORMAT, FORMAT_VERSION, file_names


class OpenedRank(NamedTuple):
    """A rank's files, opened: the data file stays open until the caller closes `file`."""

    json_path: Path  # the manifest
    st_path: Path  # the data file
    described: dict[str, Any]  # the manifest, parsed
    header: Any  # the data file's safetensors header
    mapped: mmap.mmap  # a copy-on-write map of the data file
    file: IO[bytes]  # the data file, open
    # Object storage: the data object's bytes, read on demand (`object_files.RemoteBytes`);
    # the map and the file hold them once read. None: a file on a disk, all there.
    remote: Any = None


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    p = locations.local_path(path, "checkpoint path")
    if p.is_file():
        return p.parent
    if p.is_dir() and not (p / file_names(0)[1]).exists():
        latest = commit.latest(p)  # a checkpoint root: its latest checkpoint
        if latest is not None:
            return latest
    return p


def _reach(shape: list[int], stride: list[int], itemsize: int) -> int:
    """Bytes from element 0 to one past the last element a view can touch."""
    if any(d == 0 for d in shape):
        return 0
    return itemsize * (1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True)))


def check_crcs(
    st_path: Path, view: memoryview, header: Any, recorded: Any, only: set[str] | None = None
) -> None:
    """Check the CRC32C of every entry of the file (of the entries in `only`, when given)."""
    expected = expected_crcs(st_path, header, recorded, only)
    jobs = []
    for name, crc in expected.items():
        entry = header.entries[name]
        jobs.append((name, header.data_start + entry.begin, header.data_start + entry.end, crc))
    with ThreadPoolExecutor(max_workers=max(1, copy_threads())) as pool:
        actual = list(pool.map(lambda job: crc32c(view[job[1] : job[2]]), jobs))
    for (name, _, _, crc), got in zip(jobs, actual, strict=True):
        if got != crc:
            raise CheckpointCorruptError(
                str(st_path), f"checksum mismatch ({got:#010x} != {crc:#010x})", tensor=name
            )


def tensors_of(
    st_path: Path,
    view: memoryview,
    header: Any,
    described: Any,
    *,
    loaded: dict[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The described tensors as views of their entries: of `loaded` (entry name -> its bytes in
    memory, as `entry_tensor` made them) where given, else of the file map `view`. Rows that
    were arrays are tensors too (their flags say which kind of array; `reader.load` makes them).

    A row that is the whole of its entry, as the entry's header describes it, is the loaded
    tensor itself (the first such row of an entry; later ones are views of it), so the usual
    state costs no tensor operation per tensor beyond its allocation."""
    if not isinstance(described, list):
        raise CheckpointCorruptError(str(st_path), "the manifest lists no tensors")
    dtypes = DTYPES
    entries = header.entries
    loaded = loaded or {}
    whole_taken: set[str] = set()
    firsts: dict[str, torch.Tensor] = {}  # an entry's own tensor: its storage is the entry's
    raws: dict[str, torch.Tensor | None] = {}
    bases: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    out = []
    with torch.no_grad():
        for item in described:
            name, dtype, shape, stride, offset, flags, entry_name = _row(st_path, item, dtypes)
            if entry_name is None:
                if 0 in shape:
                    out.append(_flagged(unfilled(shape, dtype), flags))
                    continue
                raise CheckpointCorruptError(
                    str(st_path), "tensor with elements but no data", tensor=name
                )
            entry = entries.get(entry_name)
            if entry is None:
                raise CheckpointCorruptError(
                    str(st_path), f"entry {entry_name!r} is not in the file", tensor=name
                )
            length = entry.end - entry.begin
            itemsize = dtype.itemsize
            if offset % itemsize or offset + _reach(shape, stride, itemsize) > length:
                raise CheckpointCorruptError(
                    str(st_path), "tensor lies outside its entry", tensor=name
                )
            mine = firsts.get(entry_name)
            if mine is None:
                mine = loaded.get(entry_name) if loaded else _mapped_entry(view, header, entry)
                if mine is not None:
                    firsts[entry_name] = mine
            if (
                mine is not None
                and entry_name not in whole_taken
                and offset == 0
                and mine.dtype == dtype
                and mine.shape == tuple(shape)
                and (mine.is_contiguous() and _contiguous(shape, stride))
            ):
                whole_taken.add(entry_name)
                out.append(_flagged(mine, flags))
                continue
            base = bases.get((entry_name, dtype))
            if base is None:
                raw = raws.get(entry_name)
                if raw is None:
                    raw = _entry_bytes(view, header, entry, mine)
                    raws[entry_name] = raw
                # Every dtype's base views the one storage of the entry, so tensors of
                # different dtypes over one entry keep sharing it (also when load() moves them
                # to a device).
                count = length // itemsize
                base = (
                    raw[: count * itemsize].view(dtype)
                    if raw is not None and count
                    else unfilled((0,), dtype)
                )
                bases[(entry_name, dtype)] = base
            t = base.as_strided(shape, stride, offset // itemsize)
            out.append(_flagged(t, flags))
    return out


def _row(
    st_path: Path, item: Any, dtypes: dict[str, torch.dtype]
) -> tuple[Any, torch.dtype, list[int], list[int], int, int, str | None]:
    """A manifest row, checked: (name, dtype, shape, stride, offset, flags, entry name)."""
    name = item.get("name") if isinstance(item, dict) else None
    try:
        code = item["dtype"]
        dtype = dtypes[code]
        shape = [int(d) for d in item["shape"]]
        stride = [int(s) for s in item["stride"]]
        offset = int(item["offset"])
        flags = int(item.get("flags", 0))
        entry_name = item["entry"]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(
            str(st_path), f"malformed tensor description: {exc}", tensor=name
        ) from None
    if entry_name is not None and not isinstance(entry_name, str):
        raise CheckpointCorruptError(
            str(st_path), "malformed tensor description: entry must be a string or null",
            tensor=name,
        )  # fmt: skip
    if flags:
        if flags & REQUIRES_GRAD and not (dtype.is_floating_point or dtype.is_complex):
            raise CheckpointCorruptError(
                str(st_path), f"malformed tensor description: a {code} tensor cannot require gradients",
                tensor=name,
            )  # fmt: skip
        if flags & ARRAY and (
            flags & ARRAY == ARRAY
            or flags & (PARAMETER | REQUIRES_GRAD)
            or code not in ARRAY_DTYPES
        ):
            raise CheckpointCorruptError(
                str(st_path), f"malformed tensor description: flags {flags} on a {code} array",
                tensor=name,
            )  # fmt: skip
    if len(shape) != len(stride) or offset < 0 or min(shape + stride, default=0) < 0:
        raise CheckpointCorruptError(str(st_path), "invalid shape, stride or offset", tensor=name)
    return name, dtype, shape, stride, offset, flags, entry_name


def _contiguous(shape: list[int], stride: list[int]) -> bool:
    """Whether a view of `shape` with `stride` (in elements) is row-major contiguous."""
    expected = 1
    for d, s in zip(reversed(shape), reversed(stride), strict=True):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def _entry_bytes(
    view: memoryview, header: Any, entry: Any, loaded: torch.Tensor | None
) -> torch.Tensor | None:
    """An entry's bytes as a uint8 tensor: of its own tensor where given (loaded, or mapped),
    else of the map."""
    length = entry.end - entry.begin
    if not length:
        return None
    if loaded is not None:  # detached: a row may yet make `loaded` require gradients
        return loaded.detach().reshape(-1).view(torch.uint8)
    start = header.data_start + entry.begin
    return torch.frombuffer(view, dtype=torch.uint8, count=length, offset=start)


def _mapped_entry(view: memoryview, header: Any, entry: Any) -> torch.Tensor | None:
    """An entry of the file map as a tensor of the entry's own dtype and shape (None where this
    torch lacks the dtype, or the entry holds no bytes)."""
    dtype = _own_dtype(entry)
    length = entry.end - entry.begin
    if dtype is None or not length:
        return None
    start = header.data_start + entry.begin
    flat = torch.frombuffer(view, dtype=dtype, count=length // dtype.itemsize, offset=start)
    return flat if len(entry.shape) == 1 else flat.view(entry.shape)


def entry_tensor(header: Any, name: str) -> torch.Tensor:
    """New memory for entry `name` of `header` to be read into: a tensor of the entry's own
    dtype and shape where this torch has the dtype (then a row that is the whole entry is this
    tensor), else its bytes. Contents undefined."""
    entry = header.entries[name]
    dtype = _own_dtype(entry)
    if dtype is not None:
        return unfilled(entry.shape, dtype)
    return unfilled((entry.end - entry.begin,), torch.uint8)


def _own_dtype(entry: Any) -> torch.dtype | None:
    """The torch dtype of a header entry whose bytes are exactly its dtype and shape (None
    where this torch lacks the dtype): the entry can then be a tensor of its own."""
    dtype = CODE_TO_DTYPE.get(entry.code)
    if dtype is None or math.prod(entry.shape) * dtype.itemsize != entry.end - entry.begin:
        return None
    return dtype


def _flagged(t: torch.Tensor, flags: int) -> torch.Tensor:
    # (Rows flagged NUMPY or CUPY stay tensors here: `reader` makes the arrays.)
    if flags & PARAMETER:
        return torch.nn.Parameter(t, requires_grad=bool(flags & REQUIRES_GRAD))
    if flags & REQUIRES_GRAD:
        t.requires_grad_(True)
    return t


def check_format_version(path: Path | str, described: dict[str, Any]) -> None:
    """Refuse a manifest (`described`, read from `path`) of a format version this pyshmckpt
    cannot read; one without a version is of the first.

    Raises:
        NotSupportedError: a newer version (written by a newer pyshmckpt).
        CheckpointCorruptError: not a version at all.
    """
    version = described.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointCorruptError(str(path), f"format version {version!r} is not one")
    if version > FORMAT_VERSION:
        raise NotSupportedError(
            f"{path}: written in checkpoint format version {version} by a newer pyshmckpt; "
            f"this one reads version {FORMAT_VERSION}"
        )


@gc_paused()
def open_rank(path: str | os.PathLike[str], rank: int) -> OpenedRank:
    """A rank's manifest, data file path, header and copy-on-write map of the data file, and the
    data file itself, open (the caller closes it)."""
    directory = checkpoint_dir(path)
    st_name, json_name = file_names(rank)
    json_path, st_path = directory / json_name, directory / st_name
    try:
        described = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptError(str(json_path), f"rank {rank}'s manifest is missing") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(str(json_path), f"unreadable manifest: {exc}") from None
    if not isinstance(described, dict) or described.get("format") != FORMAT:
        raise CheckpointCorruptError(str(json_path), "not a pyshmckpt manifest")
    check_format_version(json_path, described)
    try:
        f = st_path.open("rb")
    except FileNotFoundError:
        raise CheckpointCorruptError(str(st_path), f"rank {rank}'s data file is missing") from None
    except OSError as exc:
        raise from_os_error(exc, f"cannot open {st_path}") from exc
    try:
        size = os.fstat(f.fileno()).st_size
        header = parse_header(str(st_path), f, size)
        if not size:
            raise CheckpointCorruptError(str(st_path), "empty file")
        try:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise from_os_error(exc, f"cannot map {st_path}") from exc
    except BaseException:
        f.close()
        raise
    return OpenedRank(json_path, st_path, described, header, mapped, f)


@contextlib.contextmanager
def mapped_rank(
    path: str | os.PathLike[str], rank: int
) -> Iterator[tuple[Path, Any, Any, memoryview]]:
    """A rank's data file path, manifest, header and a view of the file's map, unmapped at the
    end (tensors made from the view must be gone by then)."""
    with mapped_opened(open_rank(path, rank)) as mapped:
        yield mapped


@contextlib.contextmanager
def mapped_opened(opened: OpenedRank) -> Iterator[tuple[Path, Any, Any, memoryview]]:
    """`mapped_rank` of a rank's files already open (their bytes all there)."""
    _, st_path, described, header, mapped, f, _ = opened
    f.close()
    view = memoryview(mapped)
    try:
        yield st_path, described, header, view
    finally:
        view.release()
        mapped.close()


def ranks(path: str | os.PathLike[str]) -> list[int]:
    """The ranks a checkpoint holds files of: every rank of the world size its commit recorded
    (without a commit record, the ranks whose manifests are present)."""
    directory = checkpoint_dir(path)
    record = directory / commit.COMMIT_RECORD
    try:
        world = json.loads(record.read_text()).get("world_size", 1)
    except FileNotFoundError:
        found = sorted(
            int(p.name[4:-5]) for p in directory.glob("rank*.json") if p.name[4:-5].isdigit()
        )
        return found or [0]
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        raise CheckpointCorruptError(str(record), f"unreadable commit record: {exc}") from None
    if type(world) is not int or world < 1:
        raise CheckpointCorruptError(str(record), f"invalid world size {world!r}")
    return list(range(world))
