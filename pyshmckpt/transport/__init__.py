"""Layer 4, transport: the writer process and the control channel to it.

`channel` defines the messages (one small manifest per checkpoint; the bytes stay in the slot);
`parent` is the trainer's side (`WriterProcess`: spawn, dispatch, deadlines, escalation); `child`
is the writer process itself; `logs` forwards its log records; `checkpoint_process` is the
drop-in for torch's `CheckpointProcess`, which leases staged slots and hands them to the writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from .checkpoint_process import CheckpointProcess, CheckpointProcessConfig
    from .child import RankInfo, no_init
    from .parent import WriterProcess

# Imported on first use (see _lazy): the writer process loads only the modules it runs.
__getattr__, __dir__ = exports(
    __name__,
    {
        "CheckpointProcess": "checkpoint_process",
        "CheckpointProcessConfig": "checkpoint_process",
        "RankInfo": "child",
        "no_init": "child",
        "WriterProcess": "parent",
    },
)

__all__ = ["CheckpointProcess", "CheckpointProcessConfig", "RankInfo", "WriterProcess", "no_init"]
