"""Atomic commit of checkpoint directories under a root, `latest`, retention and leftovers.

Protocol: a checkpoint is written into ``root/.tmp-<name>-<random>``; its files and the directory
are fsynced, then it is renamed to ``root/<name>`` and the root is fsynced. So, under a root,
every entry whose name does not start with "." is a complete, committed checkpoint. ``latest``
is a symbolic link to the newest one, replaced atomically after the commit. Retention removes the
oldest checkpoints (by commit sequence) only after a newer one is committed. Every entry is
created without following a link, with the modes of the setting (`entries`).

`directory_commit` writes and commits a whole checkpoint with these steps (through
`shared_commit` when several ranks write it together).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .. import knobs
from ..errors import ConfigError, from_os_error, os_error
from . import entries, liveness

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
REPLACED_PREFIX = ".replaced-"  # a checkpoint moved aside while a newer one takes its name
FAILED_PREFIX = ".failed-"
LATEST = "latest"
COMMIT_RECORD = "commit.json"


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(target: Path, fill: Callable[[BinaryIO], object], temp_prefix: str) -> None:
    """Write one file durably and atomically: `fill` writes it into a temporary beside `target`
    (``<temp_prefix><random>``), which is fsynced, renamed over `target`, and the directory
    fsynced. Readers see the old file or the whole new one; on failure the temporary is gone."""
    temp = target.with_name(f"{temp_prefix}{secrets.token_hex(8)}")
    try:
        with entries.open_new_file(temp) as file:
            fill(file)
            file.flush()
            os.fsync(file.fileno())
        temp.replace(target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)


def rank_and_world(rank_info: Any) -> tuple[int, int]:
    """(global rank, world size) of a torch RankInfo (or anything with those fields; None: 0, 1)."""
    rank = int(getattr(rank_info, "global_rank", 0) or 0)
    world = int(getattr(rank_info, "global_world_size", 1) or 1)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside world size {world}")
    return rank, world


def check_root(root: Path) -> None:
    """Raise a clear error unless `root` is an existing, writable directory (and the mode
    setting is valid); warn once when others may write it without the sticky bit."""
    knobs.file_mode()
    if not root.exists():
        raise os_error(errno.ENOENT, f"checkpoint root {root} does not exist", str(root))
    if not root.is_dir():
        raise os_error(errno.ENOTDIR, f"checkpoint root {root} is not a directory", str(root))
    if not os.access(root, os.W_OK | os.X_OK):
        raise os_error(errno.EACCES, f"checkpoint root {root} is not writable", str(root))
    entries.warn_if_open(root)


def check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or name in (LATEST, ".", ".."):
        raise ConfigError(
            f"invalid checkpoint name {name!r}: it must not start with '.', contain '/' or be {LATEST!r}"
        )


def new_temp_dir(root: Path, name: str) -> Path:
    check_name(name)
    path = root / f"{TMP_PREFIX}{name}-{secrets.token_hex(8)}"
    entries.make_directory(path)
    return path


def has_checkpoints(root: Path) -> bool:
    """Whether `root` holds anything of a checkpoint, committed or damaged: a directory (not
    hidden, not ``latest``) with a commit record or a rank's manifest. A root without one (or
    no root) is a job's first start; a root whose checkpoints are all damaged is not.

    Raises:
        PyshmckptOSError: the root cannot be listed (not for a missing root).
    """
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise from_os_error(exc, f"cannot list {root}") from None
    for entry in entries:
        if entry.name.startswith(".") or entry.name == LATEST:
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                path = Path(entry.path)
                if (path / COMMIT_RECORD).exists() or any(path.glob("rank*.json")):
                    return True
    return False


def committed(root: Path) -> list[tuple[int, str]]:
    """(sequence, name) of every committed checkpoint, oldest first."""
    out = []
    for entry in os.scandir(root):
        if (
            entry.name.startswith(".")
            or entry.name == LATEST
            or not entry.is_dir(follow_symlinks=False)
        ):
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads((Path(entry.path) / COMMIT_RECORD).read_text())
            out.append((int(record["sequence"]), entry.name))
    return sorted(out)


def commit(
    temp_dir: Path,
    final_dir: Path,
    world_size: int = 1,
    *,
    replace: bool = False,
    attempt: str | None = None,
) -> None:
    """Record the commit, fsync and rename `temp_dir` to `final_dir`.

    `final_dir` must not exist, unless `replace` is set and it is a committed checkpoint: then
    the two are exchanged atomically (renameat2 RENAME_EXCHANGE, so the name always holds one
    complete checkpoint) and, once the root is fsynced, the old one is deleted in the
    background. Where the filesystem cannot exchange, the old one is renamed aside first
    (``.replaced-<name>-*``): a crash between the two renames leaves the name empty, and
    `clean_leftovers` puts the old one back.
    """
    root = final_dir.parent
    exists = final_dir.exists() or final_dir.is_symlink()
    if exists and not replace:
        raise os_error(errno.EEXIST, f"checkpoint {final_dir} already exists", str(final_dir))
    if exists:
        check_replaceable(final_dir)
    sequence = max((seq for seq, _ in committed(root)), default=0) + 1
    record = temp_dir / COMMIT_RECORD
    fields: dict[str, Any] = {
        "sequence": sequence,
        "time_ns": time.time_ns(),
        "name": final_dir.name,
        "world_size": world_size,
    }
    if attempt is not None:
        fields["attempt"] = attempt
    with entries.open_new_file(record) as file:
        file.write(json.dumps(fields).encode())
    fsync_path(record)
    fsync_path(temp_dir)
    replaced = None
    if not exists:
        temp_dir.rename(final_dir)
    elif _exchange(temp_dir, final_dir):
        replaced = temp_dir  # it now holds the replaced checkpoint
    else:
        replaced = root / f"{REPLACED_PREFIX}{final_dir.name}-{secrets.token_hex(8)}"
        final_dir.rename(replaced)
        try:
            temp_dir.rename(final_dir)
        except BaseException:
            replaced.rename(final_dir)
            raise
    fsync_path(root)
    if replaced is not None:  # only now: a crash may undo a swap that is not yet durable
        _delete(replaced, background=True)
    logger.debug("committed %s (sequence %d)%s", final_dir, sequence, " over the old" * exists)


def check_replaceable(path: Path) -> None:
    """Raise unless `path` is a committed checkpoint (what ``replace`` may overwrite): never
    replace a file or directory of someone else's."""
    record: Any = None
    if not path.is_symlink():
        with contextlib.suppress(OSError, ValueError):
            record = json.loads((path / COMMIT_RECORD).read_text())
    if not (isinstance(record, dict) and record.get("name") == path.name):
        raise os_error(
            errno.EEXIST,
            f"{path} exists and is not a pyshmckpt checkpoint: not replacing it",
            str(path),
        )


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_uint,
        ]
        function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the C library or the filesystem cannot."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        logger.debug("renameat2(RENAME_EXCHANGE) unsupported here (%s)", os.strerror(code))
        return False
    raise os_error(code, f"could not exchange {a} and {b}: {os.strerror(code)}", str(b))


def update_latest(root: Path, name: str) -> None:
    """Point root/latest at `name`, atomically (a new link renamed over the old one)."""
    tmp = root / f".{LATEST}-{secrets.token_hex(8)}"
    tmp.symlink_to(name)
    try:
        tmp.replace(root / LATEST)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(root)


def latest(root: Path) -> Path | None:
    """The checkpoint `latest` points at, if it is committed; under a root without that link
    (saves that do not keep one, `link_latest=False`), the newest committed checkpoint by commit
    sequence; None when there is none."""
    link = root / LATEST
    with contextlib.suppress(OSError):
        target = str(link.readlink())
        path = root / target
        if not target.startswith(".") and (path / COMMIT_RECORD).exists():
            return path
        return None
    if link.exists() or not root.is_dir():
        return None
    newest = committed(root)
    return root / newest[-1][1] if newest else None


def remove(root: Path, name: str, *, background: bool = False) -> None:
    """Make a checkpoint disappear atomically (rename to a hidden name), then delete its files.

    With background=True the files are deleted by a daemon thread: freeing a large file takes
    a while, and nothing needs to wait for it (a crash leaves a .trash-* that the next opening of
    the root removes).
    """
    trash = root / f"{TRASH_PREFIX}{name}-{secrets.token_hex(8)}"
    (root / name).rename(trash)
    fsync_path(root)
    _delete(trash, background=background)


def remove_checkpoint(root: str, name: str) -> None:
    """`remove` for `Checkpointer.remove`, run in the writer process (deleted in the background:
    the writer waits for deletions when it closes)."""
    try:
        remove(Path(root), name, background=True)
    except OSError as exc:
        raise from_os_error(exc, f"cannot remove checkpoint {Path(root) / name}") from exc


def _delete(directory: Path, *, background: bool) -> None:
    if not background:
        shutil.rmtree(directory, ignore_errors=True)
        return
    delete_in_background(shutil.rmtree, directory, True)


def delete_in_background(function: Callable[..., object], *args: Any) -> None:
    """Run `function(*args)`, a deletion, on a daemon thread that `wait_for_deletions` waits
    for (a writer closing)."""
    thread = threading.Thread(target=function, args=args, name="pyshmckpt-trash", daemon=True)
    thread.start()
    with _DELETIONS_LOCK:
        _DELETIONS[:] = [t for t in _DELETIONS if t.is_alive()] + [thread]


_DELETIONS: list[threading.Thread] = []
_DELETIONS_LOCK = threading.Lock()


def wait_for_deletions(timeout: float) -> bool:
    """Wait (bounded) for background deletions to finish; True when none is left running."""
    with _DELETIONS_LOCK:
        threads = list(_DELETIONS)
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def retain(root: Path, keep_last: int, *, background: bool = False) -> list[str]:
    """Delete all but the newest `keep_last` committed checkpoints (never `latest`'s target)."""
    current = latest(root)
    names = [name for _, name in committed(root)]
    doomed = names[: max(0, len(names) - keep_last)]
    removed = []
    for name in doomed:
        if current is not None and current.name == name:
            continue
        remove(root, name, background=background)
        removed.append(name)
    if removed:
        logger.debug("retention (keep_last=%d) removed %s from %s", keep_last, removed, root)
    return removed


@contextlib.contextmanager
def in_use(directory: Path) -> Iterator[None]:
    """Mark a checkpoint's temporary directory as being written (a shared flock held while the
    block runs), so that `clean_leftovers` of a restarted job leaves it alone: the writer of a
    trainer that died may still be finishing it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _being_written(directory: Path) -> bool:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # no flock on this filesystem: nothing tells
    finally:
        os.close(fd)
    return False


def clean_leftovers(root: Path) -> list[str]:
    """Remove temporaries a crash left behind (unfinished checkpoints, trash, link temporaries),
    except checkpoints a live writer is still writing (see `in_use`); a checkpoint a crash left
    renamed aside while being replaced goes back to its name if nothing took it. Entries of
    other users are left alone: whatever their names, they are not ours."""
    removed = []
    uid = os.geteuid()
    for entry in os.scandir(root):
        path = Path(entry.path)
        if not entry.name.startswith(_LEFTOVER_PREFIXES):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                logger.debug("left %s alone: it belongs to another user", entry.name)
                continue
        except FileNotFoundError:
            continue
        if entry.name.startswith(REPLACED_PREFIX):
            name = entry.name[len(REPLACED_PREFIX) :].rsplit("-", 1)[0]
            if not ((root / name).exists() or (root / name).is_symlink()):
                path.rename(root / name)
                logger.warning("put back %s, left aside by a replacement that crashed", name)
                continue
        if entry.name.startswith(liveness.PREFIX):
            if _untouched_for(path, _STALE_HEARTBEAT):  # a live one is rewritten every second
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                removed.append(entry.name)
            continue
        if path.is_dir() and not path.is_symlink():
            if entry.name.startswith(TMP_PREFIX) and _being_written(path):
                logger.info("left %s alone: a writer is still finishing it", entry.name)
                continue
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(entry.name)
    if removed:
        logger.info("removed leftovers of interrupted saves from %s: %s", root, removed)
    return removed


_LEFTOVER_PREFIXES = (
    TMP_PREFIX, TRASH_PREFIX, FAILED_PREFIX, REPLACED_PREFIX, f".{LATEST}-", liveness.PREFIX
)  # fmt: skip
_STALE_HEARTBEAT = 600.0


def _untouched_for(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime > seconds
    except OSError:
        return False


Fill = Callable[[Path], "Iterable[Path] | None"]


def fill_and_sync(temp: Path, fill: Fill) -> None:
    """Run `fill` in `temp`, then give the files it wrote (None: every file there) the mode of
    the setting, whichever code created them, and fsync them."""
    files = fill(temp)
    if files is None:
        files = [Path(e.path) for e in os.scandir(temp) if e.is_file(follow_symlinks=False)]
    for file in files:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            entries.settle(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
