"""Loading a checkpoint into a state dict sharded differently from the one that was saved.

Each rank's file holds its local shards, and its manifest records where each lies in the global
tensor (`ShardInfo`). A target tensor (a DTensor's local shard on this rank, or a plain tensor:
the whole global tensor) is filled from every saved shard whose box overlaps its own: the files
are mapped, only the entries of those shards are touched, and each one's checksum is verified
(which reads the whole entry; without verification only the overlapping bytes are read).
Replicated copies of one box are read once. Plain tensors and the other leaves come from one
rank's file, as `load` reads them; the target keeps its own structure, and its leaves that are
not tensors or containers (a learning rate, a step count) take the checkpoint's values. A NumPy
or CuPy array of the target is filled in place through the tensor that views it, like a tensor.

From fewer files than every saved rank's (a memory copy holds one rank's), a target is filled
only where its bytes lie in those files: the target is checked first, and if any tensor needs
bytes of the shards left out, NotSupportedError is raised before anything is written.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import _torch_private
from ..errors import (
    CheckpointCorruptError,
    CheckpointKeyError,
    CheckpointMismatchError,
    NotSupportedError,
)
from ..staging.dtensors import ShardInfo, loaded_dtensor_type, placement_data

logger = logging.getLogger(__name__)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the global tensor


class RankFile:
    """One rank's files, opened: its decoded state, its tensors' placements, verified entries."""

    def __init__(
        self,
        rank: int,
        st_path: Path,
        described: dict[str, Any],
        tensors: list[torch.Tensor],
        state: Any,
        verify_entries: Any,
        fetch_entries: Any = None,
    ) -> None:
        self.rank = rank
        self.st_path = st_path
        self.state = state
        self._verify_entries = verify_entries  # callable(set of entry names)
        self._verified: set[str] = set()
        # callable(set of entry names) that brings their bytes into the file's map (None: there)
        self._fetch_entries = fetch_entries
        self._fetched: set[str] = set()
        rows = described.get("tensors") or []
        self._index = {id(t): i for i, t in enumerate(tensors)}
        self._entry = [row.get("entry") for row in rows]
        self._names = [row.get("name") for row in rows]
        self._infos: dict[int, ShardInfo] = {}
        for i, row in enumerate(rows):
            if row.get("dtensor") is not None:
                self._infos[i] = ShardInfo.from_json(row["dtensor"], str(st_path), row.get("name"))

    @property
    def sharded(self) -> bool:
        return bool(self._infos)

    def info(self, tensor: torch.Tensor) -> ShardInfo | None:
        i = self._index.get(id(tensor))
        return None if i is None else self._infos.get(i)

    def entry_of(self, tensor: torch.Tensor) -> str | None:
        """The name of the file entry holding `tensor` (None: not one of this file's tensors)."""
        i = self._index.get(id(tensor))
        entry = None if i is None else self._entry[i]
        return entry if isinstance(entry, str) else None

    def mark_verified(self, entry: str) -> None:
        """Record that `entry`'s checksum was checked elsewhere (as its bytes were read)."""
        self._verified.add(entry)

    def verify_entries(self, entries: set[str]) -> None:
        """Verify the checksums of `entries` not verified yet."""
        rest = entries - self._verified
        if rest:
            self._verify_entries(rest)
            self._verified |= rest

    @property
    def reads_on_demand(self) -> bool:
        """Whether the entries' bytes are read when needed (object storage), not there already."""
        return self._fetch_entries is not None

    def prefetch(self, tensors: list[torch.Tensor]) -> None:
        """Read the entries holding `tensors` in one go (see `ready`)."""
        entries = {self.entry_of(t) for t in tensors} - {None} - self._fetched
        if self._fetch_entries is not None and entries:
            self._fetch_entries(entries)
            self._fetched |= entries  # type: ignore[arg-type]

    def ready(self, tensor: torch.Tensor, verify: bool) -> None:
        """Have the bytes of the file entry holding `tensor` in the map (read on demand from
        object storage), checked when `verify`: before `tensor`'s values are read."""
        i = self._index.get(id(tensor))
        entry = None if i is None else self._entry[i]
        if self._fetch_entries is not None and entry is not None and entry not in self._fetched:
            self._fetch_entries({entry})
            self._fetched.add(entry)
        if verify:
            self.verify(tensor)

    def verify(self, tensor: torch.Tensor) -> None:
        """Verify the checksum of the file entry holding `tensor` (once per entry)."""
        i = self._index.get(id(tensor))
        entry = None if i is None else self._entry[i]
        if entry is None or entry in self._verified:
            return
        self._verify_entries({entry})
        self._verified.add(entry)


def holds_dtensors(obj: Any) -> bool:
    """Whether a (nested) state dict holds any DTensor."""
    dtensor = loaded_dtensor_type()
    if dtensor is None:
        return False
    stack = [obj]
    while stack:
        node = stack.pop()
        if type(node) is dtensor:
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return False


# Offered each target tensor (a plain tensor, or the part of a DTensor's local shard that one
# saved shard fills) and its source before the copy: True when it takes over filling the target
# (the copy and the checksum), False to have fill() copy it.
Direct = Callable[[torch.Tensor, torch.Tensor], bool]


class _Job(NamedTuple):
    """What a fill reads from and how (the same for every tensor of the target)."""

    files: list[RankFile]
    primary: int  # the index in `files` of the rank whose plain tensors and leaves are read
    verify: bool
    where: str
    direct: Direct | None
    partial: str | None  # why `files` are not every saved rank's (None: they are)
    write: bool  # False: only check that the target can be filled from `files`
    dtensor: type | None  # torch's DTensor class, if loaded (see loaded_dtensor_type)
    wanted: list[tuple[RankFile, torch.Tensor]] | None = None  # a check notes what it would read


def fill(
    target: Any,
    files: list[RankFile],
    primary: int,
    verify: bool,
    where: str,
    direct: Direct | None = None,
    *,
    partial: str | None = None,
) -> None:
    """Copy the checkpoint (`files`: every saved rank) into `target`, resharding as needed;
    `direct`, when given, may take over filling target tensors (see `Direct`).

    With `partial` (why `files` are only some of the saved ranks'), the whole target is checked
    first: NotSupportedError, naming the tensor and ending with `partial`, when a tensor needs
    bytes that lie outside `files`; nothing is written then.
    """
    sources = [f.state for f in files]
    dtensor = loaded_dtensor_type()
    if partial is not None:
        check = _Job(files, primary, verify, where, None, partial, False, dtensor)
        _fill(target, sources, check, "state_dict")
    if direct is None and any(f.reads_on_demand for f in files):
        # From object storage: every entry the fill will read, read at once (in parallel,
        # adjacent ones together) rather than one request per entry as the copies come.
        wanted: list[tuple[RankFile, torch.Tensor]] = []
        _fill(
            target,
            sources,
            _Job(files, primary, verify, where, None, None, False, dtensor, wanted),
            "state_dict",
        )
        for file in files:
            file.prefetch([tensor for owner, tensor in wanted if owner is file])
    _fill(
        target,
        sources,
        _Job(files, primary, verify, where, direct, partial, True, dtensor),
        "state_dict",
    )


def _fill(target: Any, sources: list[Any], job: _Job, path: str) -> None:
    source = sources[job.primary]
    if isinstance(target, torch.Tensor):
        _fill_tensor(target, sources, job, path)
        return
    if _is_array(target):
        if isinstance(source, torch.Tensor):
            _fill_tensor(_array_tensor(target, path), sources, job, path)
        return  # (an array leaf of an older checkpoint, inside a tuple: kept, as other leaves are)
    if isinstance(target, dict):
        if not isinstance(source, dict):
            raise CheckpointMismatchError(
                f"{path}: the checkpoint of {job.where} holds {type(source).__name__}, not a dict"
            )
        for key, value in list(target.items()):
            if key not in source:
                raise CheckpointKeyError(f"{path}[{key!r}] is not in the checkpoint {job.where}")
            if type(value) in _PLAIN_TENSORS:  # the usual leaf, without the dispatch below
                below = [source[key]] if len(sources) == 1 else _below(sources, key)
                _fill_tensor(value, below, job, f"{path}[{key!r}]")
                continue
            if _is_leaf(value, source[key]):
                leaf = _leaf(source[key], f"{path}[{key!r}]")
                if job.write:
                    target[key] = leaf
                continue
            _fill(value, _below(sources, key), job, f"{path}[{key!r}]")
        return
    if isinstance(target, (list, tuple)) and isinstance(source, (list, tuple)):
        if len(target) != len(source):
            raise CheckpointMismatchError(
                f"{path}: length {len(source)} in the checkpoint, {len(target)} in the target"
            )
        for i, value in enumerate(target):
            if _is_leaf(value, source[i]) and isinstance(target, list):
                leaf = _leaf(source[i], f"{path}[{i}]")
                if job.write:
                    target[i] = leaf
                continue
            below = [
                s[i] if isinstance(s, (list, tuple)) and len(s) == len(source) else None
                for s in sources
            ]
            _fill(value, below, job, f"{path}[{i}]")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _below(sources: list[Any], key: Any) -> list[Any]:
    """Each rank's value under `key` (None where a rank's source is not a dict)."""
    return [s.get(key) if isinstance(s, dict) else None for s in sources]


def _is_leaf(value: Any, source: Any) -> bool:
    """A value `into=` replaces with the checkpoint's (`source`): neither a tensor nor a dict or
    list, nor an array the checkpoint holds bytes for, nor a tuple holding one of those (those
    are filled in place)."""
    if isinstance(value, tuple):
        items = (
            source
            if isinstance(source, (list, tuple)) and len(source) == len(value)
            else [None] * len(value)
        )
        return all(
            _is_leaf(v, s) and not isinstance(v, (dict, list))
            for v, s in zip(value, items, strict=True)
        )
    if _is_array(value):  # an array leaf of an older checkpoint is replaced, as it was
        return not isinstance(source, torch.Tensor)
    return not isinstance(value, (torch.Tensor, dict, list))


def _is_array(value: Any) -> bool:
    """A NumPy array, or a CUDA array (``__cuda_array_interface__``) that is not a tensor."""
    cls = type(value)
    return cls is np.ndarray or (
        hasattr(cls, "__cuda_array_interface__") and not isinstance(value, torch.Tensor)
    )


def _array_tensor(target: Any, path: str) -> torch.Tensor:
    """The tensor viewing the memory of an array of the target, to be filled in place."""
    if type(target) is np.ndarray:
        if not target.flags.writeable:
            raise CheckpointMismatchError(f"{path}: the target is a read-only NumPy array")
        try:
            return torch.from_numpy(target)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointMismatchError(
                f"{path}: the target NumPy array cannot be filled in place: {exc}"
            ) from None
    try:
        tensor = torch.as_tensor(target)
    except Exception as exc:
        raise CheckpointMismatchError(
            f"{path}: the target {type(target).__qualname__} cannot be filled in place: {exc}"
        ) from None
    pointer = target.__cuda_array_interface__["data"][0]
    if not tensor.is_cuda or (tensor.numel() and tensor.data_ptr() != pointer):
        raise CheckpointMismatchError(
            f"{path}: the target {type(target).__qualname__} cannot be filled in place (torch "
            "does not view its memory)"
        )
    return tensor


def _leaf(value: Any, path: str) -> Any:
    if isinstance(value, torch.Tensor):
        raise CheckpointMismatchError(f"{path}: the checkpoint holds a tensor, the target does not")
    return value


def _fill_tensor(target: torch.Tensor, sources: list[Any], job: _Job, path: str) -> None:
    files, primary, verify, direct = job.files, job.primary, job.verify, job.direct
    source = sources[primary]
    if not isinstance(source, torch.Tensor):
        raise CheckpointMismatchError(
            f"{path}: the checkpoint holds {type(source).__name__}, the target a tensor"
        )
    is_dtensor = type(target) is job.dtensor
    if not is_dtensor and files[primary].info(source) is None:
        # A plain tensor saved plain: from the primary rank's file, as load() reads it.
        if target.shape != source.shape:
            raise CheckpointMismatchError(
                f"{path}: the checkpoint holds a tensor of shape {tuple(source.shape)}, "
                f"the target {tuple(target.shape)}"
            )
        if not job.write:
            if job.wanted is not None:
                job.wanted.append((files[primary], source))
            return
        if direct is not None and direct(target, source):
            return
        files[primary].ready(source, verify)
        with torch.no_grad():
            target.copy_(source)
        return
    global_shape = tuple(target.shape)
    local, box = _target_box(target, path) if is_dtensor else (target, _whole(global_shape))
    wanted = math.prod(box[1])
    covered = 0
    seen: set[Box] = set()
    for file, piece in zip(files, sources, strict=True):
        if not isinstance(piece, torch.Tensor):
            continue
        info = file.info(piece)
        if info is None:
            if tuple(piece.shape) != global_shape:
                raise CheckpointMismatchError(
                    f"{path}: rank {file.rank} saved a tensor of shape {tuple(piece.shape)}, "
                    f"the target's global shape is {global_shape}"
                )
            piece_box = _whole(global_shape)
        else:
            if info.global_shape != global_shape:
                raise CheckpointMismatchError(
                    f"{path}: the checkpoint holds a tensor of global shape {info.global_shape}, "
                    f"the target {global_shape}"
                )
            if not info.is_box:
                raise NotSupportedError(
                    f"{path}: rank {file.rank} saved it with placements {info.placements}; "
                    "only Shard and Replicate placements can be resharded"
                )
            if tuple(piece.shape) != info.local_shape:
                raise CheckpointCorruptError(
                    str(file.st_path), "local shard shape differs from its placement", tensor=path
                )
            piece_box = (info.global_offset, info.local_shape)
        if piece_box in seen:
            continue  # a replica of a box already read
        seen.add(piece_box)
        overlap = _intersect(box, piece_box)
        if overlap is None:
            continue
        lo, hi = overlap
        covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
        if not job.write:
            if job.wanted is not None:
                job.wanted.append((file, piece))
            continue
        if piece_box == box:  # the whole target from one whole saved shard: `direct` may read it
            part, whole = local, piece
        else:  # (views that `direct` never takes over, offered so that it keeps writes in order)
            into = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box[0], strict=True))
            out_of = tuple(
                slice(a - o, b - o) for a, b, o in zip(lo, hi, piece_box[0], strict=True)
            )
            part, whole = local[into], piece[out_of]
        if direct is not None and direct(part, whole):
            continue
        file.ready(piece, verify)
        with torch.no_grad():
            part.copy_(whole)
    if covered < wanted and job.partial is not None:
        raise NotSupportedError(
            f"{path}: the target's local shard (offset {box[0]}, shape {box[1]} of the global "
            f"{global_shape}) needs bytes of other ranks' shards: the shards read here hold "
            f"{covered} of its {wanted} elements; {job.partial}"
        )
    if covered != wanted:
        raise CheckpointMismatchError(
            f"{path}: the checkpoint's shards cover {covered} of the {wanted} elements this rank "
            "needs (overlapping or missing shards)"
        )


def _target_box(target: Any, path: str) -> tuple[torch.Tensor, Box]:
    placements = tuple(placement_data(p) for p in target.placements)
    if not all(p[0] in ("shard", "replicate") for p in placements):
        raise NotSupportedError(
            f"{path}: the target has placements {placements}; only Shard and Replicate "
            "targets can be filled from a checkpoint"
        )
    shape, offset = _torch_private.local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    local = _torch_private.local_tensor(target)
    if (
        target.device_mesh.get_coordinate() is None
        or len(offset) != target.dim()
        or tuple(local.shape) != shape
    ):
        raise NotSupportedError(
            f"{path}: the target's local tensor of shape {tuple(local.shape)} is not the shard "
            f"{shape} its placements give this rank (or this rank is not in its mesh)"
        )
    return local, (offset, shape)


def _whole(shape: tuple[int, ...]) -> Box:
    return (0,) * len(shape), shape


def _intersect(a: Box, b: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi
