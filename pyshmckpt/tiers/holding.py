"""The writer's side of the memory tier: keep the newest checkpoint in shared memory after the
trainer's death, until a new trainer takes it, a timeout, the end of the job, or ``pyshmckpt gc``.

Each save a `Checkpointer` hands over carries a `HoldInfo`; the writer remembers the newest
(`Holder.note`), or the one a new trainer took over (`Holder.adopt`). When the trainer dies, the
writer finishes what it was handed (as always), then, instead of removing every segment, keeps
the newest checkpoint's segment (its open mapping keeps it from being collected as stale),
publishes its hold record (`records.publish`) and waits. The hold ends when:

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

from ..shm import AttachedSegments, SlotAddress
from ..shm.stale import process_start_ticks
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

    def note(self, address: SlotAddress, manifest: Manifest, info: HoldInfo) -> None:
        """A save was handed over: it is the newest checkpoint now."""
        with self._lock:
            self._newest, self._adopted = (address, manifest, info), None

    def adopt(self, record: dict[str, Any], info: HoldInfo, segments: list[str]) -> None:
        """A new trainer took a held checkpoint over: it is the newest until the next save;
        `segments` names the other slots of the trainer's arena (removed if it dies first)."""
        with self._lock:
            self._newest, self._adopted = None, (record, info)
            self._others = list(segments)

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
            if newest is None and adopted is None and not replicas:
                return False
            self._holding = True
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
                logger.warning(
                    "holding checkpoint %s (rank %d of %s) in shared memory for a new trainer, "
                    "for up to %g s%s", info.name, info.rank, info.root, timeout,
                    " or until the launcher ends" if agent else "",
                )  # fmt: skip
            else:
                attached.unlink_all()
            for path, replica in replicas or ():
                if _identity(path) is not None:  # not freed by a newer replica already
                    records.publish(replica, os.getpid(), agent, timeout, path)
                    held.append((path, replica))
        except Exception:
            logger.exception("cannot hold the newest checkpoint in memory: removing it")
            attached.unlink_all()
            for path, record in held + list(replicas or ()):
                records.release(path, record)
            return False
        if replicas:
            logger.warning("holding %d replica(s) of other nodes' ranks", len(replicas))
        self._watch_terminate()
        _silence_output()
        self._wait(held, timeout, agent)
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
        self, held: list[tuple[Path, dict[str, Any]]], timeout: float, agent: tuple[int, int] | None
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
            elif agent is not None and not _alive(agent):
                reason = f"the launcher (pid {agent[0]}) is gone"
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


def _alive(process: tuple[int, int]) -> bool:
    pid, ticks = process
    now = process_start_ticks(pid)
    return now is not None and (not ticks or now == ticks)


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
