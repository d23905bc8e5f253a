"""pyshmckpt: async checkpointing of PyTorch training state through pinned shared memory."""

from __future__ import annotations

from .arena import Arena, Slot, SlotState
from .cuda import cuda_available, cuda_compiled
from .errors import (
    CapacityError,
    PinningWarning,
    PyshmckptError,
    SlotsBusyError,
    SlotStateError,
    StagerClosedError,
    StagingTimeoutError,
    UnsupportedValueError,
)
from .layout import Manifest, TensorEntry
from .stager import ShmStager, StagedHandle

__version__ = "0.1.0"

__all__ = [
    "Arena",
    "CapacityError",
    "Manifest",
    "PinningWarning",
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
    "cuda_available",
    "cuda_compiled",
]
