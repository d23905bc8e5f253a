"""The front door (pyshmckpt/checkpointer.py): saving through the Checkpointer, its commit, names,
retention and leftovers, refusals before staging, a full disk, abort and close.

Every Checkpointer spawns a writer subprocess (1-3 s here), so most tests share one (`shared`,
module scope, from conftest, with its shared-memory arena allocated up front so that the per-test
leak check sees no new segment). Every Checkpointer is closed (context manager or finally) and
every wait is bounded.

Known library bugs are pinned by tests marked ``xfail(strict=True, reason="BUG: ...")``; tests of
bugs fixed since are kept as regression tests (their docstrings say what used to go wrong).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import pyshmckpt
from pyshmckpt import (
    CheckpointAbortedError,
    CheckpointCorruptError,
    Checkpointer,
    UnsupportedValueError,
)
from pyshmckpt.shm import SlotState
from pyshmckpt.storage import commit, directory_commit

from helpers import (
    SAVE_TIMEOUT,
    assert_same_tree,
    bounded_config,
    child_env,
    failure_of,
    gpt_state,
    hidden,
    link_target,
    names_in,
    opened,
    pid_running,
    same_bytes,
    small_tmpfs,
    snapshot,
    tree_hash,
    visible,
    wait_until,
)

CLI_TIMEOUT = 120.0


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


Pair = collections.namedtuple("Pair", ["weight", "step"])  # importable by the writer subprocess


@dataclasses.dataclass
class Schedule:
    """A user object in a state dict: not plain data, so it needs pickle (importable by the
    writer subprocess, which receives the structure)."""

    warmup: int
    decay: float


# --------------------------------------------------------------------------------------------
# Checkpointer semantics
# --------------------------------------------------------------------------------------------


@pytest.mark.optimize
def test_save_returns_a_snapshot_the_source_may_change_at_once(shared, trained):
    from conftest import train_step

    model, optimizer = trained
    state = gpt_state(model, optimizer)
    before = snapshot(state)
    future = shared.save(state, name="snapshot")
    # Training goes on the moment save() returns: an optimizer step and in-place writes.
    train_step(model, optimizer, seed=5)
    with torch.no_grad():
        for value in model.state_dict().values():
            value.add_(1.0)
    assert not same_bytes(model.state_dict()["pos"], before["model"]["pos"])
    path = future.result(timeout=SAVE_TIMEOUT)
    assert_same_tree(before, pyshmckpt.load(path))


# A trainer that saves and loads plain tensors through the Checkpointer: DCP, DTensor (and with
# them TorchDynamo and SymPy, seconds of CPU) are never imported. Prints what it loaded and those
# of the modules it has.
PLAIN_TRAINER = """
import sys

import torch

import pyshmckpt

with pyshmckpt.Checkpointer(sys.argv[1]) as ck:
    ck.save({"w": torch.arange(6.0), "step": 3}, name="s3").result(timeout=60)
    state = ck.load()
heavy = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo", "sympy")
print(state["step"], state["w"].tolist(), sorted(m for m in heavy if m in sys.modules))
"""


def test_a_checkpointer_of_plain_tensors_loads_no_dcp(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_TRAINER, str(tmp_path / "ck")],
        capture_output=True, text=True, env=child_env(), cwd=str(tmp_path), timeout=CLI_TIMEOUT,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "3 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] []", done.stdout


def test_latest_follows_the_newest_checkpoint(shared):
    root = shared.root
    first = shared.save({"tag": "a", "x": torch.full((100,), 1.0)}, name="latest-a").result(
        SAVE_TIMEOUT
    )
    assert shared.latest() == first
    assert link_target(root / "latest") == "latest-a"
    # Two back to back, without waiting in between: the newest wins.
    shared.save({"tag": "b", "x": torch.full((100,), 2.0)}, name="latest-b")
    last = shared.save({"tag": "c", "x": torch.full((100,), 3.0)}, name="latest-c")
    paths = shared.wait(timeout=SAVE_TIMEOUT)
    assert last.result() in paths
    assert root / "latest-c" in paths
    assert shared.latest() == root / "latest-c"
    assert link_target(root / "latest") == "latest-c"
    assert commit.latest(root) == root / "latest-c"
    loaded = pyshmckpt.load(root)  # a root loads its latest
    assert loaded["tag"] == "c"
    assert torch.equal(loaded["x"], torch.full((100,), 3.0))
    # Commit sequences follow the commit order.
    order = [name for _, name in commit.committed(root)]
    assert order.index("latest-a") < order.index("latest-b") < order.index("latest-c")
    assert not hidden(root)


@pytest.mark.optimize
def test_existing_and_invalid_names_are_rejected_at_once(shared):
    root = shared.root
    path = shared.save({"x": torch.ones(4)}, name="taken").result(timeout=SAVE_TIMEOUT)
    before = tree_hash(path)
    with pytest.raises(FileExistsError, match="taken"):
        shared.save({"x": torch.zeros(4)}, name="taken")
    for name in ("", ".hidden", "..", ".", "a/b", "../escape", "latest"):
        with pytest.raises(ValueError, match="invalid checkpoint name"):
            shared.save({"x": torch.zeros(4)}, name=name)
    assert tree_hash(path) == before
    assert not (root.parent / "escape").exists()
    assert not [n for n in hidden(root)]
    # Nothing is left staged or being written by the rejected calls.
    arena = shared._stager.arena
    assert arena is not None
    assert all(slot.state in (SlotState.FREE, SlotState.READY) for slot in arena.slots)
    assert shared.save({"x": torch.ones(1)}, name="after-rejections").result(SAVE_TIMEOUT).is_dir()


def test_a_name_queued_twice_fails_only_the_second_save(shared):
    root = shared.root
    first = shared.save({"v": torch.full((8,), 1.0)}, name="twice")
    try:
        second = shared.save({"v": torch.full((8,), 2.0)}, name="twice")
    except FileExistsError:
        pass  # the first was already committed when the second was asked for
    else:
        exc = failure_of(second)
        assert getattr(exc, "errno", None) == errno.EEXIST or isinstance(exc, FileExistsError), exc
    assert first.result(SAVE_TIMEOUT) == root / "twice"
    assert torch.equal(pyshmckpt.load(root / "twice")["v"], torch.full((8,), 1.0))
    assert not hidden(root)


@pytest.mark.optimize
def test_leaves_that_need_pickle_are_refused_without_allow_pickle(shared):
    root = shared.root
    names = visible(root)
    cases = {
        "counter": {"w": torch.ones(2), "counts": collections.Counter(a=1)},
        "object": {"w": torch.ones(2), "schedule": Schedule(10, 0.5)},
        "defaultdict": {"w": torch.ones(2), "d": collections.defaultdict(list, k=[1])},
        "nested": {"w": torch.ones(2), "optim": {"param_groups": [{"sched": Schedule(1, 0.1)}]}},
    }
    for label, state in cases.items():
        with pytest.raises(UnsupportedValueError, match="allow_pickle") as info:
            shared.save(state, name=f"pickle-{label}")
        assert isinstance(info.value, TypeError)
    assert visible(root) == names
    arena = shared._stager.arena
    assert all(slot.state in (SlotState.FREE, SlotState.READY) for slot in arena.slots)
    assert shared.save({"w": torch.ones(2)}, name="after-pickle").result(SAVE_TIMEOUT).is_dir()


def test_leaves_that_need_pickle_are_refused_before_anything_is_staged(tmp_path):
    """Regression: the check used to run after staging, so a refused first save allocated the arena."""
    with opened(tmp_path) as ck:
        with pytest.raises(UnsupportedValueError):
            ck.save({"w": torch.ones(1024), "counts": collections.Counter(a=1)})
        assert ck._stager.arena is None, f"the refused save allocated {ck._stager.arena}"


def test_allow_pickle_round_trip_needs_allow_pickle_to_load(tmp_path):
    state = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "counts": collections.Counter(a=2, b=1),
        "schedule": Schedule(100, 0.9),
        "d": collections.defaultdict(list, k=[1, 2]),
        "pair": Pair(torch.ones(3, dtype=torch.int16), 4),
        "step": 9,
    }
    expected = snapshot(state)
    with opened(tmp_path, allow_pickle=True) as ck:
        path = ck.save(state).result(timeout=SAVE_TIMEOUT)
    with pytest.raises(CheckpointCorruptError, match="allow_pickle") as info:
        pyshmckpt.load(path)
    assert info.value.path.endswith("rank0.json")
    assert pyshmckpt.verify(path) == 2  # checks checksums without unpickling anything
    loaded = pyshmckpt.load(path, allow_pickle=True)
    assert_same_tree(expected, loaded)
    assert loaded["d"].default_factory is list
    assert loaded["pair"].weight.dtype == torch.int16
    assert loaded["pair"].step == 4


def test_a_namedtuple_needs_pickle_and_is_refused_before_staging(tmp_path):
    """Regression: encoding a namedtuple node raised a bare ValueError (a node of 4 fields was
    unpacked as one of 6), so the save failed with an unhelpful error, or in the writer."""
    with opened(tmp_path) as ck:
        with pytest.raises(UnsupportedValueError, match="container of type Pair.*allow_pickle"):
            ck.save({"pair": Pair(torch.ones(2), 1)})
        assert ck._stager.arena is None


def test_keep_last_keeps_exactly_the_newest_two(tmp_path):
    with opened(tmp_path, keep_last=2) as ck:
        history: list[list[str]] = []
        names: list[str] = []
        for i in range(4):  # one at a time: watch the oldest go first
            names.append(
                ck.save({"i": i, "x": torch.full((64,), float(i))}).result(SAVE_TIMEOUT).name
            )
            history.append(visible(tmp_path))
        futures = [
            ck.save({"i": i, "x": torch.full((64,), float(i))}) for i in range(4, 7)
        ]  # back to back
        ck.wait(timeout=SAVE_TIMEOUT)
        names += [f.result(timeout=0).name for f in futures]
    assert names == sorted(names), names
    assert len(set(names)) == 7, names
    assert history == [names[:1], names[:2], names[1:3], names[2:4]], history
    assert visible(tmp_path) == names[5:], (
        f"kept {visible(tmp_path)}, expected the newest two {names[5:]}"
    )
    assert [name for _, name in commit.committed(tmp_path)] == names[5:]
    assert link_target(tmp_path / "latest") == names[6]
    for i, name in enumerate(names[5:], start=5):
        loaded = pyshmckpt.load(tmp_path / name)
        assert loaded["i"] == i
        assert torch.equal(loaded["x"], torch.full((64,), float(i)))
    assert hidden(tmp_path) == []  # removed ones went through .trash-*, deleted by now


def test_a_clean_close_leaves_nothing_half_deleted(tmp_path):
    """Retention deletes removed checkpoints in the background; a graceful close() waits for that
    (a writer that exited mid-deletion used to leave a half-deleted .trash-* behind)."""
    with opened(tmp_path, keep_last=1) as ck:
        first = ck.save({"x": torch.ones(8)}).result(timeout=SAVE_TIMEOUT)
        extra = first / "extra"  # more files make the deletion take a while (a large checkpoint)
        extra.mkdir()
        for i in range(4000):
            (extra / str(i)).touch()
        ck.save({"x": torch.zeros(8)}).result(timeout=SAVE_TIMEOUT)  # retention removes `first`
    assert visible(tmp_path) == ["step-00000002"]
    assert hidden(tmp_path) == [], f"left after a clean close: {hidden(tmp_path)}"


def test_keep_last_and_writer_are_validated_before_anything_starts(tmp_path):
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="keep_last"):
            Checkpointer(tmp_path, keep_last=bad)
    with pytest.raises(ValueError, match="unknown writer"):
        Checkpointer(tmp_path, writer="pickle")


def test_leftovers_are_removed_when_a_checkpointer_opens_the_root(tmp_path, gpt_checkpoint):
    root = tmp_path / "root"
    root.mkdir()
    kept = root / "step-00000041"
    shutil.copytree(gpt_checkpoint["path"], kept)
    record = json.loads((kept / commit.COMMIT_RECORD).read_text())
    record.update(sequence=41, name=kept.name)
    (kept / commit.COMMIT_RECORD).write_text(json.dumps(record))
    (root / "latest").symlink_to(kept.name)
    # What a crash can leave: an unfinished checkpoint, a half-deleted one, a link temporary.
    unfinished = root / ".tmp-step-00000042-0123456789abcdef"
    unfinished.mkdir()
    (unfinished / "rank0.safetensors").write_bytes(b"\0" * 1000)
    trash = root / ".trash-step-00000040-fedcba9876543210"
    (trash / "nested").mkdir(parents=True)
    (trash / "nested" / "rank0.json").write_text("{}")
    (root / ".latest-00112233aabbccdd").symlink_to(kept.name)
    untouched = tree_hash(kept)

    with opened(root) as ck:
        assert hidden(root) == [], f"left after opening: {hidden(root)}"
        assert visible(root) == [kept.name]
        assert tree_hash(kept) == untouched
        assert link_target(root / "latest") == kept.name
        assert_same_tree(gpt_checkpoint["expected"], pyshmckpt.load(root))
        # New checkpoints continue after the committed sequence.
        path = ck.save({"x": torch.ones(3)}).result(timeout=SAVE_TIMEOUT)
    assert path.name == "step-00000042"
    assert [name for _, name in commit.committed(root)] == [kept.name, path.name]
    assert link_target(root / "latest") == path.name
    assert tree_hash(kept) == untouched


def test_a_missing_root_is_created_and_an_unusable_one_fails_at_once(tmp_path):
    root = tmp_path / "missing" / "nested"
    with opened(root) as ck:
        assert root.is_dir()
        path = ck.save({"x": torch.ones(1024)}).result(timeout=SAVE_TIMEOUT)
        assert path.parent == root
        assert torch.equal(pyshmckpt.load(path)["x"], torch.ones(1024))
        writer = ck.writer_pid
        assert writer is not None
        assert pid_running(writer)
    assert not pid_running(writer)

    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        pyshmckpt.Checkpointer(a_file)
    with pytest.raises(NotADirectoryError, match="cannot create checkpoint root"):
        pyshmckpt.Checkpointer(a_file / "below")
    assert a_file.read_text() == "not a directory"
    with small_tmpfs(tmp_path / "read-only", read_only=True) as read_only:
        with pytest.raises(pyshmckpt.PyshmckptOSError, match="cannot create checkpoint root"):
            pyshmckpt.Checkpointer(read_only / "root")
        with pytest.raises(PermissionError, match="not writable"):
            pyshmckpt.Checkpointer(read_only)


def test_a_root_removed_after_opening_fails_the_save_before_anything_is_staged(tmp_path):
    root = tmp_path / "root"
    with opened(root) as ck:
        root.rmdir()
        with pytest.raises(FileNotFoundError, match="does not exist"):
            ck.save({"x": torch.ones(1024)})
        assert ck._stager.arena is None
        assert not root.exists()

        root.write_text("a file, not a directory")
        with pytest.raises(NotADirectoryError, match="not a directory"):
            ck.save({"x": torch.ones(1024)}, name="a")
        assert ck._stager.arena is None
        assert root.read_text() == "a file, not a directory"


@pytest.mark.parametrize("writer", ["safetensors", "torch"])
def test_overwrite_replaces_a_checkpoint_atomically_and_nothing_else(tmp_path, writer):
    with opened(tmp_path, writer=writer) as ck:
        first = ck.save({"x": torch.zeros(4)}, name="last.ckpt").result(timeout=SAVE_TIMEOUT)
        with pytest.raises(FileExistsError, match="already exists"):
            ck.save({"x": torch.ones(4)}, name="last.ckpt")
        futures = [
            ck.save({"x": torch.full((4,), float(i))}, name="last.ckpt", overwrite=True)
            for i in range(1, 4)
        ]
        assert [f.result(timeout=SAVE_TIMEOUT) for f in futures] == [first] * 3
        if writer == "torch":
            saved = torch.load(first / "checkpoint_0.pt", weights_only=True)
        else:
            pyshmckpt.verify(first)
            saved = pyshmckpt.load(first)
        assert torch.equal(saved["x"], torch.full((4,), 3.0))
        assert link_target(tmp_path / "latest") == "last.ckpt"
        # The replaced ones are deleted in the background by the writer process.
        wait_until(
            lambda: hidden(tmp_path) == [], SAVE_TIMEOUT, "the replaced checkpoints' deletion"
        )
        assert visible(tmp_path) == ["last.ckpt"]

        (tmp_path / "theirs.ckpt").write_text("a file of someone else's")
        (tmp_path / "a-directory").mkdir()
        for name in ("theirs.ckpt", "a-directory"):
            with pytest.raises(FileExistsError, match="not a pyshmckpt checkpoint"):
                ck.save({"x": torch.ones(4)}, name=name, overwrite=True)
        assert (tmp_path / "theirs.ckpt").read_text() == "a file of someone else's"


# --------------------------------------------------------------------------------------------
# disk full
# --------------------------------------------------------------------------------------------


@pytest.mark.optimize
def test_disk_full_fails_that_save_only(tmp_path):
    with small_tmpfs(tmp_path / "small") as root, opened(root) as ck:
        fits = {"w": torch.full((75_000,), 1.0), "step": 1}  # 300 KB
        first = ck.save(fits, name="fits").result(timeout=SAVE_TIMEOUT)
        before = tree_hash(first)

        too_big = {"w": torch.full((1_000_000,), 2.0), "step": 2}  # 4 MB on a 2 MB file system
        exc = failure_of(ck.save(too_big, name="too-big"))
        text = str(exc)
        assert "No space left" in text or "ENOSPC" in text or "Errno 28" in text, text
        assert not (root / "too-big").exists()
        assert hidden(root) == [], f"temporaries left after ENOSPC: {hidden(root)}"
        assert visible(root) == ["fits"]
        assert link_target(root / "latest") == "fits"
        assert tree_hash(first) == before
        assert pyshmckpt.verify(first) == 1
        assert torch.equal(pyshmckpt.load(root)["w"], torch.full((75_000,), 1.0))

        again = ck.save({"w": torch.full((75_000,), 3.0), "step": 3}, name="again").result(
            SAVE_TIMEOUT
        )
        assert torch.equal(pyshmckpt.load(again)["w"], torch.full((75_000,), 3.0))
        assert ck.latest() == again
        assert hidden(root) == []


# --------------------------------------------------------------------------------------------
# abort, and closing
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_close_abort_with_a_slow_save_pending_leaves_nothing_partial_visible(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    ck = Checkpointer(root, config=bounded_config())
    writer_pid = None
    try:
        ck.save({"x": torch.full((1000,), 1.0), "step": 1}, name="before").result(
            timeout=SAVE_TIMEOUT
        )
        writer_pid = ck._process.pid
        big = {"x": torch.full((16 << 20,), 2.0), "step": 2}  # 64 MiB: written and fsynced slowly
        pending = ck.save(big, name="big")
        del big
        # Freeze the writer in the middle of the write: its temporary directory exists.
        wait_until(
            lambda: any(n.startswith(".tmp-big-") for n in names_in(root)),
            30,
            "the write",
            poll=0.001,
        )
        os.kill(writer_pid, signal.SIGSTOP)
        assert not pending.done(), "the 64 MiB write finished before the writer could be stopped"

        started = time.monotonic()
        ck.close(abort=True)
        elapsed = time.monotonic() - started
    finally:
        if writer_pid is not None and pid_running(writer_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer_pid, signal.SIGKILL)
        ck.close(abort=True)
    assert elapsed < 10, f"close(abort=True) took {elapsed:.1f}s"
    assert isinstance(failure_of(pending, 5), CheckpointAbortedError)
    wait_until(lambda: not pid_running(writer_pid), 10, "the aborted writer to be gone")

    # The partial write is there, under its hidden temporary name only.
    partial = [n for n in hidden(root) if n.startswith(".tmp-big-")]
    assert partial, hidden(root)
    assert visible(root) == ["before"]
    assert [name for _, name in commit.committed(root)] == ["before"]
    assert link_target(root / "latest") == "before"
    for name in visible(root):
        assert pyshmckpt.verify(root / name) == 1
    assert pyshmckpt.load(root)["step"] == 1

    with opened(root):  # the next Checkpointer on the root removes the partial write
        assert hidden(root) == []
        assert visible(root) == ["before"]


def test_close_right_after_opening_stops_the_writer(tmp_path):
    """close() while the writer is still starting must not leave it running (it used to: start()
    finished after close() and its dispatcher thread died on the closed wake-up pipe)."""
    ck = Checkpointer(tmp_path, config=bounded_config())
    writer = None
    try:
        ck.close()
        writer = ck._process._writer
        pid = writer.pid
        if pid is not None:
            with contextlib.suppress(AssertionError):
                wait_until(lambda: not pid_running(pid), 5, "the writer to exit")
        assert pid is None or not pid_running(pid), (
            f"writer {pid} still runs after close() returned"
        )
    finally:
        process = writer._process if writer is not None else None
        if process is not None and process.is_alive():
            process.kill()
            process.join(10)


def test_a_new_dict_is_never_mistaken_for_a_dead_staged_one(tmp_path):
    """A slot keeps the id() of the staged dict it holds after that dict is gone; a new object at
    the same address must not be taken for it (CheckpointProcess.write used to write the old
    slot's contents for it)."""
    from pyshmckpt.storage import TorchSaveWriter
    from pyshmckpt.transport import RankInfo, no_init

    stager = pyshmckpt.ShmStager(slots=2)
    process = pyshmckpt.CheckpointProcess(
        RankInfo(), bounded_config(), no_init, (), TorchSaveWriter, {}
    )
    try:
        fresh: dict[str, torch.Tensor] | None = None
        for attempt in range(10):
            staged = stager.stage({"x": torch.ones(4)})
            dead_id = id(staged)
            process.write(staged, str(tmp_path / f"first-{attempt}")).result(timeout=SAVE_TIMEOUT)
            time.sleep(0.05)  # the dispatcher thread's callbacks allocate too: let them finish
            del staged  # done with it; its slot stays READY until reused
            fresh = {"x": torch.zeros(4)}  # CPython hands out the freed dict's address again
            if id(fresh) == dead_id:
                break
            fresh = None
        if fresh is None:
            pytest.skip("no new dict reused a dead staged dict's address")
        process.write(fresh, str(tmp_path / "second")).result(timeout=SAVE_TIMEOUT)
        written = torch.load(tmp_path / "second" / "checkpoint_0.pt", weights_only=True)["x"]
        assert torch.equal(written, torch.zeros(4)), (
            f"second checkpoint holds {written.tolist()}, not zeros"
        )
    finally:
        process.close()
        stager.close()


def test_a_staged_dict_is_found_even_when_a_stale_slot_has_its_id():
    """A staged dict allocated at the address of a dead one whose (lower) slot still lists that
    id is found in its own slot (it used to be missed, and Checkpointer.save then failed with
    SlotStateError or AttributeError, a few times per thousand saves in a training loop)."""
    with pyshmckpt.ShmStager(slots=2) as stager:
        dead = stager.stage({"x": torch.ones(4)})
        live = stager.stage({"x": torch.zeros(4)})  # slot 1: slot 0 is held by `dead`
        dead_slot, live_slot = stager.handle(dead).slot, stager.handle(live).slot
        assert (dead_slot.index, live_slot.index) == (0, 1)
        del dead
        # The state CPython produces when `live` is allocated at the address of a dead staged
        # dict whose slot still lists it (being written, or READY after its write).
        dead_slot.staged_id = id(live)
        handle = stager.handle(live)
        assert handle is not None, "the staged dict is not found"
        assert handle.slot is live_slot


def test_values_a_slot_cannot_hold_are_stored_pickled_only_with_allow_pickle(tmp_path):
    state = {"w": torch.ones(3), "sparse": torch.eye(3).to_sparse()}
    with opened(tmp_path) as checkpointer:
        with pytest.raises(pyshmckpt.UnsupportedValueError, match=r"\['sparse'\].*sparse"):
            checkpointer.save(state)
        assert list(tmp_path.iterdir()) == []  # refused before anything was staged or written
    with opened(tmp_path, allow_pickle=True) as checkpointer:
        path = checkpointer.save(state).result(timeout=SAVE_TIMEOUT)
    state["sparse"].values().zero_()  # the checkpoint holds the values as they were at save()
    with pytest.raises(pyshmckpt.PyshmckptError, match="allow_pickle=True"):
        pyshmckpt.load(path)
    loaded = pyshmckpt.load(path, allow_pickle=True)
    assert loaded["sparse"].is_sparse
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(3))
    assert torch.equal(loaded["w"], torch.ones(3))


def test_a_temporary_a_live_writer_holds_survives_the_next_opening_of_the_root(tmp_path):
    """The writer of a trainer that died may still be finishing a checkpoint when the restarted
    job opens the root: its temporary is left alone while it is in use, removed after."""
    temp = commit.new_temp_dir(tmp_path, "orphaned")
    with commit.in_use(temp):
        with opened(tmp_path):
            assert temp.is_dir()
    with opened(tmp_path):
        assert not temp.exists()


def test_overwrite_where_the_filesystem_cannot_exchange_renames_the_old_one_away(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)  # as on NFS: EINVAL

    def fill(value: str):
        return lambda temp: [(temp / "data").write_text(value) and temp / "data"]

    path = directory_commit.commit_directory(tmp_path / "last", fill("old"), None)
    directory_commit.commit_directory(tmp_path / "last", fill("new"), None, replace=True)
    assert (path / "data").read_text() == "new"
    assert commit.wait_for_deletions(30.0)
    assert visible(tmp_path) == ["last"]
    assert hidden(tmp_path) == []

    # A crash between the two renames: the next opening of the root puts the old one back.
    path.rename(tmp_path / f"{commit.REPLACED_PREFIX}last-0123abcd")
    commit.clean_leftovers(tmp_path)
    assert (path / "data").read_text() == "new"
    assert hidden(tmp_path) == []


def test_replacing_exchanges_the_two_directories_atomically_on_this_filesystem(tmp_path):
    # The path every replacement takes where renameat2(RENAME_EXCHANGE) works (tmpfs, ext4, xfs).
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "which").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "which").write_text("b")
    assert commit._exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "which").read_text() == "b"
    assert (tmp_path / "b" / "which").read_text() == "a"
    with pytest.raises(FileNotFoundError):
        commit._exchange(tmp_path / "a", tmp_path / "missing")


@pytest.mark.timeout(120)
def test_the_first_save_does_not_wait_for_the_writer_and_wait_for_writer_does(tmp_path):
    checkpointer = pyshmckpt.Checkpointer(tmp_path / "ckpt")
    try:
        started = checkpointer._process.process_creation_future
        future = checkpointer.save({"w": torch.arange(100), "step": 1}, name="first")
        # The writer takes seconds to start (a new interpreter importing torch): the save was
        # spooled, not handed to a ready writer.
        assert not started.done()
        with pytest.raises(pyshmckpt.WriterStartTimeoutError):
            checkpointer.wait_for_writer(timeout=0.001)
        checkpointer.wait_for_writer(timeout=60)
        assert future.result(timeout=60) == tmp_path / "ckpt" / "first"
        assert torch.equal(pyshmckpt.load(tmp_path / "ckpt")["w"], torch.arange(100))
    finally:
        checkpointer.close()
    with pytest.raises(pyshmckpt.ClosedError):
        checkpointer.wait_for_writer()


@pytest.mark.timeout(120)
def test_a_checkpointer_told_to_wait_for_its_writer_does(tmp_path):
    config = pyshmckpt.CheckpointProcessConfig(wait_for_start=True)
    with pyshmckpt.Checkpointer(tmp_path / "ckpt", config=config) as checkpointer:
        checkpointer.save({"w": torch.ones(3)})
        assert checkpointer._process.process_creation_future.done()
        checkpointer.wait()


@pytest.mark.timeout(120)
def test_without_a_latest_link_the_newest_commit_is_the_latest(tmp_path):
    with pyshmckpt.Checkpointer(tmp_path, link_latest=False, config=bounded_config()) as ckpt:
        ckpt.save({"w": torch.ones(3)}, name="zz-first")
        ckpt.save({"w": torch.full((3,), 2.0)}, name="aa-second")  # newer, though named lower
        ckpt.wait(SAVE_TIMEOUT)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["aa-second", "zz-first"]
        assert ckpt.latest() == tmp_path / "aa-second"
    assert torch.equal(pyshmckpt.load(tmp_path)["w"], torch.full((3,), 2.0))


@pytest.mark.timeout(120)
def test_remove_runs_in_the_writer_after_the_saves_handed_over_before_it(tmp_path):
    with pyshmckpt.Checkpointer(tmp_path, config=bounded_config()) as ckpt:
        saved = ckpt.save({"w": torch.ones(1 << 16)}, name="doomed")
        removed = ckpt.remove("doomed")  # the save is still pending: removed once committed
        kept = ckpt.save({"w": torch.zeros(4)}, name="kept")
        assert removed.result(SAVE_TIMEOUT) is None
        assert saved.result(SAVE_TIMEOUT) == tmp_path / "doomed"
        kept.result(SAVE_TIMEOUT)
        missing = failure_of(ckpt.remove("doomed"), SAVE_TIMEOUT)
        assert isinstance(missing, pyshmckpt.WriterOSError)
        assert missing.errno == errno.ENOENT
        with pytest.raises(pyshmckpt.ConfigError):
            ckpt.remove("../elsewhere")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0] != ".") == ["kept", "latest"]


@pytest.mark.timeout(120)
def test_a_save_whose_writer_is_stopped_fails_at_the_stall_timeout_and_the_next_lands(tmp_path):
    with opened(tmp_path, stall_timeout=2.0) as ck:
        ck.wait_for_writer(SAVE_TIMEOUT)
        stopped = ck.writer_pid
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)  # what a write stuck on a hung filesystem looks like
        exc = failure_of(ck.save({"w": torch.ones(1000)}, name="stuck"))
        assert isinstance(exc, pyshmckpt.WriteStalledError), repr(exc)
        assert not pid_running(stopped)
        assert visible(tmp_path) == []
        landed = ck.save({"w": torch.ones(1000)}, name="next").result(timeout=SAVE_TIMEOUT)
        assert landed == tmp_path / "next"
        assert ck.writer_pid != stopped


@pytest.mark.timeout(120)
def test_wait_bounds_all_pending_saves_together_and_raises_a_write_timeout(tmp_path):
    with opened(tmp_path, stall_timeout=60.0, slots=4) as ck:
        ck.wait_for_writer(SAVE_TIMEOUT)
        stopped = ck.writer_pid
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)  # the saves below stay pending
        try:
            futures = [ck.save({"w": torch.ones(100)}, name=f"s{i}") for i in range(3)]
            started = time.monotonic()
            with pytest.raises(pyshmckpt.WriteTimeoutError, match="still pending after 1 s"):
                ck.wait(timeout=1.0)
            elapsed = time.monotonic() - started
            # One bound for the three saves, not one per save (generous for a busy machine).
            assert 1.0 <= elapsed < 2.9, elapsed
            assert not any(f.done() for f in futures)
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert ck.wait(timeout=SAVE_TIMEOUT) == [tmp_path / f"s{i}" for i in range(3)]


def test_a_rejected_config_leaves_no_heartbeat_on_the_root(tmp_path):
    with pytest.raises(pyshmckpt.ConfigError):
        pyshmckpt.Checkpointer(tmp_path, rank=0, world_size=2, run_id="run1", stall_timeout=-1.0)
    assert hidden(tmp_path) == []
    assert not list(tmp_path.glob(".alive-*"))


@pytest.mark.timeout(120)
def test_a_writer_stopped_while_starting_is_restarted_and_the_next_save_lands(tmp_path):
    with opened(tmp_path, config=bounded_config(subprocess_init_timeout_secs=3)) as ck:
        stopped = ck.writer_pid
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)  # starved or stopped before it answered
        if ck._process.process_creation_future.done():
            pytest.skip("the writer was ready before it could be stopped")
        exc = failure_of(ck.save({"w": torch.ones(10)}, name="first"))
        assert isinstance(exc, pyshmckpt.WriterStartTimeoutError), repr(exc)
        assert not pid_running(stopped)
        landed = ck.save({"w": torch.ones(10)}, name="second").result(timeout=SAVE_TIMEOUT)
        assert landed == tmp_path / "second"
        assert visible(tmp_path) == ["second"]
