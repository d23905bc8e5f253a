"""Checkpointer: one object to save training state durably and asynchronously, and load it.

The front door over the layers below: a `SlotStager` stages each save, a `CheckpointProcess`
hands it to the writer process, which runs a writer from the storage registry and commits the
checkpoint directory (across ranks too).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

from . import _processes, knobs
from .errors import (
    ClosedError,
    CommitError,
    ConfigError,
    ConfigTypeError,
    NotSupportedError,
    StagingTimeoutError,
    WriterError,
    WriterStartTimeoutError,
    WriteTimeoutError,
)
from .shm.native import Segment
from .staging import SlotStager, guards
from .storage import (
    commit,
    liveness,
    locations,
    mirror,
    object_store,
    roots,
    tree_codec,
    writer_spec,
)
from .storage.object_store import ObjectPath
from .tiers import holding, loading, records, replication, takeover, topology
from .tiers.records import HoldInfo
from .tiers.replication import ReplicaConfig
from .transport import CheckpointProcess, CheckpointProcessConfig, RankInfo, no_init

logger = logging.getLogger(__name__)


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
    for what, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{what} must be an int, not {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size


def _run_id(given: str | None, world_size: int, process_group: Any) -> str:
    """The run id every rank agrees on (see Checkpointer's run_id). It is the run's secret, never
    written to disk: the names of the run's entries on a shared root derive from it
    (`storage.run_names`), so no other user can predict them. A given run id is that secret and
    must be as hard to guess; with torch.distributed, rank 0 draws 128 bits and broadcasts them."""
    if given is not None:
        if not isinstance(given, str) or not re.fullmatch(r"[A-Za-z0-9_]{1,64}", given):
            raise ConfigError(f"run_id must be 1-64 letters, digits or '_', not {given!r}")
        return given
    if world_size == 1:
        return "local"
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "several ranks need a run id they agree on: initialize torch.distributed, or pass the "
            "same run_id=... on every rank"
        )
    # A gloo group of its own unless one is given: the broadcast never meets training's
    # collectives (nor needs a GPU under NCCL).
    group = process_group if process_group is not None else dist.new_group(backend="gloo")
    try:
        size, member = dist.get_world_size(group), dist.get_rank(group) >= 0
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"process_group is not a usable process group: {exc}") from None
    if size != world_size or not member:
        raise ConfigError(
            f"process_group must hold every rank that saves ({world_size}), not {size}"
            + ("" if member else ", and this rank is not in it")
        )
    first = dist.get_global_rank(group, 0)
    drawn = [secrets.token_hex(16) if dist.get_rank() == first else None]
    dist.broadcast_object_list(drawn, src=first, group=group)
    if process_group is None:
        dist.destroy_process_group(group)
    return str(drawn[0])


def _dying_of_an_exception() -> bool:
    """Whether the interpreter is ending because of an uncaught exception (it was printed)."""
    return (
        getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    )


def _clean_exit(error: BaseException) -> bool:
    """Whether `error` ends the program as a success (``sys.exit()``, ``sys.exit(0)``)."""
    return isinstance(error, SystemExit) and error.code in (None, 0)


def _mirror_root(mirror: Any, in_objects: bool) -> ObjectPath | None:
    """The `mirror` argument as an object storage root (None: no mirror)."""
    if mirror is None:
        return None
    if in_objects:
        raise ConfigError("mirror copies checkpoints of a root on a filesystem to object storage")
    return locations.object_root(mirror)


def drain_mirror(process: CheckpointProcess, bound: float) -> None:
    """Wait (at most `bound` seconds: the write timeout) until the writer has mirrored what it
    committed."""
    try:
        drained = process.call(mirror.drain, timeout=bound).result(timeout=bound + 30)
    except Exception as exc:  # noqa: BLE001 - the saves stand on the local root
        logger.warning("waiting for the mirror failed: %s", exc)
        return
    if not drained:
        logger.warning("checkpoints were still being mirrored after %g s", bound)


def _log_failure(what: str) -> Any:
    """A done-callback that logs a background call's failure (nothing waits for its result)."""

    def done(future: Future[Any]) -> None:
        exc = future.exception()
        if exc is not None:
            logger.warning("%s failed: %s", what, exc)

    return done


class _Request(NamedTuple):
    """A save as `save` was asked for it: where, whether to disk, replacing, and when."""

    target: Path | ObjectPath
    persist: bool
    overwrite: bool
    staged_ns: int


def _check_plain(manifest: Any) -> None:
    tree_codec.check_plain(manifest.tree)


class Checkpointer:
    """Save state dicts under a root directory asynchronously, each checkpoint a directory.

    `save` returns once the state is staged in shared memory (training may change it right
    after) and gives a Future that resolves to the committed checkpoint's path once it is
    durable; a writer process persists it meanwhile. Checkpoints appear atomically (temporary
    name, fsync, rename); ``root/latest`` follows the newest; with ``keep_last`` older ones are
    deleted after a newer one is committed. Leftover temporaries of a crash are removed when a
    Checkpointer opens the root (on rank 0). Staged saves are finished by the writer process
    even if the trainer dies first (see ``CheckpointProcessConfig.on_trainer_death``).

    The Checkpointer owns its shared memory (``slots`` slots, sized from the first state dict
    with headroom unless ``capacity_bytes`` is given, and enlarged when a larger one comes) and
    its writer process; `close` (or the end of a ``with`` block) finishes the pending saves and
    frees both. An exception out of a ``with`` block (the training failed) is a trainer's
    failure, not the job's end: the pending saves finish and, with ``hold``, the newest
    checkpoint stays held in memory for the next trainer, as after a crash.

    DTensors (FSDP2, tensor parallelism) are saved as each rank's local shard plus its placement
    (mesh shape, placements, global shape, the shard's global offsets) in the rank's manifest;
    ``pyshmckpt.load(path, into=...)`` reshards them onto any mesh and number of ranks.

    Args:
        root: a writable directory, created (with its parents) when missing; or a prefix in
            object storage, ``"s3://bucket/prefix"`` or ``"gs://bucket/prefix"`` (the ``s3``
            or ``gcs`` extra; see the guide
            "Checkpoints in object storage"): each checkpoint is then the objects
            ``prefix/name/rank<r>.*`` uploaded from the slot by the writer, committed by a
            ``commit.json`` written last, with the safetensors writer and without ``hold``.
        writer: a name from the storage registry (``pyshmckpt.storage.writer_names()``):
            "safetensors" (default: ``rankN.safetensors`` + ``rankN.json``, read by
            ``pyshmckpt.load``), "torch" (torch.save, ``checkpoint_N.pt``) or "dcp" (one rank
            only).
        slots: shared-memory slots (2: stage the next save while one is written). With
            ``hold``, one of them always keeps the newest checkpoint (the memory tier), so a
            save waits for a slot whose write finished; the default 2 costs no more memory.
        keep_last: keep only this many committed checkpoints (None: keep all).
        allow_pickle: let the safetensors writer pickle leaves that are not plain data (None,
            bool, int, float, str, bytes and containers of them).
        direct_io: the safetensors writer writes tensor data with O_DIRECT where the filesystem
            allows it (bypassing the page cache), falling back to buffered writes elsewhere.
        capacity_bytes: bytes per slot, allocated up front (None: sized on the first save).
        config: settings of the writer process (timeouts, restarts, what happens to staged saves
            when the trainer dies): a ``CheckpointProcessConfig``, pyshmckpt's or torch's. Its
            ``wait_for_start`` defaults to False here: the first save never waits for the writer
            process to start.
        rank: this process's place among ranks that write each checkpoint together (None: from
            torch.distributed when it is initialized, else 0). Every rank saves under the same
            name (pass ``name``, or save equally often so the automatic names agree) into a root
            on a filesystem they share; a save completes on each rank once the whole checkpoint
            is committed, and fails on every rank if any rank fails.
        world_size: how many ranks write each checkpoint together (None: from
            torch.distributed when it is initialized, else 1).
        barrier_timeout: seconds rank 0 waits for the other ranks' files (and they for its commit)
            while those ranks live. A rank whose processes are all gone (killed, its node lost)
            stops its heartbeat on the root, and the save then fails on every rank with
            `CommitError` within ``PYSHMCKPT_HEARTBEAT_TIMEOUT`` (10 s), not the barrier timeout.
        run_id: with several ranks and torch.distributed not initialized, a name of this run
            that every rank passes alike (letters, digits, '_'); with torch.distributed, rank 0
            draws one and broadcasts it (so every rank must construct its Checkpointer, as a
            collective call). Each save's attempt id is the run id and the save's number.
        process_group: the group rank 0's run id is broadcast over (None: a gloo group created
            and destroyed for it, so that it never meets training's collectives). The commit
            itself needs no collective: ranks meet through files on the shared root.
        link_latest: keep the ``root/latest`` link (False: the root holds the checkpoints alone,
            as frameworks that name their own files expect; `latest`, ``pyshmckpt.load(root)``
            and ``pyshmckpt inspect`` then take the newest by commit sequence).
        hold: keep the newest checkpoint in shared memory (the memory tier): while the trainer
            runs, its slot is not staged into; when the trainer dies, the writer process holds
            it for a new trainer of this root and rank, which restores it (`load`) and takes
            the memory over as its own first slot (no allocation, no copy). The hold ends when
            it is taken over, after ``hold_timeout``, when torchrun's elastic agent (the
            launcher) is gone, on SIGTERM to the writer and on ``pyshmckpt gc``. A node's
            loss loses it. None: on when ``slots`` >= 2.
        hold_timeout: seconds a writer holds the newest checkpoint after its trainer died (None:
            ``PYSHMCKPT_HOLD_TIMEOUT``, 600 s: a launcher's restart of its workers takes far
            less, and an abandoned hold gives its memory back within minutes).
        replicate: copy each checkpoint held in memory into the memory of a rank on another
            node (its buddy: the same local rank on the next node), writer to writer over TCP,
            beside the persist and after the trainer's death alike; a save's Future (and
            `wait`) resolves once the replica is held there too, every CRC32C checked (a
            replica that cannot be made leaves the save standing, with a `ReplicationWarning`).
            A restore on a replaced node fetches its ranks' checkpoints from there. Needs
            ``hold`` and torch.distributed; collective (every rank constructs its
            Checkpointer), and it waits for the writer process to start. On one node it does
            nothing (logged).
        stall_timeout: seconds a save may go without the writer reporting progress before it
            counts as hung (the writer is killed, the save fails with `WriteStalledError`); a slow
            save that keeps moving is never cut short (None: the config's
            ``write_stall_timeout_secs``, 120 s by default).
        mirror: an object storage root (``"s3://bucket/prefix"``, ``"gs://..."``) every persisted checkpoint
            is copied to once it is committed under `root`: the writer uploads it in the
            background (the save's Future resolves at the local commit) and commits it there
            under the same name, with the same ``keep_last``; `close` waits for the uploads
            (bounded by the write timeout), and so does a writer whose trainer died. `load`
            then restores the newest of memory, `root` and the mirror (a new node, whose
            `root` is empty, from the mirror). A failed upload is logged; the local checkpoint
            stands.
        overlap: `save` returns once the state is laid out and checked, and its copies run on a
            staging thread (the GIL released for them; CUDA tensors on a side stream after the
            work queued so far) while training goes on. Until they land, the state must not
            change: every torch optimizer's ``step`` and the forward of a module that has
            buffers, in training mode, wait for them by themselves (global hooks); anything
            else that changes the state in place (an EMA update, a hand-written parameter
            update) must call `wait_staged` first. A save outlives the trainer's death once its
            copies have landed and it is handed to the writer (when `wait_staged` returns, or
            the next optimizer step starts), not when `save` returns.

    Attributes:
        root: the checkpoint root, as given.
        mirror: the object storage root checkpoints are mirrored to (None: no mirror).
        rank: this process's rank among those that write each checkpoint together.
        world_size: how many ranks write each checkpoint together.

    Raises:
        ConfigError: an argument or ``PYSHMCKPT_*`` variable has a value not accepted: a
            ``keep_last`` or ``slots`` below 1, a ``barrier_timeout``, ``stall_timeout`` or
            ``capacity_bytes`` not positive, a ``hold_timeout`` below 0, ``hold=True`` with one
            slot, ``replicate=True`` without ``hold`` or torch.distributed, an unknown writer,
            ``direct_io`` with a writer other than "safetensors", a rank outside the world
            size, a missing or malformed ``run_id``, an unusable ``process_group``, an invalid
            ``config`` field.
        ConfigTypeError: ``rank``, ``world_size`` or ``capacity_bytes`` is not an int, or
            ``config`` is neither pyshmckpt's nor torch's ``CheckpointProcessConfig``.
        NotSupportedError: a single-process writer ("dcp") with ``world_size`` above 1; an
            object storage root with another writer than "safetensors", or with ``hold`` or
            ``replicate``; `UnsupportedLocationError` for a root that is another URL
            (``az://``, ``https://`` ...), or an ``s3://`` URL a Path collapsed to ``s3:/``.
        PyshmckptOSError: the root cannot be created, is not a directory
            (`PathNotADirectoryError`) or not writable (`AccessDeniedError`), or the slots of
            ``capacity_bytes`` cannot be created (``/dev/shm`` too small).
        ObjectStoreError: object storage refused or failed listing the root's checkpoints
            (`BucketNotFoundError`, `ObjectStoreAccessError`, `ObjectStoreUnavailableError`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | ObjectPath,
        *,
        writer: str = "safetensors",
        slots: int = 2,
        keep_last: int | None = None,
        allow_pickle: bool = False,
        direct_io: bool = False,
        capacity_bytes: int | None = None,
        config: CheckpointProcessConfig | Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        barrier_timeout: float = 600.0,
        run_id: str | None = None,
        process_group: Any = None,
        link_latest: bool = True,
        stall_timeout: float | None = None,
        hold: bool | None = None,
        hold_timeout: float | None = None,
        replicate: bool = False,
        overlap: bool = False,
        mirror: str | ObjectPath | None = None,
    ) -> None:
        self._closed = True
        self._overlap = bool(overlap)
        self._staging: Future[None] | None = None
        self._staging_job: Future[None] | None = None
        self._staging_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._replica_port: socket.socket | None = None
        self._link_latest = bool(link_latest)
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ConfigError(f"keep_last must be a positive int or None, not {keep_last!r}")
        self.root = locations.location(root, "checkpoint root")
        self._root = roots.root_of(self.root)
        spec = writer_spec(writer)
        in_objects = isinstance(self.root, ObjectPath)
        if in_objects and spec.name != "safetensors":
            raise NotSupportedError(
                f"the {spec.name} writer writes files on a disk; object storage takes the "
                "safetensors writer"
            )
        if in_objects and (hold or replicate):
            raise NotSupportedError(
                "hold and replicate keep checkpoints in this node's memory for a root on a "
                "filesystem; object storage is a root of its own (hold=False)"
            )
        self._allow_pickle = bool(allow_pickle)
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        if (
            isinstance(barrier_timeout, bool)
            or not isinstance(barrier_timeout, (int, float))
            or barrier_timeout <= 0
        ):
            raise ConfigError(f"barrier_timeout must be a positive number, not {barrier_timeout!r}")
        self.mirror = _mirror_root(mirror, in_objects)
        writer_args = spec.arguments(
            keep_last=keep_last, world_size=self.world_size, barrier_timeout=barrier_timeout,
            allow_pickle=self._allow_pickle, direct_io=direct_io,
            mirror=None if self.mirror is None else str(self.mirror),
        )  # fmt: skip
        self._root.open(self.rank)
        committed = self._root.committed()  # object storage: the bucket and credentials checked
        if self.mirror is not None:
            object_store.check(self.mirror)  # the mirror's bucket and credentials
        self._run_id = _run_id(run_id, self.world_size, process_group)
        self._attempts = itertools.count(1)
        if hold is None:  # holding the newest checkpoint needs a second slot to stage into
            hold = isinstance(slots, int) and slots >= 2 and not in_objects
        elif hold and isinstance(slots, int) and slots < 2:
            raise ConfigError("hold=True needs slots >= 2: one holds the newest checkpoint")
        self._hold = bool(hold)
        if hold_timeout is None:
            hold_timeout = knobs.hold_timeout()
        if (
            isinstance(hold_timeout, bool)
            or not isinstance(hold_timeout, (int, float))
            or hold_timeout < 0
        ):
            raise ConfigError(f"hold_timeout must be a number >= 0, not {hold_timeout!r}")
        self._hold_timeout = float(hold_timeout)
        self._real_root = (
            os.path.realpath(self.root) if isinstance(self.root, Path) else str(self.root)
        )
        self._agent = _processes.launcher()
        if replicate and not self._hold:
            raise ConfigError("replicate=True replicates the checkpoint held in memory: needs hold")
        plain_only = spec.needs_plain_leaves and not self._allow_pickle
        # The first save never waits for the writer to start.
        base = CheckpointProcessConfig.starting_in_background(config)
        if stall_timeout is not None:
            base = dataclasses.replace(base, write_stall_timeout_secs=stall_timeout)
        self._config = base
        # The writer process starts first: it initializes while the arena is being created.
        # A writer importable by module name starts in a fresh interpreter, without the
        # trainer's __main__: the default one then never loads torch (small, quick to start).
        self._process = CheckpointProcess(
            RankInfo(self.rank, self.world_size), base, no_init, (), spec.factory, writer_args
        )
        # The other ranks' writers see this rank alive while its trainer runs (see `liveness`).
        self._heartbeat = (
            liveness.Heartbeat(
                liveness.beat_path(self.root, self._run_id, self.rank), remove_at_exit=False
            )
            if self.world_size > 1 and isinstance(self.root, Path)
            else None
        )
        self._replica: ReplicaConfig | None = None
        if replicate:
            try:
                self._replica = self._replicate(process_group)
            except BaseException:
                self._process.close(abort=True)
                if self._heartbeat is not None:
                    self._heartbeat.stop(remove=True)
                raise
        # A checkpoint held in memory for this root and rank (its trainer died) becomes this
        # Checkpointer's first slot: no allocation, no copy, and it stays loadable.
        taken = (
            takeover.claim(self.root, self.rank, capacity_bytes, collective=self.world_size > 1)
            if self._hold and isinstance(self.root, Path)
            else None
        )
        self._taken: dict[str, Any] | None = None
        self._write_guard: int | None = None
        try:
            self._stager = SlotStager(
                capacity_bytes=None if taken is not None else capacity_bytes,
                slots=slots,
                validate=_check_plain if plain_only else None,
                pickle_unsupported=not plain_only,
            )
            if taken is not None:
                self._adopt(*taken)
        except BaseException:
            self._process.close(abort=True)
            if self._heartbeat is not None:
                self._heartbeat.stop(remove=True)
            raise
        self._pending: list[Future[Path | ObjectPath]] = []
        self._saved = False
        self._lock = threading.Lock()
        self._names = itertools.count(1 + max((seq for seq, _ in committed), default=0))
        if self.rank == 0 and self._root.cleaner is not None:
            self._process.call(self._root.cleaner, root=str(self.root)).add_done_callback(
                _log_failure("removing leftovers of interrupted saves")
            )
        # Finalizers run newest first at interpreter exit: without this one (made last), the
        # stager's would unlink the slots before the process's finished the saves reading them.
        self._finalizer = weakref.finalize(
            self, Checkpointer._finalize, self._process, self._stager, self._heartbeat,
            self._hold, None if self.mirror is None else self._mirror_bound(),
        )  # fmt: skip
        self._closed = False

    def _replicate(self, process_group: Any) -> ReplicaConfig | None:
        """Learn the nodes and this rank's buddy with the other ranks (collective), and have
        the writer listen for replicas; the config each save hands over."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.world_size < 2:
            raise ConfigError(
                "replicate=True copies checkpoints to another node: it needs torch.distributed "
                "initialized with several ranks"
            )
        config, self._replica_port = topology.join(
            self.rank, process_group, timeout=self._replica_timeout(),
            hold_timeout=self._hold_timeout, agent=self._agent,
            stall_timeout=self._config.write_stall_timeout_secs,
        )  # fmt: skip
        # Listening before the first save: another node's first replica may come sooner.
        self._process.call(replication.listen, config=config).result(
            timeout=knobs.replica_timeout()
        )
        return config

    def _replica_timeout(self) -> float:
        """Seconds one replication may take: the setting, within half the write timeout (a
        memory-only save's write is the replication alone, and must never time out for it)."""
        write_timeout = self._config.write_timeout_secs
        timeout = knobs.replica_timeout()
        return timeout if write_timeout is None else min(timeout, write_timeout / 2)

    def _adopt(self, record: dict[str, Any], segment: Segment, guard: int) -> None:
        """Make a claimed segment the first slot, held; tell the writer it is the newest.
        `guard` keeps restored tensors from mapping it while this process may write it."""
        try:
            slot = self._stager.adopt(segment)
        except BaseException:
            os.close(guard)
            segment.unlink()
            segment.close()
            raise
        self._write_guard = guard
        self._taken = record
        records.keep_taken(record)
        info = self._hold_info(str(record.get("name", "")), int(record.get("staged_ns", 0)), False)
        others = [other.name for other in slot.arena.slots if other is not slot]
        # Kept alive by the writer from now on, should this process die before it saves.
        self._process.hand_over(self._stager.descriptors())
        self._process.call(holding.adopt, record=record, info=info, segments=others)
        logger.info(
            "took over checkpoint %s held in memory (slot %s)", record.get("name"), slot.name
        )

    def _hold_info(self, name: str, staged_ns: int, persisted: bool) -> HoldInfo:
        return HoldInfo(
            root=self._real_root, rank=self.rank, world_size=self.world_size, name=name,
            staged_ns=staged_ns, persisted=persisted, timeout=self._hold_timeout,
            agent=self._agent, allow_pickle=self._allow_pickle,
        )  # fmt: skip

    def save(
        self,
        state_dict: Any,
        name: str | None = None,
        *,
        overwrite: bool = False,
        persist: bool = True,
    ) -> Future[Path | ObjectPath]:
        """Stage `state_dict` and persist it as ``root/name`` in the background.

        Blocks while the state is copied into a free slot (and, when every slot still holds a
        save being written, until one frees up); returns once staging is complete, after which
        the caller may change or free `state_dict`. With ``overlap``, returns once the state is
        laid out and checked instead: the copies run on the staging thread, and `state_dict`
        may change once they have landed (see ``overlap`` and `wait_staged`). The writer
        process then writes and commits it. A failed save leaves the Checkpointer usable.

        Args:
            state_dict: nested dicts, lists and tuples of tensors (CPU or CUDA, DTensors) and
                other leaves (numbers, strings; anything else needs ``allow_pickle``).
            name: the checkpoint's directory name under the root (not starting with '.', no
                '/', not "latest"); None: ``step-<n>`` (eight digits), ``n`` counting on from
                the commit sequence of the newest checkpoint committed when the Checkpointer
                was made, past names taken.
            overwrite: replace an existing pyshmckpt checkpoint of that name atomically once the
                new one is durable (the name always holds one complete checkpoint); anything
                else of that name is never replaced.
            persist: write it to disk; False keeps it in shared memory only (the memory tier,
                needs ``hold``): it costs the staging alone, survives the trainer's death (not
                the node's), and `load` restores it while it is the newest. A persisted save is
                held in memory too.

        Returns:
            A Future that resolves to the committed checkpoint's path once it is durable (with
                ``persist=False``: to ``root/name`` once the writer holds it; nothing is there),
                or fails with that save's error: `WriterOSError` (an `OSError` in the
                writer: a full disk; errno EEXIST when a save of that name was committed
                meanwhile), `WriterError` (the writer raised something else),
                `WriterDiedError` (the writer process died, or its restarts are spent),
                `WriteTimeoutError` or `WriteStalledError`, `CommitError` or
                `CommitTimeoutError` (several ranks: another rank failed or is gone, or the
                barrier timeout passed), `WriterStartError` (the writer process failed to
                start while the save waited for it), `CheckpointAbortedError`
                (``close(abort=True)``). Callbacks added to it while it is pending run on a
                pyshmckpt background thread: keep them short.

        Raises:
            ClosedError: the Checkpointer is closed.
            PathNotFoundError: the root no longer exists.
            PathNotADirectoryError: the root is not a directory.
            AccessDeniedError: the root is not writable.
            ConfigError: `name` is not a valid checkpoint name, or ``persist=False`` without
                ``hold``.
            PathExistsError: `name` exists and `overwrite` is False, or it exists and is not a
                pyshmckpt checkpoint.
            UnsupportedValueError: a value cannot be staged, or a leaf is not plain data while
                pickle is not allowed (safetensors writer); nothing was staged.
            SlotsBusyError: no slot became free within the slot timeout
                (``PYSHMCKPT_SLOT_TIMEOUT``, 60 s).
            StagingTimeoutError: device-to-host copies did not complete in time.
            PyshmckptOSError: a slot could not be created or enlarged (``/dev/shm`` full).
            WriterStartError: the writer process cannot be started (its start failed for a
                reason another start would not fix); `WriterStartTimeoutError` too when the
                config sets ``wait_for_start=True``.
        """
        if self._closed:
            raise ClosedError("Checkpointer is closed")
        self._root.check()
        chosen = name is not None
        if name is None:
            name = f"step-{next(self._names):08d}"
            while self._root.taken(name):
                name = f"step-{next(self._names):08d}"
        commit.check_name(name)
        self._root.check_target(name, overwrite, chosen)
        target = self.root / name
        if not persist and not self._hold:
            raise ConfigError("save(persist=False) keeps a checkpoint in memory: needs hold=True")
        request = _Request(target, persist, overwrite, time.time_ns())
        result: Future[Path | ObjectPath] = Future()
        if not self._overlap:
            staged = self._stager.stage(state_dict)
            self._hand_over(staged, result, request)
        else:
            self._wait_staging()  # saves are handed to the writer in order
            copy = self._stager.prepare(state_dict)  # checked now: bad input raises here
            staging: Future[None] = Future()
            guards.track(staging, self._stager.staging_bound)
            if self._staging_thread is None:
                self._staging_thread = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="pyshmckpt-stage"
                )
            self._staging = staging
            self._staging_job = self._staging_thread.submit(
                self._stage_and_hand_over, copy, staging, result, request
            )
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()] + [result]
        return result

    def _stage_and_hand_over(
        self, copy: Any, staging: Future[None], result: Future[Path | ObjectPath], request: _Request
    ) -> None:
        """An overlapped save, on the staging thread: the copies, then the hand-over; `staging`
        resolves once both are done (the state may change, and the save outlives this
        process)."""
        try:
            staged = copy()
            self._hand_over(staged, result, request)
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
            staging.set_exception(exc)
            return
        staging.set_result(None)

    def _hand_over(self, staged: Any, result: Future[Path | ObjectPath], request: _Request) -> None:
        """Hand a staged save to the writer; `result` resolves with it."""
        target, persist, overwrite, staged_ns = request
        name = target.name
        extra: dict[str, Any] = {"replace": True} if overwrite else {}
        if not self._link_latest:
            extra["link_latest"] = False
        attempt = None
        if self.world_size > 1 and persist:
            attempt = extra["attempt"] = f"{self._run_id}.{next(self._attempts)}"
        handle = self._stager.handle(staged) if self._hold else None
        if handle is not None:
            extra["hold"] = self._hold_info(name, staged_ns, persist)
            if self._replica is not None:
                extra["replicate"] = self._replica
        written = self._process.write(staged, str(target), **extra)
        del staged  # its slot frees itself once written and unreferenced
        if handle is not None:  # the newest checkpoint: its slot is kept until the next save's
            if self._taken is not None:
                records.forget(self._taken)
                self._taken = None
            self._stager.hold(handle.slot)

        def done(f: Future[None]) -> None:
            exc = f.exception()
            if exc is not None:
                if attempt is not None and not isinstance(exc, (CommitError, WriterError)):
                    # The writer never finished its part (it died, was killed or stopped): the
                    # other ranks stop waiting for it now rather than at the barrier timeout.
                    self._root.abandon(
                        name, attempt, self.rank, self.world_size,
                        f"rank {self.rank}'s write failed: {type(exc).__name__}: {exc}",
                    )  # fmt: skip
                result.set_exception(exc)
            else:
                result.set_result(target)

        written.add_done_callback(done)
        self._saved = True  # handed to the writer: it has something to hold

    def wait_staged(self, timeout: float | None = None) -> None:
        """With ``overlap``: wait until the newest save's copies have landed and it is handed to
        the writer process, after which its state dict may change and the save outlives this
        process. Nothing to wait for without ``overlap`` (`save` returns staged).

        Args:
            timeout: seconds to wait at most (None: the staging's own bound, a free slot's
                wait and the device copies').

        Raises:
            StagingTimeoutError: the copies had not landed within `timeout`.
            PyshmckptError: the staging failed (its save's Future fails the same way).
        """
        staging = self._staging
        if staging is None:
            return
        bound = self._stager.staging_bound if timeout is None else timeout
        try:
            staging.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            raise StagingTimeoutError(
                f"the newest save's copies had not landed after {bound:g} s"
            ) from None

    def _wait_staging(self) -> None:
        """Wait (bounded) until the overlapped save in flight has been handed to the writer;
        its errors are its Future's."""
        job = self._staging_job
        if job is not None:
            concurrent.futures.wait([job], timeout=self._stager.staging_bound)
            if not job.done():
                raise StagingTimeoutError(
                    f"the previous save was not staged within {self._stager.staging_bound:g} s"
                )

    def wait(self, timeout: float | None = None) -> list[Path | ObjectPath]:
        """Wait for the saves pending at the latest `save` and for that save.

        Args:
            timeout: seconds to wait for all of those saves together (None: no limit).

        Returns:
            Their committed paths, oldest first.

        Raises:
            WriteTimeoutError: a save was still pending after `timeout` seconds; it goes on.
            PyshmckptError: the first of those saves that failed, with its error (see the
                Future of `save`).
        """
        with self._lock:
            pending = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        paths = []
        for future in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                paths.append(future.result(timeout=left))
            except concurrent.futures.TimeoutError:
                raise WriteTimeoutError(
                    f"{len(pending) - len(paths)} save(s) still pending after {timeout:g} s"
                ) from None
        return paths

    def wait_for_writer(self, timeout: float | None = None) -> None:
        """Block until the writer process is ready.

        Saves never need this (they are handed to the writer once it is ready); a job may call
        it at set-up to keep the writer's start-up out of its first training steps. The wait is
        bounded by the writer's init timeout (``subprocess_init_timeout_secs``), and by
        `timeout` when given.

        Args:
            timeout: seconds to wait at most (None: the init timeout alone).

        Raises:
            ClosedError: the Checkpointer is closed.
            WriterStartTimeoutError: the writer was not ready within `timeout` (it goes on
                starting) or within its init timeout.
            WriterStartError: its init function or writer raised, or it exited while starting.
            WriterDiedError: it was killed while starting (the next save starts a new one).
        """
        if self._closed:
            raise ClosedError("Checkpointer is closed")
        started = self._process.process_creation_future
        done, _ = concurrent.futures.wait([started], timeout=timeout)
        if not done:
            raise WriterStartTimeoutError(
                f"the checkpoint writer process was not ready within {timeout}s"
            )
        started.result()  # its own start error, if any

    @property
    def writer_pid(self) -> int | None:
        """The current writer process's id (None before it is spawned), for monitoring.

        It changes when a writer process that died is replaced.
        """
        return self._process.pid

    def latest(self) -> Path | ObjectPath | None:
        """The newest committed checkpoint.

        Returns:
            What ``root/latest`` points at (with ``link_latest=False``, the newest committed
                checkpoint by commit sequence), or None when there is none.
        """
        return self._root.latest()

    def load(
        self,
        *,
        into: Any = None,
        map_location: str | Any = "cpu",
        source: str = "auto",
        process_group: Any = None,
        missing_ok: bool = False,
    ) -> Any:
        """Load the newest checkpoint every rank can restore, from memory, disk or the mirror.

        ``pyshmckpt.load(root, ...)`` for this Checkpointer's root and rank: a checkpoint held
        in memory for them (taken over by this Checkpointer, or still held by a writer) when
        it is the newest, else the newest on disk. With torch.distributed initialized on
        several ranks it is collective: every rank calls it and all restore the same
        checkpoint.

        Args:
            into: a state dict to fill in place (see `pyshmckpt.load`).
            map_location: the device the tensors are placed on.
            source: ``"auto"``, ``"memory"`` or ``"disk"`` (see `pyshmckpt.load`).
            process_group: the group the ranks agree over (None: a gloo group made for it).
            missing_ok: return None when no rank has any checkpoint to restore (a job's first
                start) instead of raising `CheckpointNotFoundError`.

        Returns:
            The state dict, or `into` once filled; None when nothing is found and `missing_ok`.

        Raises:
            ClosedError: the Checkpointer is closed.
            CheckpointNotFoundError: no rank has any checkpoint to restore, unless `missing_ok`.
            CheckpointCorruptError: nothing every rank can restore, or a damaged checkpoint.
            CheckpointMismatchError: `into` does not match the checkpoint.
        """
        if self._closed:
            raise ClosedError("Checkpointer is closed")
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        return loading.load(
            self.root, rank=None if distributed else self.rank, into=into,
            map_location=map_location, allow_pickle=self._allow_pickle, source=source,
            process_group=process_group, missing_ok=missing_ok, mirror=self.mirror,
        )  # fmt: skip

    def remove(self, name: str) -> Future[None]:
        """Remove the checkpoint ``root/name`` in the writer process, without blocking.

        The removal runs after every save handed over before this call (a pending save of that
        name is committed, then removed), and happens even if the trainer dies first. The
        checkpoint vanishes atomically (renamed to a hidden name, then deleted). With a
        `mirror`, it is removed from the mirror too, in the background once the uploads queued
        before it are done (the Future resolves at the local removal; `close` waits for the
        mirror's; a failure there is logged).

        Args:
            name: the checkpoint's directory name under the root.

        Returns:
            A Future that resolves to None once the checkpoint is gone, or fails:
                `WriterOSError` with errno ENOENT when nothing of that name exists by then, and
                the failures of a save that concern the writer process (`WriterDiedError`,
                `WriteTimeoutError`, `CheckpointAbortedError`).

        Raises:
            ClosedError: the Checkpointer is closed.
            ConfigError: `name` is not a valid checkpoint name.
            WriterStartError: the writer process cannot be started.
            WriterDiedError: the writer process died and its restarts are spent, or its
                control channel broke (`WriterConnectionError`).
        """
        if self._closed:
            raise ClosedError("Checkpointer is closed")
        commit.check_name(name)
        if self.mirror is not None:  # and from the mirror, behind the uploads queued before it
            return self._process.call(
                mirror.remove_checkpoint, root=str(self.root), name=name, mirror=str(self.mirror)
            )
        return self._process.call(self._root.remover, root=str(self.root), name=name)

    def close(self, abort: bool = False) -> None:
        """Finish (or abandon) the pending saves, stop the writer process, free the slots.

        Blocks until the pending saves are committed or failed (each bounded by its write
        timeout) and the writer has exited. Idempotent; a Checkpointer that is
        garbage-collected or still open at interpreter exit is closed the same way, its errors
        logged.

        Args:
            abort: kill the writer at once instead: pending saves fail with
                `CheckpointAbortedError`.

        Raises:
            CleanupError: what could not be cleaned up (a writer process alive after SIGKILL,
                a segment that could not be removed); everything else was closed.
        """
        if self._closed:
            return
        self._closed = True
        self._end_staging()
        if self._taken is not None:
            records.forget(self._taken)
        self._finalizer.detach()
        try:
            if self.mirror is not None and not abort:
                drain_mirror(self._process, self._mirror_bound())
            self._process.close(abort=abort)
        finally:
            self._release(keep_slots=False)

    def _mirror_bound(self) -> float:
        """Seconds `close` waits for the mirror's uploads: a save's write timeout."""
        return self._config.write_timeout_secs or mirror.DRAIN_TIMEOUT

    def _end_staging(self) -> None:
        """Let an overlapped save in flight reach the writer (bounded), then stop its thread."""
        if self._staging_thread is None:
            return
        try:
            self._wait_staging()
        except StagingTimeoutError as exc:
            logger.error("closing with a save still staging: %s", exc)
        self._staging_thread.shutdown(wait=False)

    def _release(self, keep_slots: bool) -> None:
        """What the Checkpointer holds besides its writer: its slots (freed, or left to the
        writer with `keep_slots`), its heartbeat and its replica port."""
        if keep_slots:
            self._stager.detach()
        else:
            self._stager.close()
        if self._write_guard is not None:
            os.close(self._write_guard)
            self._write_guard = None
        if self._heartbeat is not None:
            self._heartbeat.stop(remove=True)
        if self._replica_port is not None:
            self._replica_port.close()

    @staticmethod
    def _finalize(
        process: CheckpointProcess,
        stager: SlotStager,
        heartbeat: liveness.Heartbeat | None,
        hold: bool,
        mirrored: float | None = None,
    ) -> None:
        """Finish the pending saves, then free the slots (never raises: at exit or collection).

        An interpreter ending with an uncaught exception (an NCCL error, say) is a trainer's
        death: with `hold`, the writer is left to notice it, finish the saves and hold the
        newest checkpoint, as after a kill; the slots stay for it."""
        if hold and _dying_of_an_exception():
            process.leave()
            stager.detach()
            if heartbeat is not None:
                heartbeat.stop(remove=True)
            return
        try:
            if mirrored is not None:  # the mirror's bound
                drain_mirror(process, mirrored)
            process.close()
        except Exception as exc:  # noqa: BLE001 - a finalizer has no caller to raise to
            logger.error("closing the checkpoint writer failed: %s", exc)
        finally:
            stager.close()
            if heartbeat is not None:
                heartbeat.stop(remove=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any
    ) -> None:
        """The end of a ``with`` block: `close`; or, when an exception leaves the block (the
        training failed, the job is likely to restart), finish the pending saves and leave the
        newest checkpoint held in memory for the next trainer, as a crash would."""
        if error is None or not self._hold or _clean_exit(error):
            self.close()
            return
        self._leave_held()

    def _leave_held(self) -> None:
        """Close, but hand the memory over to the writer process (see `__exit__`); a plain
        `close` when no save was made and nothing taken over (nothing to hold)."""
        if self._closed:
            return
        if not self._saved and self._taken is None:
            self.close()
            return
        self._closed = True
        self._end_staging()
        self._finalizer.detach()
        handed = False
        try:
            handed = self._process.leave_holding()
        finally:
            self._release(keep_slots=handed)
