"""pyshmckpt: async checkpointing of PyTorch training state through pinned shared memory."""

from __future__ import annotations

from .arena import Arena, Slot, SlotState
from .channel import CheckpointAbortedError, ProtocolError, WriterDiedError
from .checkpoint_process import CheckpointProcess, CheckpointProcessConfig, CleanupError
from .checkpointer import Checkpointer
from .cuda import cuda_available, cuda_compiled
from .errors import (
    CapacityError,
    CheckpointCorruptError,
    CommitError,
    PinningWarning,
    PyshmckptError,
    SlotsBusyError,
    SlotStateError,
    StagerClosedError,
    StagingTimeoutError,
    UnsupportedValueError,
)
from .layout import Manifest, TensorEntry
from .reader import load, verify
from .stager import ShmStager, StagedHandle
from .stale import collect_stale_segments
from .writer_process import WriterError

__version__ = "0.1.0"

__all__ = [
    "Arena",
    "CapacityError",
    "CheckpointAbortedError",
    "CheckpointCorruptError",
    "CheckpointProcess",
    "CheckpointProcessConfig",
    "Checkpointer",
    "CommitError",
    "CleanupError",
    "Manifest",
    "PinningWarning",
    "ProtocolError",
    "PyshmckptError",
    "ShmStager",
    "Slot",
    "SlotState",
    "SlotStateError",
    "SlotsBusyError",
    "StagedHandle",
    "StagerClosedError",
    "StagingTimeoutError",
    "TensorEntry",
    "UnsupportedValueError",
    "WriterDiedError",
    "WriterError",
    "collect_stale_segments",
    "cuda_available",
    "cuda_compiled",
    "load",
    "verify",
]
