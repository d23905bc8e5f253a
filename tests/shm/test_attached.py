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
