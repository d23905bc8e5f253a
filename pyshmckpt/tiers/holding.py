"""The writer's side of the memory tier: keep the newest checkpoint in shared memory after the
trainer's death, until a new trainer takes it, a timeout, the end of the job, or ``pyshmckpt gc``.

Each save a `Checkpointer` hands over carries a `HoldInfo`; the writer remembers the newest
(`Holder.note`), or the one a new trainer took over (`Holder.adopt`). When the trainer dies, the
writer says so at once (`Holder.announce`: a pending hold record, so that a restart that comes
while it still finishes the writes it was handed waits for it rather than restore something
older), finishes what it was handed (as always), then, instead of removing every segment, keeps
the newest checkpoint's segment (its open mapping keeps it from being collected as stale),
publishes its hold record (`records.publish`, over the pending one) and waits. The hold ends
when:

- a new trainer claims the record (it renames it away): the segment is the new trainer's now;
- the hold timeout passes, the launcher whose end ends the job (torchrun's elastic agent) is
  gone, or the writer receives SIGTERM: the record and the segment are removed;
- ``pyshmckpt gc`` removes the record: the writer exits.

While holding, the writer's standard output and error go to /dev/null: a caller that waits for
the trainer's output to end (``subprocess.run(capture_output=True)``) is not kept waiting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._processes import Launcher
from ..shm import AttachedSegments, SlotAddress
from . import records
from .records import HoldInfo

if TYPE_CHECKING:
    from ..staging import Manifest

logger = logging.getLogger(__name__)

# How often a holding writer checks for a claim, its timeout and the launcher.
_POLL = 0.2


class Holder:
    """The newest checkpoint the trainer handed over, and the hold that follows its death."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest: tuple[SlotAddress, Manifest, HoldInfo] | None = None
        self._adopted: tuple[dict[str, Any], HoldInfo] | None = None
        self._holding = False
        self._terminated = threading.Event()
        self._others: list[str] = []  # an adopting trainer's other slots
        self._launchers: dict[tuple[int, int], Launcher] = {}
        self._announced: Path | None = None  # the pending record published at the death

    def note(self, address: SlotAddress, manifest: Manifest, info: HoldInfo) -> None:
        """A save was handed over: it is the newest checkpoint now."""
        self._launcher(info.agent)
        with self._lock:
            self._newest, self._adopted = (address, manifest, info), None
        if self._announced is not None:  # the trainer is gone: a newer save from its spool
            self.announce(info)

    def adopt(self, record: dict[str, Any], info: HoldInfo, segments: list[str]) -> None:
        """A new trainer took a held checkpoint over: it is the newest until the next save;
        `segments` names the other slots of the trainer's arena (removed if it dies first)."""
        self._launcher(info.agent)
        with self._lock:
            self._newest, self._adopted = None, (record, info)
            self._others = list(segments)

    def _launcher(self, agent: tuple[int, int] | None) -> Launcher | None:
        """The watch of `agent`, opened the first time a save names it (the trainer lives)."""
        if agent is None:
            return None
        key = (int(agent[0]), int(agent[1]))
        with self._lock:
            if key not in self._launchers:
                self._launchers[key] = Launcher(key)
            return self._launchers[key]

    def announce(self, info: HoldInfo | None = None) -> None:
        """The trainer died (or left on an error, handing its memory over): publish at once
        that this writer will hold a checkpoint of its root and rank (`info`, or the newest so
        far), still finishing what it was handed, so that a restore waits for it. Nothing when
        no save said what to hold, or once the hold itself is published; never raises (a
        restore then does not wait, which it logs)."""
        with self._lock:  # never after the record itself (`hold`), which it would replace
            newest = self._newest[2] if self._newest is not None else None
            if newest is None and self._adopted is not None:
                newest = self._adopted[1]
            if info is None or (newest is not None and newest.staged_ns > info.staged_ns):
                info = newest
            if info is None or self._holding:
                return
            try:
                self._announced = records.publish(
                    records.pending_record(info), os.getpid(), info.agent, None
                )
            except OSError as exc:
                logger.error(
                    "cannot say that checkpoint %s of rank %d is being finished (a restore will "
                    "not wait for it): %s", info.name, info.rank, exc,
                )  # fmt: skip

    def withdraw(self) -> None:
        """Nothing will be held after all: remove the pending record, if any."""
        with self._lock:
            announced, self._announced = self._announced, None
        if announced is not None:
            records.withdraw(announced)

    def segment(self) -> str | None:
        """The name of the segment the newest checkpoint is in (None: nothing to hold)."""
        with self._lock:
            if self._newest is not None:
                return self._newest[0].name
            if self._adopted is not None:
                return str(self._adopted[0]["segment"]["name"])
            return None

    def hold(
        self,
        attached: AttachedSegments,
        replicas: list[tuple[Path, dict[str, Any]]] | None = None,
        limits: tuple[float, tuple[int, int] | None] | None = None,
    ) -> bool:
        """The trainer is gone and its work finished: hold the newest checkpoint (and the
        `replicas` this writer received from other nodes, held by the same rules: `limits` is
        their (timeout, agent) when no save said) until the hold ends (see the module),
        removing the trainer's other segments; False when there is nothing to hold (the caller
        then removes every segment). Never returns True: the process exits once the hold ends."""
        with self._lock:
            if self._holding:  # another thread holds already and will end the process
                while True:
                    time.sleep(3600)
            newest, adopted = self._newest, self._adopted
            if newest is not None or adopted is not None or replicas:
                self._holding = True  # from now on nothing is announced
        if not self._holding:
            self.withdraw()
            return False
        held: list[tuple[Path, dict[str, Any]]] = []
        timeout, agent = limits if limits is not None else (0.0, None)
        try:
            info = None
            if newest is not None:
                record, info = self._describe(attached, newest)
            elif adopted is not None:
                record, info = adopted
            if info is not None:
                timeout, agent = info.timeout, info.agent
                name = str(record["segment"]["name"])
                # Open while held: an open segment is never collected as stale (a taken-over one
                # was never described to this writer).
                segment = record["segment"]
                attached.keep(name, int(segment["size"]), bytes.fromhex(segment["token"]))
                attached.note(self._others)
                attached.unlink_all(keep={name})
                held.append((records.publish(record, os.getpid(), agent, timeout), record))
                self._announced = None  # replaced by the record itself
                logger.warning(
                    "holding checkpoint %s (rank %d of %s) in shared memory for a new trainer, "
                    "for up to %g s%s", info.name, info.rank, info.root, timeout,
                    " or until the launcher ends" if agent else "",
                )  # fmt: skip
            else:
                self.withdraw()
                attached.unlink_all()
        except Exception:
            logger.exception("cannot hold the newest checkpoint in memory: removing it")
            self.withdraw()
            attached.unlink_all()
            for path, record in held:
                records.release(path, record)
            held = []
        # Each replica on its own: one that cannot be held costs itself alone.
        kept = 0
        for path, replica in replicas or ():
            if _identity(path) is None:  # freed by a newer replica already
                continue
            try:
                records.publish(replica, os.getpid(), agent, timeout, path)
            except Exception:
                logger.exception(
                    "cannot hold the replica of %s (rank %s) in memory: removing it",
                    replica.get("name"), replica.get("rank"),
                )  # fmt: skip
                records.release(path, replica)
                continue
            held.append((path, replica))
            kept += 1
        if not held:
            return False
        if kept:
            logger.warning("holding %d replica(s) of other nodes' ranks", kept)
        self._watch_terminate()
        _silence_output()
        self._wait(held, timeout, self._launcher(agent))
        return True

    @staticmethod
    def _describe(
        attached: AttachedSegments, newest: tuple[SlotAddress, Manifest, HoldInfo]
    ) -> tuple[dict[str, Any], HoldInfo]:
        address, manifest, info = newest
        slot = attached.slot(address, manifest.size)
        segment = (address.name, address.size, address.token)
        return records.describe(manifest, slot, info, segment), info

    def _watch_terminate(self) -> None:
        """SIGTERM (a scheduler ending the job) ends the hold; only the main thread can set it."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
            self._terminated.set()

        signal.signal(signal.SIGTERM, handler)

    def _wait(
        self, held: list[tuple[Path, dict[str, Any]]], timeout: float, launcher: Launcher | None
    ) -> None:
        """Until every record is claimed or replaced (nothing of it is ours then), or the hold
        ends for all of them."""
        deadline = time.monotonic() + timeout
        waiting = [(path, record, _identity(path)) for path, record in held]
        while True:
            waiting = [w for w in waiting if _identity(w[0]) == w[2]]
            if not waiting:
                return
            reason = None
            if self._terminated.is_set():
                reason = "SIGTERM"
            elif time.monotonic() >= deadline:
                reason = f"the hold timeout ({timeout:g} s)"
            elif launcher is not None and launcher.gone():
                reason = f"the launcher (pid {launcher.process[0]}) is gone"
            if reason is not None:
                logger.info("the hold ends: %s", reason)
                for path, record, _ in waiting:
                    records.release(path, record)
                return
            self._terminated.wait(_POLL)


HOLDER = Holder()


def adopt(record: dict[str, Any], info: HoldInfo, segments: list[str]) -> None:
    """Called in the writer (``CheckpointProcess.call``) by a trainer that took `record` over;
    `segments`: the other slots of its arena."""
    HOLDER.adopt(record, info, segments)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _silence_output() -> None:
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
