"""Arena and slot state machine (pyshmckpt/arena.py)."""

from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyshmckpt import Arena, SlotsBusyError, SlotState, SlotStateError, StagerClosedError
from pyshmckpt.shm.arena import _TRANSITIONS

from helpers import child_env

MIB = 1 << 20
SHM = Path("/dev/shm")


@pytest.fixture
def arena():
    a = Arena(MIB, 2, pin=False)
    yield a
    a.close()


def test_capacity_rounded_to_granularity_and_slots_are_segments(arena):
    assert arena.slot_capacity == 2 * MIB  # default granularity 2 MiB
    assert len(arena.slots) == 2
    names = {slot.name for slot in arena.slots}
    assert len(names) == 2
    for slot in arena.slots:
        assert slot.state is SlotState.FREE
        assert slot.segment.size == arena.slot_capacity
        assert slot.offset == slot.segment.data_offset
        assert slot.storage.nbytes() == slot.segment.mapped_size


def test_slot_storage_shares_memory_with_the_segment(arena):
    slot = arena.slots[0]
    view = memoryview(slot.segment)
    view[slot.offset : slot.offset + 4] = b"abcd"
    staged = slot.base(torch.uint8)[slot.offset : slot.offset + 4]
    assert bytes(staged.tolist()) == b"abcd"
    staged.fill_(7)
    assert bytes(view[slot.offset : slot.offset + 4]) == b"\x07" * 4
    del staged
    view.release()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("1", 2), TypeError),
        ((1.5, 2), TypeError),
        ((True, 2), TypeError),
        ((MIB, "2"), TypeError),
        ((0, 2), ValueError),
        ((-1, 2), ValueError),
        ((MIB, 0), ValueError),
    ],
)
def test_bad_arguments(args, error):
    with pytest.raises(error):
        Arena(*args, pin=False)


def test_state_machine_allows_exactly_the_documented_transitions(arena):
    slot = arena.slots[0]
    for source, targets in _TRANSITIONS.items():
        for target in SlotState:
            slot.state = source
            if target in targets:
                arena.transition(slot, target)
                assert slot.state is target
            else:
                with pytest.raises(SlotStateError):
                    arena.transition(slot, target)
                assert slot.state is source
    slot.state = SlotState.FREE


def test_acquire_takes_free_slots_then_times_out(arena):
    first = arena.acquire(1, timeout=0)
    second = arena.acquire(2, timeout=0)
    assert {first.index, second.index} == {0, 1}
    assert first.state is second.state is SlotState.STAGING
    assert (first.generation, second.generation) == (1, 2)
    with pytest.raises(SlotsBusyError, match="no free slot"):
        arena.acquire(3, timeout=0.05)
    arena.transition(first, SlotState.FREE)
    assert arena.acquire(4, timeout=0) is first


def test_ready_slot_is_reclaimed_once_its_tensors_are_dropped(arena):
    slot = arena.acquire(0, timeout=0)
    held = slot.base(torch.float32)[slot.offset // 4 : slot.offset // 4 + 8]
    arena.transition(slot, SlotState.READY)
    other = arena.acquire(1, timeout=0)
    assert other is not slot
    with pytest.raises(SlotsBusyError):
        arena.acquire(2, timeout=0)
    view = held[2:4]  # a view of a staged tensor also keeps the slot
    del held
    with pytest.raises(SlotsBusyError):
        arena.acquire(2, timeout=0)
    del view
    assert arena.acquire(2, timeout=0) is slot


def test_a_slow_collection_does_not_wait_past_the_deadline(arena, monkeypatch):
    """A garbage collection slower than the interval between two (a process with a large heap)
    still lets acquire give up at its deadline."""
    slot = arena.acquire(0, timeout=0)
    held = slot.base(torch.float32)[:8]  # keeps the READY slot
    arena.transition(slot, SlotState.READY)
    arena.acquire(1, timeout=0)
    real = gc.collect

    def slow(*args):
        time.sleep(0.6)  # longer than the interval between two collections
        return real(*args)

    monkeypatch.setattr(gc, "collect", slow)
    started = time.monotonic()
    with pytest.raises(SlotsBusyError):
        arena.acquire(2, timeout=0.1)
    assert time.monotonic() - started < 10
    del held


def test_storage_object_reference_keeps_the_slot(arena):
    slot = arena.acquire(0, timeout=0)
    arena.transition(slot, SlotState.READY)
    storage = slot.base(torch.uint8)[:4].untyped_storage()
    arena.acquire(1, timeout=0)
    with pytest.raises(SlotsBusyError):
        arena.acquire(2, timeout=0)
    del storage
    assert arena.acquire(2, timeout=0) is slot


def test_writing_slot_is_never_reclaimed(arena):
    slot = arena.acquire(0, timeout=0)
    arena.transition(slot, SlotState.READY)
    arena.transition(slot, SlotState.WRITING)
    arena.acquire(1, timeout=0)
    with pytest.raises(SlotsBusyError):
        arena.acquire(2, timeout=0)
    arena.transition(slot, SlotState.FREE)
    assert arena.acquire(2, timeout=0) is slot


def test_idle_and_find(arena):
    assert arena.idle()
    slot = arena.acquire(0, timeout=0)
    assert not arena.idle()
    slot.staged_id = 1234
    arena.transition(slot, SlotState.READY)
    assert arena.find(1234) == [slot]
    assert arena.find(999) == []
    assert arena.idle()  # READY and unreferenced counts as free
    assert arena.find(1234) == []  # ... and checking reclaimed it


def test_close_is_idempotent_and_blocks_acquire():
    a = Arena(MIB, 1, pin=False)
    names = [slot.name for slot in a.slots]
    a.close()
    a.close()
    assert all(slot.segment.closed for slot in a.slots)
    with pytest.raises(StagerClosedError):
        a.acquire(0, timeout=0)
    assert names


def test_staged_tensors_outlive_close():
    a = Arena(MIB, 1, pin=False)
    slot = a.acquire(0, timeout=0)
    t = slot.base(torch.int64)[slot.offset // 8 : slot.offset // 8 + 4]
    t.copy_(torch.arange(4))
    a.close()
    # torch's own mapping keeps the memory valid after the segment is unlinked and unmapped.
    assert t.tolist() == [0, 1, 2, 3]


def test_pin_without_cuda_warns_and_stays_usable():
    import pyshmckpt

    if pyshmckpt.cuda_available():
        pytest.skip("a GPU is present: pinning succeeds")
    with pytest.warns(pyshmckpt.PinningWarning, match="could not be pinned"):
        a = Arena(MIB, 1, pin=True)
    try:
        assert not a.pinned
        assert a.pin_error
        slot = a.acquire(0, timeout=0)
        assert slot.state is SlotState.STAGING
    finally:
        a.close()


def test_background_arena_makes_one_slot_then_the_rest_after_the_first_stage():
    arena = Arena(MIB, 3, pin=False, background=True)
    try:
        # Every segment exists (and has its name) at once; only the first is filled in: the
        # others wait until the first stage leaves slot 0.
        assert len(arena.slots) == 3
        assert all((SHM / slot.name).exists() for slot in arena.slots)
        time.sleep(0.2)
        assert [slot.ready for slot in arena.slots] == [True, False, False]
        # Not pinned: not even the first slot's pages are allocated before its first stage.
        assert [slot.reserved for slot in arena.slots] == [0, 0, 0]
        assert arena.idle()
        first = arena.acquire(0, timeout=1.0)
        assert first is arena.slots[0]
        arena.transition(first, SlotState.READY)
        arena.transition(first, SlotState.WRITING)  # held: never reclaimed
        # A second acquire waits for a slot from the background thread instead of failing.
        second = arena.acquire(1, timeout=10.0)
        assert second is not first
        assert second.state is SlotState.STAGING
        arena.acquire(2, timeout=10.0)
        assert [slot.ready for slot in arena.slots] == [True, True, True]
        assert [slot.reserved for slot in arena.slots] == [arena.slot_capacity] * 3
        assert len({slot.name for slot in arena.slots}) == 3
        assert [slot.index for slot in arena.slots] == [0, 1, 2]
    finally:
        arena.close()


def test_closing_a_background_arena_while_it_creates_slots_leaves_nothing():
    arena = Arena(64 * MIB, 4, pin=False, background=True)
    slot = arena.acquire(0, timeout=1.0)
    arena.transition(slot, SlotState.READY)  # the background thread starts creating
    arena.close()  # joins it; the leak-check fixture fails the test on a leftover segment
    assert arena.closed
    with pytest.raises(StagerClosedError):
        arena.acquire(1, timeout=0.1)


def test_stager_without_capacity_creates_its_other_slots_in_the_background():
    from pyshmckpt import ShmStager

    with ShmStager(slots=2) as stager:
        staged = stager.stage({"w": torch.arange(1000)})
        assert stager.arena is not None
        again = stager.stage({"w": torch.arange(1000) + 1})  # needs the second slot
        assert [slot.ready for slot in stager.arena.slots] == [True, True]
        assert torch.equal(staged["w"], torch.arange(1000))
        assert torch.equal(again["w"], torch.arange(1000) + 1)


# The child runs in its own mount namespace with a small tmpfs over /dev/shm: a slot is created
# while the space is free (its pages are not allocated), then another file takes so much of it
# that writing the slot fails: 4 MiB into 2 MiB free (one write through the file), 36 MiB into
# 20 MiB free (split between the file and the mapping; either part may fail first).
_FULL_SHM_CHILD = """
import errno, os
import numpy as np
import torch
from pyshmckpt import Arena, PyshmckptOSError, _C

MIB = 1 << 20


def check(ok, what):  # not assert: the suite also runs under PYTHONOPTIMIZE, which children inherit
    if not ok:
        raise SystemExit(f"failed: {what}")


SLOT, FILLER = SLOT_MIB * MIB, FILLER_MIB * MIB
if SLOT > 32 * MIB and _C.num_threads() < 2:
    raise SystemExit(77)  # one thread: the write is not split
arena = Arena(SLOT, 1, pin=False, background=True)
slot = arena.slots[0]
source = np.arange(SLOT // 8 - 512, dtype=np.uint64)
rows = np.array([[source.ctypes.data, 0, source.nbytes]], dtype=np.uint64)
with open("/dev/shm/filler", "wb") as filler:
    filler.write(bytes(FILLER))
for attempt in (lambda: slot.fill_from_host(rows, source.nbytes),
                lambda: slot.allocate(0, slot.offset + source.nbytes)):
    try:
        attempt()
    except PyshmckptOSError as exc:
        check(isinstance(exc, OSError) and exc.errno == errno.ENOSPC, repr(exc))
        check("not enough shared memory" in str(exc), str(exc))
    else:
        raise SystemExit("no error on a full /dev/shm")
    check(slot.reserved == 0, f"reserved {slot.reserved} after a failed write")
os.unlink("/dev/shm/filler")
slot.fill_from_host(rows, source.nbytes)  # the same slot, once there is room
check(slot.reserved == source.nbytes, f"reserved {slot.reserved}")
start = slot.offset // 8
check(np.array_equal(slot.base(torch.uint64)[start : start + len(source)].numpy(), source), "data")
arena.close()
print("ok")
"""


@pytest.mark.parametrize(
    ("slot", "tmpfs", "filler"), [(4, 8, 6), (36, 80, 60)], ids=["file", "split"]
)
def test_a_full_dev_shm_fails_a_slot_write_cleanly_and_the_slot_is_written_once_there_is_room(
    tmp_path, slot, tmpfs, filler
):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to make a small /dev/shm")
    script = f'mount -t tmpfs -o size={tmpfs}m tmpfs /dev/shm || exit 77; exec "$0" -c "$1"'
    child = _FULL_SHM_CHILD.replace("SLOT_MIB", str(slot)).replace("FILLER_MIB", str(filler))
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, child],
        capture_output=True, text=True, timeout=120, env=child_env(), cwd=str(tmp_path),
    )  # fmt: skip
    if done.returncode == 77 or "unshare failed" in done.stderr:
        pytest.skip(f"cannot mount a small /dev/shm, or one thread: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


class CopyStillRunning:
    """A test double of a device copy's event (no GPU here) that never completes."""

    def wait(self, timeout: float) -> bool:
        return False

    def query(self) -> bool:
        return False


def test_a_slot_a_device_copy_may_still_write_is_never_unmapped(caplog):
    arena = Arena(MIB, 1, pin=False)
    slot = arena.slots[0]
    slot.pending.append(CopyStillRunning())
    address, size = int(slot.segment.address), int(slot.segment.mapped_size)
    ctypes.memset(address, 7, size)
    arena.close()
    assert slot.segment.kept_mapped
    assert slot.segment.closed  # its name is gone from /dev/shm, its descriptor closed
    assert not Path("/dev/shm", slot.name).exists()
    assert "stays mapped" in caplog.text
    # Still mapped: a late copy lands in our memory, not in memory reused for something else.
    assert ctypes.string_at(address + size - 16, 16) == b"\x07" * 16


def test_a_slot_still_being_faulted_in_is_waited_for_not_called_busy():
    """A free slot the background thread is still faulting in is coming, not busy: an acquire
    waits for it whatever its timeout (a loaded node may take long to fault a slot in)."""
    arena = Arena(256 * MIB, 2, pin=False, background=True)
    try:
        first = arena.acquire(0, timeout=1.0)
        arena.transition(first, SlotState.READY)
        arena.transition(first, SlotState.WRITING)  # held: the other slot is faulted in now
        second = arena.acquire(1, timeout=0)
        assert second is arena.slots[1]
        assert second.ready
        with pytest.raises(SlotsBusyError, match="no free slot"):  # a busy ring still times out
            arena.acquire(2, timeout=0)
    finally:
        arena.close()
