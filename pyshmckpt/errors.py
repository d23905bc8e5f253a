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
    """Base class of every error pyshmckpt raises; derives from `Exception`.

    Catch it to handle any pyshmckpt failure. Each subclass also derives from the builtin a
    caller would catch for that situation, listed in its own docstring.
    """


class PyshmckptWarning(UserWarning):
    """Base category of every warning pyshmckpt issues; derives from `UserWarning`.

    Filter it (``warnings.filterwarnings("ignore", category=PyshmckptWarning)``) to silence all
    of them.
    """


class ExtensionMissingError(PyshmckptError, ImportError):
    """Raised by ``import pyshmckpt`` when the compiled extension ``pyshmckpt._C`` is missing
    (a source tree that was never built); the message says how to build it.

    Derives from `PyshmckptError` and `ImportError`.
    """


class PinningWarning(PyshmckptWarning):
    """Issued when an arena cannot be page-locked for CUDA (``cuMemHostRegister`` failed, for
    instance under a low ``ulimit -l``); staging still works, with slower device-to-host copies.

    Derives from `PyshmckptWarning`.
    """


class MemoryTierWarning(PyshmckptWarning):
    """Issued when a restore cannot use a checkpoint held in memory: a rank's copy is missing or
    fails its checksums, so every rank restores an older checkpoint (the message names the rank
    and the reason).

    Derives from `PyshmckptWarning`.
    """


# -- arguments and settings ------------------------------------------------------------------


class ReplicationWarning(PyshmckptWarning):
    """Issued when a checkpoint could not be replicated to its buddy node (unreachable, refused,
    or the replica failed its checksums there): the save itself stands, on this node only.

    Derives from `PyshmckptWarning`.
    """


class ConfigError(PyshmckptError, ValueError):
    """Raised when an argument or setting (including a ``PYSHMCKPT_*`` environment variable)
    has a value pyshmckpt does not accept: a negative timeout, an unknown writer name, an
    invalid checkpoint name. The message names the setting.

    Derives from `PyshmckptError` and `ValueError`.
    """


class ConfigTypeError(PyshmckptError, TypeError):
    """Raised when an argument has the wrong type (a float where an int is needed, a config
    object that is not a ``CheckpointProcessConfig``).

    Derives from `PyshmckptError` and `TypeError`.
    """


class NotSupportedError(PyshmckptError, NotImplementedError):
    """Raised for a combination of settings or a use pyshmckpt does not support (a
    single-process writer across ranks, a placement that cannot be resharded, a framework
    setting an adapter does not cover); the message says what to use instead.

    Derives from `PyshmckptError` and `NotImplementedError`.
    """


class UnsupportedLocationError(NotSupportedError):
    """Raised for a checkpoint location pyshmckpt cannot write or read: a URL of a service it
    does not speak (``az://``, ``https://`` ...), object storage where a directory on a local
    or shared filesystem is needed (DeepSpeed's save directory), an ``s3://`` URL a Path
    collapsed to ``s3:/``, an invalid bucket name, or ``s3://``/``gs://`` without its extra
    (``s3``, ``gcs``) installed (the message says what to install). It is never taken for a local path
    (``Path("s3://b/k")`` would be the relative directory ``s3:/b/k``).

    Derives from `NotSupportedError`.

    Attributes:
        location: the location as given.
        reason: why it is refused, in words.
    """

    def __init__(self, location: str, reason: str) -> None:
        super().__init__(f"{location}: {reason}")
        self.location = location
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (across processes) with its arguments
        return type(self), (self.location, self.reason), self.__dict__


# -- staging ---------------------------------------------------------------------------------


class UnsupportedValueError(PyshmckptError, TypeError):
    """Raised by staging when a tensor or leaf of the state dict cannot be staged (or, where
    pickle is not allowed, is not plain data); nothing is staged.

    Derives from `PyshmckptError` and `TypeError`.

    Attributes:
        path: the key path of the value, as in ``state_dict["model"]["w"]``.
        reason: why it cannot be staged.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (across processes) with its arguments
        return type(self), (self.path, self.reason), self.__dict__


class CudaError(PyshmckptError, RuntimeError):
    """Raised when CUDA cannot do what staging asked of it, with the reason in words: no driver
    (``libcuda.so.1`` cannot be loaded), a driver too old for a call pyshmckpt makes (naming
    it), no device, or a driver call that failed (with its CUDA error name; after a sticky error,
    such as an illegal address, CUDA is unusable in the process until it restarts).
    ``pyshmckpt cuda-info`` says what was found.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class CudaUnavailableError(UnsupportedValueError, CudaError):
    """Raised by staging for a CUDA tensor (or CuPy array) when CUDA cannot be used in this
    process: its key path, and why (no driver, a driver too old, no device); nothing is staged.

    Derives from `UnsupportedValueError` and `CudaError`.
    """


class CapacityError(PyshmckptError, RuntimeError):
    """Raised by ``ShmStager.stage`` when a state dict does not fit a slot and the stager was
    made with ``allow_growth=False``.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class SlotsBusyError(PyshmckptError, RuntimeError):
    """Raised by staging when no slot became free within the slot timeout: every slot holds a
    staged state dict that is still referenced or still being written.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class SlotStateError(PyshmckptError, RuntimeError):
    """Raised when a slot is asked for a transition its state machine does not allow, such as
    leasing a staged state dict whose write is still pending (a bug in the caller or in
    pyshmckpt).

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class StagerClosedError(PyshmckptError, RuntimeError):
    """Raised when a stager (``SlotStager``, ``ShmStager``) or an ``Arena`` is used after close.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class StagingTimeoutError(PyshmckptError, TimeoutError):
    """Raised by staging when device-to-host copies did not complete within
    ``PYSHMCKPT_DEVICE_COPY_TIMEOUT`` seconds (default 300).

    Derives from `PyshmckptError` and `TimeoutError`.
    """


class ManifestIndexError(PyshmckptError, IndexError):
    """Raised when a ``Manifest`` is indexed with a tensor index outside it.

    Derives from `PyshmckptError` and `IndexError`.
    """


# -- operating system ------------------------------------------------------------------------


class PyshmckptOSError(PyshmckptError, OSError):
    """Raised when a system call fails in the calling process: a segment cannot be created or
    attached (``/dev/shm`` full), a checkpoint path is missing, exists already or is not
    writable. ``errno``, ``strerror`` and ``filename`` are set as on `OSError`, and the errors
    of the common errnos are the subclasses below. The same failure in the writer process
    reaches the trainer as a `WriterOSError`.

    Derives from `PyshmckptError` and `OSError`.
    """

    def __init__(self, *args: Any) -> None:
        # OSError parses (errno, strerror, filename) only in its own __init__.
        OSError.__init__(self, *args)


class PathNotFoundError(PyshmckptOSError, FileNotFoundError):
    """Raised for ENOENT: a checkpoint, its root or a segment does not exist.

    Derives from `PyshmckptOSError` and `FileNotFoundError`.
    """


class PathExistsError(PyshmckptOSError, FileExistsError):
    """Raised for EEXIST: a checkpoint of that name exists already (and may not be replaced).

    Derives from `PyshmckptOSError` and `FileExistsError`.
    """


class PathNotADirectoryError(PyshmckptOSError, NotADirectoryError):
    """Raised for ENOTDIR: a path that must be a directory (a checkpoint root) is not one.

    Derives from `PyshmckptOSError` and `NotADirectoryError`.
    """


class AccessDeniedError(PyshmckptOSError, PermissionError):
    """Raised for EACCES or EPERM: not allowed to read, write or attach (a read-only checkpoint
    root, a segment of another user).

    Derives from `PyshmckptOSError` and `PermissionError`.
    """


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


# -- object storage --------------------------------------------------------------------------


class ObjectStoreError(PyshmckptError, OSError):
    """Raised when object storage (S3, a service speaking its API, or Google Cloud Storage)
    fails a request for good:
    after its retries (throttling and server errors are retried with backoff), or at once for
    an answer no retry changes. The message names the URL, the service's error code and HTTP
    status; the same error reaches the trainer as itself when the writer process met it.

    Derives from `PyshmckptError` and `OSError`.

    Attributes:
        url: the object or prefix the request was about (``s3://bucket/key``, ``gs://...``).
        code: the service's error code (S3's ``SlowDown``, ``NoSuchBucket`` ...; for Google
            Cloud Storage the client's name of the answer, ``TooManyRequests``, ``NotFound``
            ...), or the client's error class name when no answer came.
        status: the HTTP status of the answer (None when none came).
    """

    def __init__(self, url: str, message: str, code: str = "", status: int | None = None) -> None:
        OSError.__init__(self, f"{url}: {message}")
        self.url = url
        self.code = code
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (across processes) with its arguments
        message = str(self.args[0])[len(self.url) + 2 :]
        return type(self), (self.url, message, self.code, self.status), self.__dict__


class ObjectStoreAccessError(ObjectStoreError, PermissionError):
    """Raised when object storage refuses the credentials or the request: no credentials
    found, a wrong key or signature, an expired token, access denied (HTTP 403).

    Derives from `ObjectStoreError` and `PermissionError`.
    """


class BucketNotFoundError(ObjectStoreError, FileNotFoundError):
    """Raised when the bucket of a checkpoint location does not exist (S3's ``NoSuchBucket``,
    a 404 of Google Cloud Storage for the bucket).

    Derives from `ObjectStoreError` and `FileNotFoundError`.
    """


class ObjectStoreUnavailableError(ObjectStoreError, ConnectionError):
    """Raised when object storage cannot be reached, or keeps throttling or failing (HTTP 5xx)
    after every retry (``PYSHMCKPT_OBJECT_ATTEMPTS``).

    Derives from `ObjectStoreError` and `ConnectionError`.
    """


# -- the writer process ----------------------------------------------------------------------


class ReplicationError(PyshmckptError, ConnectionError):
    """Raised when checkpoint bytes cannot be exchanged with a peer node: it cannot be reached,
    it did not authenticate (a peer without the job's secret gets nothing), or it broke off.

    Derives from `PyshmckptError` and `ConnectionError`.
    """


class RestoreError(PyshmckptError, RuntimeError):
    """Raised by a collective restore (``pyshmckpt.load`` of a root, ``Checkpointer.load``, with
    torch.distributed initialized on several ranks) when the ranks could not agree on one
    checkpoint: a rank failed, left, or did not load the root within
    ``PYSHMCKPT_RESTORE_TIMEOUT``. No rank restored anything then.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class WriterStartError(PyshmckptError, RuntimeError):
    """Raised when the writer process cannot be started: its init function or writer factory
    raised (the message carries the writer's traceback), or it exited while initializing.
    Raised by the next ``write()``, or carried by the Futures of writes made while it started.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class WriterStartTimeoutError(WriterStartError, TimeoutError):
    """Raised when the writer process did not finish initializing within
    ``subprocess_init_timeout_secs`` (or when ``Checkpointer.wait_for_writer`` ran out of time).

    Derives from `WriterStartError` and `TimeoutError`.
    """


class WriterError(PyshmckptError, RuntimeError):
    """Fails a write (or call) whose writer raised in the writer process; the message carries
    the writer's traceback. A pyshmckpt error the writer raised (`CommitError`, for one)
    reaches the trainer as itself instead, and an `OSError` as a `WriterOSError`.

    Derives from `PyshmckptError` and `RuntimeError`.

    Attributes:
        exc_type: the qualified name of the exception the writer raised (None when unknown).
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
    """Fails a write (or call) whose writer failed with an `OSError` (a full disk, an
    unwritable path, a checkpoint that exists already); ``errno`` and ``strerror`` are the
    writer's, so ``except FileExistsError`` does not match it but ``exc.errno == errno.EEXIST``
    does.

    Derives from `WriterError` and `OSError`.
    """

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
    """Fails the pending writes of a writer process that exited (killed, crashed); the message
    says how it exited. The next write starts a new writer, until ``max_restarts`` is spent;
    after that, writes fail with this error too.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class WriterConnectionError(WriterDiedError):
    """Fails the pending writes when the control channel to the writer process broke (closed
    from outside, or the writer vanished mid-message), as torch's transport reports "Child
    process terminated unexpectedly". The writer is stopped; the next write starts a new one.

    Derives from `WriterDiedError`.
    """


class WriteTimeoutError(PyshmckptError, TimeoutError):
    """Fails a write that took longer than ``write_timeout_secs``; the writer process was
    killed first. Adapters also raise it when a wait for pending writes runs out of time.

    Derives from `PyshmckptError` and `TimeoutError`.
    """


class WriteStalledError(WriteTimeoutError):
    """Fails a write that made no progress for ``write_stall_timeout_secs`` (a hung filesystem,
    a stopped writer); the writer process was killed first.

    Derives from `WriteTimeoutError`.
    """


class WriterShutdownTimeoutError(PyshmckptError, TimeoutError):
    """The writer process was still alive after SIGKILL and the shutdown timeout. Not raised on
    its own: ``close()`` collects it into a `CleanupError`.

    Derives from `PyshmckptError` and `TimeoutError`.
    """


class ProtocolError(PyshmckptError, RuntimeError):
    """Fails the pending writes when the writer process answered something other than what was
    asked (wrong id, kind or generation) or could not map a slot as described; the writer is
    stopped.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class CheckpointAbortedError(PyshmckptError, RuntimeError):
    """Fails the pending writes abandoned by ``close(abort=True)``.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class ClosedError(PyshmckptError, RuntimeError):
    """Raised when a ``Checkpointer``, a ``CheckpointProcess`` or a framework adapter is used
    after ``close()``.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class CleanupError(PyshmckptError, RuntimeError):
    """Raised by ``close()`` for what could not be cleaned up (a writer process alive after
    SIGKILL, a segment not removed), every error collected so that none is lost.

    Derives from `PyshmckptError` and `RuntimeError`.

    Attributes:
        errors: the errors met, in order.
    """

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__("; ".join(f"{type(e).__name__}: {e}" for e in errors))
        self.errors = errors

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.errors,), self.__dict__


# -- durable checkpoints ---------------------------------------------------------------------


class CommitError(PyshmckptError, RuntimeError):
    """Fails a checkpoint written by several ranks that was not committed: another rank failed,
    gave up, or its processes are gone. The DeepSpeed adapter also raises it for a tag whose
    write failed.

    Derives from `PyshmckptError` and `RuntimeError`.
    """


class CommitTimeoutError(CommitError, TimeoutError):
    """Fails a commit that waited past its timeout: a rank for the others (or for rank 0's
    commit) after the barrier timeout, or the DeepSpeed adapter for a tag's writes after its
    commit timeout.

    Derives from `CommitError` and `TimeoutError`.
    """


class CheckpointCorruptError(PyshmckptError, ValueError):
    """Raised when loading or verifying finds a checkpoint file missing, truncated,
    inconsistent or failing its checksum.

    Derives from `PyshmckptError` and `ValueError`.

    Attributes:
        path: the file concerned.
        reason: what is wrong with it.
        tensor: the tensor (or header entry) concerned, or None when not known.
    """

    def __init__(self, path: str, reason: str, tensor: str | None = None) -> None:
        where = f"{path}" + (f" [{tensor}]" if tensor is not None else "")
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.tensor = tensor
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason, self.tensor), self.__dict__


class CheckpointNotFoundError(CheckpointCorruptError):
    """Raised when a checkpoint root holds nothing to restore: no committed checkpoint on disk
    and none held in memory for any rank (from the `source` asked). ``load(...,
    missing_ok=True)`` returns None instead: a job's first start.

    Derives from `CheckpointCorruptError` (and so from `ValueError`).
    """


class PickleNotAllowedError(PyshmckptError, ValueError):
    """Raised when decoding a checkpoint's structure meets pickled values and the caller did
    not pass ``allow_pickle=True``. `load` reports this case as a `CheckpointCorruptError`
    carrying the same message.

    Derives from `PyshmckptError` and `ValueError`.
    """


class CheckpointMismatchError(PyshmckptError, ValueError):
    """Raised by ``load(into=...)`` when the target's structure, shapes or dtypes differ from
    the checkpoint's (and by the Accelerate adapter when the accelerator holds other objects
    than were saved).

    Derives from `PyshmckptError` and `ValueError`.
    """


class CheckpointKeyError(CheckpointMismatchError, KeyError):
    """Raised by ``load(into=...)`` when a key of the target is not in the checkpoint.

    Derives from `CheckpointMismatchError` and `KeyError`.
    """


class CupyUnavailableError(PyshmckptError, RuntimeError):
    """Raised by ``load`` when the checkpoint holds CuPy arrays and this process cannot make
    them: CuPy is not installed (the ``cupy`` extra: ``python -m pip install ".[cupy]"`` in a
    clone of the repository) or sees no CUDA device. The message names the first such array;
    ``load(..., cupy_as="numpy")`` loads them as NumPy arrays instead. Raised before any tensor
    is read.

    Derives from `PyshmckptError` and `RuntimeError`.
    """
