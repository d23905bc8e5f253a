"""Native core (pyshmckpt._C): read_file_ranges (parallel preads with checksums) and
crc32c_combine."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from pyshmckpt import _C

MIB = 1 << 20


def _rows(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


@pytest.mark.parametrize(("a", "b"), [(0, 0), (0, 5), (7, 0), (1000, 3000), (3, 9 * MIB)])
def test_crc32c_combine_matches_the_whole(a, b):
    data = os.urandom(a + b)
    whole = _C.crc32c(data)
    assert _C.crc32c_combine(_C.crc32c(data[:a]), _C.crc32c(data[a:]), b) == whole


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(21 * MIB + 123)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def test_reads_ranges_into_memory_with_their_checksums(data_file):
    path, data = data_file
    before = _C.num_threads()
    _C.set_num_threads(4)  # pieces of the 20 MiB range run on several threads
    try:
        big = np.zeros(20 * MIB + 7, dtype=np.uint8)
        small = np.zeros(1000, dtype=np.uint8)
        rows = _rows(
            (5, big.ctypes.data, big.nbytes), (20 * MIB + 100, small.ctypes.data, small.nbytes)
        )
        with path.open("rb") as f:
            crcs, got = _C.read_file_ranges(f.fileno(), rows, True, str(path))
    finally:
        _C.set_num_threads(before)
    assert big.tobytes() == data[5 : 5 + big.nbytes]
    assert small.tobytes() == data[20 * MIB + 100 : 20 * MIB + 1100]
    assert list(got) == [big.nbytes, small.nbytes]
    assert list(crcs) == [_C.crc32c(big), _C.crc32c(small)]
    with path.open("rb") as f:
        crcs, _ = _C.read_file_ranges(f.fileno(), rows, False, str(path))
    assert list(crcs) == [0, 0]


def test_a_range_past_the_end_reports_how_much_was_read(data_file):
    path, data = data_file
    buf = np.zeros(2 * MIB, dtype=np.uint8)
    start = len(data) - MIB
    with path.open("rb") as f:
        crcs, got = _C.read_file_ranges(
            f.fileno(), _rows((start, buf.ctypes.data, buf.nbytes)), True, str(path)
        )
    assert int(got[0]) == MIB
    assert buf[:MIB].tobytes() == data[start:]
    assert int(crcs[0]) == _C.crc32c(data[start:])


def test_a_failed_pread_raises_oserror_naming_the_file(data_file):
    path, _ = data_file
    buf = np.zeros(16, dtype=np.uint8)
    fd = os.open(os.devnull, os.O_WRONLY)  # not open for reading
    try:
        with pytest.raises(OSError, match="pread") as info:
            _C.read_file_ranges(fd, _rows((0, buf.ctypes.data, 16)), True, str(path))
    finally:
        os.close(fd)
    assert info.value.errno == errno.EBADF
    assert info.value.filename == str(path)


@pytest.mark.parametrize(
    "rows",
    [
        np.zeros((1, 2), dtype=np.uint64),  # wrong shape
        _rows((0, 0, 16)),  # null destination
        _rows(((1 << 64) - 8, 4096, 16)),  # offset + size overflows
    ],
)
def test_invalid_rows_are_refused(data_file, rows):
    path, _ = data_file
    with path.open("rb") as f, pytest.raises(ValueError, match="read entr"):
        _C.read_file_ranges(f.fileno(), rows, True, str(path))


def test_small_ranges_back_to_back_are_read_together_each_with_its_checksum(data_file):
    """Small ranges adjacent in the file are read by one preadv per run (runs end at a gap, at
    an empty range, at 256 ranges and at 8 MiB); each still gets its own bytes and CRC32C."""
    path, data = data_file
    sizes = [4096] * 600 + [0, 3, 5] + [1 << 20] * 9 + [17, 1]
    offsets, at = [], 11
    for i, n in enumerate(sizes):
        at += 1000 if i == 300 else 0  # a gap: the run before it ends there
        offsets.append(at)
        at += n
    bufs = [np.zeros(max(n, 1), dtype=np.uint8) for n in sizes]
    rows = _rows(*((o, b.ctypes.data, n) for o, b, n in zip(offsets, bufs, sizes, strict=True)))
    with path.open("rb") as f:
        crcs, got = _C.read_file_ranges(f.fileno(), rows, True, str(path))
    for i, (o, b, n) in enumerate(zip(offsets, bufs, sizes, strict=True)):
        assert int(got[i]) == n, i
        assert b[:n].tobytes() == data[o : o + n], i
        assert int(crcs[i]) == _C.crc32c(data[o : o + n]), i


def test_a_run_the_file_ends_inside_reports_each_ranges_bytes(data_file):
    path, data = data_file
    start = len(data) - 10_000
    sizes = [4096, 4096, 4096, 4096]  # the file ends inside the third; the fourth gets nothing
    bufs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    rows = _rows(*((start + 4096 * i, b.ctypes.data, b.nbytes) for i, b in enumerate(bufs)))
    with path.open("rb") as f:
        crcs, got = _C.read_file_ranges(f.fileno(), rows, True, str(path))
    assert [int(g) for g in got] == [4096, 4096, 10_000 - 8192, 0]
    assert bufs[2][: 10_000 - 8192].tobytes() == data[start + 8192 :]
    assert int(crcs[2]) == _C.crc32c(data[start + 8192 :])
    assert int(crcs[3]) == 0
