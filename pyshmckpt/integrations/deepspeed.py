"""DeepSpeed: `ShmCheckpointEngine`, a checkpoint engine whose saves return once staged.

Switch it on right after ``deepspeed.initialize``, on every rank:

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
``save_checkpoint`` waits only for the copy, and for a free slot when both slots still hold
files being written (backpressure, bounded by ``slot_timeout_secs``).

``latest``: a plain engine's commit() runs inside ``save_checkpoint``, after which DeepSpeed
writes ``latest`` itself, so it would have to wait there for the whole write. This engine is a
*decoupled* one instead, like DeepSpeed's own ``DecoupledCheckpointEngine``: ``save_checkpoint``
returns without committing, and ``latest`` is written by the writer processes, which outlive
the trainers (`deepspeed_latest`): when ``save_checkpoint`` returns, the wrapper `use_pyshmckpt`
puts on it asks this rank's writer to seal the tag once its files are written; rank 0's writer
replaces ``latest`` with the tag's name once every rank's writer said its files are durable.
So ``latest`` never names a tag of which a file is not durable, no step waits for a write, and
a run that simply ends (no ``destroy()``), or whose trainers die after ``save_checkpoint``
returned, still ends with ``latest`` naming its last tag: DeepSpeed's ``load_checkpoint(dir)``
resumes from it. The writers' bookkeeping are empty marker files in the tag's directory
(``.pyshmckpt-<run>-rank<r>.durable``), which DeepSpeed never reads; rank 0's writer removes them
when it publishes (a tag that failed may keep some). If a write of a tag failed (disk full, the
writer killed), the ranks agree on that at an optimizer step (DeepSpeed asks
``get_commit_info()`` at each one; a small all-reduce over a gloo group of this engine's own):
the step goes on normally, ``latest`` keeps naming the previous durable tag, and the next
``save_checkpoint`` raises `CommitError` on every rank before it saves anything
(`ShmCheckpointEngine.failure` shows it earlier); the save after that works, through a new
writer process. ``close()`` (``engine.destroy()`` calls it) finishes the pending writes and
seals, and raises a failure of this rank not reported yet.

Limits: ``latest`` moves when rank 0's writer has seen every rank's files durable, a moment after
the last of them, not at a step: ``wait()`` on every rank, then read it. A tag is written file by
file: saving again (with ``save_latest``, the default) to the tag ``latest`` names, or to one
still being written, raises `NotSupportedError` (use a new tag, such as DeepSpeed's default
``global_step<N>``). DeepSpeed finds a tag's model files by listing its directory, and a file
appears there once durable: before ``engine.load_checkpoint`` of a tag just saved, call
``wait()`` on every rank (it waits for every rank's files: each rank loads the model file rank
0 wrote). DeepSpeed tells a checkpoint engine nothing when ``save_checkpoint`` raises half-way:
such a save is never sealed, so ``latest`` does not name it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import secrets
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from ..checkpointer import drain_mirror
from ..errors import (
    ClosedError,
    CommitError,
    CommitTimeoutError,
    ConfigError,
    NotSupportedError,
    from_os_error,
)
from ..storage import TorchFileWriter, liveness, locations, object_store
from ..storage.mirror import DRAIN_TIMEOUT
from ..storage.object_store import ObjectPath
from ..transport import CheckpointProcess, CheckpointProcessConfig, RankInfo, no_init
from .deepspeed_latest import LATEST, TagWriter, marker, write_marker
from .deepspeed_mirror import fetch

logger = logging.getLogger(__name__)

# What a rank says of a tag; across ranks the largest value wins.
_DURABLE, _FAILED, _PENDING = 0, 1, 2
# How long close() lets ranks wait for each other when writes have no time limit.
_UNBOUNDED_WRITES = timedelta(hours=24)


@dataclasses.dataclass
class _Tag:
    """One save_checkpoint call: its commit info and this rank's writes."""

    info: Any  # DeepSpeed's CheckpointCommitInfo (tag, save_dir, save_latest)
    writes: list[tuple[str, Future[None]]] = dataclasses.field(default_factory=list)
    sealed: bool = False  # its writer was asked to publish it once durable everywhere

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

    def names(self, info: Any) -> bool:
        """Whether `info` saves to this tag's directory."""
        return bool(info.tag == self.info.tag and _same_dir(info.save_dir, self.info.save_dir))


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
        commit_timeout: seconds ``commit()`` of a tag (when DeepSpeed commits one directly) and
            ``load()`` of a file being written may wait, and ranks wait for each other to agree
            (at close(), on top of the time their pending writes may take).
        writer: the writer built in the writer process for each file (`TorchFileWriter`, or a
            `StateDictWriter` class taking ``rank_info=``).
        mirror: an object storage root (``s3://bucket/prefix``) every tag published as
            ``latest`` is copied to in the background: each rank's writer uploads its files
            of the tag, and the tag is committed there once every rank's are up, every file's
            size and CRC32C in its commit record; the mirror's ``latest`` then names it. `fetch`
            copies a tag back into a save directory (a new node). ``close()`` waits for the
            uploads (bounded by the write timeout); a writer whose trainer died finishes them.

    Attributes:
        checkpoint_process: the `CheckpointProcess` whose writer process writes the files
            (``pid``, ``last_write_seconds``); a writer that died is restarted by the next save.
        commit_timeout: as given, in seconds.
        rank: this process's rank (0 without torch.distributed).
        world_size: the number of ranks (1 without torch.distributed).

    Raises:
        ConfigError: ``commit_timeout`` is not a positive number, ``config`` holds a value
            not accepted, or ``mirror`` is not in object storage.
        ConfigTypeError: ``config`` is neither pyshmckpt's nor torch's
            ``CheckpointProcessConfig``.
        UnsupportedLocationError: ``mirror`` is a URL pyshmckpt does not write, or
            ``s3://``/``gs://`` without its extra.
        ObjectStoreError: the mirror's bucket is missing or the credentials are refused.
        PyshmckptOSError: the slots of ``config.capacity_bytes`` cannot be created.
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        config: CheckpointProcessConfig | Any = None,
        commit_timeout: float = 300.0,
        writer: Callable[..., Any] = TorchFileWriter,
        mirror: str | None = None,
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
        self.mirror = _mirror_root(mirror)
        process_config = CheckpointProcessConfig.starting_in_background(config)
        # How long close() waits for the mirror: a write's timeout.
        self._mirror_bound = process_config.write_timeout_secs or DRAIN_TIMEOUT
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        # The ranks' agreement on which tags are durable never meets training's collectives.
        self._group = (
            dist.new_group(
                backend="gloo", timeout=_agreement_timeout(process_config, commit_timeout)
            )
            if self.world_size > 1
            else None
        )
        try:
            self._run = self._shared_run_id()
            tag_writer = {
                "writer": writer, "run": self._run, "commit_timeout": commit_timeout,
                "mirror": None if self.mirror is None else str(self.mirror),
            }  # fmt: skip
            #: The writer process (``pid``, ``last_write_seconds``), restarted after it died.
            self.checkpoint_process = CheckpointProcess(
                RankInfo(self.rank, self.world_size), process_config, no_init, (),
                TagWriter, tag_writer,
            )  # fmt: skip
        except BaseException:
            self._destroy_group()
            raise
        self._tags: list[_Tag] = []  # created and not yet settled, oldest first
        self._failed: list[_Tag] = []  # settled as failed (on some rank), not yet reported
        self._seals: list[Future[Any]] = []  # seal requests not answered yet (and the last)
        self._seal_numbers = itertools.count(1)  # a sealed tag's attempt in the mirror
        self._writes: dict[str, Future[None]] = {}  # the last write of each path
        # This rank's heartbeat in each save directory: rank 0's writer waits for no rank whose
        # trainer and writer are gone (see deepspeed_latest).
        self._heartbeats: dict[Path, liveness.Heartbeat] = {}
        self._closed = False

    # -- DeepSpeed's CheckpointEngine ---------------------------------------------------------

    def create(self, info: Any) -> None:
        """Begin a save of tag ``info.tag`` (DeepSpeed calls this on every rank, before any file).

        Seals the saves begun before (see `seal`). With several ranks, the ranks agree on
        whether the tag may be written (a collective call over this engine's gloo group).

        Args:
            info: DeepSpeed's ``CheckpointCommitInfo`` (``tag``, ``save_dir``,
                ``save_latest``).

        Raises:
            ClosedError: the engine is closed.
            CommitError: an earlier tag's write failed (on some rank), raised on every rank;
                nothing of this save is started, and the next save works. Also when the ranks
                could not agree (`CommitTimeoutError` when that timed out).
            NotSupportedError: ``latest`` names this tag, or it is still being written (on
                some rank).
            PyshmckptOSError: ``latest`` of the save directory cannot be read.
        """
        self._check_open()
        self._beat_in(info.save_dir)
        self.seal()  # an earlier save's, when save_checkpoint was not wrapped (use_pyshmckpt)
        if self._failed:
            failed, self._failed = self._failed, []
            raise self._commit_error(failed, "this save was not started; the next one will be")
        if info.save_latest:  # not save_16bit_model's, which writes beside the tags
            refused = any(t.names(info) for t in self._tags) or _latest_names(info)
            if self._agree([int(refused)], "a save's tag")[0]:
                raise NotSupportedError(
                    f"pyshmckpt cannot overwrite checkpoint {info.tag!r} in place: `latest` "
                    "names it or it is still being written (on some rank); use a new tag"
                )
        self._tags.append(_Tag(info))

    def save(self, state_dict: Any, path: str) -> None:
        """Stage `state_dict` and hand its write to the writer process; returns once staged.

        Blocks while the state is copied into a slot, and, when every slot holds a file being
        written, until one frees up (up to ``slot_timeout_secs``). A write that fails (in
        staging or in the writer) does not raise here: it fails its tag on every rank, which
        the next save raises (see `create`).

        Args:
            state_dict: what DeepSpeed saves to this file.
            path: the file's path, written exactly there (atomically) by the writer process.

        Raises:
            ClosedError: the engine is closed.
            WriterStartError: the writer process cannot be started (`WriterStartTimeoutError`
                too when ``config.wait_for_start`` is True).
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
        """Load `path` with ``torch.load``, as DeepSpeed's ``TorchCheckpointEngine`` loads.

        Blocks first until this engine's pending write of `path`, if any, is durable (bounded
        by ``commit_timeout``). Files other ranks are writing are not waited for: call `wait`
        on every rank first.

        Args:
            path: the file's path.
            map_location: passed to ``torch.load``.

        Returns:
            What ``torch.load(path, map_location=map_location, weights_only=False)`` returns.

        Raises:
            CommitTimeoutError: the pending write of `path` did not finish within
                ``commit_timeout``.
            CommitError: the pending write of `path` failed.
        """
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
        """Whether DeepSpeed commits at a later optimizer step (see `get_commit_info`).

        Returns:
            True.
        """
        return True

    def preserves_storage_sharing(self) -> bool:
        """Whether DeepSpeed must clone tensors before `save`.

        Staging copies each tensor anyway, and only the bytes a tensor reaches, never the rest
        of a storage it views.

        Returns:
            False.
        """
        return False

    def get_commit_info(self) -> None:
        """None: DeepSpeed has nothing to commit; the writer processes publish ``latest``.

        DeepSpeed calls this at every optimizer step on every rank. While tags are pending, the
        ranks agree (an all-reduce) on how many of the oldest are settled: written durably on
        every rank, or failed somewhere. Failed ones are logged and kept for the next save to
        raise (`failure`). Never waits for a write and never raises for one.

        Returns:
            None.

        Raises:
            CommitError: the ranks could not agree (`CommitTimeoutError` when that timed out).
        """
        if self._closed or not self._tags:
            return None
        # A save not sealed yet is still being handed over (on some rank): pending.
        statuses = self._agree(
            [t.status() if t.sealed else _PENDING for t in self._tags],
            "which checkpoints are durable",
        )
        ready = next((i for i, s in enumerate(statuses) if s == _PENDING), len(statuses))
        settled = list(zip(self._tags[:ready], statuses[:ready], strict=True))
        self._tags = self._tags[ready:]
        failed = [t for t, s in settled if s == _FAILED]
        if failed:
            self._record_failed(failed)
            logger.error("%s", self._commit_error(failed, "the next save raises this"))
        return None

    def commit(self, info: Any) -> bool:
        """Block until this rank's files of `info`'s save are durable (up to commit_timeout).

        DeepSpeed commits a save of the 16-bit model directly.

        Args:
            info: DeepSpeed's ``CheckpointCommitInfo`` of a save begun with `create`.

        Returns:
            True once they are durable.

        Raises:
            CommitTimeoutError: a file was still being written after ``commit_timeout``.
            CommitError: a file's write failed.
            ConfigError: no save of `info` was begun with `create`.
        """
        tag = self._created(info)
        try:
            status = self._wait(tag)
        finally:
            self._tags = [t for t in self._tags if t is not tag]
        if status == _FAILED:
            self._remove_temporaries([tag])
            raise self._commit_error([tag])
        return True

    def cleanup(self) -> None:
        """Finish and stop, as `close`; DeepSpeed's ``engine.destroy()`` calls this.

        Raises:
            CommitError: as `close`.
            CleanupError: as `close`.
        """
        self.close()

    # -- pyshmckpt's own --------------------------------------------------------------------

    @property
    def failure(self) -> CommitError | None:
        """The `CommitError` the next save will raise, or None.

        It names the tags whose write failed (on some rank), as the ranks agreed at an
        optimizer step.
        """
        return self._commit_error(self._failed) if self._failed else None

    def seal(self) -> None:
        """Ask the writer process to publish the saves begun so far as ``latest``.

        Call once every file of those saves is handed over: each is published once it is
        durable on every rank (rank 0's writer writes ``latest``). `use_pyshmckpt` calls this
        when ``save_checkpoint`` returns; otherwise the next save and `close` do. Never waits
        for a write and never raises: a seal that cannot be requested fails its tag.
        """
        for tag in self._tags:
            if tag.sealed:
                continue
            tag.sealed = True
            if not tag.info.save_latest:
                continue
            paths = [path for path, _ in tag.writes]
            self._beat_in(tag.info.save_dir)
            try:
                sealing = self.checkpoint_process.call(
                    "seal", save_dir=_absolute(tag.info.save_dir), tag=tag.info.tag, paths=paths,
                    attempt=f"{self._run}.{next(self._seal_numbers)}",
                )  # fmt: skip
                self._seals = [f for f in self._seals if not f.done()] + [sealing]
            except Exception as exc:  # its writes failed too: the next step or save reports it
                logger.error("checkpoint %r cannot be published: %s", tag.info.tag, exc)
                self._say_failed(tag)

    def close(self) -> None:
        """Finish every pending write, let the writer process publish ``latest``, and stop it.

        Blocks until the pending writes and seals are done (each write bounded by its write
        timeout); ``latest`` then names the newest tag durable on every rank. Needs no other
        rank (``engine.destroy()`` calls it, and so does the interpreter's exit through
        DeepSpeed's engine). Idempotent.

        Raises:
            CommitError: tags whose write failed on this rank (or that the ranks agreed
                failed) and that were not reported yet.
            CleanupError: the writer process could not be cleaned up.
        """
        if self._closed:
            return
        try:
            self.seal()
        finally:
            self._closed = True
        try:
            if self.mirror is not None:
                drain_mirror(self.checkpoint_process, self._mirror_bound)
            self.checkpoint_process.close()  # every pending write and seal is settled after this
            tags, self._tags = self._tags, []
            self._record_failed([t for t in tags if t.status() != _DURABLE])
            if self._failed:
                failed, self._failed = self._failed, []
                raise self._commit_error(failed)
        finally:
            for heartbeat in self._heartbeats.values():
                heartbeat.stop(remove=True)
            self._destroy_group()

    def wait(self) -> None:
        """Wait until every file handed over so far, on every rank, is written or failed, for
        instance before ``engine.load_checkpoint`` of a tag just saved: DeepSpeed finds the model
        files by listing the tag's directory, and every rank loads ``mp_rank_00_model_states.pt``,
        which rank 0 writes. Call it on every rank, like ``engine.load_checkpoint`` (with several
        ranks it is a collective call: the ranks agree through this engine's group).

        Each rank waits up to commit_timeout for its own writes and seals (`seal`: rank 0's
        publishes ``latest``). Failures are still DeepSpeed's next step's (or close()'s) to
        report.

        Raises:
            CommitTimeoutError: some rank's writes or seals were still pending after
                ``commit_timeout`` (raised on every rank).
            CommitError: the ranks could not agree.
        """
        pending = {id(f): f for f in self._writes.values() if not f.done()}
        pending.update((id(f), f) for tag in self._tags for _, f in tag.writes if not f.done())
        pending.update((id(f), f) for f in self._seals if not f.done())
        _, undone = concurrent.futures.wait(list(pending.values()), timeout=self.commit_timeout)
        if self._agree([len(undone)], "whether every file handed over is written")[0]:
            where = f"{len(undone)} on this rank" if undone else "some on another rank"
            raise CommitTimeoutError(
                f"files still being written after {self.commit_timeout:g} s ({where})"
            )

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("ShmCheckpointEngine is closed")

    def _beat_in(self, save_dir: Any) -> None:
        if self.world_size == 1 or save_dir is None:
            return
        path = liveness.beat_path(Path(_absolute(save_dir)), self._run, self.rank)
        if path not in self._heartbeats and path.parent.is_dir():
            self._heartbeats[path] = liveness.Heartbeat(path)

    def _record(self, path: str, future: Future[None]) -> None:
        self._writes = {p: f for p, f in self._writes.items() if not f.done()}
        self._writes[path] = future
        if self._tags:
            self._tags[-1].writes.append((path, future))
        tag = self._tags[-1] if self._tags else None

        def report(done: Future[None]) -> None:
            exc = done.exception()
            if exc is not None:
                logger.error("checkpoint file %s was not written: %s", path, exc)
                if tag is not None:
                    self._say_failed(tag)

        future.add_done_callback(report)

    def _say_failed(self, tag: _Tag) -> None:
        """Tell rank 0's writer, which may be waiting for this rank's files of `tag`, that they
        will not all be durable (its own writer, maybe dead, may never say so)."""
        if self.world_size == 1 or not tag.info.save_latest:
            return
        path = marker(tag.info.save_dir, tag.info.tag, self._run, self.rank, durable=False)
        if path.parent.is_dir():
            try:
                write_marker(path)
            except Exception as exc:
                logger.warning("%s", exc)

    def _shared_run_id(self) -> str:
        """A secret id all ranks of this engine share (rank 0's), from which the names of their
        heartbeats and markers derive (`storage.run_names`)."""
        run = [secrets.token_hex(16)]
        if self._group is not None:
            dist.broadcast_object_list(
                run, src=dist.get_global_rank(self._group, 0), group=self._group
            )
        return str(run[0])

    def _agree(self, values: list[int], what: str) -> list[int]:
        """Each value's largest across ranks (collective with several ranks)."""
        tensor = torch.tensor(values, dtype=torch.int32)
        if self._group is not None:
            try:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
            except RuntimeError as exc:  # torch.distributed's errors (DistError and gloo's)
                error = CommitTimeoutError if "timed out" in str(exc).lower() else CommitError
                raise error(f"the ranks could not agree on {what}: {exc}") from exc
        return [int(v) for v in tensor.tolist()]

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

    def _record_failed(self, failed: list[_Tag]) -> None:
        """Keep tags that failed for the next save (or close()) to report."""
        self._remove_temporaries(failed)
        self._failed += failed

    def _remove_temporaries(self, failed: list[_Tag]) -> None:
        """Remove what the failed writes of this rank left behind (unless written again)."""
        for tag in failed:
            for path, _ in tag.failures():
                if self._writes.get(path) is None or self._writes[path].done():
                    for temp in TorchFileWriter.temporaries(path):
                        temp.unlink(missing_ok=True)

    def _commit_error(self, failed: list[_Tag], consequence: str = "") -> CommitError:
        """The error for tags a write failed for (here or on another rank)."""
        details: list[str] = []
        first: BaseException | None = None
        for tag in failed:
            failures = tag.failures()
            for path, exc in failures:
                first = first or exc
                details.append(f"{path}: {exc}")
            if not failures:
                details.append(f"tag {tag.info.tag!r}: a write failed on another rank")
        tags = ", ".join(repr(t.info.tag) for t in failed)
        error = CommitError(
            f"checkpoint {tags} was not saved (`latest` still names an earlier tag"
            + (f"; {consequence}): " if consequence else "): ")
            + "; ".join(details)
        )
        error.__cause__ = first
        return error

    def _destroy_group(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(group)


def _agreement_timeout(config: CheckpointProcessConfig, commit_timeout: float) -> timedelta:
    """How long a rank may wait for the others in this engine's group: at close(), a rank may
    first finish up to one write per slot, one after the other, each within the write timeout."""
    if config.write_timeout_secs is None:
        return _UNBOUNDED_WRITES + timedelta(seconds=commit_timeout)
    return timedelta(seconds=config.slots * config.write_timeout_secs + commit_timeout)


def _mirror_root(mirror: Any) -> ObjectPath | None:
    if mirror is None:
        return None
    where = locations.object_root(mirror)
    object_store.check(where)  # its bucket and the credentials, before anything is saved
    return where


def _absolute(path: str | os.PathLike[str]) -> str:
    return str(locations.local_path(path, "checkpoint path").absolute())


def _same_dir(a: str, b: str) -> bool:
    return _absolute(a) == _absolute(b)


def _latest_names(info: Any) -> bool:
    """Whether `info`'s tag directory exists and its save directory's ``latest`` names it."""
    save_dir = Path(info.save_dir)
    if not (save_dir / info.tag).exists():
        return False
    try:
        return (save_dir / LATEST).read_text().strip() == info.tag
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise from_os_error(exc, f"reading {save_dir / LATEST}") from exc


def use_pyshmckpt(engine: Any, **options: Any) -> ShmCheckpointEngine:
    """Make a DeepSpeed engine save and load checkpoints through a new `ShmCheckpointEngine`.

    Call it on every rank right after ``deepspeed.initialize`` (with several ranks it is a
    collective call). It also wraps ``engine.save_checkpoint`` so that each save is sealed
    (`ShmCheckpointEngine.seal`) when it returns. A decoupled checkpoint engine it replaces is
    cleaned up first.

    Args:
        engine: the DeepSpeed engine ``deepspeed.initialize`` returned.
        **options: keyword arguments of `ShmCheckpointEngine`.

    Returns:
        The new checkpoint engine, now ``engine.checkpoint_engine``.

    Raises:
        ConfigError: an option holds a value not accepted.
        ConfigTypeError: ``config`` is of another type.
        PyshmckptOSError: the slots of ``config.capacity_bytes`` cannot be created.
    """
    previous = getattr(engine, "checkpoint_engine", None)
    checkpoint_engine = ShmCheckpointEngine(**options)
    if previous is not None and previous.is_decoupled():
        try:
            previous.cleanup()
        except BaseException:
            checkpoint_engine.close()
            raise
    engine.checkpoint_engine = checkpoint_engine
    if not getattr(engine.save_checkpoint, "_pyshmckpt_seals", False):
        engine.save_checkpoint = _sealing(engine, engine.save_checkpoint)
    return checkpoint_engine


def _sealing(engine: Any, save_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`save_checkpoint` of `engine`, which then seals the save (`ShmCheckpointEngine.seal`):
    ``latest`` follows it even if the trainer dies right after it returned. It holds the engine
    weakly: DeepSpeed's engine cleans up in ``__del__``, which a cycle would delay."""
    function = save_checkpoint.__func__  # type: ignore[attr-defined]
    owner = weakref.ref(engine)

    @functools.wraps(function)
    def save_and_seal(*args: Any, **kwargs: Any) -> Any:
        engine = owner()
        if engine is None:
            raise ClosedError("the DeepSpeed engine is gone")
        result = function(engine, *args, **kwargs)
        if isinstance(engine.checkpoint_engine, ShmCheckpointEngine):
            engine.checkpoint_engine.seal()
        return result

    save_and_seal._pyshmckpt_seals = True  # type: ignore[attr-defined]
    return save_and_seal


__all__ = ["ShmCheckpointEngine", "fetch", "use_pyshmckpt"]
