"""An arena: a ring of slots, each one shared-memory segment with a torch storage over it.

Slot life cycle (every transition is checked, also under ``python -O``)::

    FREE -> STAGING -> READY -> WRITING -> FREE   (written; staged internally)
               |        |  ^----------'          (written; the caller still holds it)
               |        \\---------------> FREE   (released, or no longer referenced)
               \\-----------------------> FREE   (staging failed)

A READY slot is handed out as a staged state dict. It becomes FREE when its consumer releases it
or when nothing in this process references its tensors any more. Device copies that may still be
writing into a slot keep it from being reused until they complete.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

from .. import _torch_private, knobs
from .._log import warn_once
from .._unfilled import unfilled
from ..errors import (
    ConfigError,
    ConfigTypeError,
    CudaError,
    PinningWarning,
    SlotsBusyError,
    SlotStateError,
    StagerClosedError,
    from_os_error,
)
from . import cuda, sharing
from .address import SlotAddress
from .native import CopyEvent, HostCopy, Segment

logger = logging.getLogger(__name__)


# Bytes faulted in per call by the background thread: close() waits for one such call at most.
_POPULATE_PIECE = 64 << 20
# Seconds between runs of the cycle collector while a stage waits for a slot (see Arena.acquire).
_COLLECT_EVERY = 0.5


class SlotState(enum.Enum):
    """Where a slot is in its life cycle.

    The allowed moves: FREE to STAGING (a stage takes it); STAGING to READY (staged) or FREE
    (staging failed); READY to WRITING (leased) or FREE (released, or no longer referenced);
    WRITING to FREE (written; staged for the lease alone) or READY (written; the caller still
    holds the staged state dict).

    Attributes:
        FREE: holds nothing; the next stage may take it.
        STAGING: being filled by a stage.
        READY: holds a staged state dict handed out to the caller; freed when released or no
            longer referenced.
        WRITING: leased to a writer, which reads it; neither freed nor overwritten until the
            lease is given back.
    """

    FREE = "free"
    STAGING = "staging"
    READY = "ready"
    WRITING = "writing"


_TRANSITIONS = {
    SlotState.FREE: {SlotState.STAGING},
    SlotState.STAGING: {SlotState.READY, SlotState.FREE},
    SlotState.READY: {SlotState.WRITING, SlotState.FREE},
    SlotState.WRITING: {SlotState.FREE, SlotState.READY},
}


def _shift(rows: np.ndarray, offset: int) -> np.ndarray:
    shifted = rows.copy()
    shifted[:, 1] += np.uint64(offset)
    return shifted


class Slot:
    """One shared-memory segment holding one staged state dict at a time.

    Made by an `Arena`, which owns it: its state changes only through `Arena.transition` and
    `Arena.acquire`, under the arena's lock. Data starts at byte `offset` of the segment.
    `storage` is a mapping of the whole segment made by torch's own allocator from the
    segment's file descriptor; each staged block is a slice of it (a storage of its own that
    shares its bytes and keeps it alive), which torch's multiprocessing pickler sends as this one
    descriptor and the slice's bounds. Copies into the slot take rows of (source address, offset
    from the slot start, nbytes) as a ``(n, 3)`` uint64 array; the caller keeps every source
    alive and unchanged until the copy has completed.

    Args:
        arena: the arena it belongs to.
        index: its place in the arena.
        capacity: bytes of data it holds.
        populate: allocate and fault in every page now; False leaves that to a stage
            (`fill_from_host`, `reserve`) and the arena's background thread.
        segment: an existing segment of `capacity` bytes to use instead of creating one (a
            held checkpoint's, taken over; its pages are allocated); it is removed at close.

    Attributes:
        arena: the arena it belongs to.
        index: its place in the arena.
        capacity: bytes of data it holds.
        state: its `SlotState`.
        generation: the number of the stage that last took it (-1 before any).
        manifest: the `Manifest` of the state dict staged here (None when FREE); the stager
            sets it, the arena clears it when the slot is freed.
        staged_id: ``id()`` of the staged state dict handed out (None when FREE, or when
            staged for a lease alone).
        offset: the byte of the segment where the slot's data starts.
        storage: torch's mapping of the whole segment.
        reserved: bytes from the slot's start whose pages are allocated.
        ready: False while its pages are still being faulted in.
        held: True while it holds the newest checkpoint of the memory tier: no stage takes it.
        adopted: its segment was taken over from a writer that held it (`Arena` ``adopt``).

    Raises:
        PyshmckptOSError: the segment cannot be created (``/dev/shm`` full, a limit reached).
    """

    def __init__(
        self,
        arena: Arena,
        index: int,
        capacity: int,
        *,
        populate: bool = True,
        segment: Segment | None = None,
    ) -> None:
        self.arena = arena
        # False while its pages are still being faulted in (see Arena): not staged into yet.
        self.ready = populate
        # Bytes from the slot's start whose pages are allocated. Copies through the mapping stay
        # below it: touching a page that a full /dev/shm cannot allocate is a SIGBUS.
        self.reserved = capacity if populate else 0
        self.index = index
        self.capacity = capacity
        self.state = SlotState.FREE
        self.generation = -1
        self.manifest: Any = None
        self.staged_id: int | None = None
        self.pending: list[CopyEvent] = []
        # Kept from the next stages while it holds the newest checkpoint (the memory tier).
        self.held = False
        # A segment taken over from a holding writer: this process removes it at close.
        self.adopted = segment is not None
        if segment is not None:
            self.segment = segment
        else:
            try:
                self.segment = Segment.create(capacity, knobs.segment_prefix(), populate)
            except OSError as exc:
                raise from_os_error(
                    exc, f"cannot create a {capacity}-byte shared-memory slot"
                ) from exc
        try:
            self.offset = int(self.segment.data_offset)
            self.storage = _torch_private.shared_fd_storage(
                self.segment.fd, self.segment.mapped_size
            )
        except BaseException:
            self.segment.close()
            raise
        sharing.register_slot(self.storage)
        self._bases: dict[torch.dtype, torch.Tensor] = {}
        self._baseline = _torch_private.storage_use_count(self.storage)
        self.base(torch.uint8)
        # References while nothing outside the arena holds the slot: C++ references to the storage
        # (one per tensor viewing it, the bases included) and Python references to the storage
        # object (torch hands out this same object from tensor.untyped_storage(), and holds one
        # reference to it itself while any tensor views the storage, as the bases always do).
        self._py_baseline = sys.getrefcount(self.storage)

    @property
    def name(self) -> str:
        """The segment's name in ``/dev/shm``."""
        return str(self.segment.name)

    def base(self, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor over the whole storage; staged tensors are views of these.

        Args:
            dtype: its dtype.

        Returns:
            The tensor, made once per dtype and kept by the slot.
        """
        base = self._bases.get(dtype)
        if base is None:
            count = self.segment.mapped_size // dtype.itemsize
            base = unfilled((0,), dtype).set_(self.storage, 0, (count,), (1,))
            self._bases[dtype] = base
            self._baseline += 1  # the base's own reference to the storage
        return base

    def referenced(self) -> bool:
        """Whether any tensor (or storage object) outside the arena views this slot's storage.

        Returns:
            True while one does: the staged state dict (or a part of it) is still held.
        """
        return (
            _torch_private.storage_use_count(self.storage) > self._baseline
            or sys.getrefcount(self.storage) > self._py_baseline
        )

    def address(self) -> SlotAddress:
        """How another process attaches this slot (segment name, size, token, data offset)."""
        return SlotAddress(
            self.name, int(self.segment.size), bytes(self.segment.token), self.offset
        )

    def fill_from_host(self, rows: np.ndarray, nbytes: int) -> None:
        """Write host memory into a slot whose pages were never allocated, through its file.

        The kernel allocates each page as the write fills it (no zeroing, no page fault), which
        costs less than `reserve` followed by a copy. Blocks until written (GIL released).

        Args:
            rows: (source address, offset from the slot start, nbytes) rows covering the slot's
                first `nbytes` bytes.
            nbytes: how many bytes from the slot's start the rows cover.

        Raises:
            PyshmckptOSError: the write failed (``/dev/shm`` full).
        """
        try:
            mapped = self.segment.write_from_host(_shift(rows, self.offset))
        except OSError as exc:
            raise from_os_error(exc, f"cannot fill slot {self.name}") from exc
        self.note_reserved(nbytes)
        logger.debug(
            "filled slot %s: %d bytes, %d of them through its mapping", self.name, nbytes, mapped
        )

    def reserve(self, nbytes: int) -> None:
        """Allocate and map the pages of the slot's first `nbytes` bytes if they are not yet.

        Args:
            nbytes: bytes from the slot's start.

        Raises:
            PyshmckptOSError: the pages cannot be allocated (``/dev/shm`` full).
        """
        if nbytes <= self.reserved:
            return
        self.allocate(0, self.offset + nbytes)
        self.note_reserved(nbytes)

    def allocate(self, start: int, nbytes: int) -> None:
        """Allocate and map the pages of segment bytes [start, start + nbytes).

        Safe while other threads write into them.

        Args:
            start: the first byte, from the segment's start (not the slot's data).
            nbytes: how many bytes.

        Raises:
            PyshmckptOSError: the pages cannot be allocated (``/dev/shm`` full).
        """
        try:
            self.segment.allocate_pages(start, nbytes)
        except OSError as exc:
            raise from_os_error(exc, f"cannot allocate {nbytes} bytes of slot {self.name}") from exc

    def populate(self, start: int, nbytes: int) -> None:
        """Reserve and map the pages of segment bytes [start, start + nbytes) on the thread pool;
        nobody may write into them meanwhile (see `allocate` for pages in use).

        Args:
            start: the first byte, from the segment's start (not the slot's data).
            nbytes: how many bytes.

        Raises:
            PyshmckptOSError: the pages cannot be allocated (``/dev/shm`` full).
        """
        try:
            self.segment.populate(start, nbytes)
        except OSError as exc:
            raise from_os_error(exc, f"cannot allocate {nbytes} bytes of slot {self.name}") from exc

    def note_reserved(self, nbytes: int) -> None:
        """Record that the pages of the slot's first `nbytes` bytes are allocated.

        `reserved` never shrinks: the stage and the arena's background thread both raise it.

        Args:
            nbytes: bytes from the slot's start.
        """
        with self.arena._cond:
            self.reserved = max(self.reserved, nbytes)

    def copy_from_host_async(self, rows: np.ndarray) -> HostCopy:
        """Start copying host memory into the slot on the native thread pool (GIL released).

        Args:
            rows: (source address, offset from the slot start, nbytes) rows; each source stays
                alive and unchanged until the copy is waited for.

        Returns:
            The running copy; its ``wait()`` blocks until it is done and raises its error.
        """
        return self.segment.copy_from_host_async(_shift(rows, self.offset))

    def copy_from_device(self, rows: np.ndarray, stream: int, device: int) -> CopyEvent:
        """Queue device-to-host copies on a CUDA stream; the slot is not reused before they land.

        Args:
            rows: (device address, offset from the slot start, nbytes) rows.
            stream: the CUDA stream handle (``torch.cuda.Stream.cuda_stream``).
            device: the CUDA device index.

        Returns:
            An event that completes once the copies landed (``wait(timeout)``, ``query()``).
        """
        event = self.segment.copy_from_device(_shift(rows, self.offset), stream, device)
        self.pending.append(event)
        return event

    def copies_pending(self) -> bool:
        """Whether device-to-host copies queued into this slot have not landed yet."""
        try:
            self.pending = [event for event in self.pending if not event.query()]
        except CudaError:
            self.segment.keep_mapped()  # whether its copies landed cannot be known
            raise
        return bool(self.pending)

    def close(self) -> None:
        """Unpin, unlink and unmap our mapping; torch's mapping lives while tensors view it.

        Device copies must never land in memory that was unpinned and unmapped: if one has not
        completed within the device-copy timeout, the slot is unlinked (its name goes) but its
        memory stays pinned and mapped for the rest of the process, and that is logged.
        """
        timeout = knobs.device_copy_timeout()
        unfinished = [event for event in self.pending if not _landed(event, timeout)]
        self.pending = []
        sharing.unregister_slot(self.storage)
        self._bases.clear()
        if unfinished or self.segment.kept_mapped:
            logger.error(
                "slot %s: device copies into it may still land (%d not finished after %.3g s, "
                "or a batch failed part-way); its memory stays mapped and pinned until the "
                "process exits, so that they cannot corrupt other memory",
                self.name, len(unfinished), timeout,
            )  # fmt: skip
            self.segment.keep_mapped()
        if self.adopted:
            with contextlib.suppress(OSError):
                self.segment.unlink()
        self.segment.close()

    def __repr__(self) -> str:
        return (
            f"<Slot {self.index} {self.name} {self.state.value} "
            f"generation={self.generation} capacity={self.capacity}>"
        )


def _landed(event: CopyEvent, timeout: float) -> bool:
    """Whether a batch of device copies completed within `timeout` seconds; False too when CUDA
    cannot say (a failed or sticky driver call): its copies may still land."""
    try:
        return bool(event.wait(timeout))
    except CudaError as exc:
        logger.error("a device copy's completion cannot be known: %s", exc)
        return False


class Arena:
    """A ring of `num_slots` shared-memory slots of `slot_capacity` bytes each.

    Creating a slot allocates and faults in every page, and page-locks them for CUDA when `pin`
    is True (or None and CUDA is available); this is the expensive step, and it happens once.
    The constructor creates every slot (so every segment has its name from the start). With
    ``background=True`` only the first is usable at once, and unless it is pinned its pages are
    not allocated either: the first stage writes them through the slot's file (`Slot.fill_from_
    host`, for host memory) or allocates what it needs (`Slot.reserve`). A background thread
    then maps all of the first slot and makes the others, once the first stage into the first
    slot is done; each joins the ring when it is ready (one it cannot fault in is removed and
    logged; the arena goes on without it).

    The arena owns its segments: `close` unlinks them. Its methods may be called from any
    thread; slot states change under one lock.

    Args:
        slot_capacity: bytes per slot, rounded up to ``PYSHMCKPT_SLOT_GRANULARITY`` (2 MiB).
        num_slots: how many slots.
        pin: page-lock the slots for CUDA (None: when CUDA is available here). Slots that
            cannot be pinned stay unpinned: a `PinningWarning` is issued for those made here,
            and a log record for those made in the background.
        background: make only the first slot usable at once and prepare the rest on a
            background thread.
        adopt: a segment holding a checkpoint taken over from a writer (the memory tier): it
            becomes slot 0, held, and sets the slot capacity; with `background`, the other
            slots are prepared by the background thread at once.

    Attributes:
        slot_capacity: bytes per slot, after rounding.
        slots: the slots, in order.
        closed: True once `close` ran.
        pin_error: why pinning failed ("" when it did not).

    Raises:
        ConfigTypeError: `slot_capacity` or `num_slots` is not an int.
        ConfigError: `slot_capacity` or `num_slots` is not positive, or a ``PYSHMCKPT_*``
            variable is invalid.
        PyshmckptOSError: a segment cannot be created (``/dev/shm`` too small, a limit
            reached); the slots made so far are closed.
    """

    def __init__(
        self,
        slot_capacity: int,
        num_slots: int = 2,
        *,
        pin: bool | None = None,
        background: bool = False,
        adopt: Segment | None = None,
    ) -> None:
        if not isinstance(slot_capacity, int) or isinstance(slot_capacity, bool):
            raise ConfigTypeError(
                f"slot_capacity must be an int, not {type(slot_capacity).__name__}"
            )
        if not isinstance(num_slots, int) or isinstance(num_slots, bool):
            raise ConfigTypeError(f"num_slots must be an int, not {type(num_slots).__name__}")
        if slot_capacity <= 0:
            raise ConfigError(f"slot_capacity must be positive, not {slot_capacity}")
        if num_slots <= 0:
            raise ConfigError(f"num_slots must be positive, not {num_slots}")
        granularity = knobs.slot_granularity()
        self.slot_capacity = -(-slot_capacity // granularity) * granularity
        self.pin_error = ""
        if pin is None:
            pin = cuda.cuda_available()
        self._pin = pin
        self.slots: list[Slot] = []
        self._cond = threading.Condition()
        self.closed = False
        self._writing_at_close: list[Slot] = []  # leased slots whose close waits for the lease
        self._creator: threading.Thread | None = None
        # The background thread pins on the caller's device (a new thread's current one is 0).
        self._device = torch.cuda.current_device() if pin and torch.cuda.is_available() else None
        if adopt is not None:
            self.slot_capacity = int(adopt.size)
        try:
            if adopt is not None:
                try:
                    adopt.allocate_pages(0, int(adopt.mapped_size))
                except OSError as exc:
                    raise from_os_error(exc, f"cannot take over segment {adopt.name}") from exc
                slot = Slot(self, 0, self.slot_capacity, segment=adopt)
                slot.held = True
                self._pin_slot(slot)
                self.slots.append(slot)
            for i in range(len(self.slots), num_slots):
                slot = self._new_slot(i, populate=not background or (i == 0 and pin))
                slot.ready = (i == 0 or not background) and not (adopt is not None and background)
                self.slots.append(slot)
            if self.pin_error:
                message = (
                    f"shared-memory arena {self.name} could not be pinned for CUDA "
                    f"({self.pin_error}); device-to-host staging will be slower"
                )
                warn_once(logger, f"pin: {self.pin_error}", "%s", message)
                warnings.warn(message, PinningWarning, stacklevel=3)
        except BaseException:
            for slot in self.slots:
                slot.close()
            raise
        logger.debug(
            "created arena %s: %d slots of %d bytes%s%s",
            self.name, num_slots, self.slot_capacity, ", pinned" if self.pinned else "",
            ", filled in the background" if background else "",
        )  # fmt: skip
        if not all(slot.reserved == slot.capacity for slot in self.slots):
            self._creator = threading.Thread(
                target=self._prepare_rest, name="pyshmckpt-slots", daemon=True
            )
            self._creator.start()

    def _new_slot(self, index: int, *, populate: bool = True) -> Slot:
        slot = Slot(self, index, self.slot_capacity, populate=populate)
        if populate:
            self._pin_slot(slot)
        return slot

    def _pin_slot(self, slot: Slot) -> None:
        if self._pin and not slot.segment.pin(knobs.pin_chunk_bytes()):
            self.pin_error = self.pin_error or slot.segment.pin_error

    def _prepare_rest(self) -> None:
        """The background thread: allocate and map the rest of the first slot, then fault in and
        pin each slot that is not ready, in pieces (so that close() waits for one piece at
        most), and let it join the ring."""
        first = self.slots[0]
        with self._cond:  # after the first stage into slot 0, not during it: both need the cores
            self._cond.wait_for(  # (an adopted slot 0 holds a checkpoint: nothing to wait for)
                lambda: (
                    self.closed
                    or first.adopted
                    or (first.generation >= 0 and first.state is not SlotState.STAGING)
                )
            )
        if self._device is not None:
            torch.cuda.set_device(self._device)
        if first.ready and first.reserved < first.capacity:
            try:
                if not self._fill(first, in_use=True):
                    return
                first.note_reserved(first.capacity)
            except Exception as exc:
                logger.warning(
                    "arena %s: cannot allocate the rest of slot 0 (%s); it holds state dicts of "
                    "up to %d bytes", self.name, exc, first.reserved,
                )  # fmt: skip
        for slot in [s for s in self.slots if not s.ready]:
            try:
                if not self._fill(slot):
                    return
                slot.note_reserved(slot.capacity)
                self._pin_slot(slot)
                if self._pin and not slot.segment.pinned:
                    warn_once(
                        logger, f"pin: {self.pin_error}", "arena %s could not be pinned (%s); "
                        "device-to-host staging will be slower", self.name, self.pin_error,
                    )  # fmt: skip
            except Exception as exc:
                logger.warning(
                    "arena %s: cannot fill slot %d (%s); going on without it",
                    self.name, slot.index, exc,
                )  # fmt: skip
                with self._cond:
                    self.slots.remove(slot)
                slot.close()
                continue
            with self._cond:
                slot.ready = True
                self._cond.notify_all()
            logger.debug("arena %s: slot %d ready", self.name, slot.index)

    def _fill(self, slot: Slot, *, in_use: bool = False) -> bool:
        """Allocate and map every page of `slot`, in pieces; False if the arena closed first. A
        slot that stages may write into meanwhile (`in_use`) is allocated without a page being
        touched; another is reserved and populated on the thread pool, which touches pages
        where the kernel cannot map them (reserved first, so a full /dev/shm is an error, not a
        SIGBUS)."""
        size = int(slot.segment.mapped_size)
        for start in range(0, size, _POPULATE_PIECE):
            if self.closed:
                return False
            piece = min(_POPULATE_PIECE, size - start)
            if in_use:
                slot.allocate(start, piece)
            else:
                slot.populate(start, piece)
        return True

    @property
    def name(self) -> str:
        """The first slot's segment name, which names the arena in messages."""
        return self.slots[0].name if self.slots else "<empty arena>"

    @property
    def pinned(self) -> bool:
        """Whether every slot is page-locked for CUDA."""
        return all(slot.segment.pinned for slot in self.slots)

    def transition(self, slot: Slot, state: SlotState) -> None:
        """Move `slot` to `state` (see `SlotState` for the allowed moves).

        Moving to FREE forgets the slot's manifest. A slot leaving WRITING after `close` is
        closed now.

        Args:
            slot: one of this arena's slots.
            state: where it goes.

        Raises:
            SlotStateError: the state machine does not allow that move.
        """
        with self._cond:
            leaving_write = slot.state is SlotState.WRITING and state is not SlotState.WRITING
            self._move(slot, state)
            self._cond.notify_all()
            close_now = self.closed and leaving_write and slot in self._writing_at_close
            if close_now:
                self._writing_at_close.remove(slot)
        if close_now:  # the writer is done with it: what close() left for it happens now
            slot.close()

    def _move(self, slot: Slot, state: SlotState) -> None:
        """The one place a slot's state changes (the lock held), checked against the state
        machine: SlotStateError for a move it does not allow."""
        if state not in _TRANSITIONS[slot.state]:
            raise SlotStateError(
                f"slot {slot.index} of {self.name} cannot go from {slot.state.value} "
                f"to {state.value}"
            )
        slot.state = state
        if state is SlotState.FREE:
            slot.manifest = None
            slot.staged_id = None

    def _available(self, slot: Slot) -> bool:
        if slot.state is SlotState.READY and not slot.referenced():
            self._move(slot, SlotState.FREE)  # nobody holds the staged tensors any more
        return slot.state is SlotState.FREE and not slot.held and not slot.copies_pending()

    def hold(self, slot: Slot | None) -> None:
        """Make `slot` the one slot of this arena that holds the newest checkpoint (None: no
        slot does); a slot no longer held is free for the next stage once nothing else uses it.

        Args:
            slot: one of this arena's slots, or None.
        """
        with self._cond:
            for other in self.slots:
                other.held = other is slot
            self._cond.notify_all()

    def acquire(self, generation: int, timeout: float) -> Slot:
        """Take a free slot into STAGING, waiting up to `timeout` seconds for one to free up.

        A READY slot whose staged state dict is no longer referenced is free. A staged state
        dict that only a reference cycle still holds (torch's AsyncCheckpointer leaves its
        staged dicts in cycles of Futures and callbacks) keeps its slot until the cycle
        collector runs: while no slot is free, the collector is run at once and then every half
        second of the wait.

        Args:
            generation: the number of this stage, recorded in the slot.
            timeout: seconds to wait at most.

        Returns:
            The slot, now STAGING; the caller moves it on with `transition`.

        Raises:
            StagerClosedError: the arena is closed.
            SlotsBusyError: no slot became free within `timeout` (a free slot still being
                faulted in is waited for: it is not busy).
        """
        deadline = time.monotonic() + timeout
        collected: float | None = None
        while True:
            with self._cond:
                if self.closed:
                    raise StagerClosedError(f"arena {self.name} is closed")
                for slot in self.slots:
                    if slot.ready and self._available(slot):
                        self._move(slot, SlotState.STAGING)
                        slot.generation = generation
                        return slot
                now = time.monotonic()
                remaining = deadline - now
                collect = any(s.state is SlotState.READY for s in self.slots) and (
                    collected is None or now - collected >= _COLLECT_EVERY
                )
                # A free slot still being faulted in (in the background) is not a busy one: it
                # is waited for whatever the timeout (a loaded node may take a while).
                filling = any(not s.ready and self._available(s) for s in self.slots)
                if remaining <= 0 and not collect and not filling:
                    states = ", ".join(s.state.value for s in self.slots)
                    raise SlotsBusyError(
                        f"no free slot among {len(self.slots)} after {timeout:.3g}s (slots: {states}); "
                        "staged state dicts that are still referenced, or still being written, "
                        "keep their slots: drop them or release() them"
                    )
                if not collect:
                    # Releases notify at once; dropped references are noticed on the next check.
                    self._cond.wait(min(remaining, 0.005) if remaining > 0 else 0.005)
                    continue
            gc.collect()  # outside the lock: finalizers it runs may close or release slots
            # From its end: a collection slower than the interval (a large heap) must not start
            # the next one at once, forever, past the deadline.
            collected = time.monotonic()

    def find(self, staged_id: int) -> list[Slot]:
        """The slots (READY or WRITING) whose staged state dict had this id.

        Ids of dead objects are reused, so the caller must check which candidate really holds
        its object.

        Args:
            staged_id: ``id()`` of a staged state dict.

        Returns:
            The candidate slots (usually none or one).
        """
        with self._cond:
            return [
                slot
                for slot in self.slots
                if slot.staged_id == staged_id
                and slot.state in (SlotState.READY, SlotState.WRITING)
            ]

    def idle(self) -> bool:
        """Whether no slot is staging, being written, referenced or receiving copies.

        Returns:
            True when the arena may be closed without harm to anyone.
        """
        with self._cond:
            return all(self._available(slot) for slot in self.slots)

    def close(self) -> None:
        """Unpin, unlink and unmap. Staged tensors still referenced keep their own mapping.

        Blocks until the background thread stops (after the piece it is faulting in) and
        device copies into the slots have landed (bounded by
        ``PYSHMCKPT_DEVICE_COPY_TIMEOUT``). A slot leased to a writer (WRITING) is closed when
        the lease ends instead: the writer may not have attached its segment yet (torch's
        AsyncCheckpointer closes its stager before the process that writes what was staged).
        Idempotent.
        """
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._writing_at_close = [s for s in self.slots if s.state is SlotState.WRITING]
            self._cond.notify_all()
        if self._creator is not None:
            self._creator.join()  # it stops after the piece it is faulting in
        for slot in self.slots:
            if slot not in self._writing_at_close:
                slot.close()

    def __repr__(self) -> str:
        return (
            f"<Arena {self.name} slots={len(self.slots)} slot_capacity={self.slot_capacity} "
            f"pinned={self.pinned}{' closed' if self.closed else ''}>"
        )
