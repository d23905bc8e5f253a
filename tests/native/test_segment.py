"""Native core (pyshmckpt._C): segments, attaching, the buffer protocol, host copies, checksums.

Every segment uses the native default prefix ("pyshmckpt-<pid>-...") or a prefix that extends the
session prefix conftest.py sets, so its leak check covers all of them; each test closes what it
creates (``with`` or try/finally).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import multiprocessing
import os
import re
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pyshmckpt import _C

from helpers import minor_faults_reading

SHM = Path("/dev/shm")
PAGE = mmap.PAGESIZE
HEADER = 4096
KIB = 1 << 10
MIB = 1 << 20
U64_MAX = (1 << 64) - 1
CHILD_TIMEOUT = 120  # seconds; generous, only to never hang the suite
# conftest.py sets a per-session prefix and checks for leaks under it; custom prefixes extend it.
SESSION_PREFIX = os.environ.get("PYSHMCKPT_SEGMENT_PREFIX", "pyshmckpt")

# SegmentHeader (csrc/segment.h): magic[16], version u32, header_size u32, size u64, token[16],
# owner_pid i64, owner_start_ticks u64 -- naturally aligned, so no padding.
HEADER_FORMAT = "<16sIIQ16sqQ"
MAGIC = b"PYSHMCKPT-SEG\0\0\0"

NO_CUDA_DEVICE = _C.cuda_device_count() == 0
# Transparent huge pages in shared memory map 512 pages a fault: page-fault counts differ.
_SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
HUGE_SHM_PAGES = _SHMEM_THP.exists() and not re.search(r"\[(never|deny)\]", _SHMEM_THP.read_text())
needs_no_cuda_device = pytest.mark.skipif(not NO_CUDA_DEVICE, reason="a CUDA device is visible")


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC_TABLE = _crc32c_table()


def crc32c_ref(data: bytes, value: int = 0) -> int:
    """Bitwise-table reference CRC32C (Castagnoli, reflected), continuing from `value`."""
    c = value ^ 0xFFFFFFFF
    table = CRC_TABLE
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def shm_file(segment_or_name: Any) -> Path:
    name = segment_or_name if isinstance(segment_or_name, str) else segment_or_name.name
    return SHM / name


def our_files() -> set[str]:
    """Our segment files created by this process (other test runs may be going on meanwhile)."""
    pid = f"-{os.getpid()}-"
    return {p.name for p in SHM.iterdir() if p.name.startswith("pyshmckpt") and pid in p.name}


def view_of(segment: Any) -> memoryview:
    """memoryview(segment); the stub cannot declare the buffer protocol on Python 3.11."""
    return memoryview(segment)


def contents(segment: Any) -> bytes:
    """A copy of the whole mapping (header included)."""
    with memoryview(segment) as view:
        return bytes(view)


def fill_random(segment: Any, seed: int, start: int | None = None) -> bytes:
    """Fills [start, mapped_size) with random bytes (start defaults to data_offset)."""
    start = segment.data_offset if start is None else start
    data = np.random.default_rng(seed).integers(0, 256, segment.mapped_size - start, dtype=np.uint8)
    with memoryview(segment) as view:
        view[start:] = data.tobytes()
    return data.tobytes()


def rows(*entries: tuple[int, int, int]) -> np.ndarray:
    return np.array(entries, dtype=np.uint64).reshape(-1, 3)


def is_mapped(name: str) -> bool:
    """True while this process maps /dev/shm/<name> (deleted or not)."""
    return f"/dev/shm/{name}" in Path("/proc/self/maps").read_text()


def resident_bytes(address: int) -> int:
    """Rss of the mapping that starts at `address`, from /proc/self/smaps."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            current = int(head.split("-")[0], 16)
        elif current == address and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping starts at {address:#x}")


def process_start_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name may hold spaces; fields resume after the last ')' at field 3, so 22 is [19].
    return int(text[text.rindex(")") + 2 :].split()[19])


@pytest.fixture
def segment() -> Iterator[Any]:
    with _C.Segment.create(64 * KIB) as seg:
        yield seg


@pytest.fixture
def restore_threads() -> Iterator[None]:
    original = _C.num_threads()
    yield
    _C.set_num_threads(original)


# --------------------------------------------------------------------------------------------------
# Creating, closing, unlinking
# --------------------------------------------------------------------------------------------------


def test_constants():
    assert _C.HEADER_SIZE == HEADER
    assert _C.TOKEN_SIZE == 16


@pytest.mark.parametrize(
    ("requested", "expected"),
    [(1, PAGE), (PAGE - 1, PAGE), (PAGE, PAGE), (PAGE + 1, 2 * PAGE), (MIB + 3, MIB + PAGE)],
)
def test_create_rounds_size_up_to_pages(requested, expected):
    with _C.Segment.create(requested) as seg:
        assert seg.size == expected
        assert seg.data_offset == HEADER
        assert seg.mapped_size == expected + HEADER
        assert shm_file(seg).stat().st_size == seg.mapped_size
        assert os.fstat(seg.fd).st_size == seg.mapped_size


def test_create_makes_an_open_owned_0600_file():
    with _C.Segment.create(PAGE) as seg:
        path = shm_file(seg)
        st = path.stat()
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        assert seg.owner
        assert not seg.closed
        assert not seg.unlinked
        assert seg.exports == 0
        # fd is that very file, and is not inherited across exec
        assert (os.fstat(seg.fd).st_ino, os.fstat(seg.fd).st_dev) == (st.st_ino, st.st_dev)
        assert not os.get_inheritable(seg.fd)
        assert seg.address != 0
        assert seg.address % PAGE == 0
        assert seg.name in repr(seg)
        assert "closed" not in repr(seg)


def test_names_carry_prefix_and_pid_and_are_unique():
    prefix = f"{SESSION_PREFIX}.names_X-9"
    pattern = re.compile(rf"^{re.escape(prefix)}-{os.getpid()}-[0-9a-f]{{32}}$")
    segments = [_C.Segment.create(PAGE, prefix) for _ in range(8)]
    try:
        names = [seg.name for seg in segments]
        for name in names:
            assert pattern.match(name), name
            assert shm_file(name).exists()
        assert len(set(names)) == len(names)
        tokens = [seg.token for seg in segments]
        assert all(len(token) == _C.TOKEN_SIZE for token in tokens)
        assert len(set(tokens)) == len(tokens)
    finally:
        for seg in segments:
            seg.close()
    assert not any(shm_file(name).exists() for name in names)


def test_default_prefix():
    with _C.Segment.create(PAGE) as seg:
        assert seg.name.startswith(f"pyshmckpt-{os.getpid()}-")


def test_header_is_written():
    with _C.Segment.create(3 * PAGE) as seg, memoryview(seg) as view:
        magic, version, header_size, size, token, pid, ticks = struct.unpack_from(
            HEADER_FORMAT, view, 0
        )
        assert magic == MAGIC
        assert version == 1
        assert header_size == HEADER
        assert size == seg.size
        assert token == seg.token
        assert pid == os.getpid()
        assert ticks == process_start_ticks(os.getpid())


def test_pages_are_allocated_up_front():
    with _C.Segment.create(8 * MIB + 1) as seg:
        st = shm_file(seg).stat()
        assert st.st_blocks * 512 >= seg.mapped_size
        assert resident_bytes(seg.address) == seg.mapped_size  # and mapped into this process


def test_close_removes_file_and_is_idempotent():
    seg = _C.Segment.create(PAGE)
    path = shm_file(seg)
    address = seg.address
    assert path.exists()
    assert is_mapped(seg.name)
    seg.close()
    assert not path.exists()
    assert seg.closed
    assert seg.unlinked
    assert seg.fd == -1
    assert not is_mapped(seg.name)
    assert "closed" in repr(seg)
    seg.close()  # idempotent
    seg.unlink()  # no-op once closed and unlinked
    assert seg.closed
    assert not path.exists()
    assert address != 0


def test_unlink_removes_only_the_name():
    with _C.Segment.create(PAGE) as seg:
        path = shm_file(seg)
        seg.unlink()
        assert not path.exists()
        assert seg.unlinked
        assert not seg.closed
        with memoryview(seg) as view:  # the mapping is still usable
            view[seg.data_offset : seg.data_offset + 3] = b"abc"
            assert bytes(view[seg.data_offset : seg.data_offset + 3]) == b"abc"
        seg.unlink()  # idempotent
        assert seg.unlinked
        with pytest.raises(FileNotFoundError):
            _C.Segment.attach(seg.name, seg.size, seg.token)
    assert seg.closed


def test_context_manager_returns_self_and_closes():
    seg = _C.Segment.create(PAGE)
    with seg as entered:
        assert entered is seg
        assert not seg.closed
    assert seg.closed
    assert not shm_file(seg).exists()


def _raise_inside_segment_context(holder: list[Any]) -> None:
    with _C.Segment.create(PAGE) as seg:
        holder.append(seg)
        raise KeyError("boom")


def test_context_manager_closes_on_error():
    holder: list[Any] = []
    with pytest.raises(KeyError, match="boom"):
        _raise_inside_segment_context(holder)
    assert holder[0].closed
    assert not shm_file(holder[0]).exists()


def test_dropping_the_last_reference_closes():
    seg = _C.Segment.create(PAGE)
    name = seg.name
    assert shm_file(name).exists()
    del seg
    assert not shm_file(name).exists()
    assert not is_mapped(name)


@pytest.mark.parametrize("size", [0, 1 << 63, U64_MAX])  # 2**63 and up: too large to describe
def test_create_rejects_bad_sizes(size):
    before = our_files()
    with pytest.raises(ValueError, match="segment size"):
        _C.Segment.create(size)
    assert our_files() == before


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "pyshmckpt/sub",
        "/pyshmckpt",
        "pyshmckpt/",
        "pyshmckpt x",
        "pyshmckpt\0x",  # would truncate the shm_open name
        "pyshmckpt:1",
        "pyshmckpt\u00e9",
        "p" * 65,
        "p" * 300,
    ],
    ids=[
        "empty",
        "slash",
        "leading-slash",
        "trailing-slash",
        "space",
        "nul",
        "colon",
        "non-ascii",
        "65-chars",
        "300-chars",
    ],
)
def test_create_rejects_bad_prefixes(prefix):
    before = our_files()
    with pytest.raises(ValueError, match="prefix"):
        _C.Segment.create(PAGE, prefix)
    assert our_files() == before


def test_create_accepts_longest_prefix():
    prefix = f"{SESSION_PREFIX}._-".ljust(64, "z")
    assert len(prefix) == 64
    with _C.Segment.create(PAGE, prefix) as seg:
        assert seg.name.startswith(f"{prefix}-{os.getpid()}-")
        assert shm_file(seg).exists()


@pytest.mark.parametrize("size", [-1, 1.5, "4096"])
def test_create_rejects_wrong_types(size):
    with pytest.raises(TypeError):
        _C.Segment.create(size)


@pytest.mark.parametrize("extra", [PAGE, 1 << 62], ids=["just-too-big", "huge"])
def test_create_larger_than_free_shm_is_enospc(extra):
    vfs = os.statvfs(SHM)
    free = vfs.f_bavail * vfs.f_frsize
    size = extra if extra > free else free + extra
    before = our_files()
    with pytest.raises(OSError, match="not enough shared memory") as info:
        _C.Segment.create(size, f"{SESSION_PREFIX}.enospc")
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename.startswith(f"{SESSION_PREFIX}.enospc-{os.getpid()}-")
    assert our_files() == before
    assert not shm_file(info.value.filename).exists()


# --------------------------------------------------------------------------------------------------
# Attaching
# --------------------------------------------------------------------------------------------------


def test_attach_in_same_process_shares_memory():
    with _C.Segment.create(5 * PAGE) as owner:
        with _C.Segment.attach(owner.name, owner.size, owner.token) as other:
            assert other.name == owner.name
            assert not other.owner
            assert other.size == owner.size
            assert other.mapped_size == owner.mapped_size
            assert other.token == owner.token
            assert other.address != owner.address
            data = fill_random(owner, seed=1)
            assert contents(other)[other.data_offset :] == data
            with memoryview(other) as view:
                view[other.data_offset : other.data_offset + 5] = b"hello"
                view[-3:] = b"end"
            tail = contents(owner)
            assert tail[owner.data_offset : owner.data_offset + 5] == b"hello"
            assert tail[-3:] == b"end"
        # closing an attached segment unmaps it but does not unlink the name
        assert other.closed
        assert not other.unlinked
        assert shm_file(owner).exists()
        assert contents(owner)[-3:] == b"end"
    assert not shm_file(owner).exists()


def test_attach_maps_pages_at_once_or_when_asked():
    # A read fault maps up to 16 pages here (the kernel's fault-around; 512 with huge pages in
    # shared memory): a lazy mapping takes at least one fault per 512 pages, a mapped one a
    # handful at most.
    pages = 8192
    with _C.Segment.create(pages * PAGE) as owner:
        fill_random(owner, seed=3)
        with _C.Segment.attach(owner.name, owner.size, owner.token) as eager:
            assert minor_faults_reading(eager) < pages // 1024
        with _C.Segment.attach(owner.name, owner.size, owner.token, map_pages=False) as lazy:
            assert minor_faults_reading(lazy) >= pages // 512
        with _C.Segment.attach(owner.name, owner.size, owner.token, map_pages=False) as lazy:
            lazy.map_pages_for_reading()
            assert minor_faults_reading(lazy) < pages // 1024
            assert contents(lazy) == contents(owner)
        with _C.Segment.attach(owner.name, owner.size, owner.token, map_pages=False) as lazy:
            half = lazy.mapped_size // 2
            lazy.map_pages_for_reading(half)  # the first half only
            with memoryview(lazy) as view:
                assert minor_faults_reading(view[:half]) < pages // 1024
                assert minor_faults_reading(view[half:]) >= pages // 1024
        closed = _C.Segment.attach(owner.name, owner.size, owner.token, map_pages=False)
        closed.close()
        with pytest.raises(ValueError, match="closed"):
            closed.map_pages_for_reading()


def test_attach_accepts_leading_slash():
    with (
        _C.Segment.create(PAGE) as owner,
        _C.Segment.attach("/" + owner.name, owner.size, owner.token) as other,
    ):
        assert other.name == owner.name
        assert not other.owner


def test_attached_mapping_outlives_the_owner():
    owner = _C.Segment.create(PAGE)
    try:
        data = fill_random(owner, seed=2)
        other = _C.Segment.attach(owner.name, owner.size, owner.token)
    finally:
        owner.close()
    try:
        assert not shm_file(owner).exists()
        assert contents(other)[other.data_offset :] == data
    finally:
        other.close()
    with pytest.raises(FileNotFoundError):
        _C.Segment.attach(owner.name, owner.size, b"\0" * 16)


def test_attached_unlink_then_owner_close():
    with _C.Segment.create(PAGE) as owner:
        with _C.Segment.attach(owner.name, owner.size, owner.token) as other:
            other.unlink()
            assert other.unlinked
            assert not shm_file(owner).exists()
        owner.close()  # the name is already gone: still no error
        assert owner.closed


def test_attach_wrong_token():
    with _C.Segment.create(PAGE) as seg:
        token = bytearray(seg.token)
        token[7] ^= 0x01
        with pytest.raises(ValueError, match="token"):
            _C.Segment.attach(seg.name, seg.size, bytes(token))


@pytest.mark.parametrize("length", [0, 15, 17, 32])
def test_attach_token_of_wrong_length(length):
    with _C.Segment.create(PAGE) as seg:
        token = (seg.token * 2)[:length]
        with pytest.raises(ValueError, match="token"):
            _C.Segment.attach(seg.name, seg.size, token)


@pytest.mark.parametrize(
    "size_of", [lambda s: s.size - PAGE, lambda s: s.size + PAGE, lambda s: 1, lambda s: 0]
)
def test_attach_wrong_size(size_of):
    with _C.Segment.create(2 * PAGE) as seg:
        with pytest.raises(ValueError, match="expected"):
            _C.Segment.attach(seg.name, size_of(seg), seg.token)


def test_attach_unrounded_size_is_rejected():
    with _C.Segment.create(1) as seg:  # really PAGE bytes
        with pytest.raises(ValueError, match="expected 1"):
            _C.Segment.attach(seg.name, 1, seg.token)
        with _C.Segment.attach(seg.name, seg.size, seg.token) as other:
            assert other.size == PAGE


def _corrupt_magic(view: memoryview) -> None:
    view[3] ^= 0xFF


def _corrupt_version(view: memoryview) -> None:
    struct.pack_into("<I", view, 16, 2)


def _corrupt_header_size(view: memoryview) -> None:
    struct.pack_into("<I", view, 20, 8192)


def _corrupt_size_field(view: memoryview) -> None:
    struct.pack_into("<Q", view, 24, struct.unpack_from("<Q", view, 24)[0] - PAGE)


def _corrupt_token(view: memoryview) -> None:
    view[40] ^= 0x80


def _junk(view: memoryview) -> None:
    view[:HEADER] = np.random.default_rng(3).integers(0, 256, HEADER, dtype=np.uint8).tobytes()


def _zeros(view: memoryview) -> None:
    view[:HEADER] = bytes(HEADER)


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_magic,
        _corrupt_version,
        _corrupt_header_size,
        _corrupt_size_field,
        _corrupt_token,
        _junk,
        _zeros,
    ],
)
def test_attach_rejects_a_bad_header(corrupt):
    with _C.Segment.create(2 * PAGE) as seg:
        token = seg.token  # read before the header changes
        with memoryview(seg) as view:
            corrupt(view)
        with pytest.raises(ValueError, match="header|token"):
            _C.Segment.attach(seg.name, seg.size, token)


@pytest.mark.parametrize("length", [1, 255])
def test_attach_missing_name_of_any_valid_length(length):
    name = f"{SESSION_PREFIX}-missing".ljust(length, "m")[:length]
    assert not shm_file(name).exists()
    with pytest.raises(FileNotFoundError):
        _C.Segment.attach(name, PAGE, b"\0" * 16)


def test_attach_missing_name():
    name = f"pyshmckpt-{os.getpid()}-{'0' * 32}"
    assert not shm_file(name).exists()
    with pytest.raises(FileNotFoundError) as info:
        _C.Segment.attach(name, PAGE, b"\0" * 16)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == name


@pytest.mark.parametrize(
    "name",
    ["", "/", "a/b", "pyshmckpt/x", "pyshmckpt\0x", "x" * 256],
    ids=["empty", "slash", "inner-slash", "prefix-slash", "nul", "256-chars"],
)
def test_attach_invalid_name(name):
    with pytest.raises(ValueError, match="name"):
        _C.Segment.attach(name, PAGE, b"\0" * 16)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o610, 0o601, 0o666])
def test_attach_refuses_a_segment_others_can_access(mode):
    with _C.Segment.create(PAGE) as seg:
        shm_file(seg).chmod(mode)
        with pytest.raises(PermissionError) as info:
            _C.Segment.attach(seg.name, seg.size, seg.token)
        assert info.value.errno == errno.EACCES
        shm_file(seg).chmod(0o600)
        with _C.Segment.attach(seg.name, seg.size, seg.token):
            pass


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_attach_refuses_a_segment_owned_by_another_uid():
    with _C.Segment.create(PAGE) as seg:
        os.chown(shm_file(seg), 12345, -1)
        with pytest.raises(PermissionError, match="12345") as info:
            _C.Segment.attach(seg.name, seg.size, seg.token)
        assert info.value.errno == errno.EACCES
    assert not shm_file(seg).exists()  # the owner still removed it


# Runs in a spawned child: no asserts (they vanish under -O), results go back through `conn`.
def _child_attach(name: str, size: int, token: bytes, digest: str, reply: bytes, conn: Any) -> None:
    result: dict[str, Any] = {}
    try:
        bad = bytes(b ^ 0xFF for b in token)
        try:
            _C.Segment.attach(name, size, bad)
            result["wrong_token"] = "accepted"
        except ValueError:
            result["wrong_token"] = "ValueError"
        with _C.Segment.attach(name, size, token) as seg:
            result["owner"] = seg.owner
            with view_of(seg) as view:
                data = bytes(view[seg.data_offset :])
                result["digest_ok"] = hashlib.sha256(data).hexdigest() == digest
                view[-len(reply) :] = reply
        result["unlinked"] = seg.unlinked
        result["exists_after_close"] = shm_file(name).exists()
    except BaseException as exc:  # report anything to the parent
        result["error"] = repr(exc)
    conn.send(result)
    conn.close()


def run_in_child(target: Callable[..., None], *args: Any) -> dict[str, Any]:
    """Runs target(*args, conn) in a spawned process and returns what it sent."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, sender))
    proc.start()
    sender.close()
    try:
        if not receiver.poll(CHILD_TIMEOUT):
            pytest.fail(f"child sent nothing within {CHILD_TIMEOUT}s")
        result = receiver.recv()
    finally:
        receiver.close()
        proc.join(CHILD_TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0
    return result


def test_attach_from_a_spawned_child():
    reply = b"written by the child"
    with _C.Segment.create(MIB + 5) as seg:
        data = fill_random(seg, seed=4)
        digest = hashlib.sha256(data).hexdigest()
        result = run_in_child(_child_attach, seg.name, seg.size, seg.token, digest, reply)
        assert "error" not in result, result.get("error")
        assert result == {
            "wrong_token": "ValueError",
            "owner": False,
            "digest_ok": True,
            "unlinked": False,
            "exists_after_close": True,
        }
        after = contents(seg)[seg.data_offset :]
        assert after[-len(reply) :] == reply
        assert after[: -len(reply)] == data[: -len(reply)]
        assert shm_file(seg).exists()
    assert not shm_file(seg).exists()


# --------------------------------------------------------------------------------------------------
# Liveness: every open segment holds a shared flock (stale-segment collection takes it exclusively)
# --------------------------------------------------------------------------------------------------


def exclusive_lock_free(name: str) -> bool:
    """Whether a collector could take /dev/shm/<name>'s lock exclusively (no process has it open)."""
    fd = os.open(SHM / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_created_and_attached_segments_hold_a_shared_lock_while_their_descriptor_is_open():
    owner = _C.Segment.create(PAGE)
    name = owner.name
    other = None
    try:
        assert not exclusive_lock_free(name)
        fd = os.open(SHM / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: every user holds it at once
        finally:
            os.close(fd)
        other = _C.Segment.attach(name, owner.size, owner.token)
        owner.disown()
        owner.close()  # the name stays (disowned); the attached segment still holds the lock
        assert not exclusive_lock_free(name)
        view = memoryview(other)
        other.close()
        assert not exclusive_lock_free(name)  # its descriptor lives while the view does
        view.release()
        assert exclusive_lock_free(name)
    finally:
        owner.close()
        if other is not None:
            other.close()
        shm_file(name).unlink(missing_ok=True)


def test_attach_waits_for_a_collector_that_leaves_the_segment_in_place():
    # A dry run (or `inspect`) takes the lock exclusively for a moment without removing the name:
    # attaching meanwhile waits for it, bounded, and succeeds.
    with _C.Segment.create(PAGE) as owner:
        owner_fd = owner.fd
        name = owner.name
        # Only the owner holds it: drop its lock to let a "collector" in, as if it had died.
        fcntl.flock(owner_fd, fcntl.LOCK_UN)
        probe = os.open(SHM / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            attached: list[Any] = []
            attacher = threading.Thread(
                target=lambda: attached.append(_C.Segment.attach(name, owner.size, owner.token))
            )
            attacher.start()
            attacher.join(0.2)
            assert attacher.is_alive()  # waiting for the exclusive lock to go
        finally:
            os.close(probe)
        attacher.join(CHILD_TIMEOUT)
        (other,) = attached
        with other:
            assert not exclusive_lock_free(name)


# --------------------------------------------------------------------------------------------------
# Reserving pages before they are touched (fallocate), and the path of kernels before 5.14
# --------------------------------------------------------------------------------------------------


def test_a_lazily_filled_segment_reserves_its_header_page_alone():
    # Its data pages are filled through the file (pwritev), which allocates them as it writes:
    # reserving them at creation would cost the first save a pass over its memory.
    with _C.Segment.create(16 * MIB, populate=False) as seg:
        assert shm_file(seg).stat().st_blocks * 512 <= 2 * MIB  # a page (a huge page at most)
        header = contents(seg)[: struct.calcsize(HEADER_FORMAT)]
        assert header.startswith(MAGIC)


def test_populate_reserves_and_maps_every_page_and_keeps_what_was_written(source):
    with _C.Segment.create(16 * MIB, populate=False) as seg:
        seg.write_from_host(rows((source.ctypes.data, seg.data_offset, 3 * PAGE + 5)))
        seg.populate(0, seg.mapped_size)
        assert shm_file(seg).stat().st_blocks * 512 >= seg.mapped_size
        assert resident_bytes(seg.address) == seg.mapped_size
        data = contents(seg)[seg.data_offset : seg.data_offset + 4 * PAGE]
        assert data == source.tobytes()[: 3 * PAGE + 5] + bytes(PAGE - 5)
        seg.populate(seg.mapped_size - PAGE, 1 << 62)  # clipped at the end of the mapping
        with pytest.raises(ValueError, match="page boundary"):
            seg.populate(PAGE + 1, PAGE)
    with pytest.raises(ValueError, match="closed"):
        seg.populate(0, PAGE)


def test_the_populate_fallback_is_forced_only_when_asked():
    assert not _C._populate_fallback_forced()


# Runs in a spawned child (the fallback, once met, is remembered by the copy engine for the life of
# the process): no asserts, results go back through `conn`.
def _child_fallback(conn: Any) -> None:
    result: dict[str, Any] = {}
    try:
        _C._force_populate_fallback(True)
        result["forced"] = _C._populate_fallback_forced()
        with _C.Segment.create(8 * MIB) as seg:
            result["eager_reserved"] = shm_file(seg).stat().st_blocks * 512 >= seg.mapped_size
            result["eager_mapped"] = resident_bytes(seg.address) == seg.mapped_size
        data = np.random.default_rng(7).integers(0, 256, 40 * MIB, dtype=np.uint8)
        with _C.Segment.create(data.nbytes, populate=False) as seg:
            # A batch large enough to be shared with the mapping's helper thread, which cannot
            # map pages here and leaves them to the file.
            result["helper_filled"] = seg.write_from_host(
                rows((data.ctypes.data, seg.data_offset, data.nbytes))
            )
            seg.populate(0, seg.mapped_size)  # touches each page: reads and writes it back
            seg.allocate_pages(0, seg.mapped_size)
            with _C.Segment.attach(seg.name, seg.size, seg.token, map_pages=False) as other:
                other.map_pages_for_reading()
                result["same"] = contents(other)[other.data_offset :] == data.tobytes()
        _C._force_populate_fallback(False)
        result["unforced"] = not _C._populate_fallback_forced()
    except BaseException as exc:  # report anything to the parent
        result["error"] = repr(exc)
    conn.send(result)
    conn.close()


def test_the_forced_fallback_touches_reserved_pages_one_by_one():
    result = run_in_child(_child_fallback)
    assert "error" not in result, result.get("error")
    assert result == {
        "forced": True,
        "eager_reserved": True,
        "eager_mapped": True,
        "helper_filled": 0,
        "same": True,
        "unforced": True,
    }


# --------------------------------------------------------------------------------------------------
# Buffer protocol
# --------------------------------------------------------------------------------------------------


def test_memoryview_covers_the_whole_mapping(segment):
    with memoryview(segment) as view:
        assert len(view) == segment.mapped_size
        assert view.nbytes == segment.mapped_size
        assert view.format == "B"
        assert view.itemsize == 1
        assert view.ndim == 1
        assert not view.readonly
        assert view.c_contiguous
        assert segment.exports == 1
        with memoryview(segment) as second:
            assert segment.exports == 2
            view[HEADER] = 0x5A
            assert second[HEADER] == 0x5A
        assert segment.exports == 1
    assert segment.exports == 0


def test_numpy_frombuffer_is_zero_copy(segment):
    array = np.frombuffer(segment, dtype=np.uint8)
    try:
        assert array.size == segment.mapped_size
        assert array.flags.writeable
        assert array.ctypes.data == segment.address
        assert segment.exports == 1
        pattern = np.arange(1000, dtype=np.uint8) * 7
        array[segment.data_offset : segment.data_offset + 1000] = pattern
        with memoryview(segment) as view:
            start = segment.data_offset
            assert bytes(view[start : start + 1000]) == pattern.tobytes()
            view[-4:] = b"tail"
        assert array[-4:].tobytes() == b"tail"
        words = np.frombuffer(segment, dtype=np.uint64, offset=segment.data_offset)
        words[0] = 0x0102030405060708
        assert array[segment.data_offset] == 0x08  # little-endian, same memory
        del words
    finally:
        del array
    assert segment.exports == 0


def test_view_stays_valid_after_close_and_mapping_goes_with_the_last_view():
    seg = _C.Segment.create(2 * PAGE)
    view = memoryview(seg)
    try:
        data = fill_random(seg, seed=5)
        seg.close()
        assert seg.closed
        assert seg.unlinked
        assert not shm_file(seg).exists()
        assert seg.exports == 1
        assert is_mapped(seg.name)  # close deferred the munmap
        assert bytes(view[seg.data_offset :]) == data
        view[-2:] = b"ok"
        assert bytes(view[-2:]) == b"ok"
        with pytest.raises(BufferError):
            memoryview(seg)  # no new views of a closed segment, even while one is alive
        assert seg.exports == 1
    finally:
        view.release()
    assert seg.exports == 0
    assert not is_mapped(seg.name)


def test_numpy_view_keeps_mapping_after_close():
    seg = _C.Segment.create(PAGE)
    array = np.frombuffer(seg, dtype=np.uint8)
    seg.close()
    array[-1] = 42
    assert array[-1] == 42
    assert is_mapped(seg.name)
    del array
    assert seg.exports == 0
    assert not is_mapped(seg.name)


def test_no_buffer_of_a_closed_segment():
    seg = _C.Segment.create(PAGE)
    seg.close()
    with pytest.raises(BufferError):
        memoryview(seg)
    with pytest.raises(BufferError):
        np.frombuffer(seg, dtype=np.uint8)
    assert seg.exports == 0


def test_attached_segment_buffer_and_close():
    with _C.Segment.create(PAGE) as owner:
        other = _C.Segment.attach(owner.name, owner.size, owner.token)
        view = memoryview(other)
        other.close()
        view[-1] = 9
        assert contents(owner)[-1] == 9
        view.release()
        assert other.exports == 0
        assert shm_file(owner).exists()


# --------------------------------------------------------------------------------------------------
# copy_from_host / copy_from_host_async
# --------------------------------------------------------------------------------------------------


def make_batch(
    rng: np.random.Generator, source: np.ndarray, start: int, sizes: list[int]
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Entries copying random ranges of `source` to disjoint destinations from `start` on.

    Returns the (n, 3) entries (in shuffled order) and (source offset, dst, nbytes) triples.
    """
    triples = []
    dst = start + int(rng.integers(0, 64))
    for n in sizes:
        src = int(rng.integers(0, source.nbytes - n + 1))
        triples.append((src, dst, n))
        dst += n + int(rng.integers(0, 48))
    order = rng.permutation(len(triples))
    triples = [triples[i] for i in order]
    base = source.ctypes.data
    return rows(*[(base + s, d, n) for s, d, n in triples]), triples


def expected_after(before: bytes, source: np.ndarray, triples: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(before)
    raw = source.tobytes()
    for s, d, n in triples:
        out[d : d + n] = raw[s : s + n]
    return bytes(out)


def mixed_sizes(rng: np.random.Generator) -> list[int]:
    """Many small (zero-length included), some several MiB with odd sizes."""
    sizes = [int(n) for n in rng.integers(0, 3000, 300)]
    sizes[::37] = [0] * len(sizes[::37])
    sizes += [3 * MIB + 1, 5 * MIB - 7, MIB + 333, 256 * KIB + 1, 64 * KIB - 3]
    rng.shuffle(sizes)
    return sizes


@pytest.fixture(scope="module")
def source() -> np.ndarray:
    return np.random.default_rng(1234).integers(0, 256, 6 * MIB + 17, dtype=np.uint8)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_copy_from_host_mixed_batch(source, threads, seed):
    _C.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    sizes = mixed_sizes(rng)
    with _C.Segment.create(sum(sizes) + 64 * KIB) as seg:
        fill_random(seg, seed=seed + 100, start=0)
        before = contents(seg)
        entries, triples = make_batch(rng, source, seg.data_offset, sizes)
        assert max(d + n for _, d, n in triples) <= seg.mapped_size
        seg.copy_from_host(entries)
        assert contents(seg) == expected_after(before, source, triples)
        assert seg.exports == 0


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_from_host_many_tiny_entries_across_pieces(source, threads):
    # ~1 MiB in 6000 entries: several internal pieces, each starting inside some entry
    _C.set_num_threads(threads)
    rng = np.random.default_rng(7)
    sizes = [int(n) for n in rng.integers(1, 350, 6000)]
    with _C.Segment.create(sum(sizes) + 48 * 6000 + 64) as seg:
        before = contents(seg)
        entries, triples = make_batch(rng, source, seg.data_offset, sizes)
        seg.copy_from_host(entries)
        assert contents(seg) == expected_after(before, source, triples)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_from_host_large_batch_streams_every_byte(threads):
    # Batches of 16 MiB and more take the streaming-store copy: odd sizes and misaligned sources
    # and destinations (heads and tails shorter than a cache line), small entries among large.
    _C.set_num_threads(threads)
    rng = np.random.default_rng(11)
    large = np.random.default_rng(12).integers(0, 256, 7 * MIB + 91, dtype=np.uint8)
    sizes = [7 * MIB + 3, 5 * MIB - 61, 4 * MIB + 129, 63, 64, 65, 1, 0, 127, 3 * MIB + 1]
    sizes += [int(n) for n in rng.integers(0, 200, 50)]
    with _C.Segment.create(sum(sizes) + 64 * KIB) as seg:
        fill_random(seg, seed=5, start=0)
        before = contents(seg)
        entries, triples = make_batch(rng, large, seg.data_offset, sizes)
        assert sum(sizes) >= 16 * MIB
        seg.copy_from_host(entries)
        assert contents(seg) == expected_after(before, large, triples)


def test_copy_from_host_up_to_the_last_byte(source, segment):
    before = contents(segment)
    n = 1001
    seg_end = segment.mapped_size
    entries = rows(
        (source.ctypes.data, segment.data_offset, 3), (source.ctypes.data + 5, seg_end - n, n)
    )
    segment.copy_from_host(entries)
    expected = expected_after(before, source, [(0, segment.data_offset, 3), (5, seg_end - n, n)])
    assert contents(segment) == expected


@pytest.mark.parametrize(
    "convert",
    [
        lambda a: a,
        lambda a: np.asfortranarray(a),
        lambda a: a.astype(np.int64),
        lambda a: np.ascontiguousarray(np.hstack([a, a])[:, :3]),
        lambda a: np.hstack([a, a])[:, 3:],  # non-contiguous view
    ],
    ids=["c", "fortran", "int64", "copy", "strided"],
)
def test_copy_from_host_accepts_convertible_arrays(source, segment, convert):
    triples = [(0, segment.data_offset + 10, 100), (500, segment.data_offset + 1000, 777)]
    entries = rows(*[(source.ctypes.data + s, d, n) for s, d, n in triples])
    before = contents(segment)
    segment.copy_from_host(convert(entries))
    assert contents(segment) == expected_after(before, source, triples)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_from_host_only_zero_length_and_empty(source, segment, threads):
    _C.set_num_threads(threads)
    before = contents(segment)
    zero_length = [(source.ctypes.data, segment.data_offset + i, 0) for i in range(5)]
    segment.copy_from_host(rows(*zero_length))
    segment.copy_from_host(np.zeros((0, 3), dtype=np.uint64))
    segment.copy_from_host_async(np.zeros((0, 3), dtype=np.uint64)).wait()
    assert contents(segment) == before


BAD_ENTRIES: dict[str, Callable[[Any, int], tuple[int, int, int]]] = {
    "in-header": lambda seg, src: (src, 0, 8),
    "just-below-data": lambda seg, src: (src, seg.data_offset - 1, 2),
    "one-past-end": lambda seg, src: (src, seg.mapped_size - 3, 4),
    "starts-at-end": lambda seg, src: (src, seg.mapped_size, 1),
    "far-past-end": lambda seg, src: (src, seg.mapped_size + PAGE, 1),
    "nbytes-wraps-to-end": lambda seg, src: (src, seg.data_offset, (1 << 64) - seg.data_offset),
    "nbytes-max": lambda seg, src: (src, seg.data_offset + 8, U64_MAX),
    "dst-max": lambda seg, src: (src, U64_MAX, 2),
    "dst-wraps": lambda seg, src: (src, U64_MAX - 7, 16),
    "null-source": lambda seg, src: (0, seg.data_offset + 64, 16),
}


def batch_with_bad_entry(seg: Any, source: np.ndarray, bad: str) -> np.ndarray:
    src = source.ctypes.data
    good = [(src, seg.data_offset + 100 * i, 100) for i in range(1, 6)]
    return rows(*good[:3], BAD_ENTRIES[bad](seg, src), *good[3:])


@pytest.mark.parametrize("method", ["copy_from_host", "copy_from_host_async", "write_from_host"])
@pytest.mark.parametrize("bad", sorted(BAD_ENTRIES))
def test_host_copies_reject_bad_entries_before_copying(source, segment, bad, method):
    fill_random(segment, seed=8, start=0)
    before = contents(segment)
    with pytest.raises(ValueError, match="entry 3"):
        getattr(segment, method)(batch_with_bad_entry(segment, source, bad))
    assert contents(segment) == before
    assert segment.exports == 0


def test_allocate_pages_keeps_what_is_written_and_maps_the_rest(source):
    pages = 4096
    with _C.Segment.create(pages * PAGE, populate=False) as seg:
        written = rows((source.ctypes.data, seg.data_offset, 3 * PAGE + 5))
        seg.write_from_host(written)
        half = (seg.mapped_size // 2) & ~(PAGE - 1)
        seg.allocate_pages(0, half)  # over written pages too: nothing written, nothing lost
        with memoryview(seg) as view:
            assert minor_faults_reading(view[:half]) < pages // 1024  # mapped for writing
            data = bytes(view[seg.data_offset : seg.data_offset + 4 * PAGE])
        assert data == source.tobytes()[: 3 * PAGE + 5] + bytes(PAGE - 5)
        seg.allocate_pages(half, seg.mapped_size)  # clipped at the end of the mapping
        with pytest.raises(ValueError, match="page boundary"):
            seg.allocate_pages(PAGE + 1, PAGE)
    with pytest.raises(ValueError, match="closed"):
        seg.allocate_pages(0, PAGE)


def test_a_closed_segment_keeps_its_descriptor_while_exported():
    # A write through the file (GIL released) holds an export: another thread's close() must not
    # close the descriptor under it (its number could then name another file).
    seg = _C.Segment.create(PAGE)
    fd, name = seg.fd, seg.name
    view = memoryview(seg)
    seg.close()
    assert seg.fd == -1
    assert name in str(Path(f"/proc/self/fd/{fd}").readlink())
    view.release()
    try:
        target = str(Path(f"/proc/self/fd/{fd}").readlink())
    except FileNotFoundError:
        target = ""
    assert name not in target


@pytest.mark.parametrize("populated", [False, True], ids=["fresh", "populated"])
@pytest.mark.parametrize("seed", [0, 1])
def test_write_from_host_writes_every_entry_through_the_file(source, populated, seed):
    # Entries in any order, zero-length ones among them; runs of entries adjacent in the segment
    # go in one pwritev (longer runs than IOV_MAX, 1024, in several).
    rng = np.random.default_rng(seed)
    sizes = mixed_sizes(rng)
    adjacent = [int(n) for n in rng.integers(1, 40, 2500)]
    with _C.Segment.create(sum(sizes) + sum(adjacent) + 64 * KIB, populate=populated) as seg:
        if populated:
            fill_random(seg, seed=seed + 200)
            before = contents(seg)
        else:  # no page of the data touched before the write: what it does not write reads 0
            with memoryview(seg) as view:
                before = bytes(view[: seg.data_offset]) + bytes(seg.size)
        scattered, triples = make_batch(rng, source, seg.data_offset, sizes)
        dst = max(d + n for _, d, n in triples) + 5
        run = []
        for n in adjacent:
            src = int(rng.integers(0, source.nbytes - n + 1))
            run.append((src, dst, n))
            dst += n
        assert dst <= seg.mapped_size
        entries = np.concatenate(
            [scattered, rows(*[(source.ctypes.data + a, b, c) for a, b, c in run])]
        )
        seg.write_from_host(entries[rng.permutation(len(entries))])
        assert contents(seg) == expected_after(before, source, triples + run)
        assert seg.exports == 0


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("populated", [False, True], ids=["fresh", "populated"])
@pytest.mark.parametrize("seed", [0, 1])
def test_write_from_host_shares_a_large_batch_between_the_file_and_the_mapping(
    source, threads, populated, seed
):
    # 32 MiB or more with two threads: 4 MiB pieces (of the mapping's offsets, cutting entries)
    # go through the file from the front and through the mapping from the back until they meet.
    _C.set_num_threads(threads)
    rng = np.random.default_rng(seed + 10)
    sizes = mixed_sizes(rng) + [int(n) for n in rng.integers(4 * MIB, 6 * MIB, 11)]
    rng.shuffle(sizes)
    with _C.Segment.create(sum(sizes) + 256 * KIB, populate=populated) as seg:
        if populated:
            fill_random(seg, seed=seed + 300)
            before = contents(seg)
        else:
            with memoryview(seg) as view:
                before = bytes(view[: seg.data_offset]) + bytes(seg.size)
        entries, triples = make_batch(rng, source, seg.data_offset, sizes)
        assert sum(sizes) >= 60 * MIB
        filled = seg.write_from_host(entries)
        # How much the helper takes depends on when it gets a core: the front writes pieces 0, 1,
        # ... through the file, the helper fills whole pieces from the last one down.
        total = sum(sizes)
        if threads == 1:
            assert filled == 0
        else:  # whole 4 MiB pieces of the mapping's offsets, from the last one down
            last = max(d + n for _, d, n in triples)
            pieces = -(-last // (4 * MIB))
            suffixes = {
                sum(max(0, d + n - max(d, k * 4 * MIB)) for _, d, n in triples)
                for k in range(pieces + 1)
            }
            assert filled in suffixes, (filled, sorted(suffixes))
        if not populated and not HUGE_SHM_PAGES:
            last = max(d + n for _, d, n in triples)
            piece = 4 * MIB  # of the mapping's offsets
            with memoryview(seg) as view:
                # Reading a page the file wrote faults in its neighbours too (16 pages a fault
                # here); one the helper wrote is mapped already.
                front = (seg.data_offset, seg.data_offset + 2 * MIB)
                back = ((last - 1) // piece * piece, -(-last // PAGE) * PAGE)
                if filled < total:  # the front wrote piece 0
                    assert minor_faults_reading(view[front[0] : front[1]]) > 8
                if filled > 0:  # the helper filled the last piece first
                    assert minor_faults_reading(view[back[0] : back[1]]) == 0
        assert contents(seg) == expected_after(before, source, triples)
        assert seg.exports == 0


@pytest.mark.parametrize(
    "entries",
    [
        np.zeros((2, 2), dtype=np.uint64),
        np.zeros((2, 4), dtype=np.uint64),
        np.zeros(3, dtype=np.uint64),
        np.zeros((1, 3, 1), dtype=np.uint64),
        np.zeros((0,), dtype=np.uint64),
    ],
    ids=["n2", "n4", "flat", "3d", "empty-flat"],
)
@pytest.mark.parametrize("method", ["copy_from_host", "copy_from_host_async", "write_from_host"])
def test_copy_rejects_wrong_shapes(segment, entries, method):
    before = contents(segment)
    with pytest.raises(ValueError, match="shape"):
        getattr(segment, method)(entries)
    assert segment.exports == 0
    assert contents(segment) == before


@pytest.mark.parametrize("method", ["copy_from_host", "copy_from_host_async", "write_from_host"])
def test_copy_into_closed_segment(source, method):
    seg = _C.Segment.create(PAGE)
    seg.close()
    with pytest.raises(ValueError, match="closed"):
        getattr(seg, method)(rows((source.ctypes.data, HEADER, 8)))
    assert seg.exports == 0


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_from_host_async(source, threads):
    _C.set_num_threads(threads)
    rng = np.random.default_rng(11 + threads)
    sizes = mixed_sizes(rng)
    with _C.Segment.create(sum(sizes) + 64 * KIB) as seg:
        before = contents(seg)
        entries, triples = make_batch(rng, source, seg.data_offset, sizes)
        handle = seg.copy_from_host_async(entries)
        entries[:] = 0  # the entries were copied in: changing them now must not matter
        assert seg.exports >= 1  # the copy holds the mapping until waited for
        handle.wait()
        assert handle.done
        assert seg.exports == 0
        handle.wait()  # idempotent
        assert handle.done
        assert seg.exports == 0
        assert contents(seg) == expected_after(before, source, triples)


def test_close_while_async_copy_runs_still_completes_the_copy(source):
    seg = _C.Segment.create(8 << 20)
    size = 8 << 20
    data = np.arange(size, dtype=np.uint64).view(np.uint8)[:size]
    handle = seg.copy_from_host_async(rows((data.ctypes.data, HEADER, size)))
    view = memoryview(seg)  # keeps the mapping so the result can be read after close()
    seg.close()
    handle.wait()  # the copy neither fails nor loses the mapping because of the close
    assert handle.done
    assert bytes(view[HEADER : HEADER + size]) == data.tobytes()
    assert seg.exports == 1
    view.release()
    assert seg.exports == 0


def test_done_turns_true_without_wait(source):
    with _C.Segment.create(PAGE) as seg:
        handle = seg.copy_from_host_async(rows((source.ctypes.data, HEADER, 64)))
        for _ in range(10_000_000):
            if handle.done:
                break
        assert handle.done
        handle.wait()


def test_copy_from_host_async_keeps_segment_alive(source):
    handle = _C.Segment.create(PAGE).copy_from_host_async(rows((source.ctypes.data, HEADER, 64)))
    handle.wait()
    assert handle.done
    del handle  # drops the last reference to the segment, which then closes


# --------------------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "crc"),
    [
        (b"", 0),
        (b"123456789", 0xE3069283),
        (bytes(32), 0x8A9136AA),  # RFC 3720 B.4
        (b"\xff" * 32, 0x62A8AB43),
        (bytes(range(32)), 0x46DD794E),
        (bytes(range(31, -1, -1)), 0x113FDB5C),
    ],
)
def test_crc32c_known_vectors(data, crc):
    assert crc32c_ref(data) == crc  # the reference itself
    assert _C.crc32c(data) == crc


# Past 48 KiB the hardware path runs three 16 KiB lanes at once and combines them.
@pytest.mark.parametrize(
    "length",
    [*range(0, 41), 63, 64, 65, 255, 1023, 4096, 4097, 49151, 49152, 49153, 65537, 98317, 147456],
)
def test_crc32c_matches_reference(length):
    data = np.random.default_rng(length).integers(0, 256, length + 7, dtype=np.uint8).tobytes()
    for start in (0, 1, 3, 7):  # misaligned starts too
        chunk = data[start : start + length]
        assert _C.crc32c(chunk) == crc32c_ref(chunk)
        assert _C.crc32c(memoryview(data)[start : start + length]) == crc32c_ref(chunk)


@pytest.mark.parametrize("seed", range(5))
def test_crc32c_chaining(seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
    whole = crc32c_ref(data)
    assert _C.crc32c(data) == whole
    cuts = sorted(int(c) for c in rng.integers(0, len(data) + 1, 4))
    crc = 0
    for lo, hi in zip([0, *cuts], [*cuts, len(data)], strict=True):
        crc = _C.crc32c(data[lo:hi], crc)
        assert crc == crc32c_ref(data[:hi])
    assert crc == whole
    assert _C.crc32c(b"", whole) == whole
    assert _C.crc32c(data, value=0x12345678) == crc32c_ref(data, 0x12345678)


def test_crc32c_chaining_through_the_three_lane_path():
    # Chunks past 48 KiB take three 16 KiB lanes, continuing from the crc of what came before.
    data = np.random.default_rng(21).integers(0, 256, 160_003, dtype=np.uint8).tobytes()
    whole = crc32c_ref(data)
    assert _C.crc32c(data) == whole
    crc = 0
    for lo, hi in [(0, 5), (5, 60_001), (60_001, 60_002), (60_002, 160_003)]:
        crc = _C.crc32c(data[lo:hi], crc)
    assert crc == whole
    assert _C.crc32c(data[100:], value=_C.crc32c(data[:100])) == whole


def test_crc32c_buffer_types():
    raw = np.random.default_rng(12).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    crc = crc32c_ref(raw)
    assert _C.crc32c(bytearray(raw)) == crc
    assert _C.crc32c(memoryview(raw)) == crc
    assert _C.crc32c(np.frombuffer(raw, dtype=np.uint8)) == crc
    assert _C.crc32c(np.frombuffer(raw, dtype=np.float64)) == crc  # bytes, not items
    assert _C.crc32c(np.frombuffer(raw, dtype=np.uint32).reshape(32, 32)) == crc
    assert _C.crc32c(memoryview(raw).cast("I", (32, 32))) == crc


def test_crc32c_rejects_non_contiguous_2d():
    array = np.arange(64, dtype=np.uint8).reshape(8, 8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        _C.crc32c(array)


@pytest.mark.parametrize(
    "make",
    [
        lambda raw: memoryview(raw)[::2],
        lambda raw: memoryview(raw)[::-1],
        lambda raw: np.frombuffer(raw, dtype=np.uint8)[1::3],
        lambda raw: np.frombuffer(raw, dtype=np.uint16)[::2],
    ],
    ids=["memoryview", "reversed", "numpy", "numpy-uint16"],
)
def test_crc32c_rejects_strided_1d(make):
    # size * itemsize bytes from the first element would be the wrong bytes (or out of bounds)
    with pytest.raises(ValueError, match="contiguous"):
        _C.crc32c(make(bytes(range(64))))


def test_crc32c_accepts_a_single_element_stride():
    raw = bytes(range(64))
    view = memoryview(raw)[10:11:5]  # one element: contiguous whatever the stride
    assert _C.crc32c(view) == crc32c_ref(raw[10:11])


def test_crc32c_hardware_is_bool():
    assert isinstance(_C.crc32c_hardware(), bool)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_checksums_match_reference(threads):
    _C.set_num_threads(threads)
    rng = np.random.default_rng(13)
    with _C.Segment.create(64 * KIB) as seg:
        fill_random(seg, seed=14)
        data = contents(seg)
        end = seg.mapped_size
        ranges = [(0, HEADER), (0, end), (end, 0), (0, 0), (HEADER, 1), (end - 1, 1), (17, 4099)]
        for _ in range(40):
            off = int(rng.integers(0, end))
            ranges.append((off, int(rng.integers(0, min(end - off, 3000) + 1))))
        sums = seg.checksums(np.array(ranges, dtype=np.uint64))
        assert sums.dtype == np.uint32
        assert sums.shape == (len(ranges),)
        assert [int(s) for s in sums] == [crc32c_ref(data[o : o + n]) for o, n in ranges]
        assert seg.exports == 0


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_checksums_of_large_ranges_match_crc32c(threads):
    _C.set_num_threads(threads)
    with _C.Segment.create(4 * MIB) as seg:
        fill_random(seg, seed=15)
        data = contents(seg)
        step = MIB + 7
        ranges = [(o, min(step, seg.mapped_size - o)) for o in range(0, seg.mapped_size, step)]
        sums = seg.checksums(np.array(ranges, dtype=np.uint64))
        assert [int(s) for s in sums] == [_C.crc32c(data[o : o + n]) for o, n in ranges]
        chained = 0
        for s_off, n in ranges:
            chained = _C.crc32c(data[s_off : s_off + n], chained)
        assert chained == _C.crc32c(data)


def test_checksums_empty(segment):
    sums = segment.checksums(np.zeros((0, 2), dtype=np.uint64))
    assert sums.shape == (0,)
    assert sums.dtype == np.uint32


BAD_RANGES: dict[str, Callable[[int], tuple[int, int]]] = {
    "offset-past-end": lambda end: (end + 1, 0),
    "one-past-end": lambda end: (end - 4, 5),
    "at-end-nonempty": lambda end: (end, 1),
    "too-long": lambda end: (0, end + 1),
    "nbytes-max": lambda end: (1, U64_MAX),
    "offset-max": lambda end: (U64_MAX, 2),
}


@pytest.mark.parametrize("bad", sorted(BAD_RANGES))
def test_checksums_out_of_range(segment, bad):
    ranges = np.array([(0, 16), BAD_RANGES[bad](segment.mapped_size), (16, 16)], dtype=np.uint64)
    with pytest.raises(ValueError, match="range 1"):
        segment.checksums(ranges)
    assert segment.exports == 0


@pytest.mark.parametrize(
    "ranges",
    [
        np.zeros((2, 3), dtype=np.uint64),
        np.zeros(2, dtype=np.uint64),
        np.zeros((1, 2, 1), dtype=np.uint64),
    ],
    ids=["n3", "flat", "3d"],
)
def test_checksums_wrong_shape(segment, ranges):
    with pytest.raises(ValueError, match="shape"):
        segment.checksums(ranges)


def test_checksums_of_closed_segment():
    seg = _C.Segment.create(PAGE)
    seg.close()
    with pytest.raises(ValueError, match="closed"):
        seg.checksums(np.array([[0, 8]], dtype=np.uint64))


# --------------------------------------------------------------------------------------------------
# Thread pool, populate
# --------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("n", [1, 3, 8, 256])
def test_set_num_threads(n):
    _C.set_num_threads(n)
    assert _C.num_threads() == n


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("n", [0, 257, 1 << 40])
def test_set_num_threads_out_of_range(n):
    _C.set_num_threads(2)
    with pytest.raises(ValueError, match="num_threads"):
        _C.set_num_threads(n)
    assert _C.num_threads() == 2


def test_num_threads_default_is_sane():
    assert 1 <= _C.num_threads() <= 256


# --------------------------------------------------------------------------------------------------
# CUDA entry points without a device
# --------------------------------------------------------------------------------------------------


def test_cuda_queries_do_not_raise():
    count = _C.cuda_device_count()
    assert count >= 0
    assert _C.cuda_device_count() == count
    status = _C.cuda_driver_status()
    assert status["usable"] == (count > 0)
    if not status["usable"]:
        assert status["reason"], status


@needs_no_cuda_device
def test_pin_fails_cleanly_without_a_device():
    with _C.Segment.create(PAGE) as seg:
        assert not seg.pinned
        assert seg.pin_error == ""
        assert seg.pin() is False
        assert seg.pin_error
        assert not seg.pinned
        assert "pinned" not in repr(seg)
        assert seg.pin(chunk_bytes=PAGE) is False
        assert seg.pin_error
        seg.unpin()  # no-op
        assert not seg.pinned
        assert not _C.is_pinned(seg.address)
        assert not _C.is_pinned(seg.address + seg.data_offset)


@needs_no_cuda_device
def test_is_pinned_is_false_without_a_device():
    array = np.zeros(16)
    assert _C.is_pinned(array.ctypes.data) is False
    assert _C.is_pinned(0) is False


def test_pin_argument_errors():
    with _C.Segment.create(PAGE) as seg:
        with pytest.raises(ValueError, match="chunk"):
            seg.pin(0)
    with pytest.raises(ValueError, match="closed"):
        seg.pin()


@needs_no_cuda_device
def test_copy_from_device_without_a_device(source, segment):
    entries = rows((source.ctypes.data, segment.data_offset, 16))
    with pytest.raises(RuntimeError):
        segment.copy_from_device(entries, 0, 0)
    assert segment.exports == 0


def test_copy_from_device_checks_bounds_and_shape_first(source, segment):
    with pytest.raises(ValueError, match="outside"):
        segment.copy_from_device(rows((source.ctypes.data, 0, 16)), 0, 0)
    with pytest.raises(ValueError, match="shape"):
        segment.copy_from_device(np.zeros((1, 2), dtype=np.uint64), 0, 0)
    assert segment.exports == 0
