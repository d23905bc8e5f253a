"""Layer 3, storage: checkpoint files, their atomic commit, and reading them back.

Writers run in the writer process and are found by name in one registry (`writers`): the default
safetensors writer persists straight from the slot (`safetensors_writer`, with the header in
`safetensors_header` and the structure as JSON in `tree_codec`); torch's formats are in
`torch_writers` (with `TorchFileWriter`, which writes one file at the exact path a framework
chose: not a Checkpointer writer, so not in the registry). `commit` makes a checkpoint directory
visible only once it is durable (`shared_commit` for several ranks); `reader` loads, `inspection`
verifies and describes, both over `rank_files` (``pyshmckpt.load``, which also restores a root
from memory, lives in the tiers layer above).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from .inspection import verify
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

# Imported on first use (see _lazy): the writer process loads only the modules it runs. The
# built-in writers are registered by `writers` on the registry's first use.
__getattr__, __dir__ = exports(
    __name__,
    {
        "verify": "inspection",
        "SafetensorsWriter": "safetensors_writer",
        "DcpWriter": "torch_writers",
        "TorchFileWriter": "torch_writers",
        "TorchSaveWriter": "torch_writers",
        "SlotWriter": "writers",
        "StateDictWriter": "writers",
        "WriterSpec": "writers",
        "register_writer": "writers",
        "writer_kind": "writers",
        "writer_names": "writers",
        "writer_spec": "writers",
    },
)

__all__ = [
    "DcpWriter",
    "SafetensorsWriter",
    "SlotWriter",
    "StateDictWriter",
    "TorchFileWriter",
    "TorchSaveWriter",
    "WriterSpec",
    "register_writer",
    "verify",
    "writer_kind",
    "writer_names",
    "writer_spec",
]
