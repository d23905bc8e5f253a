"""pyshmckpt: async checkpointing of PyTorch training state through pinned shared memory.

The package reads as layers, each importing only from those before it: `shm` (segments, arena,
slots), `staging` (layout plan, manifest, `ShmStager`), `storage` (files, commit, reading them),
`tiers` (memory, replicas on other nodes, and which tier a restore reads: `load`), `transport`
(writer process, `CheckpointProcess`), then `checkpointer` (`Checkpointer`),
`integrations` (framework adapters) and `cli` (the ``pyshmckpt`` command). See
docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ._lazy import exports
from .errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CapacityError,
    CheckpointAbortedError,
    CheckpointCorruptError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CleanupError,
    ClosedError,
    CommitError,
    CommitTimeoutError,
    ConfigError,
    ConfigTypeError,
    CudaError,
    CudaUnavailableError,
    CupyUnavailableError,
    ExtensionMissingError,
    ManifestIndexError,
    MemoryTierWarning,
    NotSupportedError,
    ObjectStoreAccessError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
    PathExistsError,
    PathNotADirectoryError,
    PathNotFoundError,
    PickleNotAllowedError,
    PinningWarning,
    ProtocolError,
    PyshmckptError,
    PyshmckptOSError,
    PyshmckptWarning,
    ReplicationError,
    ReplicationWarning,
    RestoreError,
    SlotsBusyError,
    SlotStateError,
    StagerClosedError,
    StagingTimeoutError,
    UnsupportedLocationError,
    UnsupportedValueError,
    WriterConnectionError,
    WriterDiedError,
    WriterError,
    WriterOSError,
    WriterShutdownTimeoutError,
    WriterStartError,
    WriterStartTimeoutError,
    WriteStalledError,
    WriteTimeoutError,
)

# The compiled extension is loaded now (it does not load torch): a tree that was never built
# fails at `import pyshmckpt` with one clear error, not at first use.
from .shm import native as _native  # noqa: F401

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .shm import (
        Arena,
        CudaInfo,
        Slot,
        SlotState,
        collect_stale_segments,
        cuda_available,
        cuda_compiled,
        cuda_info,
    )
    from .staging import Manifest, ShmStager, StagedHandle, TensorEntry
    from .storage import verify
    from .storage.object_store import ObjectPath
    from .tiers import load
    from .transport import CheckpointProcess, CheckpointProcessConfig

# Imported on first use (see _lazy): ``import pyshmckpt.x`` in the writer process loads neither
# torch nor the trainer-side modules.
__getattr__, __dir__ = exports(
    __name__,
    {
        "Checkpointer": "checkpointer",
        "Arena": "shm",
        "Slot": "shm",
        "SlotState": "shm",
        "collect_stale_segments": "shm",
        "CudaInfo": "shm",
        "cuda_available": "shm",
        "cuda_compiled": "shm",
        "cuda_info": "shm",
        "Manifest": "staging",
        "ShmStager": "staging",
        "StagedHandle": "staging",
        "TensorEntry": "staging",
        "load": "tiers",
        "verify": "storage",
        "ObjectPath": "storage.object_store",
        "CheckpointProcess": "transport",
        "CheckpointProcessConfig": "transport",
    },
)

__version__ = "0.1.0"

# A library logs, the application decides what is shown: without its configuration, nothing is.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AccessDeniedError",
    "Arena",
    "BucketNotFoundError",
    "CapacityError",
    "CheckpointAbortedError",
    "CheckpointCorruptError",
    "CheckpointKeyError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointProcess",
    "CheckpointProcessConfig",
    "Checkpointer",
    "CleanupError",
    "ClosedError",
    "CommitError",
    "CommitTimeoutError",
    "ConfigError",
    "ConfigTypeError",
    "CudaError",
    "CudaInfo",
    "CudaUnavailableError",
    "CupyUnavailableError",
    "ExtensionMissingError",
    "Manifest",
    "ManifestIndexError",
    "NotSupportedError",
    "ObjectPath",
    "ObjectStoreAccessError",
    "ObjectStoreError",
    "ObjectStoreUnavailableError",
    "UnsupportedLocationError",
    "PathExistsError",
    "PathNotADirectoryError",
    "PathNotFoundError",
    "PickleNotAllowedError",
    "MemoryTierWarning",
    "PinningWarning",
    "ProtocolError",
    "PyshmckptError",
    "PyshmckptOSError",
    "PyshmckptWarning",
    "ReplicationError",
    "ReplicationWarning",
    "RestoreError",
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
    "WriteStalledError",
    "WriteTimeoutError",
    "WriterConnectionError",
    "WriterDiedError",
    "WriterError",
    "WriterOSError",
    "WriterShutdownTimeoutError",
    "WriterStartError",
    "WriterStartTimeoutError",
    "collect_stale_segments",
    "cuda_available",
    "cuda_compiled",
    "cuda_info",
    "load",
    "verify",
]
