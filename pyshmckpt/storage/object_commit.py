"""Checkpoints under an object storage root: an atomic commit, ``latest`` and retention on a store
that has no rename.

Layout under a root ``s3://bucket/prefix``: a checkpoint ``name`` is the objects
``prefix/name/rank<r>.safetensors`` and ``prefix/name/rank<r>.json`` (the files of a checkpoint
directory, so a copy of them to a disk is one) and ``prefix/name/commit.json``, the commit
record, written last. A checkpoint exists only once its commit record does; the record names
every object of every rank with its ETag and size, and readers fetch each object on condition
that its ETag is still the recorded one. ``prefix/latest`` names the newest checkpoint, written
after its commit record.

Consistency: S3 is strongly consistent for reads after writes and for listings, a PUT of a
single object is atomic (a reader gets the old object or the new one whole) and a conditional PUT
(``If-None-Match: *``) creates an object only where none is. So a reader who sees a commit record
sees a complete checkpoint (every object it names was complete before the record was written);
one who sees ``latest`` sees a record; a record is created only once (a second save of the same
name fails, unless it replaces, which removes the old record before writing any object);
retention removes a record before the objects it names, so a checkpoint disappears at once and
whole. A reader who read a record and then meets an object with another ETag (the checkpoint
was replaced meanwhile) fails with a typed error instead of reading a mix.

Several ranks: each rank uploads its objects, then a marker ``prefix/.pending/name/<attempt>/
rank<r>.json`` listing them; rank 0 waits (bounded by the barrier timeout) for every marker,
then writes the commit record naming every rank's objects. A rank that fails writes
``.../failed`` with its reason (a conditional PUT: the first stays), which stops every rank.
Attempts are named under the run's secret (`run_names`), as on a filesystem. Rank 0 removes a
committed attempt's markers, and the markers and uncommitted objects of the run's earlier
attempts that died; what a process that died left (an unfinished multipart upload, objects
never committed) is removed when a root is opened once it is older than
``PYSHMCKPT_OBJECT_ABANDONED_AFTER``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import knobs
from ..errors import CommitError, CommitTimeoutError, ObjectStoreError, os_error
from . import commit, object_store, progress, run_names
from .commit import COMMIT_RECORD, LATEST, check_name
from .object_store import ObjectPath
from .shared_commit import number_of, public_attempt, run_of

logger = logging.getLogger(__name__)

PENDING = ".pending"
FAILED = "failed"
_RANK_FILE = re.compile(r"rank[0-9]+\.(safetensors|json)")
_RECORD_LIMIT = 64 << 20  # bytes of a commit record (it names every rank's objects)
_SMALL_LIMIT = 1 << 20  # bytes of `latest`, a marker or a tombstone

Upload = Callable[[ObjectPath], dict[str, dict[str, Any]]]


def record_of(checkpoint: ObjectPath) -> dict[str, Any] | None:
    """The commit record of `checkpoint` (None when it is not committed: no record, or one
    that is not a pyshmckpt record of that name)."""
    raw = object_store.get(checkpoint / COMMIT_RECORD, limit=_RECORD_LIMIT)
    if raw is None:
        return None
    with contextlib.suppress(ValueError, RecursionError):
        record = json.loads(raw)
        if (
            isinstance(record, dict)
            and record.get("name") == checkpoint.name
            and type(record.get("sequence")) is int
            and type(record.get("world_size")) is int
            and isinstance(record.get("objects"), dict)
        ):
            return record
    logger.warning("%s is not a pyshmckpt commit record: ignored", checkpoint / COMMIT_RECORD)
    return None


def names(root: ObjectPath) -> list[str]:
    """The names directly below `root` that may be checkpoints (not hidden)."""
    out = []
    for entry in object_store.listing(root, delimiter=True):
        prefix = entry.get("Prefix")
        if prefix:
            name = prefix[len(root.prefix) :].rstrip("/")
            if name and not name.startswith(".") and name != LATEST:
                out.append(name)
    return out


def _records(root: ObjectPath) -> list[tuple[int, str, dict[str, Any]]]:
    """(sequence, name, commit record) of every committed checkpoint under `root`, oldest
    first."""
    found = names(root)
    with ThreadPoolExecutor(max(1, min(16, len(found)))) as pool:
        records = list(pool.map(lambda name: record_of(root / name), found))
    listed = [(r["sequence"], name, r) for name, r in zip(found, records, strict=True) if r]
    return sorted(listed, key=lambda entry: entry[:2])


def committed(root: ObjectPath) -> list[tuple[int, str]]:
    """(sequence, name) of every committed checkpoint under `root`, oldest first."""
    return [(sequence, name) for sequence, name, _ in _records(root)]


def newest(root: ObjectPath) -> tuple[ObjectPath, dict[str, Any]] | None:
    """The checkpoint ``latest`` names when it is committed, else the newest committed one by
    commit sequence, with its commit record; None when there is none."""
    return pointed(root) or listed_newest(root)


def pointed(root: ObjectPath) -> tuple[ObjectPath, dict[str, Any]] | None:
    """The checkpoint ``latest`` names and its commit record (None: no ``latest``, or it names
    nothing committed)."""
    pointer = _latest_pointer(root)
    if pointer is not None:
        name = pointer.get("name")
        if isinstance(name, str) and name and "/" not in name and not name.startswith("."):
            record = record_of(root / name)
            if record is not None:
                return root / name, record
    return None


def listed_newest(root: ObjectPath) -> tuple[ObjectPath, dict[str, Any]] | None:
    """The newest committed checkpoint by commit sequence, found by listing the root."""
    listed = _records(root)
    return (root / listed[-1][1], listed[-1][2]) if listed else None


def latest(root: ObjectPath) -> ObjectPath | None:
    """The checkpoint `newest` finds (None: none)."""
    found = newest(root)
    return found[0] if found is not None else None


def _latest_pointer(root: ObjectPath) -> dict[str, Any] | None:
    return _parsed(object_store.get(root / LATEST, limit=_SMALL_LIMIT))


_sequences: dict[str, int] = {}  # root URL -> the highest sequence this process committed there


def _next_sequence(root: ObjectPath) -> int:
    known = _sequences.get(str(root))
    pointer = _latest_pointer(root) or {}
    newest = pointer.get("sequence")
    newest = newest if type(newest) is int else 0
    if known is None:
        known = max((seq for seq, _ in committed(root)), default=0)
    return max(known, newest) + 1


def save(
    path: ObjectPath,
    upload: Upload,
    keep_last: int | None,
    *,
    files: tuple[str, ...],
    rank: int = 0,
    world_size: int = 1,
    attempt: str | None = None,
    barrier_timeout: float = 600.0,
    replace: bool = False,
    link_latest: bool = True,
    staged_ns: int | None = None,
    background_retention: bool = False,
) -> ObjectPath:
    """Upload this rank's `files` of a checkpoint with `upload(path)` (which returns the objects
    it wrote: relative name -> ``{"etag", "size"}``) and commit it as `path` (see the module docstring), then
    update ``latest`` (unless `link_latest` is False) and apply retention (with
    `background_retention`, on a thread `commit.wait_for_deletions` waits for: the save is
    answered once committed, and a retention that fails is logged). With world_size > 1
    every rank calls this with the same `path` and `attempt` (``<run>.<number>``). `staged_ns`
    (when the save was staged) goes into the commit record.

    Raises:
        PathExistsError: a checkpoint of that name is committed and `replace` is not set.
        CommitError: another rank failed (`CommitTimeoutError`: did not finish in time).
        ObjectStoreError: (a subclass) the service refused or kept failing a request.
    """
    check_name(path.name)
    root = path.parent
    old = record_of(path)
    if old is not None:
        if not replace:
            raise os_error(errno.EEXIST, f"checkpoint {path} already exists", str(path))
        # Every rank removes it before it overwrites its objects: no reader sees the old
        # record naming objects being replaced (one who read it before gets a typed error).
        object_store.delete(path, [(path / COMMIT_RECORD).key])
    if world_size > 1:
        if not attempt or "/" in attempt:
            raise CommitError(f"a multi-rank save needs an attempt id, not {attempt!r}")
        _SharedSave(path, rank, world_size, attempt, barrier_timeout).run(upload, files, staged_ns)
    else:
        objects = _upload_or_clean(path, upload, files)
        _write_record(path, world_size, objects, None, staged_ns)
    if rank == 0:
        if link_latest:
            sequence = _sequences[str(root)]
            object_store.put(
                root / LATEST, json.dumps({"name": path.name, "sequence": sequence}).encode()
            )
        if keep_last is not None and background_retention:
            commit.delete_in_background(_retain_logged, root, keep_last)
        elif keep_last is not None:
            retain(root, keep_last)
    return path


_retentions = threading.Lock()  # one at a time: two would remove the same checkpoints


def _retain_logged(root: ObjectPath, keep_last: int) -> None:
    with _retentions:
        try:
            retain(root, keep_last)
        except Exception as exc:  # the new checkpoint is committed: say so, the next one retries
            logger.warning("retention (keep_last=%d) in %s failed: %s", keep_last, root, exc)


def _upload_or_clean(
    path: ObjectPath, upload: Upload, files: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """`upload(path)`; on failure, the objects of this rank's `files` that it may have written
    are removed while nothing committed names them (best effort: the root's cleanup gets what
    this cannot)."""
    try:
        return upload(path)
    except BaseException:
        with contextlib.suppress(ObjectStoreError, OSError):
            if record_of(path) is None:
                mine = [(path / name).key for name in files]
                object_store.delete(path, mine)
        raise


def _write_record(
    path: ObjectPath,
    world_size: int,
    objects: dict[str, Any],
    attempt: str | None,
    staged_ns: int | None,
) -> None:
    root = path.parent
    sequence = _next_sequence(root)
    record: dict[str, Any] = {
        "sequence": sequence,
        "time_ns": time.time_ns(),
        "name": path.name,
        "world_size": world_size,
        "objects": objects,
    }
    if attempt is not None:
        record["attempt"] = attempt
    if isinstance(staged_ns, int):  # when rank 0 staged it: a restore compares tiers by it
        record["staged_ns"] = staged_ns
    object_store.put(path / COMMIT_RECORD, json.dumps(record).encode(), create_only=True)
    _sequences[str(root)] = sequence
    logger.debug("committed %s (sequence %d)", path, sequence)


class _SharedSave:
    """One rank's part in one attempt of a checkpoint several ranks save together."""

    def __init__(
        self, path: ObjectPath, rank: int, world_size: int, attempt: str, timeout: float
    ) -> None:
        self.path, self.rank, self.world_size, self.timeout = path, rank, world_size, timeout
        self.run_id, self.number = run_of(attempt), number_of(attempt)
        self.public = public_attempt(attempt)
        self.pending = pending_path(path, attempt)
        self.marker = self.pending / f"rank{rank}.json"
        self.tomb = self.pending / FAILED

    def run(self, upload: Upload, files: tuple[str, ...], staged_ns: int | None) -> None:
        self._check_tomb()
        deadline = time.monotonic() + (self.timeout if self.rank == 0 else self.timeout * 1.1 + 1.0)
        try:
            objects = _upload_or_clean(self.path, upload, files)
            object_store.put(self.marker, json.dumps(objects).encode())
        except BaseException as exc:
            bury(
                self.tomb,
                f"rank {self.rank} failed to upload its files: {type(exc).__name__}: {exc}",
            )
            raise
        if self.rank != 0:
            self._wait_for_commit(deadline)
            return
        try:
            merged = self._wait_for_ranks(deadline)
            _write_record(self.path, self.world_size, merged, self.public, staged_ns)
        except CommitError:
            raise
        except BaseException as exc:
            bury(self.tomb, f"rank 0 could not commit: {type(exc).__name__}: {exc}")
            raise
        self._remove_markers()

    def _check_tomb(self) -> None:
        reason = object_store.get(self.tomb, limit=_SMALL_LIMIT)
        if reason is not None:
            why = reason.decode(errors="replace") or "another rank gave up"
            raise CommitError(f"checkpoint {self.path} was abandoned: {why}")

    def _wait_for_ranks(self, deadline: float) -> dict[str, Any]:
        expected = {f"rank{r}.json" for r in range(self.world_size)}
        for delay in _poll_delays():
            found = {
                entry["Key"][len(self.pending.prefix) :]
                for entry in object_store.listing(self.pending)
            }
            if FAILED in found:
                self._check_tomb()
            missing = expected - found
            if not missing:
                break
            progress.advance()  # waiting for ranks is no stall
            if time.monotonic() >= deadline:
                ranks = sorted(int(m[4:-5]) for m in missing)
                bury(
                    self.tomb,
                    f"rank 0 waited {self.timeout:g} s for ranks {ranks} to upload their files",
                )
                raise CommitTimeoutError(
                    f"checkpoint {self.path}: ranks {ranks} did not finish uploading within "
                    f"{self.timeout:g} s"
                )
            time.sleep(delay)
        merged: dict[str, Any] = {}
        with ThreadPoolExecutor(min(16, self.world_size)) as pool:
            markers = pool.map(
                lambda r: object_store.get(self.pending / f"rank{r}.json", limit=_SMALL_LIMIT),
                range(self.world_size),
            )
            for r, raw in enumerate(markers):
                objects = _parsed(raw)
                if objects is None:
                    raise CommitError(f"rank {r}'s marker of {self.path} is unreadable")
                twice = sorted(set(objects) & set(merged))
                if twice:  # two ranks wrote one key: the record would name one rank's alone
                    why = f"rank {r} uploaded {twice[0]!r}, which another rank uploaded too"
                    bury(self.tomb, why)
                    raise CommitError(f"checkpoint {self.path}: {why}")
                merged.update(objects)
        return merged

    def _wait_for_commit(self, deadline: float) -> None:
        for delay in _poll_delays():
            record = record_of(self.path)
            if record is not None and record.get("attempt") == self.public:
                return
            self._check_tomb()
            progress.advance()  # waiting for rank 0 is no stall
            if time.monotonic() >= deadline:
                bury(self.tomb, f"rank {self.rank} waited {self.timeout:g} s for rank 0 to commit")
                raise CommitTimeoutError(
                    f"checkpoint {self.path}: rank 0 did not commit it within {self.timeout:g} s"
                )
            time.sleep(delay)

    def _remove_markers(self) -> None:
        """This attempt's markers, and what the run's earlier attempts that died left: their
        markers, tombstones and (when never committed) their checkpoints' objects."""
        root = self.path.parent
        doomed = [entry["Key"] for entry in object_store.listing(self.pending)]
        for entry in object_store.listing(root / PENDING):
            parts = entry["Key"][len((root / PENDING).prefix) :].split("/")
            if len(parts) != 3:
                continue
            name, attempt, file = parts
            number = attempt.partition(".")[0]
            earlier = number.isdigit() and int(number) < int(self.number)
            if earlier and attempt == _attempt_name(self.run_id, number):  # only this run's
                doomed.append(entry["Key"])
                if record_of(root / name) is None:
                    doomed += [
                        listed["Key"]
                        for listed in object_store.listing(root / name)
                        if ours(listed["Key"][len(root.prefix) :])
                    ]
                    # The objects a rank's marker names (files of other names than rank files,
                    # a framework's mirrored: `mirror.Mirror.put`).
                    if _RANK_FILE.fullmatch(file):
                        marker = dataclasses.replace(root, key=entry["Key"])
                        named = _parsed(object_store.get(marker, limit=_SMALL_LIMIT)) or {}
                        doomed += [(root / name / n).key for n in named if _plain_name(n)]
        with contextlib.suppress(ObjectStoreError):
            object_store.delete(self.path, sorted(set(doomed)))


def _plain_name(name: Any) -> bool:
    """Whether `name` is an object's name within a checkpoint (no path, nothing hidden)."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".")


def _parsed(raw: bytes | None) -> dict[str, Any] | None:
    """A JSON object from `raw` (None: missing, or not a JSON object)."""
    with contextlib.suppress(ValueError, RecursionError):
        value = json.loads(raw) if raw is not None else None
        return value if isinstance(value, dict) else None
    return None


def _attempt_name(run: str, number: str) -> str:
    """How the bucket names the run's attempt `number`: under the run's secret."""
    return f"{number}.{run_names.tag(run, 'object', number)}"


def pending_path(path: ObjectPath, attempt: str) -> ObjectPath:
    """Where the ranks of `attempt` meet for checkpoint `path`."""
    return path.parent / PENDING / path.name / _attempt_name(run_of(attempt), number_of(attempt))


def bury(tomb: ObjectPath, reason: str) -> None:
    """Give an attempt up for every rank (the first reason stays), best effort."""
    logger.warning("giving up %s: %s", tomb.parent, reason)
    with contextlib.suppress(ObjectStoreError, OSError):
        object_store.put(tomb, reason.encode(errors="replace"), create_only=True)


def abandon(root: str, name: str, attempt: str, rank: int, world_size: int, reason: str) -> None:
    """Give a multi-rank attempt up from outside the writer (this rank's writer died with it
    pending): the other ranks stop at once with `reason`."""
    path = object_store.parse(root) / name
    bury(pending_path(path, attempt) / FAILED, reason)


def _poll_delays() -> Any:
    """Seconds between two looks at the store while waiting for other ranks: quick at first,
    then once a second (each look is a request or two, billed, and counted against the
    bucket's request rate)."""
    delay = 0.05
    while True:
        yield delay
        delay = min(delay * 2, 1.0)


def remove(root: ObjectPath, name: str) -> None:
    """Remove checkpoint `name`: its commit record first (it is gone at once, whole), then its
    objects.

    Raises:
        PathNotFoundError: nothing of that name is under `root`.
    """
    check_name(name)
    path = root / name
    keys = [entry["Key"] for entry in object_store.listing(path)]
    if not keys:
        raise os_error(errno.ENOENT, f"checkpoint {path} does not exist", str(path))
    record = (path / COMMIT_RECORD).key
    if record in keys:
        object_store.delete(path, [record])
    object_store.delete(path, [key for key in keys if key != record])


def remove_checkpoint(root: str, name: str) -> None:
    """`remove` for `Checkpointer.remove`, run in the writer process."""
    remove(object_store.parse(root), name)


def retain(root: ObjectPath, keep_last: int) -> list[str]:
    """Remove all but the newest `keep_last` committed checkpoints (never ``latest``'s). A
    checkpoint committed again since it was listed (a save that replaced it) is kept."""
    current = latest(root)
    listed = committed(root)
    removed = []
    for sequence, name in listed[: max(0, len(listed) - keep_last)]:
        if current is not None and current.name == name:
            continue
        record = record_of(root / name)
        if record is None or record["sequence"] != sequence:
            continue  # removed, or replaced by a newer save, meanwhile
        remove(root, name)
        removed.append(name)
    if removed:
        logger.debug("retention (keep_last=%d) removed %s from %s", keep_last, removed, root)
    return removed


def ours(relative: str) -> bool:
    """Whether a key below a root (``name/file``) is one a save writes: a rank's file of a
    checkpoint. Cleanup removes nothing else (the root may hold other data)."""
    name, _, file = relative.partition("/")
    return bool(name) and not name.startswith(".") and _RANK_FILE.fullmatch(file) is not None


def clean_leftovers(root: str) -> list[str]:
    """Remove what saves that died left under `root` once it is older than
    ``PYSHMCKPT_OBJECT_ABANDONED_AFTER``: unfinished multipart uploads of a rank's file, the
    objects of checkpoints never committed (names holding nothing but rank files), and markers.
    Anything else under the root is left alone. Returns the keys and uploads removed."""
    where = object_store.parse(root)
    limit = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        seconds=knobs.object_abandoned_after()
    )
    removed: list[str] = []
    store = object_store.store(where)
    for key, began, handle in store.unfinished(where):
        if began < limit and ours(key[len(where.prefix) :]):
            store.abort(where, key, handle)
            removed.append(f"upload of {key}")
    doomed: list[str] = []
    for entry in object_store.listing(where / PENDING):
        if entry["LastModified"] < limit:
            doomed.append(entry["Key"])
    for name in names(where):
        if record_of(where / name) is not None:
            continue
        objects = list(object_store.listing(where / name))
        if (
            objects
            and all(ours(entry["Key"][len(where.prefix) :]) for entry in objects)
            and all(entry["LastModified"] < limit for entry in objects)
        ):
            doomed += [entry["Key"] for entry in objects]
    object_store.delete(where, doomed)
    removed += doomed
    if removed:
        logger.info("removed leftovers of interrupted saves from %s: %s", root, removed)
    return removed
