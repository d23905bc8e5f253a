"""Atomic commit of checkpoint directories under a root, `latest`, retention and leftovers.

Protocol: a checkpoint is written into ``root/.tmp-<name>-<random>``; its files and the directory
are fsynced, then it is renamed to ``root/<name>`` and the root is fsynced. So, under a root,
every entry whose name does not start with "." is a complete, committed checkpoint. ``latest``
is a symbolic link to the newest one, replaced atomically after the commit. Retention removes the
oldest checkpoints (by commit sequence) only after a newer one is committed.

Several ranks (world_size > 1, on a filesystem they share) write one checkpoint directory
together. Each save is an *attempt* with an id every rank agrees on (a session id shared at start
plus the save's sequence number), so nothing left by another attempt is ever mistaken for this
one's. Every rank writes its files into ``root/.tmp-<name>-<attempt>``, fsyncs them and the
directory, then creates ``.rank<r>.done``. Rank 0 waits (bounded) for every marker, claims them
by unlinking each one, and commits as above. A rank that gives up waiting withdraws its marker by
renaming it: whichever of the claim and the withdrawal comes first decides, atomically, whether
the attempt can still be committed. Any rank that fails or gives up writes a tombstone
``root/.failed-<name>-<attempt>`` with its reason: every other rank stops at once with that
reason, and nothing is committed. The other ranks return once the committed checkpoint's record
names their attempt. A rank whose processes are all gone (killed, or its node lost) stops its
heartbeat (`liveness`): rank 0 gives the attempt up once a rank it waits for is gone, and the
others once rank 0 is, within the heartbeat timeout rather than the barrier timeout.
Only rank 0 removes temporaries: a dead attempt's files once a later attempt is committed (every
rank has finished with the earlier one by then), and everything left when a root is opened.
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

from ..errors import CommitError, CommitTimeoutError, ConfigError, from_os_error, os_error
from . import liveness, progress

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
        with temp.open("xb") as file:
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
    """Raise a clear error unless `root` is an existing, writable directory."""
    if not root.exists():
        raise os_error(errno.ENOENT, f"checkpoint root {root} does not exist", str(root))
    if not root.is_dir():
        raise os_error(errno.ENOTDIR, f"checkpoint root {root} is not a directory", str(root))
    if not os.access(root, os.W_OK | os.X_OK):
        raise os_error(errno.EACCES, f"checkpoint root {root} is not writable", str(root))


def check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or name in (LATEST, ".", ".."):
        raise ConfigError(
            f"invalid checkpoint name {name!r}: it must not start with '.', contain '/' or be {LATEST!r}"
        )


def new_temp_dir(root: Path, name: str) -> Path:
    check_name(name)
    path = root / f"{TMP_PREFIX}{name}-{secrets.token_hex(8)}"
    path.mkdir(mode=0o755)
    return path


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
    complete checkpoint) and the old one is deleted in the background. Where the filesystem
    cannot exchange, the old one is renamed aside first (``.replaced-<name>-*``): a crash
    between the two renames leaves the name empty, and `clean_leftovers` puts the old one back.
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
    record.write_text(json.dumps(fields))
    fsync_path(record)
    fsync_path(temp_dir)
    if not exists:
        temp_dir.rename(final_dir)
    elif _exchange(temp_dir, final_dir):
        _delete(temp_dir, background=True)  # it now holds the replaced checkpoint
    else:
        aside = root / f"{REPLACED_PREFIX}{final_dir.name}-{secrets.token_hex(8)}"
        final_dir.rename(aside)
        try:
            temp_dir.rename(final_dir)
        except BaseException:
            aside.rename(final_dir)
            raise
        _delete(aside, background=True)
    fsync_path(root)
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
    thread = threading.Thread(
        target=shutil.rmtree, args=(directory, True), name="pyshmckpt-trash", daemon=True
    )
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
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _being_written(directory: Path) -> bool:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
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
    renamed aside while being replaced goes back to its name if nothing took it."""
    removed = []
    for entry in os.scandir(root):
        path = Path(entry.path)
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
        if entry.name.startswith(
            (TMP_PREFIX, TRASH_PREFIX, FAILED_PREFIX, REPLACED_PREFIX, f".{LATEST}-")
        ):
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


_STALE_HEARTBEAT = 600.0


def _untouched_for(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


Fill = Callable[[Path], "Iterable[Path] | None"]


def commit_directory(
    path: str | os.PathLike[str],
    fill: Fill,
    keep_last: int | None,
    *,
    rank: int = 0,
    world_size: int = 1,
    attempt: str | None = None,
    barrier_timeout: float = 600.0,
    replace: bool = False,
    link_latest: bool = True,
) -> Path:
    """Write a checkpoint with `fill(temp_dir)`, then commit it as `path`, update `latest`
    (unless `link_latest` is False), and apply retention. Nothing is visible under the root
    until the rename; on any failure the temporary directory is removed and earlier
    checkpoints are untouched.

    `fill` returns the files it wrote (None: every file in the directory), which are fsynced.
    With `replace`, a committed checkpoint at `path` is replaced atomically (see `commit`).
    With world_size > 1, every rank calls this with the same `path` and `attempt` (see the module
    docstring); `attempt` must be unique to this save among all saves into the root.
    """
    final = Path(path)
    root = final.parent
    check_root(root)
    if world_size > 1:
        if not attempt or not isinstance(attempt, str) or "/" in attempt or "-" in attempt:
            raise ConfigError(
                f"a multi-rank save needs an attempt id without '-' or '/', not {attempt!r}"
            )
        shared = _SharedCommit(final, rank, world_size, attempt, barrier_timeout, replace)
        return shared.run(fill, keep_last, link_latest)
    if replace and (final.exists() or final.is_symlink()):
        check_replaceable(final)  # before writing anything
    temp = new_temp_dir(root, final.name)
    try:
        with in_use(temp):
            _fill_and_sync(temp, fill)
            commit(temp, final, replace=replace)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    if link_latest:
        update_latest(root, final.name)
    if keep_last is not None:
        retain(root, keep_last, background=True)
    return final


def _fill_and_sync(temp: Path, fill: Fill) -> None:
    files = fill(temp)
    if files is None:
        files = [Path(e.path) for e in os.scandir(temp) if e.is_file(follow_symlinks=False)]
    for file in files:
        fsync_path(file)


def run_of(attempt: str) -> str:
    """The run an attempt id (``<run>.<number>``) belongs to."""
    return attempt.rpartition(".")[0] or attempt


def abandon(root: Path, name: str, attempt: str, rank: int, world_size: int, reason: str) -> None:
    """Give a multi-rank attempt up for every rank, from outside the writer (this rank's writer
    died or was stopped with the attempt pending): the others stop at once with `reason`."""
    with contextlib.suppress(OSError, CommitError, ConfigError):
        _SharedCommit(root / name, rank, world_size, attempt, 0.0, False)._bury(reason)


def _poll_delays() -> Iterable[float]:
    delay = 0.001
    while True:
        yield delay
        delay = min(delay * 2, 0.05)


class _SharedCommit:
    """One rank's part in one attempt of a multi-rank commit (see the module docstring)."""

    def __init__(
        self, final: Path, rank: int, world_size: int, attempt: str, timeout: float, replace: bool
    ) -> None:
        check_name(final.name)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size}")
        self.final, self.root, self.name = final, final.parent, final.name
        self.rank, self.world_size, self.attempt, self.timeout = rank, world_size, attempt, timeout
        self.replace = replace
        self.temp = self.root / f"{TMP_PREFIX}{final.name}-{attempt}"
        self.tomb = self.root / f"{FAILED_PREFIX}{final.name}-{attempt}"
        self.done = self.temp / f".rank{rank}.done"
        self.run_id = run_of(attempt)
        self.watch = liveness.Watch(self.root, self.run_id)

    def run(self, fill: Fill, keep_last: int | None, link_latest: bool = True) -> Path:
        # Beating while this rank takes part: the others see it alive even once its trainer died.
        with liveness.beating(liveness.beat_path(self.root, self.run_id, self.rank)):
            return self._run(fill, keep_last, link_latest)

    def _run(self, fill: Fill, keep_last: int | None, link_latest: bool) -> Path:
        if self.final.exists() or self.final.is_symlink():
            if not self.replace:
                raise os_error(
                    errno.EEXIST, f"checkpoint {self.final} already exists", str(self.final)
                )
            check_replaceable(self.final)
        self._check_tomb()  # another rank already gave this attempt up: do not write
        # The other ranks wait a little longer than rank 0, so rank 0's verdict normally lands first.
        deadline = time.monotonic() + (self.timeout if self.rank == 0 else self.timeout * 1.1 + 1.0)
        with contextlib.ExitStack() as lock:
            try:
                self.temp.mkdir(mode=0o755, exist_ok=True)
                lock.enter_context(in_use(self.temp))
                _fill_and_sync(self.temp, fill)
                self._mark_done()
            except BaseException as exc:
                self._bury(
                    f"rank {self.rank} failed to write its files: {type(exc).__name__}: {exc}"
                )
                raise
            return self._finish(deadline, keep_last, link_latest)

    def _finish(self, deadline: float, keep_last: int | None, link_latest: bool) -> Path:
        if self.rank != 0:
            self._wait_for_commit(deadline)
            return self.final
        try:
            self._wait_for_ranks(deadline)
            self._claim()
            commit(
                self.temp, self.final, self.world_size, replace=self.replace, attempt=self.attempt
            )
        except CommitError:
            shutil.rmtree(self.temp, ignore_errors=True)
            raise
        except BaseException as exc:
            self._bury(f"rank 0 could not commit: {type(exc).__name__}: {exc}")
            raise
        if link_latest:
            update_latest(self.root, self.name)
        self._remove_dead_attempts()
        if keep_last is not None:
            retain(self.root, keep_last, background=True)
        return self.final

    def _mark_done(self) -> None:
        """Make this rank's file names durable, then say so. The marker is created through a
        descriptor of the directory, so rank 0 may claim and rename it at any moment after."""
        dfd = os.open(self.temp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
            os.close(
                os.open(self.done.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            )
        finally:
            os.close(dfd)

    def _bury(self, reason: str) -> None:
        """Give the attempt up for every rank. The tombstone appears with its reason in one step
        (a hard link of a written file), and the first one stays; where even that cannot be
        written (a full disk), an empty tombstone still stops every rank. Rank 0 removes the
        temporary directory first, which also frees the space the reason needs on a full disk."""
        logger.warning("giving up checkpoint %s (attempt %s): %s", self.name, self.attempt, reason)
        if self.rank == 0:
            shutil.rmtree(self.temp, ignore_errors=True)
        staged = self.root / f"{FAILED_PREFIX}{self.name}-{self.attempt}.rank{self.rank}"
        try:
            staged.write_text(reason)
            os.link(staged, self.tomb)
        except FileExistsError:
            pass
        except OSError:
            with contextlib.suppress(OSError):
                os.close(os.open(self.tomb, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        finally:
            with contextlib.suppress(OSError):
                staged.unlink()

    def _check_tomb(self) -> None:
        try:
            reason = self.tomb.read_text(errors="replace")
        except FileNotFoundError:
            return
        reason = (
            reason or "another rank gave up (its reason could not be written: is the disk full?)"
        )
        if self.rank == 0:
            shutil.rmtree(self.temp, ignore_errors=True)
        raise CommitError(f"checkpoint {self.name} was abandoned: {reason}")

    def _wait_for_ranks(self, deadline: float) -> None:
        expected = {f".rank{r}.done" for r in range(self.world_size)}
        for delay in _poll_delays():
            self._check_tomb()
            missing = expected - {p.name for p in self.temp.iterdir()}
            if not missing:
                return
            ranks = sorted(int(m[5:-5]) for m in missing)
            gone = self.watch.gone(ranks)
            if gone:
                reason = "; ".join(self.watch.describe(r) for r in gone)
                self._bury(f"{reason}: ranks {gone} are gone")
                raise CommitError(
                    f"checkpoint {self.name} was abandoned: ranks {gone} are gone before writing "
                    f"their files ({reason} for {self.watch.timeout:g} s)"
                )
            progress.advance()  # waiting for ranks that live is no stall
            if time.monotonic() >= deadline:
                self._bury(
                    f"rank 0 waited {self.timeout:g} s for ranks {ranks} to write their files"
                )
                raise CommitTimeoutError(
                    f"checkpoint {self.name}: ranks {ranks} did not finish writing within {self.timeout:g} s"
                )
            time.sleep(delay)

    def _claim(self) -> None:
        """Unlink every rank's marker; a marker already withdrawn means that rank gave up."""
        for r in range(self.world_size):
            try:
                (self.temp / f".rank{r}.done").unlink()
            except FileNotFoundError:
                self._bury(f"rank {r} gave up waiting before rank 0 could commit")
                self._check_tomb()

    def _wait_for_commit(self, deadline: float) -> None:
        claimed = False
        for delay in _poll_delays():
            if self._committed():
                return
            self._check_tomb()
            if self.watch.gone([0]):
                self._give_up_on_rank0(claimed)
            progress.advance()  # waiting for a rank 0 that lives is no stall
            if time.monotonic() >= deadline:
                if claimed:
                    raise CommitTimeoutError(
                        f"checkpoint {self.name}: rank 0 claimed it but did not commit it in time"
                    )
                try:
                    self.done.rename(self.temp / f".rank{self.rank}.withdrawn")
                except FileNotFoundError:
                    claimed = True  # rank 0 claimed this rank's files: give it time to commit
                    deadline = time.monotonic() + self.timeout
                    continue
                self._bury(f"rank {self.rank} waited {self.timeout:g} s for rank 0 to commit")
                raise CommitTimeoutError(
                    f"checkpoint {self.name}: rank 0 did not commit it within {self.timeout:g} s"
                )
            time.sleep(delay)

    def _give_up_on_rank0(self, claimed: bool) -> None:
        """Rank 0's processes are gone: withdraw this rank's files and raise (unless rank 0 claimed
        them and then committed after all)."""
        reason = self.watch.describe(0)
        if not claimed:
            try:
                self.done.rename(self.temp / f".rank{self.rank}.withdrawn")
            except FileNotFoundError:
                claimed = True
        if claimed and self._committed():
            return
        self._bury(f"{reason}: rank 0 is gone")
        raise CommitError(
            f"checkpoint {self.name} was abandoned: rank 0 is gone ({reason} for "
            f"{self.watch.timeout:g} s)"
        )

    def _committed(self) -> bool:
        """Rank 0 committed this attempt (not an earlier checkpoint of the same name)."""
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            record = json.loads((self.final / COMMIT_RECORD).read_text())
            return bool(record.get("attempt") == self.attempt)
        return False

    def _remove_dead_attempts(self) -> None:
        """Every rank has finished with this session's earlier attempts (each rank saves in
        order, and all of them took part in this one): remove their temporaries and tombstones."""
        session, _, number = self.attempt.rpartition(".")
        for entry in os.scandir(self.root):
            if not entry.name.startswith((TMP_PREFIX, FAILED_PREFIX)):
                continue
            other = entry.name.rpartition("-")[2]
            other_session, _, other_number = other.rpartition(".")
            if (
                other_session == session
                and other_number.isdigit()
                and number.isdigit()
                and int(other_number) < int(number)
            ):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        Path(entry.path).unlink()
