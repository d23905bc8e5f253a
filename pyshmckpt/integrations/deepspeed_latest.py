"""DeepSpeed's ``latest`` file, published by the writer processes (see `ShmCheckpointEngine`).

`TagWriter` is what each rank's writer process builds: it writes DeepSpeed's files through the
engine's writer and remembers which were written durably. When a tag's save has handed over all
of this rank's files, the trainer asks its writer to `seal` the tag; being a request in order
with the writes, it runs once they are done, even when the trainer died or exited meanwhile.
Sealing writes a marker into the tag directory (``.pyshmckpt-<label>-rank<r>.durable``, or
``.failed``: the run's public label, as the run id is the secret its heartbeats' names derive
from); rank 0's writer waits for every rank's marker (bounded) and, when all say durable,
replaces ``latest`` atomically with the tag's name and removes the markers. The ranks' trainers
never write ``latest`` (one publisher, which outlives them), and it never names a tag of which a
file is not durable. Each rank's trainer and writer beat in the save directory
(`storage.liveness`; the writer from its first file there until it closes, so an orphaned writer
still finishing counts as alive): a rank whose processes are all gone is not waited for, and
``latest`` stays, within the heartbeat timeout.

With a mirror (object storage), each rank's writer then uploads its files of a tag it sealed
durable (rank 0: of a tag it published) in the background, from the files, and the ranks
commit the tag in the mirror as one checkpoint of those files (`storage.mirror`: they meet in
the bucket, rank 0 writes its commit record with every file's size and CRC32C, then the
mirror's ``latest``); a rank whose files are not durable gives the tag up there at once.

This module runs in the writer process and does not import DeepSpeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import from_os_error
from ..storage import commit, liveness, mirror, object_commit, object_store, run_names
from ..storage.object_store import ObjectPath

logger = logging.getLogger(__name__)

LATEST = "latest"  # DeepSpeed's file naming the newest tag of a save directory
_POLL = 0.01  # seconds between looks for the other ranks' markers


def marker(save_dir: str, tag: str, run: str, rank: int, durable: bool) -> Path:
    """Where rank `rank` of run `run` says whether its files of `tag` are durable."""
    state = "durable" if durable else "failed"
    return Path(save_dir) / tag / f".pyshmckpt-{run_names.label(run)}-rank{rank}.{state}"


def write_marker(path: Path) -> None:
    """An empty marker, durable before anyone can see it."""
    try:
        commit.write_file(path, lambda file: None, f"{path.name}.tmp-")
    except OSError as exc:
        raise from_os_error(exc, f"writing {path}") from exc


def write_latest(save_dir: Path, tag: str) -> None:
    """DeepSpeed's ``latest`` file (the tag's name), replaced atomically and durably."""
    try:
        commit.write_file(
            save_dir / LATEST, lambda file: file.write(tag.encode()), f".{LATEST}.tmp-"
        )
    except OSError as exc:
        raise from_os_error(exc, f"writing {save_dir / LATEST}") from exc


class TagWriter:
    """The writer process's side of one rank's DeepSpeed checkpoints (see the module docstring).

    Args:
        rank_info: the rank and world size (torch's RankInfo).
        writer: the writer class each file is written with (``TorchFileWriter`` or another
            taking ``rank_info=``).
        run: the secret id the ranks of one engine share (markers of other runs are ignored;
            see `storage.run_names`).
        commit_timeout: seconds rank 0's writer waits for the other ranks' markers (and, in the
            mirror, for their uploads).
        mirror: the object storage root (``s3://...``) sealed tags are mirrored to (None: none).
    """

    def __init__(
        self,
        rank_info: Any,
        *,
        writer: Callable[..., Any],
        run: str,
        commit_timeout: float,
        mirror: str | None = None,
    ) -> None:
        self.rank, self.world_size = commit.rank_and_world(rank_info)
        self.writer = writer(rank_info=rank_info)
        self.run = run
        self.commit_timeout = float(commit_timeout)
        self.mirror = object_store.parse(mirror) if mirror else None
        self._durable: set[str] = set()  # paths whose last write succeeded
        self._heartbeats: dict[Path, liveness.Heartbeat] = {}

    def _beat_in(self, save_dir: Path) -> None:
        if self.world_size == 1:
            return
        path = liveness.beat_path(save_dir, self.run, self.rank)
        if path not in self._heartbeats and save_dir.is_dir():
            self._heartbeats[path] = liveness.Heartbeat(path)

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        self._beat_in(Path(path).parent.parent)  # DeepSpeed's save_dir/tag/file
        self._durable.discard(path)
        self.writer.write(path=path, state_dict=state_dict, **kwargs)
        self._durable.add(path)

    def seal(self, save_dir: str, tag: str, paths: list[str], attempt: str | None = None) -> bool:
        """This rank handed over `paths` for `tag`, all written before this runs: say whether
        they are durable; rank 0 then publishes ``latest`` once every rank says so. Returns
        whether it was published (rank 0) or this rank's files are durable (the others). With a
        mirror, the tag is then mirrored as `attempt` (the same on every rank)."""
        done = self._seal(save_dir, tag, paths)
        if self.mirror is not None:
            self._mirror(self.mirror, Path(save_dir) / tag, paths, attempt, done)
        return done

    def _mirror(
        self, root: ObjectPath, directory: Path, paths: list[str], attempt: str | None, ok: bool
    ) -> None:
        """Queue this rank's files of the tag in `directory` for the mirror `root`, or (not
        `ok`) give the tag up there for every rank."""
        target = root / directory.name
        if not ok:
            if self.world_size > 1 and attempt:
                object_commit.abandon(
                    str(root), directory.name, attempt, self.rank, self.world_size,
                    f"rank {self.rank}'s files of {directory.name!r} are not durable",
                )  # fmt: skip
            return
        files = tuple(Path(p).name for p in paths if Path(p).parent == directory)
        elsewhere = [p for p in paths if Path(p).parent != directory]
        if elsewhere:  # a tag's files are all directly in its directory, as DeepSpeed saves them
            logger.warning(
                "not mirroring %s: outside the directory of tag %r", elsewhere, target.name
            )
        mirror.MIRROR.put(
            directory, target, files=files, checksums=True, keep_last=None, rank=self.rank,
            world_size=self.world_size, attempt=attempt, barrier_timeout=self.commit_timeout,
            replace=True,
        )  # fmt: skip

    def _seal(self, save_dir: str, tag: str, paths: list[str]) -> bool:
        durable = all(path in self._durable for path in paths)
        if self.world_size == 1:
            if durable:
                write_latest(Path(save_dir), tag)
            return durable
        self._beat_in(Path(save_dir))
        write_marker(marker(save_dir, tag, self.run, self.rank, durable))
        if self.rank != 0:
            return durable
        published = durable and self._all_durable(save_dir, tag)
        if published:
            write_latest(Path(save_dir), tag)
            logger.debug("latest of %s names %s", save_dir, tag)
        for rank in range(self.world_size):
            for state in (True, False):
                marker(save_dir, tag, self.run, rank, state).unlink(missing_ok=True)
        return published

    def _all_durable(self, save_dir: str, tag: str) -> bool:
        """Wait (bounded by commit_timeout) until every rank said its files of `tag` are durable;
        False as soon as one says they are not, or when the time is up."""
        deadline = time.monotonic() + self.commit_timeout
        waiting = set(range(1, self.world_size))
        watch = liveness.Watch(Path(save_dir), self.run)
        while waiting:
            for rank in list(waiting):
                if marker(save_dir, tag, self.run, rank, False).exists():
                    logger.warning("checkpoint %r failed on rank %d: `latest` stays", tag, rank)
                    return False
                if marker(save_dir, tag, self.run, rank, True).exists():
                    waiting.discard(rank)
            gone = watch.gone(sorted(waiting))
            if gone:
                logger.warning(
                    "ranks %s are gone before finishing checkpoint %r (%s): `latest` stays",
                    gone, tag, "; ".join(watch.describe(r) for r in gone),
                )  # fmt: skip
                return False
            if waiting and time.monotonic() > deadline:
                logger.warning(
                    "ranks %s did not finish checkpoint %r within %g s: `latest` stays",
                    sorted(waiting), tag, self.commit_timeout,
                )  # fmt: skip
                return False
            if waiting:
                time.sleep(_POLL)
        return True

    def close(self) -> None:
        if self.mirror is not None and not mirror.drain(mirror.DRAIN_TIMEOUT):
            logger.warning("tags were still being mirrored after %g s", mirror.DRAIN_TIMEOUT)
        for heartbeat in self._heartbeats.values():
            heartbeat.stop(remove=True)
        close = getattr(self.writer, "close", None)
        if callable(close):
            close()
