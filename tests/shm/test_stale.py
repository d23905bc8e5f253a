"""Stale-segment collection (`pyshmckpt.shm.stale`): a segment is stale exactly when no process
has it open, proven by the shared ``flock`` every open segment holds; never by a pid.

Segments are made under a prefix that extends the session's (conftest.py's leak check covers
them); each test removes what it leaves.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pyshmckpt import _C
from pyshmckpt.shm import stale

from helpers import child_env, wait_until

SHM = Path("/dev/shm")
PAGE = 4096
CHILD_TIMEOUT = 60  # seconds a child may take to start and answer; only to never hang
# Seconds a creator or attacher waits between opening a segment and locking it, in the tests that
# run a collector in between: long enough for a loaded machine to get the collector there first.
LOCK_DELAY = 1.5
# The owner pid and start time in the segment header (csrc/segment.h): after magic[16], version,
# header_size, size, token[16].
OWNER_AT = struct.calcsize("<16sIIQ16s")
OWNER = struct.Struct("<qQ")

# Creates a segment under argv[1], prints its name, size and token, then waits for stdin to close
# (or a SIGKILL): a process that keeps its segment open, as a trainer does.
HOLDER = """
import sys
from pyshmckpt import _C

segment = _C.Segment.create(int(sys.argv[2]), sys.argv[1])
print(segment.name, segment.size, segment.token.hex(), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix of this test's own; whatever is left under it is removed afterwards."""
    name = f"{os.environ['PYSHMCKPT_SEGMENT_PREFIX']}-stale{os.getpid()}"
    yield name
    for path in SHM.glob(f"{name}-*"):
        path.unlink(missing_ok=True)


@pytest.fixture
def no_lock_delay() -> Iterator[None]:
    yield
    _C._set_lock_delay(0)


@contextlib.contextmanager
def holder(
    prefix: str, size: int = PAGE
) -> Iterator[tuple[subprocess.Popen[str], str, int, bytes]]:
    """A process that created a segment and keeps it open: (process, name, size, token)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, prefix, str(size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(), cwd="/",
    )  # fmt: skip
    try:
        line = read_line(process)
        name, data_size, token = line.split()
        yield process, name, int(data_size), bytes.fromhex(token)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=CHILD_TIMEOUT)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def read_line(process: subprocess.Popen[str]) -> str:
    """The child's first line of output, waited for at most CHILD_TIMEOUT seconds."""
    lines: list[str] = []
    assert process.stdout is not None
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(CHILD_TIMEOUT)
    if not lines or not lines[0]:
        process.kill()
        pytest.fail(f"the child printed nothing within {CHILD_TIMEOUT} s")
    return lines[0]


def killed(process: subprocess.Popen[str]) -> None:
    """SIGKILL `process` and reap it: no cleanup of any kind runs."""
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=CHILD_TIMEOUT) == -signal.SIGKILL


def lock_free(name: str) -> bool:
    """Whether no process holds the lock of /dev/shm/<name> (an exclusive lock can be had)."""
    fd = os.open(SHM / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def collected(prefix: str) -> dict[str, stale.SegmentInfo]:
    return {info.name: info for info in stale.collect_stale_segments(prefix)}


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait(timeout=CHILD_TIMEOUT)
    return process.pid


def set_header_owner(name: str, pid: int, ticks: int) -> None:
    fd = os.open(SHM / name, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.pwrite(fd, OWNER.pack(pid, ticks), OWNER_AT)
    finally:
        os.close(fd)


def open_descriptor_of(name: str) -> bool:
    """Whether this process has /dev/shm/<name> open (deleted since, or not)."""
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if str(fd.readlink()).startswith(f"/dev/shm/{name}"):
                return True
    return False


def test_a_live_creators_segment_is_kept_and_collected_once_it_is_sigkilled(prefix):
    with holder(prefix) as (process, name, _, _):
        assert not lock_free(name)
        assert collected(prefix) == {}
        (info,) = stale.list_segments(prefix)
        assert (info.name, info.stale, info.reason) == (name, False, "open in a live process")
        assert info.size == PAGE
        killed(process)  # an OOM kill: the segment's name is left behind
        assert (SHM / name).exists()
        assert lock_free(name)  # the kernel dropped the lock with the process
        removed = collected(prefix)
        assert list(removed) == [name]
        assert removed[name].stale
        assert removed[name].reason == "no process has it open"
        assert removed[name].owner_pid == process.pid  # for information
        assert not (SHM / name).exists()


def test_an_attached_segment_outlives_its_sigkilled_creator_until_closed(prefix):
    with holder(prefix, 3 * PAGE) as (process, name, size, token):
        attached = _C.Segment.attach(name, size, token)
        try:
            killed(process)
            assert collected(prefix) == {}  # the attacher keeps it alive, in any PID namespace
            assert (SHM / name).exists()
            with memoryview(attached) as view:
                view[-1] = 7  # and it is still usable
        finally:
            attached.close()  # not the creator: the name stays
        assert list(collected(prefix)) == [name]


def test_a_mapping_exported_after_close_keeps_the_lock(prefix):
    with holder(prefix) as (process, name, size, token):
        attached = _C.Segment.attach(name, size, token)
        killed(process)
        view = memoryview(attached)
        attached.close()  # the descriptor stays open while the view lives
        try:
            assert collected(prefix) == {}
        finally:
            view.release()
        assert list(collected(prefix)) == [name]


def test_liveness_is_never_judged_by_the_pid_in_the_header(prefix):
    # Another PID namespace's pids mean nothing here: a live segment whose header names a pid
    # that does not exist here stays, and a dead one that names a live pid goes.
    live = _C.Segment.create(PAGE, prefix)
    try:
        set_header_owner(live.name, dead_pid(), 1)
        with holder(prefix) as (process, orphan, _, _):
            killed(process)
            set_header_owner(orphan, os.getpid(), 0)
            removed = collected(prefix)
        assert list(removed) == [orphan]
        assert (SHM / live.name).exists()
    finally:
        live.close()


def test_a_segment_without_a_header_is_judged_by_its_lock(prefix):
    # What a creator that is still allocating, or died while it did, leaves: a name, no header.
    name = f"{prefix}-{os.getpid()}-{os.urandom(16).hex()}"
    fd = os.open(SHM / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        (info,) = stale.list_segments(prefix)
        assert (info.stale, info.reason, info.size) == (False, "no header; being created", 0)
        assert collected(prefix) == {}
    finally:
        os.close(fd)
    removed = collected(prefix)
    assert removed[name].reason == "no header; no process has it open"
    assert not (SHM / name).exists()


def test_a_dry_run_removes_nothing_and_holds_no_lock_afterwards(prefix):
    with holder(prefix) as (process, name, _, _):
        killed(process)
        would = stale.collect_stale_segments(prefix, dry_run=True)
        assert [info.name for info in would] == [name]
        assert (SHM / name).exists()
        assert lock_free(name)
        assert list(collected(prefix)) == [name]


def test_collection_follows_no_symlink_and_leaves_other_files_alone(prefix, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"x" * PAGE)
    link = SHM / f"{prefix}-1-{os.urandom(16).hex()}"
    fifo = SHM / f"{prefix}-2-{os.urandom(16).hex()}"
    link.symlink_to(target)
    os.mkfifo(fifo, 0o600)
    try:
        assert stale.list_segments(prefix) == []
        assert collected(prefix) == {}  # neither followed nor waited on
        assert target.read_bytes() == b"x" * PAGE
        assert link.is_symlink()
        assert fifo.exists()
    finally:
        link.unlink()
        fifo.unlink()


@pytest.mark.usefixtures("no_lock_delay")
def test_a_name_collected_between_its_creation_and_its_lock_is_given_up_for_another(prefix):
    # A collector that opens a new segment before its creator locks it takes it for a dead
    # process's: the creator must notice and make another, never use an unnamed file.
    _C._set_lock_delay(LOCK_DELAY)
    made: list[Any] = []
    creator = threading.Thread(target=lambda: made.append(_C.Segment.create(PAGE, prefix)))
    creator.start()
    try:
        wait_until(lambda: any(SHM.glob(f"{prefix}-*")), CHILD_TIMEOUT, "the segment's name")
        (first,) = (p.name for p in SHM.glob(f"{prefix}-*"))
        assert list(collected(prefix)) == [first]  # not locked yet: taken for stale
    finally:
        creator.join(CHILD_TIMEOUT)
        _C._set_lock_delay(0)
    (segment,) = made
    try:
        assert segment.name != first
        assert not (SHM / first).exists()
        assert not lock_free(segment.name)
        assert collected(prefix) == {}
        with _C.Segment.attach(segment.name, segment.size, segment.token) as other:
            assert other.token == segment.token
    finally:
        segment.close()


@pytest.mark.usefixtures("no_lock_delay")
def test_attaching_a_segment_collected_before_its_lock_is_enoent(prefix):
    with holder(prefix) as (process, name, size, token):
        killed(process)
    _C._set_lock_delay(LOCK_DELAY)
    failure: list[BaseException] = []

    def attach() -> None:
        try:
            _C.Segment.attach(name, size, token).close()
        except OSError as exc:
            failure.append(exc)

    attacher = threading.Thread(target=attach)
    attacher.start()
    try:
        wait_until(lambda: open_descriptor_of(name), CHILD_TIMEOUT, "the attacher to open it")
        assert list(collected(prefix)) == [name]  # opened, not locked yet: stale
    finally:
        attacher.join(CHILD_TIMEOUT)
        _C._set_lock_delay(0)
    (error,) = failure
    assert isinstance(error, FileNotFoundError)
    assert error.errno == errno.ENOENT
    assert "removed as stale" in str(error)
    assert not open_descriptor_of(name)
