"""Atomic commit of checkpoint directories under a root, `latest`, retention and leftovers.

Protocol: a checkpoint is written into ``root/.tmp-<name>-<random>``; its files and the directory
are fsynced, then it is renamed to ``root/<name>`` and the root is fsynced. So, under a root,
every entry whose name does not start with "." is a complete, committed checkpoint. ``latest``
is a symbolic link to the newest one, replaced atomically after the commit. Retention removes the
oldest checkpoints (by commit sequence) only after a newer one is committed.

Several ranks (world_size > 1, on a filesystem they share) write one checkpoint directory
together: every rank writes its own files into ``root/.tmp-<name>`` (a name they all agree on),
fsyncs them and leaves a ``.rank<r>.done`` marker (or ``.rank<r>.failed`` with its error). Rank 0
waits, bounded, for every marker, then commits as above; the other ranks wait until the committed
directory appears, so each rank's save completes only once the whole checkpoint is durable. A
failure or timeout on any rank fails the save on every rank and removes the temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .errors import CommitError

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


def rank_and_world(rank_info: Any) -> tuple[int, int]:
    """(global rank, world size) of a torch RankInfo (or anything with those fields; None: 0, 1)."""
    rank = int(getattr(rank_info, "global_rank", 0) or 0)
    world = int(getattr(rank_info, "global_world_size", 1) or 1)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    return rank, world


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


def commit(temp_dir: Path, final_dir: Path, world_size: int = 1) -> None:
    """Record the commit, fsync and rename `temp_dir` to `final_dir` (which must not exist)."""
    root = final_dir.parent
    if final_dir.exists() or final_dir.is_symlink():
        raise FileExistsError(f"checkpoint {final_dir} already exists")
    sequence = max((seq for seq, _ in committed(root)), default=0) + 1
    record = temp_dir / COMMIT_RECORD
    record.write_text(
        json.dumps({"sequence": sequence, "time_ns": time.time_ns(), "name": final_dir.name, "world_size": world_size})
    )
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


Fill = Callable[[Path], "Iterable[Path] | None"]


def commit_directory(
    path: str | os.PathLike[str],
    fill: Fill,
    keep_last: int | None,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier_timeout: float = 600.0,
) -> Path:
    """Write a checkpoint with `fill(temp_dir)`, then commit it as `path`, update `latest`, and
    apply retention. Nothing is visible under the root until the rename; on any failure the
    temporary directory is removed and earlier checkpoints are untouched.

    `fill` returns the files it wrote (None: every file in the directory), which are fsynced.
    With world_size > 1, every rank calls this with the same `path` (see the module docstring).
    """
    final = Path(path)
    root = final.parent
    check_root(root)
    if world_size > 1:
        return _commit_shared(final, fill, keep_last, rank, world_size, barrier_timeout)
    temp = new_temp_dir(root, final.name)
    try:
        _fill_and_sync(temp, fill)
        commit(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _after_commit(root, final.name, keep_last)
    return final


def _fill_and_sync(temp: Path, fill: Fill) -> None:
    files = fill(temp)
    if files is None:
        files = [Path(e.path) for e in os.scandir(temp) if e.is_file(follow_symlinks=False)]
    for file in files:
        fsync_path(file)


def _after_commit(root: Path, name: str, keep_last: int | None) -> None:
    update_latest(root, name)
    if keep_last is not None:
        retain(root, keep_last, background=True)


def _marker(rank: int, outcome: str) -> str:
    return f".rank{rank}.{outcome}"


def _commit_shared(
    final: Path, fill: Fill, keep_last: int | None, rank: int, world_size: int, timeout: float
) -> Path:
    check_name(final.name)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    root = final.parent
    if final.exists() or final.is_symlink():
        raise FileExistsError(f"checkpoint {final} already exists")
    temp = root / f"{TMP_PREFIX}{final.name}"  # every rank derives the same name
    deadline = time.monotonic() + timeout
    with contextlib.suppress(FileExistsError):
        temp.mkdir(mode=0o755)
    try:
        _fill_and_sync(temp, fill)
        done = temp / _marker(rank, "done")
        done.touch(exist_ok=False)
        fsync_path(done)
        fsync_path(temp)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            (temp / _marker(rank, "failed")).write_text(f"{type(exc).__name__}: {exc}")
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    if rank != 0:
        _wait_for_commit(temp, final, deadline, timeout)
        return final
    try:
        _wait_for_ranks(temp, final.name, world_size, deadline, timeout)
        for r in range(world_size):
            (temp / _marker(r, "done")).unlink()
        commit(temp, final, world_size)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _after_commit(root, final.name, keep_last)
    return final


def _poll_delays() -> Iterable[float]:
    delay = 0.001
    while True:
        yield delay
        delay = min(delay * 2, 0.05)


def _wait_for_ranks(temp: Path, name: str, world_size: int, deadline: float, timeout: float) -> None:
    """Rank 0: wait until every rank has marked its files done; fail fast if one failed."""
    expected = {_marker(r, "done") for r in range(world_size)}
    for delay in _poll_delays():
        present = set(os.listdir(temp))
        failed = sorted(p for p in present if p.startswith(".rank") and p.endswith(".failed"))
        if failed:
            reason = (temp / failed[0]).read_text(errors="replace")
            raise CommitError(f"checkpoint {name}: {failed[0][1:-7]} failed to write its files: {reason}")
        missing = expected - present
        if not missing:
            return
        if time.monotonic() >= deadline:
            ranks = sorted(int(m[5:-5]) for m in missing)
            raise TimeoutError(f"checkpoint {name}: ranks {ranks} did not finish writing within {timeout:g} s")
        time.sleep(delay)


def _wait_for_commit(temp: Path, final: Path, deadline: float, timeout: float) -> None:
    """Ranks other than 0: wait until rank 0 has committed `final` (or abandoned it)."""
    record = final / COMMIT_RECORD
    for delay in _poll_delays():
        if record.exists():
            return
        if not temp.exists():
            if record.exists():
                return
            raise CommitError(f"checkpoint {final.name} was abandoned by rank 0 (it failed or timed out)")
        if time.monotonic() >= deadline:
            shutil.rmtree(temp, ignore_errors=True)
            raise TimeoutError(f"checkpoint {final.name}: rank 0 did not commit it within {timeout:g} s")
        time.sleep(delay)
