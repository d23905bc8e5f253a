"""Loading checkpoints written by pyshmckpt, with verification that never trusts the file."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import torch

from ..errors import (
    CheckpointCorruptError,
    PickleNotAllowedError,
    from_os_error,
)
from ..shm.native import copy_threads, crc32c, read_file_ranges
from ..staging.dtensors import ShardInfo
from ..staging.manifest import DTYPES, PARAMETER, REQUIRES_GRAD
from . import commit, resharding, tree_codec
from .safetensors_header import parse_header
from .safetensors_writer import FORMAT, file_names

logger = logging.getLogger(__name__)


class _Opened(NamedTuple):
    """A rank's files, opened: the data file stays open until the caller closes `file`."""

    json_path: Path  # the manifest
    st_path: Path  # the data file
    described: dict[str, Any]  # the manifest, parsed
    header: Any  # the data file's safetensors header
    mapped: mmap.mmap  # a copy-on-write map of the data file
    file: IO[bytes]  # the data file, open


def _checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
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


def load(
    path: str | os.PathLike[str],
    *,
    map_location: str | torch.device | None = "cpu",
    verify: bool = True,
    allow_pickle: bool = False,
    rank: int = 0,
    into: Any = None,
    mmap: bool | None = None,
) -> Any:
    """Load a checkpoint written by pyshmckpt's safetensors writer.

    `path` is a checkpoint directory (or a checkpoint root: its `latest`). Returns the nested
    state dict with container types and tied-storage aliases restored. By default each file
    entry is read into memory of its own once (views of one storage still share it), by the
    native thread pool with large parallel reads, each entry's CRC32C computed from its bytes as
    they land (the default for a CPU `map_location`, ``mmap=None``). With ``mmap=True`` (the
    default for another device, whose tensors are copied there from the map, so that the host
    holds no second copy) CPU tensors are instead zero-copy copy-on-write maps of the
    file (pages read when used, after the checksum pass reads them once when `verify`; the
    file's disk space stays in use while they live, also after the checkpoint is deleted).
    With `into` (a state dict of the same structure), the values are copied into its tensors in
    place (any device) and `into` is returned: a contiguous CPU tensor of the saved dtype that
    owns its whole storage is read straight from the file into its memory (one copy, checksum
    from the landed bytes), others are copied from a map of the file. Every entry is checked
    when `verify`, also those the target does not use; with `into`, a corrupt entry is found
    once its bytes are read, so the target may be partly overwritten when that raises.
    `verify` checks every CRC32C. Pickled values are only loaded with allow_pickle=True.
    Anything wrong with the files raises CheckpointCorruptError naming the file and tensor.

    Sharded checkpoints (DTensors saved on several ranks): without `into`, the tensors of rank
    `rank`'s file are its local shards, as plain tensors. With `into`, each DTensor of the target
    (any mesh, any number of ranks) gets its local shard filled from whichever saved shards
    overlap it, and a plain tensor the whole global tensor; only the file entries holding those
    bytes are read, and their checksums verified. Plain tensors and other leaves come from rank
    `rank`'s file.

    With `into`, the target keeps its structure: its tensors are filled in place, and its leaves
    that are neither tensors nor containers (a learning rate, a step count) take the
    checkpoint's values.
    """
    opened = _open(path, rank)
    with opened.file:
        directory = opened.json_path.parent
        if into is not None and (_sharded(opened.described) or resharding.holds_dtensors(into)):
            _reshard_into(opened, into, rank, verify=verify, allow_pickle=allow_pickle)
            return into
        if into is not None:
            _load_into(opened, into, rank, verify=verify, allow_pickle=allow_pickle)
            logger.debug("loaded %s (rank %d) into the target state dict", directory, rank)
            return into
        device = torch.device("cpu" if map_location is None else map_location)
        in_memory = device.type == "cpu" if mmap is None else not mmap
        file = _rank_file(opened, rank, allow_pickle, verify_all=verify, in_memory=in_memory)
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
    opened: _Opened,
    rank: int,
    allow_pickle: bool,
    *,
    verify_all: bool = False,
    in_memory: bool = False,
) -> resharding.RankFile:
    """A rank's opened files with their tensors (file maps, or copies in memory) and decoded
    structure; with verify_all, every checksum is checked first."""
    json_path, st_path, described, header, mapped, f = opened
    view = memoryview(mapped)
    loaded = None
    if in_memory:
        loaded = _read_entries(st_path, f, header, described.get("entries"), verify=verify_all)
    elif verify_all:
        _verify(st_path, view, header, described.get("entries"))
    tensors = _tensors(st_path, view, header, described.get("tensors"), loaded=loaded)
    try:
        state = tree_codec.decode(
            described.get("tree"), tensors, allow_pickle=allow_pickle, where=str(json_path)
        )
    except PickleNotAllowedError as exc:
        raise CheckpointCorruptError(str(json_path), str(exc)) from None

    def verify_entries(names: set[str]) -> None:
        _verify(st_path, view, header, described.get("entries"), only=names)

    return resharding.RankFile(rank, st_path, described, tensors, state, verify_entries)


def _reshard_into(
    opened: _Opened,
    into: Any,
    rank: int,
    *,
    verify: bool,
    allow_pickle: bool,
) -> None:
    """Fill `into` (DTensors on any mesh, or plain tensors) from every rank's shards; `opened`
    is rank `rank`'s files, already open."""
    directory = opened.json_path.parent
    saved = ranks(directory)
    if rank not in saved:
        raise CheckpointCorruptError(
            str(directory), f"rank {rank} is not among the checkpoint's ranks {saved}"
        )
    files = []
    for r in saved:
        if r == rank:
            files.append(_rank_file(opened, r, allow_pickle))
            continue
        other = _open(directory, r)
        with other.file:  # the file map stays; the descriptor is not needed
            files.append(_rank_file(other, r, allow_pickle))
    resharding.fill(into, files, saved.index(rank), verify, str(directory))
    logger.debug("resharded %s (%d ranks) into the target state dict", directory, len(saved))


def _verify(
    st_path: Path, view: memoryview, header: Any, recorded: Any, only: set[str] | None = None
) -> None:
    """Check the CRC32C of every entry of the file (of the entries in `only`, when given)."""
    expected = _expected_crcs(st_path, header, recorded, only)
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


def _expected_crcs(
    st_path: Path, header: Any, recorded: Any, only: set[str] | None = None
) -> dict[str, int]:
    """The recorded CRC32C of every entry of the file (of those in `only`, when given), in the
    header's order; raises when one is missing on either side."""
    if not isinstance(recorded, dict):
        raise CheckpointCorruptError(str(st_path), "the manifest records no checksums")
    expected = {}
    for name in header.entries:
        if only is not None and name not in only:
            continue
        crc = recorded.get(name, {}).get("crc32c") if isinstance(recorded.get(name), dict) else None
        if type(crc) is not int:
            raise CheckpointCorruptError(str(st_path), "no checksum recorded", tensor=name)
        expected[name] = crc
    missing = set(recorded) - set(header.entries)
    if only is not None:
        missing &= only
    if missing:
        raise CheckpointCorruptError(
            str(st_path), "entry missing from the file", tensor=sorted(missing)[0]
        )
    return expected


def _read_ranges(
    st_path: Path,
    f: IO[bytes],
    header: Any,
    jobs: list[tuple[str, int]],
    expected: dict[str, int] | None,
) -> None:
    """pread each (entry name, destination address) job's entry straight to its address, in
    parallel; with `expected`, check each entry's CRC32C computed from the bytes as they landed.

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
    st_path: Path, f: IO[bytes], header: Any, recorded: Any, *, verify: bool
) -> dict[str, torch.Tensor]:
    """Every non-empty entry of the file read into memory of its own (uint8), checksums verified
    from the landed bytes when `verify` (empty entries too: theirs must be 0)."""
    expected = _expected_crcs(st_path, header, recorded) if verify else None
    loaded = {}
    for name, entry in header.entries.items():
        length = entry.end - entry.begin
        if length:
            loaded[name] = torch.empty(length, dtype=torch.uint8)
        elif expected is not None and expected[name] != 0:
            raise CheckpointCorruptError(
                str(st_path), f"checksum mismatch (0x00000000 != {expected[name]:#010x})",
                tensor=name,
            )  # fmt: skip
    _read_ranges(st_path, f, header, [(name, t.data_ptr()) for name, t in loaded.items()], expected)
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
        expected: dict[str, int] | None,
    ) -> None:  # fmt: skip
        self._st_path, self._f, self._header, self._file = st_path, f, header, file
        self._expected = expected
        self._pending: list[tuple[torch.Tensor, str]] = []
        self._seen: dict[int, tuple[str, int] | None] = {}  # target storage -> (entry, bytes)

    def __call__(self, target: torch.Tensor, source: torch.Tensor) -> bool:
        if target.device.type != "cpu":
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
        _read_ranges(self._st_path, self._f, self._header, jobs, self._expected)
        for target, entry in pending:
            torch.autograd.graph.increment_version(target)  # as an in-place copy_ would
            if self._expected is not None:
                self._file.mark_verified(entry)


def _load_into(opened: _Opened, into: Any, rank: int, *, verify: bool, allow_pickle: bool) -> None:
    """Fill `into` from rank `rank`'s file (no resharding): eligible CPU tensors straight from
    the file, the others copied from its map; every entry's checksum checked when `verify`."""
    _, st_path, described, header, _, f = opened
    expected = _expected_crcs(st_path, header, described.get("entries")) if verify else None
    file = _rank_file(opened, rank, allow_pickle)
    direct = _DirectReads(st_path, f, header, file, expected)
    resharding.fill(into, [file], 0, verify, str(st_path.parent), direct=direct)
    direct.flush()
    if verify:
        file.verify_entries(set(header.entries))  # those the target does not use, too


def _tensors(
    st_path: Path,
    view: memoryview,
    header: Any,
    described: Any,
    *,
    loaded: dict[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The described tensors as views of their entries: of `loaded` (entry name -> its bytes in
    memory) where given, else of the file map `view`."""
    if not isinstance(described, list):
        raise CheckpointCorruptError(str(st_path), "the manifest lists no tensors")
    raws: dict[str, torch.Tensor | None] = dict(loaded or {})
    bases: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    out = []
    for item in described:
        name = item.get("name") if isinstance(item, dict) else None
        try:
            dtype = DTYPES[item["dtype"]]
            shape = [int(d) for d in item["shape"]]
            stride = [int(s) for s in item["stride"]]
            offset = int(item["offset"])
            flags = int(item.get("flags", 0))
            entry_name = item["entry"]
            if entry_name is not None and not isinstance(entry_name, str):
                raise CheckpointCorruptError(
                    str(st_path),
                    "malformed tensor description: entry must be a string or null",
                    tensor=name,
                )
            if flags & REQUIRES_GRAD and not (dtype.is_floating_point or dtype.is_complex):
                raise CheckpointCorruptError(
                    str(st_path), f"malformed tensor description: a {item['dtype']} tensor cannot require gradients",
                    tensor=name,
                )  # fmt: skip
        except CheckpointCorruptError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(
                str(st_path), f"malformed tensor description: {exc}", tensor=name
            ) from None
        if (
            len(shape) != len(stride)
            or any(d < 0 for d in shape)
            or any(s < 0 for s in stride)
            or offset < 0
        ):
            raise CheckpointCorruptError(
                str(st_path), "invalid shape, stride or offset", tensor=name
            )
        if entry_name is None:
            if any(d == 0 for d in shape):
                out.append(_flagged(torch.empty(shape, dtype=dtype), flags))
                continue
            raise CheckpointCorruptError(
                str(st_path), "tensor with elements but no data", tensor=name
            )
        entry = header.entries.get(entry_name)
        if entry is None:
            raise CheckpointCorruptError(
                str(st_path), f"entry {entry_name!r} is not in the file", tensor=name
            )
        length = entry.end - entry.begin
        if offset % dtype.itemsize or offset + _reach(shape, stride, dtype.itemsize) > length:
            raise CheckpointCorruptError(str(st_path), "tensor lies outside its entry", tensor=name)
        base = bases.get((entry_name, dtype))
        if base is None:
            raw = raws.get(entry_name)
            if raw is None:
                start = header.data_start + entry.begin
                raw = (
                    torch.frombuffer(view, dtype=torch.uint8, count=length, offset=start)
                    if length
                    else None
                )
                raws[entry_name] = raw
            # Every dtype's base views the one storage of the entry, so tensors of different
            # dtypes over one entry keep sharing it (also when load() moves them to a device).
            count = length // dtype.itemsize
            base = (
                raw[: count * dtype.itemsize].view(dtype)
                if raw is not None and count
                else torch.empty(0, dtype=dtype)
            )
            bases[(entry_name, dtype)] = base
        with torch.no_grad():
            t = base.as_strided(shape, stride, offset // dtype.itemsize)
        out.append(_flagged(t, flags))
    return out


def _flagged(t: torch.Tensor, flags: int) -> torch.Tensor:
    if flags & PARAMETER:
        return torch.nn.Parameter(t, requires_grad=bool(flags & REQUIRES_GRAD))
    if flags & REQUIRES_GRAD:
        t.requires_grad_(True)
    return t


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
        out = torch.empty(0, dtype=t.dtype, device=device)
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


def _open(path: str | os.PathLike[str], rank: int) -> _Opened:
    """A rank's manifest, data file path, header and copy-on-write map of the data file, and the
    data file itself, open (the caller closes it)."""
    directory = _checkpoint_dir(path)
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
    return _Opened(json_path, st_path, described, header, mapped, f)


@contextlib.contextmanager
def _mapped(path: str | os.PathLike[str], rank: int) -> Iterator[tuple[Path, Any, Any, memoryview]]:
    """A rank's data file path, manifest, header and a view of the file's map, unmapped at the
    end (tensors made from the view must be gone by then)."""
    _, st_path, described, header, mapped, f = _open(path, rank)
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
    directory = _checkpoint_dir(path)
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


def verify(path: str | os.PathLike[str], rank: int = 0) -> int:
    """Check every checksum and that every tensor lies inside the file (nothing is unpickled).

    Returns the number of tensors; raises CheckpointCorruptError.
    """
    with _mapped(path, rank) as (st_path, described, header, view):
        _verify(st_path, view, header, described.get("entries"))
        tensors = _tensors(st_path, view, header, described.get("tensors"))
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
    with _mapped(path, rank) as (st_path, described, header, view):
        _tensors(st_path, view, header, described.get("tensors"))  # validates every description
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
