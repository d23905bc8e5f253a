"""DeepSpeed: `ShmCheckpointEngine`, a checkpoint engine whose saves return once staged.

Switch it on right after ``deepspeed.initialize``, on every rank::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    use_pyshmckpt(engine)
    ...
    engine.save_checkpoint(save_dir)  # returns once the state is staged in shared memory
    ...
    engine.destroy()  # finishes pending writes; `latest` names the last durable tag

DeepSpeed chooses its checkpoint engine from its configuration and has no entry for other
engines; assigning ``engine.checkpoint_engine`` (what `use_pyshmckpt` does) is the way in.

Each file DeepSpeed saves (``mp_rank_00_model_states.pt``, ``zero_pp_rank_*_optim_states.pt``,
...) is copied into a shared-memory slot and written by pyshmckpt's writer process at exactly
DeepSpeed's path, with ``torch.save``, atomically (a temporary file, fsync, rename, fsync of the
directory). DeepSpeed's own loader, its ``zero_to_fp32.py`` and ``torch.load(path,
weights_only=False)`` read the files as they read ``TorchCheckpointEngine``'s; loading and
everything else (file names, tags, what each rank saves, ``zero_to_fp32.py``) stay DeepSpeed's.

``latest``: DeepSpeed writes it itself, right after ``commit()`` returns. A plain engine's
commit() runs inside ``save_checkpoint``, so it would have to wait there for the whole write.
This engine is therefore a *decoupled* one, like DeepSpeed's own ``DecoupledCheckpointEngine``:
``save_checkpoint`` returns without committing, and at each optimizer step DeepSpeed asks
``get_commit_info()`` whether a tag is ready to commit. The answer is yes only once every rank's
files of the tag are durable (the ranks agree with one small all-reduce over a gloo group of this
engine's own, only while a tag is pending), so ``commit()`` never waits for a write, no training
step is blocked by one, and ``latest`` never names a tag of which a file is not durable. If a
write of the tag failed (disk full, the writer killed), ``commit()`` raises `CommitError` on
every rank at the same step and ``latest`` keeps naming the previous tag; the next save starts a
new writer process. ``close()`` (``engine.destroy()`` calls it) finishes the pending writes and
points ``latest`` at the newest durable tag.

Limits: a checkpoint staged before the trainer dies is still written by the writer process (see
``CheckpointProcessConfig.on_trainer_death``), but only a living trainer moves ``latest``: load
such a tag by name. DeepSpeed finds a tag's model files by listing its directory, and a file
appears there once durable: before ``engine.load_checkpoint`` of a tag this process has just
saved, call ``wait()``. DeepSpeed tells a checkpoint engine nothing when ``save_checkpoint``
raises half-way: a program that catches that and trains on should not rely on ``latest`` naming
a complete tag.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import secrets
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from ..errors import ClosedError, CommitError, CommitTimeoutError, ConfigError
from ..storage import TorchFileWriter, commit
from ..transport import CheckpointProcess, CheckpointProcessConfig, RankInfo, no_init

logger = logging.getLogger(__name__)

# What a rank says of a tag; across ranks the largest value wins.
_DURABLE, _FAILED, _PENDING = 0, 1, 2
_LATEST = "latest"  # DeepSpeed's file naming the newest tag of a save directory


@dataclasses.dataclass
class _Tag:
    """One save_checkpoint call: its commit info and this rank's writes."""

    info: Any  # DeepSpeed's CheckpointCommitInfo (tag, save_dir, save_latest)
    writes: list[tuple[str, Future[None]]] = dataclasses.field(default_factory=list)

    def status(self) -> int:
        if not all(future.done() for _, future in self.writes):
            return _PENDING
        return _FAILED if self.failures() else _DURABLE

    def failures(self) -> list[tuple[str, BaseException]]:
        return [
            (path, exc)
            for path, future in self.writes
            if future.done() and (exc := future.exception()) is not None
        ]


class ShmCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # DeepSpeed is untyped
    """A DeepSpeed ``CheckpointEngine`` that stages each file in shared memory and returns; a
    writer process writes it durably at DeepSpeed's path (see the module docstring).

    Construct it on every rank (with several ranks it creates a gloo process group, a collective
    call), or use `use_pyshmckpt`.

    Args:
        config_params: DeepSpeed's configuration (accepted as DeepSpeed's engines do; unused).
        config: the writer process's settings (`CheckpointProcessConfig`: slots and their size,
            write timeout, restarts after a writer died, what happens to staged writes when the
            trainer dies). Two slots hold one tag's two files per rank (model and ZeRO states).
        commit_timeout: seconds ``commit()`` of a tag (when DeepSpeed commits one directly),
            ``load()`` of a file being written, and the ranks' agreement may wait.
        writer: the writer built in the writer process for each file (`TorchFileWriter`, or a
            `StateDictWriter` class taking ``rank_info=``).
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        config: CheckpointProcessConfig | Any = None,
        commit_timeout: float = 300.0,
        writer: Callable[..., Any] = TorchFileWriter,
    ) -> None:
        super().__init__(config_params)
        self.name = "ShmCheckpointEngine"
        self._closed = True
        if (
            isinstance(commit_timeout, bool)
            or not isinstance(commit_timeout, (int, float))
            or commit_timeout <= 0
        ):
            raise ConfigError(f"commit_timeout must be a positive number, not {commit_timeout!r}")
        self.commit_timeout = float(commit_timeout)
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        # The ranks' agreement on which tags are durable never meets training's collectives.
        self._group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=self.commit_timeout))
            if self.world_size > 1
            else None
        )
        try:
            #: The writer process (``pid``, ``last_write_seconds``), restarted after it died.
            self.checkpoint_process = CheckpointProcess(
                RankInfo(self.rank, self.world_size), config or CheckpointProcessConfig(),
                no_init, (), writer, {},
            )  # fmt: skip
        except BaseException:
            self._destroy_group()
            raise
        self._tags: list[_Tag] = []  # created and not yet committed, oldest first
        self._writes: dict[str, Future[None]] = {}  # the last write of each path
        self._settled: tuple[Any, list[_Tag], list[int]] | None = None  # get_commit_info's
        self._closed = False

    # -- DeepSpeed's CheckpointEngine ---------------------------------------------------------

    def create(self, info: Any) -> None:
        """A save of tag ``info.tag`` begins (DeepSpeed calls this on every rank)."""
        self._check_open()
        self._tags.append(_Tag(info))

    def save(self, state_dict: Any, path: str) -> None:
        """Stage `state_dict` and hand its write to the writer process; returns once staged.

        A write that fails (here or in the writer) fails the commit of its tag on every rank.
        """
        self._check_open()
        path = _absolute(path)
        try:
            future = self.checkpoint_process.write(state_dict, path)
        except BaseException as exc:  # the tag must not commit without this file
            future = Future()
            future.set_exception(exc)
            self._record(path, future)
            raise
        self._record(path, future)

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load`` of `path` (as DeepSpeed's TorchCheckpointEngine loads), after this
        engine's pending write of `path`, if any, is durable (bounded by commit_timeout)."""
        pending = self._writes.get(_absolute(path))
        if pending is not None:
            done, _ = concurrent.futures.wait([pending], timeout=self.commit_timeout)
            if not done:
                raise CommitTimeoutError(
                    f"{path} was still being written after {self.commit_timeout:g} s"
                )
            exc = pending.exception()
            if exc is not None:
                raise CommitError(f"{path} could not be loaded: its write failed: {exc}") from exc
        return torch.load(path, map_location=map_location, weights_only=False)

    def is_decoupled(self) -> bool:
        """True: DeepSpeed commits at a later optimizer step (see `get_commit_info`)."""
        return True

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed need not clone tensors before save(). Staging copies each tensor
        anyway, and only the bytes a tensor reaches, never the rest of a storage it views."""
        return False

    def get_commit_info(self) -> Any:
        """The tag DeepSpeed should commit now, or None to go on training.

        DeepSpeed calls this at every optimizer step on every rank. While tags are pending, the
        ranks agree (an all-reduce) on how many of the oldest are settled: written durably on
        every rank, or failed somewhere. Returns the newest settled tag that asked for
        ``latest`` (else the newest settled one): DeepSpeed then calls commit() and writes
        ``latest``. Never waits for a write.
        """
        self._settled = None
        if self._closed or not self._tags:
            return None
        statuses = self._agree(self._tags)
        ready = next((i for i, s in enumerate(statuses) if s == _PENDING), len(statuses))
        if ready == 0:
            return None
        tags = self._tags[:ready]
        info = next((t.info for t in reversed(tags) if t.info.save_latest), tags[-1].info)
        self._settled = (info, tags, statuses[:ready])
        return info

    def commit(self, info: Any) -> bool:
        """Confirm that the tag of `info` is durable on every rank; DeepSpeed writes ``latest``
        once this returns. Raises `CommitError` (on every rank) when a write of it failed.

        After get_commit_info() this never waits. A tag DeepSpeed commits directly (a save of
        the 16-bit model) is waited for, up to commit_timeout, on this rank.
        """
        settled, self._settled = self._settled, None
        if settled is not None and settled[0] is info:
            _, tags, statuses = settled
        else:
            tags = [self._created(info)]
            statuses = [self._wait(tags[0])]
        self._tags = [t for t in self._tags if not any(t is s for s in tags)]
        failed = [t for t, s in zip(tags, statuses, strict=True) if s == _FAILED]
        if failed:
            raise self._commit_error(failed)
        return True

    def cleanup(self) -> None:
        """DeepSpeed's ``engine.destroy()`` calls this: see close()."""
        self.close()

    # -- pyshmckpt's own --------------------------------------------------------------------

    def close(self) -> None:
        """Finish every pending write, point each save directory's ``latest`` at its newest
        tag that is durable on every rank (rank 0 writes it, atomically), and stop the writer
        process. Raises `CommitError` for tags that failed. Call it on every rank, like
        ``engine.destroy()`` (which calls it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.checkpoint_process.close()  # every pending write is settled after this
            finally:
                self._publish_latest()
        finally:
            self._destroy_group()

    def wait(self) -> None:
        """Wait (up to commit_timeout) until every file handed over so far is written or failed,
        for instance before ``engine.load_checkpoint`` of a tag this process just saved (DeepSpeed
        finds the model files by listing the directory). Failures and ``latest`` are still
        DeepSpeed's next commit's (or close()'s) to report and move."""
        for tag in list(self._tags):
            self._wait(tag)

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("ShmCheckpointEngine is closed")

    def _record(self, path: str, future: Future[None]) -> None:
        self._writes = {p: f for p, f in self._writes.items() if not f.done()}
        self._writes[path] = future
        if self._tags:
            self._tags[-1].writes.append((path, future))

        def report(done: Future[None]) -> None:
            exc = done.exception()
            if exc is not None:
                logger.error("checkpoint file %s was not written: %s", path, exc)

        future.add_done_callback(report)

    def _agree(self, tags: list[_Tag]) -> list[int]:
        """Each tag's status on the worst-off rank (collective with several ranks)."""
        statuses = torch.tensor([t.status() for t in tags], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(statuses, op=dist.ReduceOp.MAX, group=self._group)
        return [int(s) for s in statuses.tolist()]

    def _created(self, info: Any) -> _Tag:
        for tag in reversed(self._tags):
            if tag.info == info:
                return tag
        raise ConfigError(f"commit of checkpoint {info.tag!r}, which was not created (saved)")

    def _wait(self, tag: _Tag) -> int:
        futures = [future for _, future in tag.writes]
        _, pending = concurrent.futures.wait(futures, timeout=self.commit_timeout)
        if pending:
            raise CommitTimeoutError(
                f"checkpoint {tag.info.tag!r}: {len(pending)} file(s) still being written after "
                f"{self.commit_timeout:g} s"
            )
        return tag.status()

    def _commit_error(self, failed: list[_Tag]) -> CommitError:
        """The error for tags a write failed for (here or on another rank); removes what the
        failed writes of this rank left behind."""
        details: list[str] = []
        first: BaseException | None = None
        for tag in failed:
            failures = tag.failures()
            for path, exc in failures:
                first = first or exc
                details.append(f"{path}: {exc}")
                if self._writes.get(path) is None or self._writes[path].done():
                    for temp in TorchFileWriter.temporaries(path):
                        temp.unlink(missing_ok=True)
            if not failures:
                details.append(f"tag {tag.info.tag!r}: a write failed on another rank")
        tags = ", ".join(repr(t.info.tag) for t in failed)
        error = CommitError(
            f"checkpoint {tags} was not saved (`latest` still names an earlier tag): "
            + "; ".join(details)
        )
        error.__cause__ = first
        return error

    def _publish_latest(self) -> None:
        tags, self._tags = self._tags, []
        if not tags:
            return
        if self._group is not None and not dist.is_initialized():
            logger.warning(
                "torch.distributed was shut down before the checkpoint engine closed: `latest` "
                "was not moved to tags %s",
                [t.info.tag for t in tags],
            )
            return
        statuses = self._agree(tags)
        newest: dict[str, str] = {}  # save directory -> its newest durable tag asking for latest
        for tag, status in zip(tags, statuses, strict=True):
            if status == _DURABLE and tag.info.save_latest:
                newest[tag.info.save_dir] = tag.info.tag
        if self.rank == 0:
            for save_dir, name in newest.items():
                _write_latest(Path(save_dir), name)
        failed = [t for t, s in zip(tags, statuses, strict=True) if s != _DURABLE]
        if failed:
            raise self._commit_error(failed)

    def _destroy_group(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(group)


def _absolute(path: str | os.PathLike[str]) -> str:
    return str(Path(path).absolute())


def _write_latest(save_dir: Path, tag: str) -> None:
    """DeepSpeed's ``latest`` file (the tag's name), replaced atomically and durably."""
    temp = save_dir / f".{_LATEST}.tmp-{secrets.token_hex(8)}"
    try:
        with temp.open("x") as file:
            file.write(tag)
            file.flush()
            os.fsync(file.fileno())
        temp.replace(save_dir / _LATEST)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    commit.fsync_path(save_dir)


def use_pyshmckpt(engine: Any, **options: Any) -> ShmCheckpointEngine:
    """Make DeepSpeed `engine` save and load checkpoints through a new `ShmCheckpointEngine`
    (``options`` are its keyword arguments); returns it. Call it on every rank right after
    ``deepspeed.initialize``. A decoupled engine it replaces is cleaned up first."""
    previous = getattr(engine, "checkpoint_engine", None)
    checkpoint_engine = ShmCheckpointEngine(**options)
    if previous is not None and previous.is_decoupled():
        try:
            previous.cleanup()
        except BaseException:
            checkpoint_engine.close()
            raise
    engine.checkpoint_engine = checkpoint_engine
    return checkpoint_engine


__all__ = ["ShmCheckpointEngine", "use_pyshmckpt"]
