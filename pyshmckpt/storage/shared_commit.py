"""A checkpoint directory written by several ranks together (world_size > 1, on a filesystem they
share), committed once by rank 0 with `commit`'s steps.

Each save is an *attempt* with an id every rank agrees on, ``<run>.<number>``: the run's secret id,
shared at start and never written to disk, and the save's sequence number. Nothing left by another
attempt is ever mistaken for this one's, and no one without the secret can predict this one's
names (`run_names`): the root shows ``<number>.<tag>`` where it names an attempt, and
``commit.json`` the run's public label and the number. Every rank writes its files into
``root/.tmp-<name>-<number>.<tag>`` (made by the first rank there, joined by the others only when
it is a directory of this user that others cannot write: `entries`), fsyncs them and the
directory, then creates ``.rank<r>.done``. Rank 0 waits (bounded) for every marker, claims them by
unlinking each one, and commits it as a single rank does (`commit.commit`). A rank that gives up
waiting withdraws its marker by renaming it: whichever of the claim and the withdrawal comes first
decides, atomically, whether the attempt can still be committed. Any rank that fails or gives up
writes a tombstone ``root/.failed-<name>-<number>.<tag>`` with its reason: every other rank stops
at once with that reason, and nothing is committed. The other ranks return once the committed
checkpoint's record names their attempt. A rank whose processes are all gone (killed, or its node
lost) stops its heartbeat (`liveness`): rank 0 gives the attempt up once a rank it waits for is
gone, and the others once rank 0 is, within the heartbeat timeout rather than the barrier timeout.
Only rank 0 removes temporaries, and only its own user's: a dead attempt's files once a later
attempt is committed (every rank has finished with the earlier one by then), and everything left
when a root is opened.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from ..errors import CommitError, CommitTimeoutError, ConfigError, os_error
from . import entries, liveness, progress, run_names
from .commit import (
    COMMIT_RECORD,
    FAILED_PREFIX,
    TMP_PREFIX,
    Fill,
    check_name,
    check_replaceable,
    commit,
    fill_and_sync,
    in_use,
    retain,
    update_latest,
)

logger = logging.getLogger(__name__)


def run_of(attempt: str) -> str:
    """The run an attempt id (``<run>.<number>``) belongs to."""
    return attempt.rpartition(".")[0] or attempt


def public_attempt(attempt: str) -> str:
    """How the root names an attempt (``commit.json``, logs): the run's public label and the
    save's number, never the run's secret."""
    return f"{run_names.label(run_of(attempt))}.{number_of(attempt)}"


def number_of(attempt: str) -> str:
    """The save's number in an attempt id (``<run>.<number>``)."""
    run, _, number = attempt.rpartition(".")
    return number if run else ""


_TOMB_LIMIT = 64 << 10  # bytes of a tombstone's reason read back


def abandon(root: Path, name: str, attempt: str, rank: int, world_size: int, reason: str) -> None:
    """Give a multi-rank attempt up for every rank, from outside the writer (this rank's writer
    died or was stopped with the attempt pending): the others stop at once with `reason`."""
    with contextlib.suppress(OSError, CommitError, ConfigError):
        SharedCommit(root / name, rank, world_size, attempt, 0.0, False)._bury(reason)


def _poll_delays() -> Iterable[float]:
    delay = 0.001
    while True:
        yield delay
        delay = min(delay * 2, 0.05)


class SharedCommit:
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
        self.run_id, self.number = run_of(attempt), number_of(attempt)
        self.public = public_attempt(attempt)
        self.temp = self.root / f"{TMP_PREFIX}{final.name}-{self._suffix('tmp', self.number)}"
        self.tomb = self.root / f"{FAILED_PREFIX}{final.name}-{self._suffix('failed', self.number)}"
        self.done = self.temp / f".rank{rank}.done"
        self.watch = liveness.Watch(self.root, self.run_id)

    def _suffix(self, kind: str, number: str) -> str:
        """The name part of this run's `kind` of entry for attempt `number`."""
        return f"{number}.{run_names.tag(self.run_id, kind, number)}"

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
                entries.make_or_join_directory(self.temp)
                lock.enter_context(in_use(self.temp))
                fill_and_sync(self.temp, fill)
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
                self.temp, self.final, self.world_size, replace=self.replace, attempt=self.public
            )
        except CommitError:
            self._remove_temp()
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

    def _remove_temp(self) -> None:
        """Remove this attempt's temporary directory, unless what has its name is not ours."""
        if entries.is_own(self.temp):
            shutil.rmtree(self.temp, ignore_errors=True)

    def _mark_done(self) -> None:
        """Make this rank's file names durable, then say so. The marker is created through a
        descriptor of the directory, so rank 0 may claim and rename it at any moment after."""
        dfd = os.open(self.temp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
            os.close(entries.create_file(self.done.name, dir_fd=dfd))
        finally:
            os.close(dfd)

    def _bury(self, reason: str) -> None:
        """Give the attempt up for every rank. The tombstone appears with its reason in one step
        (a hard link of a written file), and the first one stays; where even that cannot be
        written (a full disk), an empty tombstone still stops every rank. Rank 0 removes the
        temporary directory first, which also frees the space the reason needs on a full disk."""
        logger.warning("giving up checkpoint %s (attempt %s): %s", self.name, self.public, reason)
        if self.rank == 0:
            self._remove_temp()
        # A name of its own: the tombstone's is not shown before it exists.
        staged = self.root / f"{FAILED_PREFIX}{self.name}-{self.number}.{secrets.token_hex(16)}"
        try:
            with entries.open_new_file(staged) as file:
                file.write(reason.encode(errors="replace"))
            os.link(staged, self.tomb)
        except FileExistsError:
            pass
        except OSError:
            with contextlib.suppress(OSError):
                os.close(entries.create_file(self.tomb))
        finally:
            with contextlib.suppress(OSError):
                staged.unlink()

    def _check_tomb(self) -> None:
        try:
            reason = entries.read_own_file(self.tomb, _TOMB_LIMIT).decode(errors="replace")
        except FileNotFoundError:
            return
        reason = (
            reason or "another rank gave up (its reason could not be written: is the disk full?)"
        )
        if self.rank == 0:
            self._remove_temp()
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
            return bool(record.get("attempt") == self.public)
        return False

    def _remove_dead_attempts(self) -> None:
        """Every rank has finished with this run's earlier attempts (each rank saves in order,
        and all of them took part in this one): remove their temporaries and tombstones, known
        by the names only this run can make."""
        if not self.number.isdigit():
            return
        for entry in os.scandir(self.root):
            if entry.name.startswith(TMP_PREFIX):
                kind = "tmp"
            elif entry.name.startswith(FAILED_PREFIX):
                kind = "failed"
            else:
                continue
            other = entry.name.rpartition("-")[2]
            other_number = other.partition(".")[0]
            if (
                other_number.isdigit()
                and int(other_number) < int(self.number)
                and other == self._suffix(kind, other_number)
                and entries.is_own(Path(entry.path))
            ):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        Path(entry.path).unlink()
