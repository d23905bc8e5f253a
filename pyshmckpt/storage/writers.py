"""What the writer process calls on a writer, and the registry the Checkpointer picks one from.

A writer is built inside the writer process (``factory(rank_info=..., **options)``) and is one of
two kinds, both declared as protocols:

- `SlotWriter` persists straight from shared memory: it gets the mapped slot and the manifest,
  so tensor bytes go from the slot to the file without building tensors (the default
  safetensors writer).
- `StateDictWriter` is torch's ``CheckpointWriter`` shape: it gets the staged state dict, whose
  CPU tensors are zero-copy views of the slot.

Either may have ``close()``, called once when the writer process shuts down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError, NotSupportedError
from ..shm import SlotMapping
from ..staging import Manifest


@runtime_checkable
class SlotWriter(Protocol):
    """Persists a staged slot: `slot` is the writer process's mapping of it, `manifest` says
    where each tensor lies. Raises to fail the write (the trainer gets a WriterError)."""

    def write_slot(
        self, path: str, slot: SlotMapping, manifest: Manifest, **kwargs: Any
    ) -> None: ...


@runtime_checkable
class StateDictWriter(Protocol):
    """torch's CheckpointWriter shape: persists a state dict of zero-copy CPU tensors."""

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None: ...


def writer_kind(writer: object) -> type[SlotWriter] | type[StateDictWriter] | None:
    """Which protocol `writer` follows (a slot writer first), or None."""
    if isinstance(writer, SlotWriter):
        return SlotWriter
    if isinstance(writer, StateDictWriter):
        return StateDictWriter
    return None


@dataclasses.dataclass(frozen=True)
class WriterSpec:
    """A writer the Checkpointer can select by name.

    `factory` runs in the writer process with ``rank_info=`` and the keyword arguments
    `arguments` returns. `options` are the Checkpointer options it takes beyond ``keep_last``
    (``allow_pickle``: it stores non-plain leaves only when allowed, so the Checkpointer refuses
    them before staging otherwise; ``direct_io``; ``mirror``). `multi_rank`: several ranks can write one
    checkpoint with it (it then also takes ``barrier_timeout``).
    """

    name: str
    factory: Callable[..., Any]
    description: str
    options: frozenset[str] = frozenset()
    multi_rank: bool = True

    def arguments(
        self,
        *,
        keep_last: int | None,
        world_size: int,
        barrier_timeout: float,
        allow_pickle: bool = False,
        direct_io: bool = False,
        mirror: str | None = None,
    ) -> dict[str, Any]:
        """The factory's keyword arguments; raises for options this writer does not take."""
        if world_size > 1 and not self.multi_rank:
            others = sorted(name for name, spec in _registry().items() if spec.multi_rank)
            raise NotSupportedError(
                f"the {self.name} writer is single-process; across ranks use one of {others}, "
                "or torch.distributed.checkpoint.async_save with pyshmckpt.ShmStager"
            )
        args: dict[str, Any] = {"keep_last": keep_last}
        if world_size > 1:
            args["barrier_timeout"] = float(barrier_timeout)
        if "allow_pickle" in self.options:
            args["allow_pickle"] = bool(allow_pickle)
        if "direct_io" in self.options:
            args["direct_io"] = bool(direct_io)
        elif direct_io:
            raise ConfigError(f"direct_io applies to the safetensors writer, not {self.name!r}")
        if "mirror" in self.options:
            args["mirror"] = mirror
        elif mirror:
            raise ConfigError(f"mirror applies to the safetensors writer, not {self.name!r}")
        return args

    @property
    def needs_plain_leaves(self) -> bool:
        """Whether non-tensor leaves must be plain data unless allow_pickle is set."""
        return "allow_pickle" in self.options


_REGISTRY: dict[str, WriterSpec] = {}
_BUILTINS_REGISTERED = False


def _registry() -> dict[str, WriterSpec]:
    """The registry, with the built-in writers in it. They are registered on first use, not at
    import: torch's formats import torch, which the writer process of the default writer (it
    imports this module to tell a SlotWriter) must not load. A name registered first keeps its
    own spec."""
    global _BUILTINS_REGISTERED
    if not _BUILTINS_REGISTERED:
        from .safetensors_writer import SafetensorsWriter
        from .torch_writers import DcpWriter, TorchSaveWriter

        builtins = (
            WriterSpec(
                "safetensors", SafetensorsWriter,
                "rank<r>.safetensors + rank<r>.json, written straight from shared memory",
                options=frozenset({"allow_pickle", "direct_io", "mirror"}),
            ),
            WriterSpec(
                "torch", TorchSaveWriter, "torch.save, checkpoint_<r>.pt (torch's CheckpointReader)"
            ),
            WriterSpec(
                "dcp", DcpWriter, "torch.distributed.checkpoint, one process", multi_rank=False
            ),
        )  # fmt: skip
        for spec in builtins:
            _REGISTRY.setdefault(spec.name, spec)
        _BUILTINS_REGISTERED = True
    return _REGISTRY


def register_writer(spec: WriterSpec) -> None:
    """Make `spec` selectable as ``Checkpointer(writer=spec.name)``."""
    _registry()[spec.name] = spec


def writer_spec(name: str) -> WriterSpec:
    """The registered writer called `name`; ConfigError naming the choices otherwise."""
    registry = _registry()
    spec = registry.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError(f"unknown writer {name!r}; choose one of {sorted(registry)}")
    return spec


def writer_names() -> list[str]:
    return sorted(_registry())
