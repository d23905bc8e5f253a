"""pyshmckpt/errors.py: one hierarchy, each error also the builtin a caller would catch, and
errors that cross processes intact (pickle)."""

from __future__ import annotations

import errno
import inspect
import pickle
from pathlib import Path

import pytest

import pyshmckpt
from pyshmckpt import errors

ERROR_CLASSES = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
]
BUILTIN_BASES = (
    TypeError,
    ValueError,
    RuntimeError,
    TimeoutError,
    OSError,
    ImportError,
    LookupError,
)


def sample(cls: type[BaseException]) -> BaseException:
    """An instance of `cls` built the way pyshmckpt builds it."""
    if issubclass(cls, errors.UnsupportedValueError):
        return cls("state_dict['w']", "sparse tensors cannot be staged")
    if issubclass(cls, errors.CheckpointCorruptError):
        return cls("/ck/rank0.safetensors", "checksum mismatch", tensor="w")
    if issubclass(cls, errors.WriterOSError):
        return cls("checkpoint writer raised:\nTraceback ...\nOSError: [Errno 28] No space left",
                   "builtins.OSError", errno.ENOSPC, "No space left on device")  # fmt: skip
    if issubclass(cls, errors.WriterError):
        return cls("checkpoint writer raised:\nTraceback ...", "builtins.ValueError")
    if issubclass(cls, errors.UnsupportedLocationError):
        return cls("az://container/run", "Azure Blob Storage is not supported")
    if issubclass(cls, errors.ObjectStoreError):
        return cls("s3://bucket/run/step-1/rank0.safetensors",
                   "uploading part 3 failed: SlowDown (HTTP 503)", "SlowDown", 503)  # fmt: skip
    if issubclass(cls, errors.CleanupError):
        return cls([errors.WriterShutdownTimeoutError("ignored SIGTERM")])
    if issubclass(cls, errors.PyshmckptOSError):
        return cls(errno.ENOENT, "checkpoint root /x does not exist", "/x")
    return cls("something went wrong")


def test_the_hierarchy_is_complete():
    names = {cls.__name__ for cls in ERROR_CLASSES}
    assert {
        "WriterError",
        "WriterDiedError",
        "WriteTimeoutError",
        "CommitError",
        "CheckpointCorruptError",
    } <= names


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_is_ours_and_a_builtin(cls):
    if issubclass(cls, Warning):
        assert issubclass(cls, errors.PyshmckptWarning)
        return
    assert issubclass(cls, errors.PyshmckptError)
    if cls is not errors.PyshmckptError:
        assert issubclass(cls, BUILTIN_BASES), (
            f"{cls.__name__} derives from no builtin a caller would catch"
        )
    assert getattr(pyshmckpt, cls.__name__) is cls, f"{cls.__name__} is not exported by pyshmckpt"


@pytest.mark.parametrize(
    "cls", [c for c in ERROR_CLASSES if not issubclass(c, Warning)], ids=lambda c: c.__name__
)
def test_every_error_survives_pickle(cls):
    """Errors cross process boundaries (futures of a process pool, DCP's background process)."""
    original = sample(cls)
    original.add_note("while saving step 7")
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls
    assert str(copy) == str(original)
    assert copy.__notes__ == ["while saving step 7"]
    attributes = ("path", "reason", "tensor", "exc_type", "errno", "strerror", "filename",
                  "location", "url", "code", "status")  # fmt: skip
    for attribute in attributes:
        assert getattr(copy, attribute, None) == getattr(original, attribute, None), attribute


@pytest.mark.parametrize(
    ("code", "builtin"),
    [
        (errno.ENOENT, FileNotFoundError),
        (errno.EEXIST, FileExistsError),
        (errno.ENOTDIR, NotADirectoryError),
        (errno.EACCES, PermissionError),
        (errno.EPERM, PermissionError),
        (errno.ENOSPC, OSError),
    ],
)
def test_os_error_picks_the_class_oserror_would(code, builtin):
    exc = errors.os_error(code, "what happened", "/some/path")
    assert isinstance(exc, builtin)
    assert isinstance(exc, errors.PyshmckptOSError)
    assert (exc.errno, exc.strerror, exc.filename) == (code, "what happened", "/some/path")
    assert issubclass(type(exc), type(OSError(code, "x")))  # the builtin OSError itself picks


def test_from_os_error_keeps_the_errno_and_chains_the_original():
    try:
        Path("/nonexistent/dir/file").open()
    except OSError as exc:
        converted = errors.from_os_error(exc, "cannot open the manifest")
    assert isinstance(converted, FileNotFoundError)
    assert isinstance(converted, pyshmckpt.PyshmckptError)
    assert converted.errno == errno.ENOENT
    assert str(converted).startswith(
        "[Errno 2] cannot open the manifest: No such file or directory"
    )
    assert isinstance(converted.__cause__, FileNotFoundError)
    assert errors.from_os_error(converted, "again") is converted


def test_writer_os_error_reads_as_the_writers_error():
    exc = sample(errors.WriterOSError)
    assert isinstance(exc, OSError)
    assert isinstance(exc, RuntimeError)
    assert exc.errno == errno.ENOSPC
    assert str(exc).startswith("checkpoint writer raised:")  # not "[Errno 28] ..."


def test_bad_settings_are_config_errors(monkeypatch):
    monkeypatch.setenv("PYSHMCKPT_SLOTS", "two")
    with pytest.raises(pyshmckpt.ConfigError, match="PYSHMCKPT_SLOTS") as info:
        pyshmckpt.ShmStager()
    assert isinstance(info.value, ValueError)
    monkeypatch.delenv("PYSHMCKPT_SLOTS")
    with pytest.raises(pyshmckpt.ConfigTypeError, match="capacity_bytes") as info:
        pyshmckpt.ShmStager(capacity_bytes="1 GiB")  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
