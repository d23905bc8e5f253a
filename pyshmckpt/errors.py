"""Every exception and warning pyshmckpt raises to a caller, in one hierarchy.

Each error derives from `PyshmckptError` and from the builtin a caller would catch for that
situation (`TypeError`, `ValueError`, `RuntimeError`, `TimeoutError`, `OSError` and its errno
subclasses), so both ``except pyshmckpt.PyshmckptError`` and ``except TimeoutError`` work. Warnings
share the `PyshmckptWarning` category. Exceptions used only for control flow inside a module stay
private to it (``_Name``) and never reach a caller.
"""

from __future__ import annotations

import errno as _errno
from typing import Any


class PyshmckptError(Exception):
    """Base class of every error pyshmckpt raises."""


class PyshmckptWarning(UserWarning):
    """Base category of every warning pyshmckpt issues."""


class ExtensionMissingError(PyshmckptError, ImportError):
    """The compiled extension pyshmckpt._C is not built (a source tree without a build)."""


class PinningWarning(PyshmckptWarning):
    """The arena could not be page-locked for CUDA; staging still works, more slowly."""


# -- arguments and settings ------------------------------------------------------------------


class ConfigError(PyshmckptError, ValueError):
    """An argument or setting (including a ``PYSHMCKPT_*`` environment variable) has a value
    pyshmckpt does not accept."""


class ConfigTypeError(PyshmckptError, TypeError):
    """An argument has the wrong type."""


class NotSupportedError(PyshmckptError, NotImplementedError):
    """A combination of settings pyshmckpt does not support (the message says what to use)."""


# -- staging ---------------------------------------------------------------------------------


class UnsupportedValueError(PyshmckptError, TypeError):
    """A tensor or leaf in the state dict cannot be staged; the message names its key path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (across processes) with its arguments
        return type(self), (self.path, self.reason), self.__dict__


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


class ManifestIndexError(PyshmckptError, IndexError):
    """A tensor index outside a manifest."""


# -- operating system ------------------------------------------------------------------------


class PyshmckptOSError(PyshmckptError, OSError):
    """A system call failed: a segment could not be created or attached, a checkpoint path is
    missing, exists already or is not writable, the disk is full. ``errno``, ``strerror`` and
    ``filename`` are set as on `OSError`; `os_error` picks the subclass matching the errno."""

    def __init__(self, *args: Any) -> None:
        # OSError parses (errno, strerror, filename) only in its own __init__.
        OSError.__init__(self, *args)


class PathNotFoundError(PyshmckptOSError, FileNotFoundError):
    """ENOENT: a file, directory or segment does not exist."""


class PathExistsError(PyshmckptOSError, FileExistsError):
    """EEXIST: a checkpoint (or segment) of that name exists already."""


class PathNotADirectoryError(PyshmckptOSError, NotADirectoryError):
    """ENOTDIR: a path that must be a directory is not one."""


class AccessDeniedError(PyshmckptOSError, PermissionError):
    """EACCES or EPERM: not allowed to read, write or attach."""


_OS_ERRORS: dict[int, type[PyshmckptOSError]] = {
    _errno.ENOENT: PathNotFoundError,
    _errno.EEXIST: PathExistsError,
    _errno.ENOTDIR: PathNotADirectoryError,
    _errno.EACCES: AccessDeniedError,
    _errno.EPERM: AccessDeniedError,
}


def os_error(code: int | None, message: str, filename: str | None = None) -> PyshmckptOSError:
    """The `PyshmckptOSError` subclass for `code` (as `OSError` itself picks
    `FileNotFoundError` for ENOENT), with `message` as its strerror."""
    cls = _OS_ERRORS.get(code, PyshmckptOSError) if code is not None else PyshmckptOSError
    if code is None:
        return cls(message)
    if filename is None:
        return cls(code, message)
    return cls(code, message, filename)


def from_os_error(exc: OSError, context: str) -> PyshmckptOSError:
    """`exc` as a `PyshmckptOSError` of the same errno, its message prefixed with `context`."""
    if isinstance(exc, PyshmckptOSError):
        return exc
    reason = exc.strerror or str(exc)
    converted = os_error(exc.errno, f"{context}: {reason}", exc.filename)
    converted.__cause__ = exc
    return converted


# -- the writer process ----------------------------------------------------------------------


class WriterStartError(PyshmckptError, RuntimeError):
    """The writer process could not be started: its init function or writer raised (the message
    carries the child's traceback), or it exited while initializing."""


class WriterStartTimeoutError(WriterStartError, TimeoutError):
    """The writer process did not acknowledge its initialization in time."""


class WriterError(PyshmckptError, RuntimeError):
    """The user's writer raised in the writer process; the message carries its traceback.

    ``exc_type`` is the qualified name of the exception the writer raised. When that was an
    `OSError` (a full disk, an unwritable path), the error is a `WriterOSError` with the same
    ``errno``.
    """

    def __init__(self, message: str, exc_type: str | None = None) -> None:
        super().__init__(message)
        self.exc_type = exc_type

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.exc_type), self.__dict__


def as_writer_error(failure: BaseException, context: str) -> PyshmckptError:
    """`failure` of a background write, to raise later: itself if it is a PyshmckptError, else a
    WriterError saying `context`, caused by it."""
    if isinstance(failure, PyshmckptError):
        return failure
    error = WriterError(f"{context}: {failure!r}")
    error.__cause__ = failure
    return error


class WriterOSError(WriterError, OSError):
    """The writer failed with an `OSError`; ``errno`` and ``strerror`` are the writer's."""

    def __init__(
        self, message: str, exc_type: str | None, code: int | None, strerror: str | None
    ) -> None:
        OSError.__init__(self, message)
        self.exc_type = exc_type
        self.errno = code
        self.strerror = strerror

    def __str__(self) -> str:  # the message with the writer's traceback, not "[Errno N] ..."
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.exc_type, self.errno, self.strerror), self.__dict__


class WriterDiedError(PyshmckptError, RuntimeError):
    """The writer process exited while work was pending; the message says how it exited."""


class WriterConnectionError(WriterDiedError):
    """The control channel to the writer process broke (closed from outside, or the writer
    vanished mid-message). As torch's transport says: "Child process terminated unexpectedly".
    The writer is stopped; the next write starts a new one."""


class WriteTimeoutError(PyshmckptError, TimeoutError):
    """A write took longer than its write timeout; the writer process was killed first."""


class WriteStalledError(WriteTimeoutError):
    """A write made no progress for the stall timeout (a hung filesystem, a stopped writer);
    the writer process was killed first."""


class WriterShutdownTimeoutError(PyshmckptError, TimeoutError):
    """The writer process was still alive after SIGKILL and the shutdown timeout."""


class ProtocolError(PyshmckptError, RuntimeError):
    """The writer answered something other than what was asked (wrong id, kind or generation)."""


class CheckpointAbortedError(PyshmckptError, RuntimeError):
    """The write was abandoned by close(abort=True)."""


class ClosedError(PyshmckptError, RuntimeError):
    """A CheckpointProcess or Checkpointer was used after close()."""


class CleanupError(PyshmckptError, RuntimeError):
    """Errors met while closing, collected so that none is lost."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__("; ".join(f"{type(e).__name__}: {e}" for e in errors))
        self.errors = errors

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.errors,), self.__dict__


# -- durable checkpoints ---------------------------------------------------------------------


class CommitError(PyshmckptError, RuntimeError):
    """A checkpoint written by several ranks was not committed: another rank failed or gave up."""


class CommitTimeoutError(CommitError, TimeoutError):
    """A commit waited past its timeout: a rank for the others (or for rank 0's commit) after
    the barrier timeout, or a checkpoint engine for a tag's writes."""


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

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason, self.tensor), self.__dict__


class PickleNotAllowedError(PyshmckptError, ValueError):
    """A checkpoint holds pickled values and the caller did not allow unpickling them."""


class CheckpointMismatchError(PyshmckptError, ValueError):
    """``load(into=...)``: the target's structure, shapes or dtypes differ from the checkpoint's."""


class CheckpointKeyError(CheckpointMismatchError, KeyError):
    """``load(into=...)``: a key of the target is not in the checkpoint."""
