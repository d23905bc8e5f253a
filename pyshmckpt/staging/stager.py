"""SlotStager: stages state dicts into shared-memory slots (`ShmStager` adds torch's protocols).

Only the arena and this module move a slot through its states. A consumer (the writer
transport) leases the slot of a staged state dict with `lease_staged` or `SlotStager.stage_leased`
and gives it back once the writer no longer reads it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from .. import _torch_private, knobs
from .._gc import gc_paused
from ..errors import (
    CapacityError,
    ConfigError,
    ConfigTypeError,
    SlotStateError,
    StagerClosedError,
)
from ..shm import Arena, Slot, SlotAddress, SlotState
from ..shm.native import Segment, set_copy_threads
from . import copies, guards, layout, planner
from .dtensors import loaded_dtensor_type
from .manifest import Manifest, rebuild, tensor_steps

logger = logging.getLogger(__name__)

# Every live stager, so that a consumer handed a staged state dict can find the one that staged it.
_STAGERS: weakref.WeakSet[SlotStager] = weakref.WeakSet()

_Stager = TypeVar("_Stager", bound="SlotStager")


class StagedHandle:
    """Where a staged state dict lives: its arena, slot, generation and manifest.

    `ShmStager.handle` returns one, which only describes the slot. The library's transport also
    leases slots through handles (``SlotStager.lease``, ``SlotStager.stage_leased``,
    ``lease_staged``): a leased slot is neither freed nor overwritten until ``give_back``, which
    the holder calls once the writer no longer reads the slot.

    Attributes:
        arena: the `Arena` the slot belongs to.
        slot: the `Slot` holding the staged bytes.
        generation: the number of the stage that filled the slot (a new stage into the same
            slot has another).
        manifest: the `Manifest` describing the staged state dict (structure, dtypes, shapes
            and where each tensor's bytes lie in the slot).
    """

    __slots__ = ("arena", "slot", "generation", "manifest", "_stager", "_owned", "_leased")

    def __init__(
        self, stager: SlotStager, slot: Slot, *, leased: bool = False, owned: bool = False
    ) -> None:
        self.arena = slot.arena
        self.slot = slot
        self.generation = slot.generation
        if slot.manifest is None:
            raise StagerClosedError("the slot holds no staged state dict")
        self.manifest: Manifest = slot.manifest
        self._stager = stager
        self._owned = owned  # staged for this lease alone: freed when given back
        self._leased = leased

    @property
    def address(self) -> SlotAddress:
        """How another process attaches the slot (segment name, size, token, data offset)."""
        return self.slot.address()

    def segments(self) -> list[tuple[str, int, bytes]]:
        """Every live segment of the stager that staged this state dict.

        Returns:
            (name, data size in bytes, token) of each, as `SlotStager.segments`.
        """
        return self._stager.segments()

    def descriptors(self) -> dict[str, int]:
        """The open descriptor of every live segment of the stager, by name (see
        `SlotStager.descriptors`)."""
        return self._stager.descriptors()

    def give_back(self) -> None:
        """End the lease: the writer no longer reads the slot.

        A slot staged for the lease alone (`SlotStager.stage_leased`) is free again; one the
        caller staged is READY again and frees itself once the caller drops (or releases) its
        staged state dict. Idempotent, and a no-op for a handle that holds no lease; may be
        called from any thread.
        """
        if not self._leased:
            return
        self._leased = False
        self.arena.transition(self.slot, SlotState.FREE if self._owned else SlotState.READY)


class SlotStager:
    """Stage state dicts into a ring of shared-memory slots.

    `stage` copies every tensor (CPU: thread pool, GIL released; CUDA: batched device-to-host
    copies on a side stream) into a free slot and returns the same structure with CPU tensors
    that view the slot. NumPy arrays, and CuPy arrays (objects with ``__cuda_array_interface__``),
    are staged as the tensors that view them and come back as NumPy arrays over the slot
    (`pyshmckpt.load` gives a CuPy array back). `ShmStager` is this stager with torch's stager
    protocols, for DCP and torch's checkpointers; the `Checkpointer` stages with this class, which
    loads none of DCP. The staged state dict is an ordinary state dict to every consumer: each staged
    block (the bytes of one source storage) is a storage of its own, so torch.save writes each
    tensor's bytes once and mixed dtypes are fine; torch's multiprocessing pickler (DCP's process
    executor, torch's CheckpointProcess) sends a whole slot as a single file descriptor
    (`pyshmckpt.shm.sharing`). The result is a snapshot: changing the source afterwards changes
    nothing in it.

    The stager owns the shared memory: a slot stays busy while its staged tensors are
    referenced in this process or until `release` is called for it; `close` (or the end of a
    ``with`` block) frees the arenas, and staged tensors still held keep their own mapping of
    the memory.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        slots: int | None = None,
        async_staging: bool = False,
        allow_growth: bool = True,
        pin: bool | None = None,
        slot_timeout: float | None = None,
        headroom: float | None = None,
        validate: Callable[[Manifest], None] | None = None,
        pickle_unsupported: bool = False,
        reuse_plans: bool = True,
    ) -> None:
        """Make a stager: its arena now with `capacity_bytes`, else at the first stage.

        Args:
            capacity_bytes: bytes per slot. Given, the arena is created, faulted in and pinned
                here, so the first stage costs what later ones do. None: sized from the first
                state dict with ``headroom`` (that stage creates one slot, writing host tensors
                through its file, and the rest of it and the other slots are allocated in the
                background; so does a move to a larger arena).
            slots: slots in the ring (default 2, ``PYSHMCKPT_SLOTS``).
            async_staging: return a Future from stage(); copies run on a background thread.
            allow_growth: when a state dict outgrows its slot, move to a larger arena (the old
                one is freed once none of its slots is in use) instead of raising
                `CapacityError`.
            pin: page-lock the arena for CUDA; None pins when CUDA is available.
            slot_timeout: seconds stage() waits for a busy slot (default 60,
                ``PYSHMCKPT_SLOT_TIMEOUT``).
            headroom: slot size over the first state dict's size when sizing automatically
                (default 1.25, ``PYSHMCKPT_HEADROOM``).
            validate: called with each state dict's `Manifest` after the layout walk and before
                a slot is taken or anything copied; whatever it raises, stage() raises, with
                nothing staged.
            pickle_unsupported: values a slot cannot hold (sparse, nested, quantized and meta
                tensors, tensor subclasses, arrays torch cannot view) are deep-copied and
                carried pickled beside the slot, as torch's transport would pickle them,
                instead of raising `UnsupportedValueError`.
            reuse_plans: a state dict of the same structure as the previous one (same
                containers, keys, tensor dtypes, shapes, strides, devices and storage sharing)
                reuses its layout after a check, instead of being laid out again; ``plan_stats``
                counts both.

        Raises:
            ConfigError: ``capacity_bytes`` or ``slots`` is not positive, ``slot_timeout`` is
                negative, ``headroom`` is below 1, or a ``PYSHMCKPT_*`` variable is invalid.
            ConfigTypeError: ``capacity_bytes`` is not an int, ``slot_timeout`` or ``headroom``
                is not a number, or ``validate`` is not callable.
            PyshmckptOSError: the slots of ``capacity_bytes`` cannot be created (``/dev/shm``
                too small).
        """
        self._closed = True  # until fully constructed, so __del__ has nothing to do
        self._closing = False
        if capacity_bytes is not None and (
            not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool)
        ):
            raise ConfigTypeError(
                f"capacity_bytes must be an int or None, not {type(capacity_bytes).__name__}"
            )
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be positive, not {capacity_bytes}")
        self._slots = knobs.slots() if slots is None else slots
        if not isinstance(self._slots, int) or isinstance(self._slots, bool) or self._slots < 1:
            raise ConfigError(f"slots must be a positive int, not {slots!r}")
        self._slot_timeout = (
            knobs.slot_timeout() if slot_timeout is None else _number("slot_timeout", slot_timeout)
        )
        if self._slot_timeout < 0:
            raise ConfigError(f"slot_timeout must be >= 0, not {slot_timeout}")
        self._headroom = knobs.headroom() if headroom is None else _number("headroom", headroom)
        if self._headroom < 1.0:
            raise ConfigError(f"headroom must be >= 1.0, not {headroom}")
        if validate is not None and not callable(validate):
            raise ConfigTypeError(
                f"validate must be callable or None, not {type(validate).__name__}"
            )
        self._validate = validate
        self._pickle_unsupported = bool(pickle_unsupported)
        self._planner = planner.Planner(
            pickle_unsupported=self._pickle_unsupported, reuse=bool(reuse_plans)
        )
        self._allow_growth = bool(allow_growth)
        self._pin = pin
        self._async = bool(async_staging)
        self._generations = itertools.count()
        self._lock = threading.RLock()
        # The newest arena takes new stages; older ones are closed once idle. The finalizer holds
        # this same list, so it closes whatever is in it at the time.
        self._arenas: list[Arena] = []
        self._streams = copies.SideStreams()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Any] | None = None
        threads = knobs.copy_threads()
        if threads is not None:
            set_copy_threads(threads)
        if capacity_bytes is not None:
            self._arenas.append(Arena(capacity_bytes, self._slots, pin=pin))
        if self._async:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyshmckpt-stage")
        self._closed = False
        self._finalizer = weakref.finalize(self, SlotStager._finalize, self._arenas)
        _STAGERS.add(self)

    # -- public API -------------------------------------------------------------------------

    @property
    def arena(self) -> Arena | None:
        """The arena new stages go to (None before the first stage when no capacity was given)."""
        return self._arenas[-1] if self._arenas else None

    @property
    def closed(self) -> bool:
        """True once `close` has been called."""
        return self._closed or self._closing

    @property
    def staging_bound(self) -> float:
        """Seconds a stage can take at most: its wait for a free slot and for its device copies
        are each bounded (a margin for the copies on the host)."""
        return self._slot_timeout + knobs.device_copy_timeout() + 30.0

    @property
    def plan_stats(self) -> planner.PlannerStats:
        """Full layouts and reused ones so far (see ``reuse_plans``), and why the last full
        layout was needed."""
        return self._planner.stats

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        """Copy `state_dict` into a free slot; returns the staged copy.

        Blocks until the copies are done, or, with ``async_staging``, only while the state dict
        is laid out and checked: the copies then run on a background thread, and the caller
        must not change the source until the Future resolves (DCP's
        `synchronize_staging`); every torch optimizer's step and the forward of a module with
        buffers in training mode wait for it by themselves (see ``Checkpointer(overlap=True)``).
        A stage waits up to the slot timeout for a free slot. A failed stage leaves the stager
        usable, with nothing staged.

        Args:
            state_dict: nested dicts, lists and tuples (named tuples and OrderedDicts too) of
                tensors (CPU or CUDA, DTensors), NumPy and CuPy arrays, and other leaves.
            **kwargs: accepted and ignored (torch passes some).

        Returns:
            The staged state dict: the same structure, its tensors CPU tensors that view the
                slot (a snapshot: changing the source afterwards changes nothing in it), its
                NumPy and CuPy arrays NumPy arrays that view the slot, the other leaves copied.
                With ``async_staging``, a Future of it, which fails with the errors below that
                concern copies and slots.

        Raises:
            StagerClosedError: the stager is closed.
            UnsupportedValueError: a value cannot be staged (the message names its key path),
                such as an array torch cannot view or a CuPy array where torch has no CUDA;
                raised at once, also with ``async_staging``.
            CapacityError: the state dict does not fit a slot and ``allow_growth`` is False.
            SlotsBusyError: no slot became free within the slot timeout.
            StagingTimeoutError: device-to-host copies did not complete within
                ``PYSHMCKPT_DEVICE_COPY_TIMEOUT``.
            PyshmckptOSError: a slot could not be created or enlarged (``/dev/shm`` full).
        """
        if self._executor is None:
            self._check_open()
            # Validation first: nothing is staged for bad input.
            staging_plan = self._plan(state_dict, defer_flags=True)
            return self._staged(state_dict, staging_plan, None)
        future = self._executor.submit(self.prepare(state_dict))
        # An optimizer's step (and a forward that updates buffers) waits for the copies.
        guards.track(future, self.staging_bound)
        self._pending = future
        return future

    def prepare(self, state_dict: Any) -> Callable[[], Any]:
        """Lay `state_dict` out and check it now; copy it later, on any thread.

        What `stage` does on the caller's thread with ``async_staging``: the layout, the checks
        and, for CUDA tensors, an event on each device's current stream (the copies start
        after the work queued so far). Until the returned function has run, the caller must not
        change the tensors of `state_dict` (its other leaves are captured here).

        Args:
            state_dict: as for `stage`.

        Returns:
            A function of no arguments that fills a free slot and returns the staged state
                dict, raising what `stage` raises about copies and slots.

        Raises:
            StagerClosedError: the stager is closed.
            UnsupportedValueError: a value cannot be staged.
        """
        self._check_open()
        staging_plan = self._plan(state_dict, defer_flags=False)
        events = self._record_producers(staging_plan)
        return functools.partial(self._staged, state_dict, staging_plan, events)

    def handle(self, staged: Any) -> StagedHandle | None:
        """Describe where a state dict this stager returned is staged.

        Args:
            staged: a staged state dict (the object `stage` returned, not a part of it).

        Returns:
            Its arena, slot, generation and manifest (holding no lease), or None when
                `staged` is not a state dict this stager staged that is still in its slot.
        """
        slot = self._slot_of(staged)
        return StagedHandle(self, slot) if slot is not None else None

    def lease(self, staged: Any) -> StagedHandle | None:
        """Hold the slot of a staged state dict for a write until the handle is given back.

        While leased, the slot is neither freed nor overwritten, even when the caller drops
        the staged state dict.

        Args:
            staged: a state dict this stager's `stage` returned.

        Returns:
            The leased handle (call `StagedHandle.give_back` when the writer is done), or None
                when `staged` is not one of this stager's.

        Raises:
            SlotStateError: `staged` is leased already (being written).
        """
        slot = self._slot_of(staged)
        if slot is None:
            return None
        if slot.state is not SlotState.READY:
            raise SlotStateError(
                f"state dict of generation {slot.generation} is already being written"
            )
        slot.arena.transition(slot, SlotState.WRITING)
        return StagedHandle(self, slot, leased=True)

    def stage_leased(self, state_dict: Any) -> StagedHandle:
        """Stage `state_dict` into a slot of its own and lease it.

        No staged copy is handed out: the consumer reads the slot through the handle's
        manifest, and giving the handle back frees the slot. Blocks until the copies are done,
        whatever ``async_staging`` says.

        Args:
            state_dict: as for `stage`.

        Returns:
            The leased handle; the caller must call `StagedHandle.give_back`.

        Raises:
            StagerClosedError: the stager is closed.
            UnsupportedValueError: a value cannot be staged.
            CapacityError: the state dict does not fit a slot and ``allow_growth`` is False.
            SlotsBusyError: no slot became free within the slot timeout.
            StagingTimeoutError: device-to-host copies did not complete in time.
            PyshmckptOSError: a slot could not be created or enlarged.
        """
        self._check_open()
        slot, _ = self._stage(
            state_dict, self._plan(state_dict, defer_flags=True), None, lease=True
        )
        return StagedHandle(self, slot, leased=True, owned=True)

    def _slot_of(self, staged: Any) -> Slot | None:
        for arena in list(self._arenas):
            for slot in arena.find(id(staged)):
                if _views_slot(staged, slot):
                    return slot
        return None

    def segments(self) -> list[tuple[str, int, bytes]]:
        """Every live slot segment, for a process that attaches them.

        Returns:
            (segment name, data size in bytes, token) of each slot of each open arena.
        """
        return [
            (address.name, address.size, address.token)
            for arena in list(self._arenas)
            if not arena.closed
            for address in (slot.address() for slot in arena.slots)
        ]

    def descriptors(self) -> dict[str, int]:
        """The open descriptor of every live slot segment, by name: what keeps it alive (see
        `shm.stale`) for another process that is handed a duplicate. They belong to the arena
        and close with it.
        """
        return {
            slot.name: int(slot.segment.fd)
            for arena in list(self._arenas)
            if not arena.closed
            for slot in arena.slots
        }

    def release(self, staged: Any) -> None:
        """Declare a staged state dict done with: its slot may be overwritten by the next stage.

        Any tensor of it still held afterwards may see newer data. A slot leased for a write
        stays held until the lease is given back. May be called from any thread.

        Args:
            staged: a state dict this stager's `stage` returned; other objects are ignored.
        """
        handle = self.handle(staged)
        if handle is not None and handle.slot.state is SlotState.READY:
            handle.arena.transition(handle.slot, SlotState.FREE)
        self._collect_retired()

    def close(self) -> None:
        """Free the arenas (unpin, unmap, unlink). Idempotent; safe from ``__del__`` and atexit.

        Blocks while a stage already requested (``async_staging``) finishes: its Future may
        have been handed to a writer (torch's AsyncCheckpointer closes its stager before its
        process). Staged tensors still referenced stay valid: they keep torch's mapping of the
        memory. A slot leased for a write is freed when its lease ends.
        """
        if self._closed or self._closing:
            return
        self._closing = True  # refuses new stages; requested ones may still take a slot
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._closed = True
        self._finalizer()

    def __enter__(self: _Stager) -> _Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else repr(self.arena)
        return f"<{type(self).__name__} {state}>"

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise StagerClosedError("the stager is closed")

    @staticmethod
    def _finalize(arenas: list[Arena]) -> None:
        for arena in arenas:
            arena.close()
        arenas.clear()

    def _record_producers(self, plan: layout.StagingPlan) -> dict[int, torch.cuda.Event]:
        # Async mode: pending kernels on the caller's current streams must finish before copying.
        events = {}
        for device in set(plan.device) | {t.get_device() for _, t in plan.gathers if t.is_cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events[device] = event
        return events

    def _slot_for(self, nbytes: int) -> Slot:
        with self._lock:
            if self._closed:
                raise StagerClosedError("the stager is closed")
            arena = self.arena
            if arena is None or nbytes > arena.slot_capacity:
                if arena is not None and not self._allow_growth:
                    raise CapacityError(
                        f"the state dict needs {nbytes} bytes but slots hold {arena.slot_capacity} "
                        "and growth is disabled (allow_growth=False)"
                    )
                capacity = max(int(nbytes * self._headroom), 1)
                if arena is not None:
                    logger.info(
                        "a state dict of %d bytes outgrows the %d-byte slots of %s: "
                        "moving to a larger arena", nbytes, arena.slot_capacity, arena.name,
                    )  # fmt: skip
                # The stage waiting here needs one slot: the others are made in the background.
                arena = Arena(capacity, self._slots, pin=self._pin, background=True)
                self._arenas.append(arena)
            self._collect_retired()
        return arena.acquire(next(self._generations), self._slot_timeout)

    def detach(self) -> None:
        """Leave the arenas as they are for good (the process is ending, and another process
        takes their segments over): nothing is unlinked, now or at exit."""
        self._finalizer.detach()
        self._closed = True
        for arena in self._arenas:
            for slot in arena.slots:
                slot.segment.disown()

    def adopt(self, segment: Segment) -> Slot:
        """Take over a segment that holds a checkpoint (the memory tier) as the first slot of
        this stager's arena, held until `hold` names another slot: no allocation and no copy.
        Only before the first stage, with no arena made yet.

        Args:
            segment: the attached segment (its pages are allocated if some are not).

        Returns:
            Its slot.

        Raises:
            SlotStateError: the stager has an arena already.
            PyshmckptOSError: its pages cannot be allocated, or another slot cannot be made.
        """
        with self._lock:
            if self._arenas:
                raise SlotStateError("a stager that has an arena cannot take a segment over")
            arena = Arena(
                int(segment.size), self._slots, pin=self._pin, adopt=segment, background=True
            )
            self._arenas.append(arena)
            return arena.slots[0]

    def hold(self, slot: Slot | None) -> None:
        """Keep `slot` (which holds the newest checkpoint) from the next stages, and release the
        slot held before (None: release it alone). May be called from any thread.

        Args:
            slot: a slot of one of this stager's arenas, or None.
        """
        with self._lock:
            for arena in self._arenas:
                arena.hold(slot if slot is not None and slot.arena is arena else None)
        self._collect_retired()

    def _collect_retired(self) -> None:
        with self._lock:
            for arena in [a for a in self._arenas[:-1] if a.idle()]:
                arena.close()
                self._arenas.remove(arena)
                logger.debug("retired arena %s", arena.name)

    def _plan(self, state_dict: Any, *, defer_flags: bool) -> layout.StagingPlan:
        """Plan (and validate) `state_dict`. `defer_flags` lets a reused plan's flags be checked
        while its copies run, on the caller's thread: not for an asynchronous stage (whose
        copies run after stage() returned, when the caller may be changing the state dict), nor
        with a validator (it must see the flags of the moment)."""
        staging_plan = self._planner.plan(
            state_dict, defer_flags=defer_flags and self._validate is None
        )
        if self._validate is not None:
            with gc_paused():  # it may allocate per tensor too (the JSON check does)
                self._validate(staging_plan.manifest)
        return staging_plan

    def _staged(
        self,
        state_dict: Any,
        staging_plan: layout.StagingPlan,
        producers: dict[int, torch.cuda.Event] | None,
    ) -> Any:
        """Stage into a free slot; return the staged state dict (the slot is READY)."""
        _, staged = self._stage(state_dict, staging_plan, producers, lease=False)
        return staged

    def _stage(
        self,
        state_dict: Any,
        staging_plan: layout.StagingPlan,
        producers: dict[int, torch.cuda.Event] | None,
        *,
        lease: bool,
    ) -> tuple[Slot, Any]:
        """_stage_plan, and again with a full plan when a reused plan's recheck fails."""
        try:
            return self._stage_plan(staging_plan, producers, lease=lease)
        except _Relayout as relayout:
            # No validator to run again: flags are deferred only without one (see _plan).
            staging_plan = self._planner.replan(state_dict, staging_plan, relayout.reason)
        return self._stage_plan(staging_plan, producers, lease=lease)

    def _stage_plan(
        self,
        staging_plan: layout.StagingPlan,
        producers: dict[int, torch.cuda.Event] | None,
        *,
        lease: bool,
    ) -> tuple[Slot, Any]:
        """Fill a free slot. Leased, it goes straight to WRITING and no staged tensors are built
        (the consumer reads the slot through the manifest); otherwise it is READY and the staged
        state dict is returned."""
        manifest = staging_plan.manifest
        slot = self._slot_for(manifest.size)
        arena = slot.arena
        running = None
        staged = None
        try:
            running = copies.start(staging_plan, slot, self._streams, producers)
            # What the copies did not need checked first, checked while they run.
            if staging_plan.recheck is not None and (reason := staging_plan.recheck()) is not None:
                raise _Relayout(reason)
            if not lease:  # building the staged tensors overlaps with the copies
                with gc_paused():
                    staged = rebuild(manifest, slot.storage, slot.offset)
            running.wait()
        except BaseException as exc:
            if running is not None:
                copies.note_cleanup_error(exc, running.abandon())
            arena.transition(slot, SlotState.FREE)
            raise
        slot.manifest = manifest
        slot.staged_id = None if lease else id(staged)
        arena.transition(slot, SlotState.READY)
        if lease:
            arena.transition(slot, SlotState.WRITING)
        return slot, staged


class _Relayout(Exception):
    """A reused plan's recheck failed after its copies started: plan in full and stage again."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _views_slot(staged: Any, slot: Slot) -> bool:
    """Whether `staged` really is the state dict staged in `slot`, not a new object that reuses
    the address (the id) of one that no longer exists: its first tensor with bytes in the slot
    must view the slot."""
    manifest = slot.manifest
    if manifest is None:
        return False
    in_slot = np.flatnonzero(manifest.block >= 0)
    if not len(in_slot):
        return True  # no tensor bytes in the slot: nothing to confuse
    node = staged
    try:
        for step in tensor_steps(manifest.tree, int(in_slot[0])) or ():
            node = node[step]
    except (KeyError, IndexError, TypeError):
        return False
    if type(node) is np.ndarray:  # an array staged over the slot
        address = int(node.__array_interface__["data"][0])
    elif isinstance(node, torch.Tensor):
        if type(node) is loaded_dtensor_type():
            node = _torch_private.local_tensor(node)
        address = node.untyped_storage().data_ptr()  # each block is a storage of its own
    else:
        return False
    start = slot.storage.data_ptr()
    return start <= address < start + slot.storage.nbytes()


def lease_staged(staged: Any) -> StagedHandle | None:
    """Lease the slot of `staged` from whichever live stager staged it (see
    `SlotStager.lease`); None when no stager did."""
    for stager in list(_STAGERS):
        if stager.closed:
            continue
        handle = stager.lease(staged)
        if handle is not None:
            return handle
    return None


def _number(name: str, value: Any) -> float:
    """`value` as a float; ConfigTypeError unless it is an int or a float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number, not {value!r}")
    return float(value)
