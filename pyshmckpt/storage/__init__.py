"""Layer 3, storage: checkpoint files, their atomic commit, and reading them back.

Writers run in the writer process and are found by name in one registry (`writers`): the default
safetensors writer persists straight from the slot (`safetensors_writer`, with the header in
`safetensors_header` and the structure as JSON in `tree_codec`); torch's formats are in
`torch_writers` (with `TorchFileWriter`, which writes one file at the exact path a framework
chose: not a Checkpointer writer, so not in the registry). `commit` makes a checkpoint directory
visible only once it is durable (one rank or several); `reader` loads and verifies.
"""

from __future__ import annotations

from .reader import load, verify
from .safetensors_writer import SafetensorsWriter
from .torch_writers import DcpWriter, TorchFileWriter, TorchSaveWriter
from .writers import (
    SlotWriter,
    StateDictWriter,
    WriterSpec,
    register_writer,
    writer_kind,
    writer_names,
    writer_spec,
)

register_writer(
    WriterSpec(
        "safetensors", SafetensorsWriter,
        "rank<r>.safetensors + rank<r>.json, written straight from shared memory",
        options=frozenset({"allow_pickle", "direct_io"}),
    )
)  # fmt: skip
register_writer(
    WriterSpec("torch", TorchSaveWriter, "torch.save, checkpoint_<r>.pt (torch's CheckpointReader)")
)
register_writer(
    WriterSpec("dcp", DcpWriter, "torch.distributed.checkpoint, one process", multi_rank=False)
)

__all__ = [
    "DcpWriter",
    "SafetensorsWriter",
    "SlotWriter",
    "StateDictWriter",
    "TorchFileWriter",
    "TorchSaveWriter",
    "WriterSpec",
    "load",
    "register_writer",
    "verify",
    "writer_kind",
    "writer_names",
    "writer_spec",
]
