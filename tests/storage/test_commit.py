"""The single-rank commit protocol of `storage/commit.py`, step by step, and a crash at each step:
a process is SIGKILLed (``os._exit``, nothing cleaned up) at that point of a save, and what a
restart then sees (after `clean_leftovers`, which every Checkpointer runs on opening its root) is
checked: only whole checkpoints, under their names, and `latest` naming a whole one."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pyshmckpt.storage import commit, directory_commit

from helpers import child_env

# Runs one save of checkpoint "new" (replacing it when it exists) under ROOT, killed at STEP.
CRASHING_SAVE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from pyshmckpt.storage import commit, directory_commit

    root, step = Path(sys.argv[1]), sys.argv[2]

    def die():
        os._exit(9)

    def fill(temp):
        (temp / "data").write_text("new")
        if step == "fill":
            die()
        return None

    if step == "record":  # the commit record written and fsynced, the rename not done
        fsync = commit.fsync_path
        def fsync_then_die(path):
            fsync(path)
            if Path(path).name == commit.COMMIT_RECORD:
                die()
        commit.fsync_path = fsync_then_die
    elif step == "rename":  # renamed into place, `latest` not moved
        commit.update_latest = lambda root, name: die()
    elif step == "latest":  # `latest` moved, retention not run
        commit.retain = lambda *args, **kwargs: die()
    elif step == "aside":  # replacing without RENAME_EXCHANGE: the old one moved aside, no more
        commit._exchange = lambda a, b: False
        rename = Path.rename
        def rename_then_die(self, target):
            moved = rename(self, target)
            if Path(target).name.startswith(commit.REPLACED_PREFIX):
                die()
            return moved
        Path.rename = rename_then_die
    directory_commit.commit_directory(
        root / "new", fill, keep_last=1, replace=(root / "new").exists()
    )
    """
)


def save(root: Path, name: str, text: str, **options: object) -> None:
    def fill(temp: Path) -> None:
        (temp / "data").write_text(text)

    directory_commit.commit_directory(root / name, fill, None, **options)  # type: ignore[arg-type]


def crash_during_save(tmp_path: Path, root: Path, step: str) -> None:
    script = tmp_path / "crashing_save.py"
    script.write_text(CRASHING_SAVE)
    done = subprocess.run(
        [sys.executable, str(script), str(root), step],
        env=child_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 9, done.stderr


def seen_after_restart(root: Path) -> tuple[list[str], str | None, list[str]]:
    """(committed names in commit order, what `latest` names, hidden entries) once a restarted
    job has opened the root."""
    commit.clean_leftovers(root)
    assert commit.wait_for_deletions(30)
    latest = commit.latest(root)
    hidden = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    return [name for _, name in commit.committed(root)], latest and latest.name, hidden


def test_each_step_of_a_commit(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    save(root, "a", "a")
    record = json.loads((root / "a" / commit.COMMIT_RECORD).read_text())
    assert record["sequence"] == 1
    assert record["name"] == "a"
    assert commit.latest(root) == root / "a"
    save(root, "b", "b")
    assert [name for _, name in commit.committed(root)] == ["a", "b"]
    assert commit.latest(root) == root / "b"
    # Replacing keeps the name holding one whole checkpoint and gives it a newer sequence.
    save(root, "a", "a2", replace=True)
    assert commit.wait_for_deletions(30)
    assert [name for _, name in commit.committed(root)] == ["b", "a"]
    assert (root / "a" / "data").read_text() == "a2"
    assert commit.latest(root) == root / "a"
    # Without a link, the newest commit is the latest.
    save(root, "c", "c", link_latest=False)
    assert commit.latest(root) == root / "a"  # the link still names a
    (root / commit.LATEST).unlink()
    assert commit.latest(root) == root / "c"
    # Retention keeps the newest and never what `latest` names.
    commit.update_latest(root, "b")
    assert commit.retain(root, 1) == ["a"]
    assert [name for _, name in commit.committed(root)] == ["b", "c"]
    # A name that exists is never overwritten without replace.
    with pytest.raises(FileExistsError):
        save(root, "c", "again")
    assert sorted(p.name for p in root.iterdir()) == ["b", "c", "latest"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("step", "committed", "latest"),
    [
        ("fill", ["old"], "old"),  # half-written: removed, the old checkpoint stays latest
        ("record", ["old"], "old"),  # complete but not renamed: removed
        ("rename", ["old", "new"], "old"),  # committed whole; `latest` not moved yet
        ("latest", ["old", "new"], "new"),  # retention had not run: the next save runs it
    ],
)
def test_a_crash_at_each_step_of_a_new_checkpoint(tmp_path, step, committed, latest):
    root = tmp_path / "root"
    root.mkdir()
    save(root, "old", "old")
    crash_during_save(tmp_path, root, step)
    assert seen_after_restart(root) == (committed, latest, [])
    for name in committed:
        assert (root / name / "data").read_text() == name


@pytest.mark.timeout(120)
def test_a_crash_between_the_two_renames_of_a_replacement_puts_the_old_one_back(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    save(root, "new", "the old one")
    crash_during_save(tmp_path, root, "aside")
    assert not (root / "new").exists()  # the name was empty when it died
    assert seen_after_restart(root) == (["new"], "new", [])
    assert (root / "new" / "data").read_text() == "the old one"


# --------------------------------------------------------------------------------------------
# replacing: the old checkpoint's files go only once the swap is durable
# --------------------------------------------------------------------------------------------

_FAN_CLOEXEC, _FAN_CLASS_CONTENT, _FAN_MARK_ADD = 0x1, 0x4, 0x1
_FAN_OPEN_PERM, _FAN_ONDIR, _FAN_ALLOW, _AT_FDCWD = 0x10000, 0x40000000, 0x1, -100
_EVENT = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_RESPONSE = struct.Struct("=iI")  # struct fanotify_response


@contextlib.contextmanager
def held_opens(directory: Path, on_open: Callable[[], None]) -> Iterator[None]:
    """Every open() of `directory` (fsyncing a directory opens it) waits in the kernel while
    `on_open` runs in a thread of this process (fanotify permission events; skips the test
    without CAP_SYS_ADMIN). Closing the group lets every open still held go on."""
    libc = ctypes.CDLL(None, use_errno=True)
    fan = libc.fanotify_init(_FAN_CLASS_CONTENT | _FAN_CLOEXEC, os.O_RDONLY)
    if fan < 0:
        pytest.skip(f"fanotify permission events: {os.strerror(ctypes.get_errno())}")
    mark = libc.fanotify_mark
    mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    mask = _FAN_OPEN_PERM | _FAN_ONDIR
    if mark(fan, _FAN_MARK_ADD, mask, _AT_FDCWD, os.fsencode(directory)) != 0:
        os.close(fan)
        pytest.skip(f"fanotify_mark: {os.strerror(ctypes.get_errno())}")
    stop = threading.Event()
    failures: list[BaseException] = []

    def serve() -> None:
        while not stop.is_set():
            if not select.select([fan], [], [], 0.05)[0]:
                continue
            data = os.read(fan, 4096)
            offset = 0
            while offset < len(data):
                length, *_, fd, _pid = _EVENT.unpack_from(data, offset)
                try:
                    on_open()
                except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
                    failures.append(exc)
                finally:
                    os.write(fan, _RESPONSE.pack(fd, _FAN_ALLOW))
                    os.close(fd)
                offset += length

    thread = threading.Thread(target=serve, name="held-opens", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        os.close(fan)
    if failures:
        raise failures[0]


@pytest.mark.timeout(60)
def test_a_replaced_checkpoint_is_deleted_only_once_the_root_is_fsynced(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    save(root, "c", "old")
    old_dir = (root / "c").stat().st_ino
    old_file = os.open(root / "c" / "data", os.O_RDONLY)  # its link count says when it is deleted
    links_while_the_root_is_fsynced: list[int] = []

    def on_open() -> None:
        # The first open of the root after the swap is the fsync that makes the swap durable:
        # held for a while, the old checkpoint's file must stay meanwhile.
        if (root / "c").stat().st_ino == old_dir or links_while_the_root_is_fsynced:
            return
        deadline = time.monotonic() + 1.0
        while os.fstat(old_file).st_nlink and time.monotonic() < deadline:
            time.sleep(0.01)
        links_while_the_root_is_fsynced.append(os.fstat(old_file).st_nlink)

    try:
        with held_opens(root, on_open):
            save(root, "c", "new", replace=True)
        assert links_while_the_root_is_fsynced == [1], "deleted before the swap was durable"
        assert commit.wait_for_deletions(30)
        assert os.fstat(old_file).st_nlink == 0  # and deleted after it
    finally:
        os.close(old_file)
    assert (root / "c" / "data").read_text() == "new"
    assert sorted(p.name for p in root.iterdir()) == ["c", "latest"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give entries to another user")
def test_leftovers_of_another_user_are_left_alone(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o1777)
    theirs = [root / ".tmp-c-1.0123", root / ".failed-c-1.0123", root / ".alive-0123"]
    theirs[0].mkdir()
    for path in theirs[1:]:
        path.write_text("theirs")
        os.utime(path, (0, 0))  # a heartbeat untouched for long: ours would be removed
    for path in theirs:
        os.lchown(path, 65534, 65534)
    ours = root / ".tmp-d-0123456789abcdef"
    ours.mkdir()
    assert commit.clean_leftovers(root) == [ours.name]
    assert all(path.exists() for path in theirs)
