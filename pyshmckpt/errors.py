"""Exception types. Each also derives from the builtin a caller would catch for that situation."""

from __future__ import annotations


class PyshmckptError(Exception):
    """Base class of every error pyshmckpt raises on purpose."""


class UnsupportedValueError(PyshmckptError, TypeError):
    """A tensor or leaf in the state dict cannot be staged; the message names its key path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CapacityError(PyshmckptError, RuntimeError):
    """A state dict does not fit its slot and the arena is not allowed to grow."""


class SlotsBusyError(PyshmckptError, RuntimeError):
    """No slot became free within the timeout: every slot holds staged data still in use."""


class SlotStateError(PyshmckptError, RuntimeError):
    """An illegal slot transition was requested (a bug in the caller or in pyshmckpt)."""


class StagerClosedError(PyshmckptError, RuntimeError):
    """The stager (or arena) was used after close()."""


class StagingTimeoutError(PyshmckptError, TimeoutError):
    """Device-to-host copies did not complete within the timeout."""


class PinningWarning(UserWarning):
    """The arena could not be page-locked for CUDA; staging still works, more slowly."""


class CheckpointCorruptError(PyshmckptError, ValueError):
    """A checkpoint file is missing, truncated, inconsistent or fails its checksum.

    `path` is the file and `tensor` the tensor (or header entry) concerned, when known.
    """

    def __init__(self, path: str, reason: str, tensor: str | None = None) -> None:
        where = f"{path}" + (f" [{tensor}]" if tensor is not None else "")
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.tensor = tensor
        self.reason = reason


class CommitError(PyshmckptError, RuntimeError):
    """A checkpoint written by several ranks was not committed: another rank failed or gave up."""
