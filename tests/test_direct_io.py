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
from pyshmckpt import ShmStager, file_writer
from pyshmckpt.file_writer import BLOCK_PREFIX, DIRECT_IO_BLOCK, SafetensorsWriter, plan_file
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


def write_directly(tmp_path: Path, state: dict[str, Any], **kwargs: Any) -> tuple[Path, SafetensorsWriter]:
    """Stage `state` and write it with SafetensorsWriter in this process (no subprocess)."""
    writer = SafetensorsWriter(direct_io=True, **kwargs)
    with ShmStager(slots=1) as stager:
        staged = stager.stage(state)
        handle = stager.handle(staged)
        target = tmp_path / "ck"
        writer.write_slot(str(target), handle.slot.segment, handle.slot.offset, handle.manifest)
        del staged
    return target, writer


def check_same(loaded: dict[str, Any], state: dict[str, Any]) -> None:
    for key in ("big", "odd", "wide_t", "every_third", "bf16"):
        assert same_bytes(loaded[key], state[key]), key
    assert loaded["tied"][0] is loaded["big"] or loaded["tied"][0].data_ptr() == loaded["big"].data_ptr()
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


@pytest.mark.parametrize("where", ["open", "first write"])
def test_filesystem_refusing_o_direct_falls_back_to_buffered_writes(tmp_path, monkeypatch, where):
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and where == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_pwrite(fd, data, position):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, position)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    state = mixed_state()
    target, writer = write_directly(tmp_path, state)
    monkeypatch.undo()
    assert writer.last_direct_bytes == 0
    check_same(pyshmckpt.load(target), state)


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
    manifest = pyshmckpt.layout.plan(state).manifest
    plan = plan_file(manifest, mirror_slot=True)
    cursor = 0
    for entry, (source, size) in zip(plan.entries, plan.sources, strict=True):
        assert entry.begin == cursor == source and entry.end - entry.begin == size
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
