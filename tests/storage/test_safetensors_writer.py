"""The safetensors writer's O_DIRECT option: the file mirrors the slot, the aligned bulk bypasses
the page cache where the filesystem allows it, and the result reads exactly like a buffered one."""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import pyshmckpt
from pyshmckpt import ShmStager
from pyshmckpt.shm import SlotMapping
from pyshmckpt.staging import layout
from pyshmckpt.storage import safetensors_writer as file_writer
from pyshmckpt.storage.safetensors_writer import (
    BLOCK_PREFIX,
    DIRECT_IO_BLOCK,
    SafetensorsWriter,
    plan_file,
)

from helpers import SAVE_TIMEOUT, opened, same_bytes


def mixed_state() -> dict[str, Any]:
    """Sizes that are not multiples of 4 KiB, several dtypes, a view with gaps, a tied alias and
    one tensor big enough to span several O_DIRECT chunks when the chunk size is lowered."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300_001, generator=g)
    odd = torch.arange(77, dtype=torch.int16)
    wide = torch.randn(33, 17, generator=g, dtype=torch.float64)
    return {
        "big": big,
        "odd": odd,
        "wide_t": wide.t(),  # a non-contiguous view, staged as its whole storage
        "every_third": torch.arange(1000, dtype=torch.uint8)[::3],
        "tied": [big, odd],
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "step": 12,
    }


def supports_direct_io(directory: Path) -> bool:
    """Whether `directory`'s filesystem accepts an aligned O_DIRECT write."""
    probe = directory / ".probe"
    buf = mmap.mmap(-1, DIRECT_IO_BLOCK)  # page-aligned
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def write_directly(
    tmp_path: Path, state: dict[str, Any], **kwargs: Any
) -> tuple[Path, SafetensorsWriter]:
    """Stage `state` and write it with SafetensorsWriter in this process (no subprocess)."""
    writer = SafetensorsWriter(direct_io=True, **kwargs)
    with ShmStager(slots=1) as stager:
        staged = stager.stage(state)
        handle = stager.handle(staged)
        target = tmp_path / "ck"
        writer.write_slot(
            str(target), SlotMapping(handle.slot.segment, handle.slot.offset), handle.manifest
        )
        del staged
    return target, writer


def check_same(loaded: dict[str, Any], state: dict[str, Any]) -> None:
    for key in ("big", "odd", "wide_t", "every_third", "bf16"):
        assert same_bytes(loaded[key], state[key]), key
    assert (
        loaded["tied"][0] is loaded["big"]
        or loaded["tied"][0].data_ptr() == loaded["big"].data_ptr()
    )
    assert loaded["step"] == 12


def test_mirrored_file_is_a_safetensors_file_whose_data_starts_on_a_block(tmp_path):
    state = mixed_state()
    target, writer = write_directly(tmp_path, state)
    data = target / "rank0.safetensors"
    raw = data.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % DIRECT_IO_BLOCK == 0
    check_same(pyshmckpt.load(target), state)
    assert pyshmckpt.verify(target) == 5  # "tied" holds the same tensor objects again
    read = load_file(str(data))  # the standard reader accepts it, padding entries included
    assert torch.equal(read["big"], state["big"])
    assert any(name.startswith(BLOCK_PREFIX + "pad") for name in read)
    if supports_direct_io(tmp_path):
        staged_bytes = len(raw) - (8 + n)
        assert writer.last_direct_bytes == staged_bytes - staged_bytes % DIRECT_IO_BLOCK > 0
    else:
        assert writer.last_direct_bytes == 0


def test_chunks_written_in_parallel_land_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(file_writer, "DIRECT_IO_CHUNK", 3 * DIRECT_IO_BLOCK)  # ~100 chunks
    state = mixed_state()
    target, _ = write_directly(tmp_path, state)
    check_same(pyshmckpt.load(target), state)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP], ids=errno.errorcode.get)
@pytest.mark.parametrize("where", ["open", "first write"])
def test_filesystem_refusing_o_direct_falls_back_to_buffered_writes(
    tmp_path, monkeypatch, where, code
):
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and where == "open":
            raise OSError(code, os.strerror(code))
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_pwrite(fd, data, position):
        if fd in direct_fds:
            raise OSError(code, os.strerror(code))
        return real_pwrite(fd, data, position)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    state = mixed_state()
    target, writer = write_directly(tmp_path, state)
    monkeypatch.undo()
    assert writer.last_direct_bytes == 0
    check_same(pyshmckpt.load(target), state)


CHUNK = 3 * DIRECT_IO_BLOCK  # lowered chunk size: mixed_state() spans about 100 chunks


def fake_direct_io(monkeypatch, misbehave) -> tuple[list[int], list[tuple[int, int]]]:
    """Make O_DIRECT writes go through `misbehave(position, data, write)` on any filesystem (the
    O_DIRECT flag is dropped at open); `write(n)` really writes the first n bytes and returns n.
    As the kernel does, an O_DIRECT write at an unaligned position or length fails with EINVAL.

    Returns the file positions of the O_DIRECT writes attempted and (position, nbytes) of the
    buffered writes, both filled in as the writer runs.
    """
    monkeypatch.setattr(file_writer, "DIRECT_IO_CHUNK", CHUNK)
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()
    attempts: list[int] = []
    buffered: list[tuple[int, int]] = []

    def fake_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags & ~os.O_DIRECT, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_pwrite(fd, data, position):
        if fd not in direct_fds:
            buffered.append((position, len(data)))
            return real_pwrite(fd, data, position)
        attempts.append(position)
        if position % DIRECT_IO_BLOCK or len(data) % DIRECT_IO_BLOCK:
            raise OSError(errno.EINVAL, "Invalid argument (unaligned O_DIRECT write)")
        return misbehave(position, data, lambda n: real_pwrite(fd, data[:n], position))

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    return attempts, buffered


def bulk_of(target: Path) -> tuple[int, int]:
    """(file offset of the data, bytes of it meant for O_DIRECT) of a direct_io rank file."""
    raw = (target / "rank0.safetensors").read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    return start, (len(raw) - start) // DIRECT_IO_BLOCK * DIRECT_IO_BLOCK


def write_with_fake_direct_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, misbehave: Any
) -> tuple[list[int], list[tuple[int, int]], SafetensorsWriter, int, int]:
    """Write mixed_state() through fake_direct_io, check the result loads back exactly, and
    return (O_DIRECT positions attempted, buffered writes, the writer, data start, bulk bytes)."""
    attempts, buffered = fake_direct_io(monkeypatch, misbehave)
    state = mixed_state()
    target, writer = write_directly(tmp_path, state)
    monkeypatch.undo()
    check_same(pyshmckpt.load(target), state)
    start, bulk = bulk_of(target)
    return attempts, buffered, writer, start, bulk


@pytest.mark.parametrize("failure", ["EINVAL", "EOPNOTSUPP", "short"])
def test_a_later_chunk_refused_or_short_is_finished_with_buffered_writes(
    tmp_path, monkeypatch, failure
):
    order: list[int] = []  # chunk positions in the order their writes were attempted
    misbehaved: dict[
        int, tuple[int, int]
    ] = {}  # position: (chunk bytes, bytes written with O_DIRECT)

    def misbehave(position, data, write):
        order.append(position)
        if len(order) not in (6, 41):  # every other chunk (the first included) goes through whole
            return write(len(data))
        if failure == "short":
            done = len(data) // 2 + 100  # not a multiple of the block size: no O_DIRECT retry
            misbehaved[position] = (len(data), done)
            return write(done)
        misbehaved[position] = (len(data), 0)
        code = getattr(errno, failure)
        raise OSError(code, os.strerror(code))

    attempts, buffered, writer, start, bulk = write_with_fake_direct_io(
        tmp_path, monkeypatch, misbehave
    )
    assert len(misbehaved) == 2
    assert sorted(attempts) == [start + pos for pos in range(0, bulk, CHUNK)]  # one try per chunk
    for position, (size, done) in misbehaved.items():  # the rest went through the buffered fd
        assert (position + done, size - done) in buffered
    assert writer.last_direct_bytes == bulk - sum(size - done for size, done in misbehaved.values())


def test_a_short_first_write_keeps_o_direct_for_the_other_chunks(tmp_path, monkeypatch):
    order: list[int] = []

    def misbehave(position, data, write):
        order.append(position)
        return write(DIRECT_IO_BLOCK + 1 if len(order) == 1 else len(data))

    attempts, buffered, writer, start, bulk = write_with_fake_direct_io(
        tmp_path, monkeypatch, misbehave
    )
    assert order[0] == start  # the first chunk is written first, before the others start
    assert (start + DIRECT_IO_BLOCK + 1, CHUNK - DIRECT_IO_BLOCK - 1) in buffered
    assert sorted(attempts) == [start + pos for pos in range(0, bulk, CHUNK)]
    assert writer.last_direct_bytes == bulk - (CHUNK - DIRECT_IO_BLOCK - 1)


def test_other_errors_of_a_later_chunk_fail_the_write_and_leave_nothing(tmp_path, monkeypatch):
    seen: list[int] = []

    def misbehave(position, data, write):
        seen.append(position)
        if len(seen) == 7:
            raise OSError(errno.EIO, "Input/output error")
        return write(len(data))

    fake_direct_io(monkeypatch, misbehave)
    with pytest.raises(OSError, match="Input/output"):
        write_directly(tmp_path, mixed_state())
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_other_o_direct_errors_fail_the_write_and_leave_nothing(tmp_path, monkeypatch):
    real_open = os.open

    def failing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(OSError, match="Input/output"):
        write_directly(tmp_path, mixed_state())
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_mirror_plan_tiles_the_slot_in_order():
    state = mixed_state()
    manifest = layout.plan(state).manifest
    plan = plan_file(manifest, mirror_slot=True)
    cursor = 0
    for entry, (source, size) in zip(plan.entries, plan.sources, strict=True):
        assert entry.begin == cursor == source
        assert entry.end - entry.begin == size
        cursor = entry.end
    assert cursor == manifest.size
    begin = {e.name: e.begin for e in plan.entries}
    for i, t in enumerate(plan.tensors):  # each tensor lies in the file where it lies in the slot
        assert t["entry"] is not None
        assert begin[t["entry"]] + t["offset"] == int(manifest.offset[i]), t["name"]


def test_checkpointer_direct_io_round_trip_and_option_checks(tmp_path):
    state = mixed_state()
    with opened(tmp_path, direct_io=True) as ck:
        path = ck.save(state, name="d").result(timeout=SAVE_TIMEOUT)
    check_same(pyshmckpt.load(path), state)
    assert json.loads((path / "rank0.json").read_text())["format_version"] == 1
    with pytest.raises(ValueError, match="direct_io"):
        pyshmckpt.Checkpointer(tmp_path, writer="torch", direct_io=True)


def write_after_stale_stage(tmp_path: Path, name: str, stale: float, state: dict[str, Any]) -> Path:
    """Stage `stale`-filled data in a one-slot stager, drop it, then stage and write `state` to
    the checkpoint `name` with direct_io (the file mirrors the slot, gaps included)."""
    writer = SafetensorsWriter(direct_io=True)
    with ShmStager(slots=1) as stager:
        old = stager.stage({"secret": torch.full((1000,), stale), "more": torch.full((77,), stale)})
        del old
        staged = stager.stage(state)
        handle = stager.handle(staged)
        target = tmp_path / name
        writer.write_slot(
            str(target), SlotMapping(handle.slot.segment, handle.slot.offset), handle.manifest
        )
        del staged
    return target


def test_padding_entries_hold_zeros_not_earlier_training_state(tmp_path):
    state = {"a": torch.ones(3), "b": torch.ones(5), "c": torch.arange(7, dtype=torch.int16)}
    target = write_after_stale_stage(tmp_path, "ck", -1.0, state)
    read = load_file(str(target / "rank0.safetensors"))
    pads = {name: t for name, t in read.items() if name.startswith(BLOCK_PREFIX + "pad")}
    assert len(pads) == 2
    assert all(t.numel() > 0 for t in pads.values())
    for name, pad in pads.items():
        assert torch.count_nonzero(pad).item() == 0, name
    for key, value in state.items():
        assert torch.equal(read[key], value)
    assert pyshmckpt.verify(target) == 3


def test_saves_of_the_same_state_are_byte_identical_whatever_the_slot_held(tmp_path):
    state = mixed_state()
    first = write_after_stale_stage(tmp_path, "one", -1.0, state)
    second = write_after_stale_stage(tmp_path, "two", 12345.0, state)
    for name in ("rank0.safetensors", "rank0.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
