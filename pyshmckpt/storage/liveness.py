"""Heartbeats of the ranks that commit checkpoints together, through files on the shared root.

A rank's trainer (for as long as its Checkpointer is open) and its writer process (while it takes
part in a multi-rank commit) both rewrite ``root/.alive-<tag>`` every `INTERVAL` seconds with their
pid and a counter (the tag names the run and the rank under the run's secret, `run_names`: no one
else can predict it; the file is never opened through a link, nor used when another user's). A
rank waiting for another watches that file: as long as its content changes, some process of that
rank lives and may still deliver; when it stays the same for the heartbeat timeout
(`knobs.heartbeat_timeout`, measured on the watcher's own monotonic clock, so that clocks of
different nodes never meet), every process of that rank is gone, and the attempt cannot complete.
No network, no collective: a rank on a node that vanished stops beating like one whose processes
were killed.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .. import knobs
from ..errors import PyshmckptOSError
from . import entries, run_names

logger = logging.getLogger(__name__)

PREFIX = ".alive-"
INTERVAL = 1.0
_WIDTH = 48  # every beat writes this many bytes: two writers of one file never leave a mix


def beat_path(root: Path, run: str, rank: int) -> Path:
    """Where rank `rank` of run `run` (the run's secret id) beats under `root`."""
    return root / f"{PREFIX}{run_names.tag(run, 'alive', rank)}"


class Heartbeat:
    """Beats `path` from a daemon thread until `stop()` (or the process's end). With
    `remove_at_exit`, an interpreter that exits without `stop()` removes the file (an owner with
    a finalizer of its own, which must beat while it finishes, stops it there instead)."""

    def __init__(self, path: Path, *, remove_at_exit: bool = True) -> None:
        self.path = path
        self._stopped = threading.Event()
        self._counter = itertools.count()
        self._warned = False
        entries.warn_if_open(path.parent)
        self._beat()  # the first beat before anyone waits on it
        self._thread = threading.Thread(target=self._run, name="pyshmckpt-heartbeat", daemon=True)
        self._thread.start()
        self._at_exit = remove_at_exit
        if remove_at_exit:
            atexit.register(self._remove)

    def _run(self) -> None:
        while not self._stopped.wait(INTERVAL):
            self._beat()

    def _beat(self) -> None:
        text = f"{os.getpid()} {next(self._counter)} {time.time():.3f}".ljust(_WIDTH - 1) + "\n"
        try:
            # Opened by name each time: a file removed meanwhile (cleaning a root) comes back.
            fd = entries.open_own_file(self.path)
            try:
                os.pwrite(fd, text.encode(), 0)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._warned:  # once: a root that refuses it refuses the checkpoints too
                self._warned = True
                logger.warning("cannot write the heartbeat %s: %s", self.path, exc)

    def stop(self, *, remove: bool = False) -> None:
        self._stopped.set()
        self._thread.join(INTERVAL * 2)
        if self._at_exit:
            atexit.unregister(self._remove)
        if remove:
            self._remove()

    def _remove(self) -> None:
        self._stopped.set()
        if entries.is_own(self.path):  # what another user put at its name is theirs
            with contextlib.suppress(OSError):
                self.path.unlink()


_SHARED: dict[Path, tuple[Heartbeat, int]] = {}
_SHARED_LOCK = threading.Lock()


@contextlib.contextmanager
def beating(path: Path) -> Iterator[None]:
    """Beat `path` while the block runs (one thread per path in a process, however many blocks)."""
    with _SHARED_LOCK:
        heartbeat, users = _SHARED.get(path, (None, 0))
        if heartbeat is None:
            heartbeat = Heartbeat(path, remove_at_exit=False)
        _SHARED[path] = (heartbeat, users + 1)
    try:
        yield
    finally:
        with _SHARED_LOCK:
            heartbeat, users = _SHARED[path]
            if users == 1:
                del _SHARED[path]
                heartbeat.stop()
            else:
                _SHARED[path] = (heartbeat, users - 1)


class Watch:
    """Which of some ranks stopped beating (see the module docstring)."""

    def __init__(self, root: Path, run: str, timeout: float | None = None) -> None:
        self.root, self.run = root, run
        self.timeout = knobs.heartbeat_timeout() if timeout is None else timeout
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank: (content, when it changed)
        self._refused: dict[int, str] = {}  # rank: why its heartbeat's entry is not read
        self._next = 0.0

    def gone(self, ranks: Iterable[int]) -> list[int]:
        """The ranks among `ranks` whose heartbeat has not changed for the timeout (read at most
        once per beat interval; a rank first asked about now is given the whole timeout)."""
        now = time.monotonic()
        if now < self._next:
            return [r for r in ranks if self._stale(r, now)]
        self._next = now + INTERVAL
        for rank in ranks:
            content = self._read(rank)
            previous = self._seen.get(rank)
            if previous is None or previous[0] != content:
                self._seen[rank] = (content, now)
        return [r for r in ranks if self._stale(r, now)]

    def _stale(self, rank: int, now: float) -> bool:
        seen = self._seen.get(rank)
        return seen is not None and now - seen[1] >= self.timeout

    def _read(self, rank: int) -> bytes | None:
        try:
            return entries.read_own_file(beat_path(self.root, self.run, rank), _WIDTH)
        except PyshmckptOSError as exc:  # a link or another user's file: never read through
            self._refused[rank] = str(exc)
            return None
        except OSError:
            return None

    def describe(self, rank: int) -> str:
        seen = self._seen.get(rank)
        content = seen[0] if seen is not None else None
        if content is None:
            refused = self._refused.get(rank)
            return f"rank {rank} has no heartbeat" + (f" ({refused})" if refused else "")
        pid = content.split(b" ", 1)[0].decode(errors="replace")
        return f"the heartbeat of rank {rank} (last from pid {pid}) stopped"
