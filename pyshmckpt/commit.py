"""Atomic commit of checkpoint directories under a root, `latest`, retention and leftovers.

Protocol: a checkpoint is written into ``root/.tmp-<name>-<random>``; its files and the directory
are fsynced, then it is renamed to ``root/<name>`` and the root is fsynced. So, under a root,
every entry whose name does not start with "." is a complete, committed checkpoint. ``latest``
is a symbolic link to the newest one, replaced atomically after the commit. Retention removes the
oldest checkpoints (by commit sequence) only after a newer one is committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LATEST = "latest"
COMMIT_RECORD = "commit.json"


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_root(root: Path) -> None:
    """Raise a clear error unless `root` is an existing, writable directory."""
    if not root.exists():
        raise FileNotFoundError(f"checkpoint root {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"checkpoint root {root} is not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(f"checkpoint root {root} is not writable")


def check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or name in (LATEST, ".", ".."):
        raise ValueError(f"invalid checkpoint name {name!r}: it must not start with '.', contain '/' or be {LATEST!r}")


def new_temp_dir(root: Path, name: str) -> Path:
    check_name(name)
    path = root / f"{TMP_PREFIX}{name}-{secrets.token_hex(8)}"
    path.mkdir(mode=0o755)
    return path


def committed(root: Path) -> list[tuple[int, str]]:
    """(sequence, name) of every committed checkpoint, oldest first."""
    out = []
    for entry in os.scandir(root):
        if entry.name.startswith(".") or entry.name == LATEST or not entry.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads((Path(entry.path) / COMMIT_RECORD).read_text())
            out.append((int(record["sequence"]), entry.name))
    return sorted(out)


def commit(temp_dir: Path, final_dir: Path) -> None:
    """Record the commit, fsync and rename `temp_dir` to `final_dir` (which must not exist)."""
    root = final_dir.parent
    if final_dir.exists() or final_dir.is_symlink():
        raise FileExistsError(f"checkpoint {final_dir} already exists")
    sequence = max((seq for seq, _ in committed(root)), default=0) + 1
    record = temp_dir / COMMIT_RECORD
    record.write_text(json.dumps({"sequence": sequence, "time_ns": time.time_ns(), "name": final_dir.name}))
    fsync_path(record)
    fsync_path(temp_dir)
    os.rename(temp_dir, final_dir)
    fsync_path(root)


def update_latest(root: Path, name: str) -> None:
    """Point root/latest at `name`, atomically (a new link renamed over the old one)."""
    tmp = root / f".{LATEST}-{secrets.token_hex(8)}"
    os.symlink(name, tmp)
    try:
        os.replace(tmp, root / LATEST)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(root)


def latest(root: Path) -> Path | None:
    """The checkpoint `latest` points at, if it is committed."""
    link = root / LATEST
    with contextlib.suppress(OSError):
        target = os.readlink(link)
        path = root / target
        if not target.startswith(".") and (path / COMMIT_RECORD).exists():
            return path
    return None


def remove(root: Path, name: str, *, background: bool = False) -> None:
    """Make a checkpoint disappear atomically (rename to a hidden name), then delete its files.

    With background=True the files are deleted by a daemon thread: freeing a large file takes
    a while, and nothing needs to wait for it (a crash leaves a .trash-* that the next opening of
    the root removes).
    """
    trash = root / f"{TRASH_PREFIX}{name}-{secrets.token_hex(8)}"
    os.rename(root / name, trash)
    fsync_path(root)
    if background:
        thread = threading.Thread(target=shutil.rmtree, args=(trash, True), name="pyshmckpt-trash", daemon=True)
        thread.start()
        with _DELETIONS_LOCK:
            _DELETIONS[:] = [t for t in _DELETIONS if t.is_alive()] + [thread]
    else:
        shutil.rmtree(trash, ignore_errors=True)


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
    return removed


def clean_leftovers(root: Path) -> list[str]:
    """Remove temporaries a crash left behind (unfinished checkpoints, trash, link temporaries)."""
    removed = []
    for entry in os.scandir(root):
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX, f".{LATEST}-")):
            path = Path(entry.path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            removed.append(entry.name)
    return removed


def commit_directory(path: str | os.PathLike[str], fill: Callable[[Path], None], keep_last: int | None) -> Path:
    """Write a checkpoint with `fill(temp_dir)`, then commit it as `path`, update `latest`, and
    apply retention. Nothing is visible under the root until the rename; on any failure the
    temporary directory is removed and earlier checkpoints are untouched."""
    final = Path(path)
    root = final.parent
    check_root(root)
    temp = new_temp_dir(root, final.name)
    try:
        fill(temp)
        for entry in os.scandir(temp):
            if entry.is_file(follow_symlinks=False):
                fsync_path(Path(entry.path))
        commit(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    update_latest(root, final.name)
    if keep_last is not None:
        retain(root, keep_last, background=True)
    return final
