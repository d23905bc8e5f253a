"""Files and directories pyshmckpt creates under a checkpoint root: never through a symbolic link,
with the modes `knobs.file_mode` gives, and an entry that was already there used only when it is
our own.

A root that others may write (a shared scratch directory) is safe with its sticky bit set: no one
else can then rename or remove an entry we created, a link planted at a name we create or write is
refused (``O_NOFOLLOW``, ``O_EXCL``) instead of followed, and an entry another user made first is
refused rather than written into. Names others could take first are unpredictable besides
(`run_names`). Without the sticky bit anyone who may write the root can swap our entries, which
no care of ours prevents: opening such a root logs a warning, once.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO, cast

from .. import knobs
from .._log import warn_once
from ..errors import os_error

logger = logging.getLogger(__name__)

_FILE_DEFAULT = 0o666  # less the umask, as open() gives it
_DIR_DEFAULT = 0o775  # less the umask; a directory we write into is never writable by others
_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# An existing entry may be a FIFO another user planted: O_NONBLOCK keeps its open from waiting.
_EXISTING = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def directory_mode(file_mode: int) -> int:
    """A directory's mode for files of `file_mode`: search wherever read is allowed, never
    writable by others."""
    return (file_mode | (file_mode & 0o444) >> 2) & ~stat.S_IWOTH


def settle(fd: int, *, directory: bool = False) -> None:
    """Give the entry open at `fd` the mode the setting asks for (nothing to do by default: the
    umask applied when it was created)."""
    mode = knobs.file_mode()
    if mode is None:
        return
    wanted = directory_mode(mode) if directory else mode
    if stat.S_IMODE(os.fstat(fd).st_mode) != wanted:
        os.fchmod(fd, wanted)


def create_file(path: Path | str, flags: int = os.O_WRONLY, *, dir_fd: int | None = None) -> int:
    """Create a file that must not exist yet (nor be a link) and open it with `flags`; returns
    the descriptor. Raises FileExistsError when anything is at `path`."""
    mode = knobs.file_mode()
    fd = os.open(path, flags | _NEW, _FILE_DEFAULT if mode is None else mode, dir_fd=dir_fd)
    try:
        settle(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_new_file(path: Path) -> BinaryIO:
    """`create_file` for writing, as a binary file object named `path` (as open() names it)."""
    return cast(BinaryIO, open(path, "wb", opener=lambda name, _: create_file(name)))  # noqa: PTH123


def open_own_file(path: Path, flags: int = os.O_WRONLY | os.O_CREAT) -> int:
    """Open (with O_CREAT in `flags`: or create) a regular file of ours at `path`; returns the
    descriptor. Raises a `PyshmckptOSError` naming `path` when a link, another kind of file or a
    file of another user is there: nothing is written through it."""
    mode = knobs.file_mode()
    try:
        fd = os.open(path, flags | _EXISTING, _FILE_DEFAULT if mode is None else mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EACCES, errno.EPERM):
            # A link (ELOOP), or an entry the kernel's sticky-directory protections refused.
            try:
                found = os.lstat(path)
            except OSError:
                raise exc from None
            _check_own(path, found, directory=False)
        raise
    try:
        _check_own(path, os.fstat(fd), directory=False)
        if flags & (os.O_WRONLY | os.O_RDWR):
            settle(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_own_file(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of the regular file of ours at `path` (FileNotFoundError when there
    is none; a `PyshmckptOSError` naming `path` for a link or an entry of another user)."""
    fd = open_own_file(path, os.O_RDONLY)
    try:
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def make_directory(path: Path) -> None:
    """Create the directory `path`, which must not exist yet (nor be a link)."""
    mode = knobs.file_mode()
    path.mkdir(mode=_DIR_DEFAULT if mode is None else directory_mode(mode))
    if mode is not None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            settle(fd, directory=True)
        finally:
            os.close(fd)


def make_or_join_directory(path: Path) -> None:
    """Create the directory `path`, or accept the one there when it is ours: a real directory
    (not a link), owned by this user and not writable by others, as another rank of this job
    made it. Raises a `PyshmckptOSError` (FileExistsError) naming `path` for anything else."""
    try:
        make_directory(path)
    except FileExistsError:
        _check_own(path, os.lstat(path), directory=True)


def is_own(path: Path) -> bool:
    """Whether the entry at `path` (a link itself, not what it names) belongs to this user."""
    try:
        return path.lstat().st_uid == os.geteuid()
    except OSError:
        return False


def warn_if_open(root: Path) -> None:
    """Log a warning (once per root and process) when anyone may write `root` and it lacks the
    sticky bit: another user could then move our entries away and put theirs in their place."""
    try:
        mode = root.stat().st_mode
    except OSError:
        return
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        warn_once(
            logger, f"open root {os.path.realpath(root)}",
            "checkpoint root %s is writable by others without the sticky bit (chmod +t): another "
            "user can replace the checkpoints and temporaries written there", root,
        )  # fmt: skip


def _check_own(path: Path, st: os.stat_result, *, directory: bool) -> None:
    """Raise unless `st` is a regular file (a directory) of this user; a directory others may
    write is not ours alone either."""
    if stat.S_ISLNK(st.st_mode):
        raise _not_ours(path, "a symbolic link")
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(st.st_mode):
        raise _not_ours(path, "not a directory" if directory else "not a regular file")
    if st.st_uid != os.geteuid():
        raise _not_ours(path, f"owned by uid {st.st_uid}")
    if directory and st.st_mode & stat.S_IWOTH:
        raise _not_ours(path, "writable by others")


def _not_ours(path: Path, why: str) -> OSError:
    return os_error(errno.EEXIST, f"{path} is not ours to use ({why})", str(path))
