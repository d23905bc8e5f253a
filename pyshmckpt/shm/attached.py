"""The writer process's side of the arena: the trainer's slots, attached once and kept mapped.

`AttachedSegments` maps each segment the trainer describes (checking owner, size and token) and
closes those it no longer describes; `SlotMapping` is one staged slot as the writer reads it.
When the trainer dies, `unlink_all` removes every segment it was told of.

An attached segment stays open until it is closed here, and an open segment is never collected as
stale (its lock, see `stale`): after the trainer's death, what the writer keeps attached (the
writes it finishes, the checkpoint it holds) stays, whatever other jobs start meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Iterable

import numpy as np

from ..errors import PathNotFoundError, ProtocolError, from_os_error
from .address import SlotAddress
from .native import Segment
from .stale import SHM_DIR

logger = logging.getLogger(__name__)


class SlotMapping:
    """The bytes of one slot in the writer's mapping of its segment.

    Offsets given to its methods are relative to the slot's start. The mapping stays valid while
    the writer holds the segment (until the trainer retires the arena).
    """

    def __init__(self, segment: Segment, offset: int) -> None:
        self._segment = segment
        self.offset = offset

    @property
    def name(self) -> str:
        return str(self._segment.name)

    @property
    def address(self) -> int:
        """Address of the slot's first byte in this process."""
        return int(self._segment.address) + self.offset

    @property
    def nbytes(self) -> int:
        return int(self._segment.mapped_size) - self.offset

    def memoryview(self) -> memoryview:
        """A view of the slot's bytes; release it (or let it go) before the segment is closed."""
        view = memoryview(self._segment)
        try:
            return view[self.offset :]
        finally:
            view.release()

    def checksums(self, ranges: np.ndarray) -> np.ndarray:
        """CRC32C of each (offset, nbytes) row, on the native thread pool (GIL released)."""
        shifted = np.array(ranges, dtype=np.uint64, copy=True).reshape(-1, 2)
        shifted[:, 0] += np.uint64(self.offset)
        return self._segment.checksums(shifted)


class AttachedSegments:
    """Segments the writer has mapped, by name, and every name it was told of (for cleanup).

    A segment is attached when the trainer first describes it, and the pages a write reads are
    mapped when it first reads them (`slot`), once: steady-state writes take no page fault, and
    the first write waits for its own pages only, not for every slot of the arena (which may
    not even be filled yet, see Arena).
    """

    def __init__(self) -> None:
        self._segments: dict[str, Segment] = {}
        self._mapped: dict[str, int] = {}  # bytes from each segment's start mapped so far
        self._known: set[str] = set()
        self._unattachable: dict[str, BaseException] = {}  # name -> why it could not be attached
        # Taken by the main loop and by the orphan's watchdog thread (unlink_all); never by a
        # signal handler (the parent-death one only wakes the watch thread).
        self._lock = threading.Lock()

    def sync(
        self, described: Iterable[tuple[str, int, bytes]], *, close_others: bool = True
    ) -> None:
        """Attach newly described segments ((name, data size, token), as
        `ShmStager.segments` lists them); close those no longer described (retired arenas).

        Each segment is attached on its own: one that cannot be (gone because the trainer closed
        its arena after describing it, or not whole because the trainer died while creating it)
        never keeps the others from being attached; a write that reads it fails in `slot()`
        with that segment's own error. With `close_others` False, segments attached before stay
        attached."""
        described = list(described)
        names = {name for name, _, _ in described}
        with self._lock:
            self._known = names | set(self._segments) | (set() if close_others else self._known)
            for name in list(self._segments):
                if close_others and name not in names:
                    self._segments.pop(name).close()
                    self._mapped.pop(name, None)
            for name, size, token in described:
                if name in self._segments:
                    continue
                try:
                    segment = Segment.attach(name, size, token, map_pages=False)
                except Exception as exc:
                    error = (
                        from_os_error(exc, f"cannot attach slot {name}")
                        if isinstance(exc, OSError)
                        else ProtocolError(f"cannot attach slot {name}: {exc}")  # not as described
                    )
                    self._unattachable[name] = error
                    logger.debug("cannot attach %s: %s", name, exc)
                    continue
                self._unattachable.pop(name, None)
                self._segments[name] = segment
                logger.debug("attached %s (%d bytes)", name, size)

    def keep(self, name: str, size: int, token: bytes) -> None:
        """Attach segment `name` now if it is not yet (a checkpoint a new trainer took over and
        never described to this writer), so that it stays while this process holds it.

        Raises:
            PyshmckptOSError: it cannot be attached (``PathNotFoundError``: it is gone).
            ProtocolError: it is not as described (size, header or token).
        """
        self.sync([(name, size, token)], close_others=False)
        with self._lock:
            error = self._unattachable.get(name)
        if error is not None:
            raise error

    def note(self, names: Iterable[str]) -> None:
        """Remember segment names the trainer described without attaching them (for cleanup)."""
        with self._lock:
            self._known.update(names)

    def names(self) -> set[str]:
        with self._lock:
            return set(self._segments)

    def slot(self, address: SlotAddress, nbytes: int | None = None) -> SlotMapping:
        """The mapping of an attached slot, the pages of its first `nbytes` bytes (None: all)
        mapped. Only those: the trainer may not have allocated the rest yet (see Arena)."""
        with self._lock:
            segment = self._segments.get(address.name)
            if segment is None:
                error = self._unattachable.get(address.name)
                if error is not None:
                    raise error
                raise PathNotFoundError(
                    errno.ENOENT, f"slot {address.name} is not attached: its segment is gone"
                )
            size = int(segment.mapped_size)
            wanted = size if nbytes is None else min(address.offset + nbytes, size)
            if wanted > self._mapped.get(address.name, 0):
                try:
                    segment.map_pages_for_reading(wanted)
                except OSError as exc:
                    raise from_os_error(
                        exc, f"cannot map the pages of slot {address.name}"
                    ) from exc
                self._mapped[address.name] = wanted
            return SlotMapping(segment, address.offset)

    def unlink_all(self, keep: Iterable[str] = ()) -> None:
        """The trainer is gone: remove its segments (but those in `keep`) so that nothing is
        left in /dev/shm, and close them here, so that their memory is given back now rather
        than when this process exits (a writer holding the newest checkpoint lives on for
        minutes; a mapping still exported stays until its last view goes)."""
        kept = set(keep)
        with self._lock:
            for name in (self._known | set(self._segments)) - kept:
                with contextlib.suppress(OSError):
                    (SHM_DIR / name).unlink()
            closing = [self._segments.pop(n) for n in list(self._segments) if n not in kept]
            for segment in closing:
                self._mapped.pop(str(segment.name), None)
        for segment in closing:
            segment.close()
