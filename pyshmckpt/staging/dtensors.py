"""DTensors in a staged state dict: each rank's local shard is a tensor of the slot, and the
placement that makes it a part of a global tensor travels beside the manifest.

A `ShardInfo` is the placement in plain data (global shape, mesh shape, placements, the box of
the global tensor this rank's shard covers): it is what checkpoint files record and what
resharding on load reads. A `Sharding` maps tensor indices of a manifest to their ShardInfo and
keeps the live `DTensorSpec`s (device mesh included), so the staged state dict holds DTensors
again; the specs cross to other processes pickled once per manifest, unpickled only if used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pickle
import sys
from typing import Any

import torch

from .. import _torch_private
from ..errors import CheckpointCorruptError, NotSupportedError, UnsupportedValueError

# ("shard", dim) | ("replicate",) | ("partial", reduce_op) | ("strided_shard", dim, split_factor)
PlacementData = tuple[Any, ...]


@functools.cache
def dtensor_type() -> type | None:
    """torch's DTensor class, or None where torch was built without distributed support
    (imported on first use: the import loads TorchDynamo and SymPy, seconds of CPU)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def loaded_dtensor_type() -> type | None:
    """torch's DTensor class if this process has imported it, else None: what telling whether an
    object is a DTensor needs, since no DTensor exists before its module is imported. A state
    dict without DTensors never pays for the import (see `dtensor_type`)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    return dtensor_type()


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Where one rank's local tensor lies in its DTensor's global tensor."""

    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    global_offset: tuple[int, ...]  # index of the local shard's first element in the global tensor
    local_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    coordinate: tuple[int, ...] | None  # this rank's place in the mesh
    placements: tuple[PlacementData, ...]
    parameter: bool = False
    requires_grad: bool = False

    @property
    def is_box(self) -> bool:
        """Whether the local tensor is exactly the box global_offset + local_shape of the global
        tensor (no partial sums, no strided sharding): what resharding can read from."""
        return all(p[0] in ("shard", "replicate") for p in self.placements)

    def to_json(self) -> dict[str, Any]:
        return {
            "global_shape": list(self.global_shape),
            "global_stride": list(self.global_stride),
            "global_offset": list(self.global_offset),
            "local_shape": list(self.local_shape),
            "mesh_shape": list(self.mesh_shape),
            "mesh_dim_names": None if self.mesh_dim_names is None else list(self.mesh_dim_names),
            "coordinate": None if self.coordinate is None else list(self.coordinate),
            "placements": [list(p) for p in self.placements],
        }

    @classmethod
    def from_json(cls, data: Any, where: str, tensor: str | None = None) -> ShardInfo:
        """Parse what `to_json` wrote; CheckpointCorruptError for anything malformed."""
        try:
            info = cls(
                global_shape=_ints(data["global_shape"]),
                global_stride=_ints(data["global_stride"]),
                global_offset=_ints(data["global_offset"]),
                local_shape=_ints(data["local_shape"]),
                mesh_shape=_ints(data["mesh_shape"]),
                mesh_dim_names=None
                if data["mesh_dim_names"] is None
                else tuple(str(n) for n in data["mesh_dim_names"]),
                coordinate=None if data["coordinate"] is None else _ints(data["coordinate"]),
                placements=tuple(_placement(p) for p in data["placements"]),
            )
        except (KeyError, TypeError, ValueError, _Malformed) as exc:
            raise CheckpointCorruptError(
                where, f"malformed placement: {exc!r}", tensor=tensor
            ) from None
        n = len(info.global_shape)
        if (
            len(info.global_offset) != n
            or len(info.local_shape) != n
            or any(
                o < 0 or o + s > g
                for o, s, g in zip(
                    info.global_offset, info.local_shape, info.global_shape, strict=True
                )
            )  # fmt: skip
        ):
            raise CheckpointCorruptError(
                where, "placement box lies outside the global tensor", tensor=tensor
            )
        return info


def _ints(values: Any) -> tuple[int, ...]:
    """Sizes from JSON: ints only (a bool or a float is not a size)."""
    if not isinstance(values, (list, tuple)) or any(type(v) is not int for v in values):
        raise _Malformed(f"expected a list of ints, not {values!r:.80}")
    return tuple(values)


def _placement(value: Any) -> PlacementData:
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise _Malformed(f"a placement must be a list starting with its kind, not {value!r:.80}")
    return tuple(value)


class _Malformed(Exception):
    """Raised inside ShardInfo.from_json; reported as CheckpointCorruptError."""


def placement_data(placement: Any) -> PlacementData:
    """A DTensor placement as plain data."""
    if _torch_private.is_strided_shard(placement):
        return ("strided_shard", int(placement.dim), int(placement.split_factor))
    if placement.is_shard():
        return ("shard", int(placement.dim))
    if placement.is_replicate():
        return ("replicate",)
    if placement.is_partial():
        return ("partial", str(getattr(placement, "reduce_op", "sum")))
    return ("other", repr(placement))


def shard_info(dtensor: Any) -> ShardInfo:
    """The ShardInfo of a DTensor on this rank."""
    spec = _torch_private.dtensor_spec(dtensor)
    mesh = spec.mesh
    local_shape, offset = _torch_private.local_shape_and_global_offset(
        dtensor.shape, mesh, spec.placements
    )
    coordinate = mesh.get_coordinate()
    local = _torch_private.local_tensor(dtensor)
    if coordinate is None or len(offset) != dtensor.dim() or tuple(local.shape) != local_shape:
        # Not part of the mesh, or a local tensor that is not the shard its placements describe
        # (DTensor.from_local with a custom uneven split): no box to record.
        raise UnsupportedValueError(
            "a DTensor",
            f"its local tensor of shape {tuple(local.shape)} is not the shard {local_shape} "
            f"its placements give this rank (coordinate {coordinate})",
        )
    return ShardInfo(
        global_shape=tuple(dtensor.shape),
        global_stride=tuple(dtensor.stride()),
        global_offset=offset,
        local_shape=local_shape,
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=None if mesh.mesh_dim_names is None else tuple(mesh.mesh_dim_names),
        coordinate=tuple(coordinate),
        placements=tuple(placement_data(p) for p in spec.placements),
        parameter=isinstance(dtensor, torch.nn.Parameter),
        requires_grad=dtensor.requires_grad,
    )


class Sharding:
    """The DTensors of a manifest: tensor index -> ShardInfo, plus their DTensorSpecs.

    In the process that staged them the specs are the live objects; pickled, they travel as one
    pickle (the device mesh once) that is only unpickled where DTensors are rebuilt.
    """

    __slots__ = ("infos", "_specs", "_pickled", "_meshes")

    def __init__(
        self,
        infos: dict[int, ShardInfo],
        specs: dict[int, Any] | None = None,
        pickled: bytes | None = None,
        meshes: bytes = b"",
    ) -> None:
        self.infos = infos
        self._specs = specs
        self._pickled = pickled
        self._meshes = meshes  # what the infos leave out of the specs: ranks, device, order

    @classmethod
    def of(cls, dtensors: dict[int, tuple[Any, ShardInfo]]) -> Sharding:
        """From tensor index -> (DTensor, its shard_info)."""
        specs = {i: _torch_private.dtensor_spec(d) for i, (d, _) in dtensors.items()}
        meshes = repr(
            sorted(
                (i, s.mesh.device_type, s.mesh.mesh.tolist(), repr(getattr(s, "shard_order", None)))
                for i, s in specs.items()
            )
        ).encode()
        return cls({i: info for i, (_, info) in dtensors.items()}, specs, None, meshes)

    def digest(self) -> bytes:
        h = hashlib.blake2b(repr(sorted(self.infos.items())).encode(), digest_size=16)
        h.update(self._meshes)
        return h.digest()

    def specs(self) -> dict[int, Any]:
        if self._specs is None:
            self._specs = pickle.loads(self._pickled) if self._pickled is not None else {}
        return self._specs

    def wrap(self, tensors: list[torch.Tensor]) -> None:
        """Replace each local tensor in `tensors` by its DTensor (in place)."""
        specs = self.specs()
        dtype = dtensor_type()
        if dtype is None:  # pragma: no cover - torch without distributed
            raise NotSupportedError("this torch has no DTensor: the state cannot be rebuilt")
        for i, info in self.infos.items():
            dt = _torch_private.dtensor_over(dtype, tensors[i], specs[i])
            # Not nn.Parameter(dt): that detaches through DTensor's own constructor, which puts
            # the slot offset back on the wrapper (see dtensor_over).
            if info.requires_grad:
                dt.requires_grad_(True)
            if info.parameter:
                _torch_private.mark_parameter(dt)
            tensors[i] = dt

    def __reduce__(self) -> tuple[Any, ...]:
        pickled = self._pickled
        if pickled is None:
            pickled = pickle.dumps(self._specs, protocol=pickle.HIGHEST_PROTOCOL)
        return Sharding, (self.infos, None, pickled, self._meshes)
