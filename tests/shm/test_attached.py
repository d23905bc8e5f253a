"""AttachedSegments: the writer's mappings of the trainer's slots."""

from __future__ import annotations

from pyshmckpt.shm import Arena, AttachedSegments

from helpers import minor_faults_reading

PAGE = 4096


def test_a_slot_is_read_without_page_faults_and_others_wait_for_their_first_write():
    arena = Arena(32 << 20, 2)
    attached = AttachedSegments()
    try:
        described = [(s.name, int(s.segment.size), bytes(s.segment.token)) for s in arena.slots]
        attached.sync(described)
        pages = int(arena.slots[0].segment.mapped_size) // PAGE
        first = attached.slot(arena.slots[0].address())
        view = first.memoryview()
        try:
            assert minor_faults_reading(view) < pages // 1024  # mapped by its first write, once
        finally:
            view.release()
        assert attached.names() == {s.name for s in arena.slots}
        # Slot 1 is attached but not mapped until a write reads it (a read fault maps up to 16
        # pages here, 512 with huge pages in shared memory).
        second = attached._segments[arena.slots[1].name]
        view = memoryview(second)
        try:
            assert minor_faults_reading(view) >= pages // 512
        finally:
            view.release()
    finally:
        attached.sync([])
        arena.close()


def test_a_write_maps_the_bytes_it_reads_and_a_larger_one_the_rest():
    # The trainer may not have allocated a slot's later pages yet (a first stage writes only the
    # state's bytes): a write maps as far as its manifest reaches, a larger write further.
    arena = Arena(32 << 20, 1)
    attached, other = AttachedSegments(), AttachedSegments()
    try:
        slot = arena.slots[0]
        described = [(slot.name, int(slot.segment.size), bytes(slot.segment.token))]
        attached.sync(described)
        other.sync(described)
        size = int(slot.segment.size)
        half = (size // 2) & ~(PAGE - 1)
        pages = half // PAGE
        with attached.slot(slot.address(), half).memoryview() as view:
            assert minor_faults_reading(view[:half]) < pages // 1024
        with other.slot(slot.address(), half).memoryview() as view:  # a mapping of its own
            assert minor_faults_reading(view[half:]) >= pages // 512  # not mapped by that write
        with attached.slot(slot.address(), size).memoryview() as view:
            assert minor_faults_reading(view[half:]) < pages // 1024  # mapped by the larger one
    finally:
        attached.sync([])
        other.sync([])
        arena.close()


def test_a_segment_that_cannot_be_attached_never_keeps_the_others_from_being_attached():
    import pytest

    from pyshmckpt import PathNotFoundError, PyshmckptError
    from pyshmckpt.shm.address import SlotAddress

    arena = Arena(1 << 20, 2, pin=False)
    attached = AttachedSegments()
    try:
        gone, whole = arena.slots
        described = [(s.name, int(s.segment.size), bytes(s.segment.token)) for s in arena.slots]
        wrong_token = [(whole.name, int(whole.segment.size), bytes(16))]
        gone.segment.unlink()  # the trainer closed it after describing it
        attached.sync([described[0], *wrong_token])  # listed first: neither is attachable
        with pytest.raises(PathNotFoundError):
            attached.slot(gone.address())
        with pytest.raises(PyshmckptError):
            attached.slot(whole.address())
        attached.sync(described)  # the right token: attached now, whatever failed before it
        assert attached.names() == {whole.name}
        assert attached.slot(whole.address()).memoryview().nbytes > 0
        with pytest.raises(PathNotFoundError):
            attached.slot(SlotAddress("pyshmckpt-never-described", 0, 0, bytes(16)))
    finally:
        attached.sync([])
        arena.close()
