"""The durable-checkpoint layer: Checkpointer, the atomic commit, the writers, load/verify, the CLI.

Every Checkpointer spawns a writer subprocess (1-3 s here), so most tests share one (`shared`,
module scope, with its shared-memory arena allocated up front so that the per-test leak check of
conftest sees no new segment) and a TinyGPT + AdamW checkpoint written once (`gpt_checkpoint`);
corruption tests damage copies of that checkpoint. Every Checkpointer is closed (context manager
or finally) and every wait is bounded.

Known library bugs are pinned by tests marked ``xfail(strict=True, reason="BUG: ...")``; tests of
bugs fixed since are kept as regression tests (their docstrings say what used to go wrong).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    SAVE_TIMEOUT,
    bounded_config,
    child_env,
    failure_of,
    hidden,
    link_target,
    names_in,
    opened,
    pid_running,
    same_bytes,
    small_tmpfs,
    visible,
    wait_until,
)

import pyshmckpt
from pyshmckpt import (
    CheckpointAbortedError,
    CheckpointCorruptError,
    Checkpointer,
    UnsupportedValueError,
)
from pyshmckpt import cli
from pyshmckpt.shm import SlotState
from pyshmckpt.storage import commit

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


def assert_same_tree(expected: Any, actual: Any, path: str = "state") -> None:
    """Same container types, keys (in order), leaves, and bitwise-equal tensors."""
    assert type(actual) is type(expected), (
        f"{path}: {type(actual).__name__}, expected {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert same_bytes(actual, expected), f"{path}: tensor bytes differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_tree(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_tree(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def snapshot(state: Any) -> Any:
    """A deep copy with every tensor cloned (aliasing kept), taken before anything changes."""
    return copy.deepcopy(state)


def gpt_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3}


def tree_hash(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` (to show it was not touched)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def read_st_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header JSON) of a .safetensors file, parsed independently of pyshmckpt."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8 : 8 + n])


def write_st_header(path: Path, header: dict[str, Any]) -> None:
    """Replace the header of a .safetensors file (data bytes kept), padded to 8 like the writer."""
    start, _ = read_st_header(path)
    data = path.read_bytes()[start:]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


# --------------------------------------------------------------------------------------------
# shared fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpointer]:
    """One Checkpointer for the tests that do not need a root of their own. Its arena is
    allocated here (capacity given), so no test creates a segment through it."""
    root = tmp_path_factory.mktemp("shared-root")
    with opened(root, capacity_bytes=8 << 20) as ck:
        yield ck


@pytest.fixture(scope="module")
def gpt_checkpoint(shared: Checkpointer) -> dict[str, Any]:
    """A TinyGPT + AdamW (after one step) saved once through the safetensors writer.

    Returns the committed path, the state as it was at save time (cloned), and deep copies of
    the model and optimizer taken before saving (to continue training from)."""
    from conftest import TinyGPT, train_step

    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer)
    state = gpt_state(model, optimizer)
    expected = snapshot(state)
    reference = copy.deepcopy((model, optimizer))  # together: the optimizer keeps its params
    path = shared.save(state, name="gpt").result(timeout=SAVE_TIMEOUT)
    return {"path": path, "expected": expected, "reference": reference}


# --------------------------------------------------------------------------------------------
# round trip through the safetensors writer
# --------------------------------------------------------------------------------------------


def test_round_trip_of_a_transformer_and_adamw_state(gpt_checkpoint, shared):
    path, expected = gpt_checkpoint["path"], gpt_checkpoint["expected"]
    assert path == shared.root / "gpt"
    assert sorted(names_in(path)) == ["commit.json", "rank0.json", "rank0.safetensors"]

    loaded = pyshmckpt.load(path)
    assert_same_tree(expected, loaded)

    # Container types: the module's OrderedDict (with its _metadata), int keys of the optimizer
    # state, tuples (AdamW betas) inside param_groups, the plain int leaf.
    assert type(loaded["model"]) is collections.OrderedDict
    assert loaded["model"]._metadata == expected["model"]._metadata
    assert all(type(k) is int for k in loaded["optim"]["state"])
    group = loaded["optim"]["param_groups"][0]
    assert type(group["betas"]) is tuple
    assert group["betas"] == (0.9, 0.999)
    assert group["params"] == expected["optim"]["param_groups"][0]["params"]
    assert loaded["step"] == 3
    assert type(loaded["step"]) is int

    # Tied embeddings come back as aliases of one buffer.
    model = loaded["model"]
    assert model["embed.weight"].data_ptr() == model["head.weight"].data_ptr()
    assert (
        model["embed.weight"].untyped_storage().data_ptr()
        == model["head.weight"].untyped_storage().data_ptr()
    )

    # verify() agrees and counts every tensor.
    n_tensors = len(json.loads((path / "rank0.json").read_text())["tensors"])
    assert pyshmckpt.verify(path) == n_tensors
    # A file of the checkpoint names it too.
    assert_same_tree(expected, pyshmckpt.load(path / "rank0.safetensors"))


def test_loaded_state_resumes_training_exactly(gpt_checkpoint):
    from conftest import TinyGPT, train_step

    ref_model, ref_opt = copy.deepcopy(gpt_checkpoint["reference"])
    loaded = pyshmckpt.load(gpt_checkpoint["path"])

    torch.manual_seed(123)  # a different initialisation: everything must come from the checkpoint
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optim"])
    assert model.head.weight is model.embed.weight  # still tied after loading

    for seed in (1, 2, 3):  # the later steps depend on the restored AdamW moments and step
        expected_loss = train_step(ref_model, ref_opt, seed=seed)
        loss = train_step(model, optimizer, seed=seed)
        assert loss == expected_loss, f"step with seed {seed}: {loss!r} != {expected_loss!r}"
    for (name, p), (_, q) in zip(
        model.state_dict().items(), ref_model.state_dict().items(), strict=True
    ):
        assert same_bytes(p, q), name


def test_safetensors_library_reads_the_file(gpt_checkpoint):
    st = pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    path, expected = gpt_checkpoint["path"], gpt_checkpoint["expected"]
    tensors = load_file(str(path / "rank0.safetensors"))
    with st.safe_open(str(path / "rank0.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pyshmckpt"

    model = expected["model"]
    present = {key for key in model if f"model.{key}" in tensors}
    for key in present:
        assert same_bytes(tensors[f"model.{key}"], model[key]), key
    # A key is absent only when it aliases a stored one (the tied head shares the embedding).
    for key in set(model) - present:
        assert any(model[key].data_ptr() == model[k].data_ptr() for k in present), (
            f"model.{key} missing"
        )
    assert "model.embed.weight" in tensors
    assert "model.pos" in tensors
    # The optimizer's moments are ordinary named tensors too.
    for index, slot in expected["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bytes(tensors[f"optim.state.{index}.{key}"], slot[key]), (index, key)


def test_load_into_copies_in_place(gpt_checkpoint):
    from conftest import TinyGPT

    torch.manual_seed(7)
    model = TinyGPT()
    target = {"model": model.state_dict()}
    pointers = {k: v.data_ptr() for k, v in target["model"].items()}
    result = pyshmckpt.load(gpt_checkpoint["path"], into=target)
    assert result is target
    expected = gpt_checkpoint["expected"]["model"]
    for key, value in target["model"].items():
        assert value.data_ptr() == pointers[key], f"{key} was replaced, not copied into"
        assert same_bytes(value, expected[key]), key
    # The module itself now holds the checkpoint's weights (its state_dict tensors are views).
    assert same_bytes(model.embed.weight, expected["embed.weight"])
    assert same_bytes(model.head.weight, expected["embed.weight"])


def test_load_into_rejects_a_different_structure(gpt_checkpoint):
    path = gpt_checkpoint["path"]
    with pytest.raises(ValueError, match="pos"):
        pyshmckpt.load(path, into={"model": {"pos": torch.zeros(3, 3)}})
    with pytest.raises(KeyError, match="nonexistent"):
        pyshmckpt.load(path, into={"model": {"nonexistent": torch.zeros(1)}})


# --------------------------------------------------------------------------------------------
# Checkpointer semantics
# --------------------------------------------------------------------------------------------


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
    assert loaded["pair"].weight.dtype == torch.int16 and loaded["pair"].step == 4


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


def test_missing_or_non_directory_root_fails_before_anything_is_staged(tmp_path):
    root = tmp_path / "missing"
    with opened(root) as ck:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            ck.save({"x": torch.ones(1024)})
        assert ck._stager.arena is None
        assert not root.exists()

        root.write_text("a file, not a directory")
        with pytest.raises(NotADirectoryError, match="not a directory"):
            ck.save({"x": torch.ones(1024)}, name="a")
        assert ck._stager.arena is None
        assert root.read_text() == "a file, not a directory"

        root.unlink()
        root.mkdir()
        path = ck.save({"x": torch.ones(1024)}).result(timeout=SAVE_TIMEOUT)
        assert path.parent == root
        assert torch.equal(pyshmckpt.load(path)["x"], torch.ones(1024))


# --------------------------------------------------------------------------------------------
# the other writers
# --------------------------------------------------------------------------------------------


def test_torch_writer_writes_a_torch_loadable_file(tmp_path, trained):
    model, optimizer = trained
    state = gpt_state(model, optimizer)
    expected = snapshot(state)
    with opened(tmp_path, writer="torch") as ck:
        path = ck.save(state).result(timeout=SAVE_TIMEOUT)
    assert sorted(names_in(path)) == ["checkpoint_0.pt", "commit.json"]
    assert ck.latest() == path

    loaded = torch.load(path / "checkpoint_0.pt", weights_only=True)
    assert_same_tree(expected, loaded)
    assert loaded["model"]["embed.weight"].data_ptr() == loaded["model"]["head.weight"].data_ptr()

    try:
        from torch.distributed.checkpoint._experimental.checkpoint_reader import CheckpointReader
        from torch.distributed.checkpoint._experimental.types import RankInfo
    except ImportError:
        pass  # torch without the experimental reader: torch.load above is the check
    else:
        read, missing = CheckpointReader(RankInfo(global_rank=0, global_world_size=1)).read(
            str(path)
        )
        assert missing == []
        assert_same_tree(expected, read)

    with pytest.raises(CheckpointCorruptError, match="missing"):
        pyshmckpt.load(path)  # not the safetensors layout: a clear error, not a crash


def _zeros_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        out = type(tree)()
        for key, value in tree.items():
            out[key] = _zeros_like(value)
        return out
    return copy.deepcopy(tree)


def test_dcp_writer_writes_a_dcp_loadable_checkpoint(tmp_path, trained):
    import torch.distributed.checkpoint as dcp

    model, optimizer = trained
    state = {
        "model": model.state_dict(),
        "optim": {"state": optimizer.state_dict()["state"]},
        "step": 3,
    }
    expected = snapshot(state)
    with opened(tmp_path, writer="dcp") as ck:
        path = ck.save(state, name="dcp").result(timeout=SAVE_TIMEOUT)
    assert (path / ".metadata").is_file()
    assert (path / commit.COMMIT_RECORD).is_file()
    assert visible(tmp_path) == ["dcp"]
    assert link_target(tmp_path / "latest") == "dcp"

    target = _zeros_like(expected)
    target["step"] = 0
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
    assert target["step"] == 3
    for key, value in expected["model"].items():
        assert same_bytes(target["model"][key], value), key
    for index, slot in expected["optim"]["state"].items():
        for key, value in slot.items():
            assert same_bytes(target["optim"]["state"][index][key], value), (index, key)


# --------------------------------------------------------------------------------------------
# disk full
# --------------------------------------------------------------------------------------------


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
# corruption
# --------------------------------------------------------------------------------------------


def _flip_tensor_byte(d: Path) -> None:
    st = d / "rank0.safetensors"
    start, header = read_st_header(st)
    begin, end = header["model.pos"]["data_offsets"]
    data = bytearray(st.read_bytes())
    data[start + (begin + end) // 2] ^= 0x5A
    st.write_bytes(bytes(data))


def _truncate(size: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        st = d / "rank0.safetensors"
        os.truncate(st, size(st.stat().st_size))

    return damage


def _edit_tensor(**changes: Any) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        manifest = json.loads((d / "rank0.json").read_text())
        for item in manifest["tensors"]:
            if item["name"] == "model.pos":
                item.update(changes)
        (d / "rank0.json").write_text(json.dumps(manifest))

    return damage


def _edit_manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        manifest = json.loads((d / "rank0.json").read_text())
        edit(manifest)
        (d / "rank0.json").write_text(json.dumps(manifest))

    return damage


def _header_past_the_end(d: Path) -> None:
    st = d / "rank0.safetensors"
    _, header = read_st_header(st)
    last = max(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1]
    )
    header[last]["data_offsets"][1] += 1 << 20
    write_st_header(st, header)


def _header_overlapping(d: Path) -> None:
    st = d / "rank0.safetensors"
    _, header = read_st_header(st)
    second = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )[1]
    header[second]["data_offsets"] = [
        x - 4 for x in header[second]["data_offsets"]
    ]  # overlaps the first
    write_st_header(st, header)


@dataclasses.dataclass(frozen=True)
class Corruption:
    damage: Callable[[Path], None]
    file: str  # the file the error must name
    tensor: str | None = None  # the tensor (or entry) it must name
    reason: str = ""  # a fragment of its reason
    by_inspect: bool = True  # `pyshmckpt inspect` (descriptions only) detects it too
    structural: bool = True  # found without checksums: load(verify=False) reports it too
    source: str = "gpt"  # the checkpoint damaged: "gpt" or "ints"


def _int_tensors_require_grad(manifest: dict[str, Any]) -> None:
    for item in manifest["tensors"]:
        if item["dtype"] == "int64":
            item["flags"] = 2  # REQUIRES_GRAD, which only floating-point tensors can have


ST, JS = "rank0.safetensors", "rank0.json"
CHECKSUM_ONLY = {"by_inspect": False, "structural": False}
TREE_ONLY = {"by_inspect": False}  # inspect lists tensors, it does not rebuild the structure
CORRUPTIONS: dict[str, Corruption] = {
    "flipped-byte": Corruption(_flip_tensor_byte, ST, "model.pos", "checksum", **CHECKSUM_ONLY),
    "truncated-data": Corruption(_truncate(lambda n: n - 100), ST, None, "truncated"),
    "truncated-header": Corruption(_truncate(lambda n: 100), ST, None, "truncated"),
    "truncated-length": Corruption(_truncate(lambda n: 5), ST, None, "8-byte"),
    "empty-data-file": Corruption(_truncate(lambda n: 0), ST),
    "missing-manifest": Corruption(lambda d: (d / JS).unlink(), JS, None, "missing"),
    "missing-data-file": Corruption(lambda d: (d / ST).unlink(), ST, None, "missing"),
    "manifest-not-json": Corruption(lambda d: (d / JS).write_text("{"), JS, None, "unreadable"),
    "manifest-not-ours": Corruption(lambda d: (d / JS).write_text("[1]"), JS, None, "not a"),
    "offset-outside-entry": Corruption(_edit_tensor(offset=8192), ST, "model.pos", "outside"),
    "shape-outside-entry": Corruption(_edit_tensor(shape=[64, 33]), ST, "model.pos", "outside"),
    "stride-outside-entry": Corruption(_edit_tensor(stride=[33, 1]), ST, "model.pos", "outside"),
    "negative-offset": Corruption(_edit_tensor(offset=-4), ST, "model.pos", "invalid"),
    "unknown-entry": Corruption(_edit_tensor(entry="nope"), ST, "model.pos", "not in the file"),
    "entry-not-a-string": Corruption(_edit_tensor(entry=["model.pos"]), ST, "model.pos"),
    "unknown-dtype": Corruption(_edit_tensor(dtype="float99"), ST, "model.pos", "malformed"),
    "integer-tensor-requires-grad": Corruption(
        _edit_manifest(_int_tensors_require_grad), ST, "ids", source="ints"
    ),
    "no-checksum": Corruption(
        _edit_manifest(lambda m: m["entries"].pop("model.pos")),
        ST,
        "model.pos",
        "no checksum",
        **CHECKSUM_ONLY,
    ),  # fmt: skip
    "checksum-of-a-missing-entry": Corruption(
        _edit_manifest(lambda m: m["entries"].update(ghost={"crc32c": 1})),
        ST,
        "ghost",
        "missing",
        **CHECKSUM_ONLY,
    ),  # fmt: skip
    "tree-index-out-of-range": Corruption(
        _edit_manifest(lambda m: m.update(tree={"t": 10**6})), JS, None, "structure", **TREE_ONLY
    ),
    "tree-garbage": Corruption(
        _edit_manifest(lambda m: m.update(tree=[1])), JS, None, "structure", **TREE_ONLY
    ),
    "header-offsets-past-the-end": Corruption(_header_past_the_end, ST, None, "past the end"),
    "header-overlap": Corruption(_header_overlapping, ST, None, "overlap"),
}


@pytest.fixture(scope="module")
def int_checkpoint(shared: Checkpointer) -> Path:
    """A checkpoint with an integer tensor (for the requires-grad case)."""
    state = {"ids": torch.arange(16), "w": torch.ones(4)}
    return shared.save(state, name="with-ints").result(SAVE_TIMEOUT)


def _check_reported(case: Corruption, d: Path, call: Callable[[], Any]) -> None:
    with pytest.raises(CheckpointCorruptError) as info:
        call()
    exc = info.value
    assert isinstance(exc, ValueError)  # documented: a ValueError too
    assert Path(exc.path) == d / case.file, str(exc)
    if case.tensor is not None:
        assert exc.tensor == case.tensor, str(exc)
        assert f"[{case.tensor}]" in str(exc)
    assert case.reason in exc.reason, str(exc)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_reported_never_a_crash(
    kind, tmp_path, gpt_checkpoint, int_checkpoint, capsys
):
    case = CORRUPTIONS[kind]
    d = tmp_path / "ckpt"
    shutil.copytree(int_checkpoint if case.source == "ints" else gpt_checkpoint["path"], d)
    case.damage(d)

    _check_reported(case, d, lambda: pyshmckpt.load(d))
    if case.structural:
        _check_reported(case, d, lambda: pyshmckpt.load(d, verify=False))
    _check_reported(case, d, lambda: pyshmckpt.verify(d))

    # The command line (in-process here; test_command_line_verify_and_inspect runs the real
    # entry point) reports it, names the file, and exits 1 without a traceback.
    capsys.readouterr()
    assert cli.main(["verify", str(d)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("CORRUPT: "), err
    assert str(d / case.file) in err
    if case.by_inspect:
        assert cli.main(["inspect", str(d)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("CORRUPT: "), err
        assert str(d / case.file) in err


def test_flipped_byte_loads_without_verification_and_differs(tmp_path, gpt_checkpoint):
    d = tmp_path / "ckpt"
    shutil.copytree(gpt_checkpoint["path"], d)
    _flip_tensor_byte(d)
    loaded = pyshmckpt.load(d, verify=False)  # the caller opted out: no error, no crash
    expected = gpt_checkpoint["expected"]["model"]
    assert not same_bytes(loaded["model"]["pos"], expected["pos"])
    assert same_bytes(loaded["model"]["embed.weight"], expected["embed.weight"])


def test_a_root_without_checkpoints_is_reported(tmp_path):
    with pytest.raises(CheckpointCorruptError, match="missing"):
        pyshmckpt.load(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="missing"):
        pyshmckpt.verify(tmp_path / "nope")


def test_command_line_verify_and_inspect(tmp_path, gpt_checkpoint):
    path = gpt_checkpoint["path"]
    corrupt = tmp_path / "corrupt"
    shutil.copytree(path, corrupt)
    _flip_tensor_byte(corrupt)
    commands = {
        "verify-ok": ["verify", str(path)],
        "verify-corrupt": ["verify", str(corrupt)],
        "inspect": ["inspect", str(path)],
    }
    # Started together: each one imports torch, which is most of its time.
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "pyshmckpt", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=str(tmp_path),
        )  # fmt: skip
        for key, args in commands.items()
    }
    results = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=CLI_TIMEOUT)
            results[key] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    n_tensors = len(json.loads((path / "rank0.json").read_text())["tensors"])
    rc, out, err = results["verify-ok"]
    assert rc == 0, err
    assert out.startswith("OK: ")
    assert f"{n_tensors} tensors" in out

    rc, out, err = results["verify-corrupt"]
    assert rc == 1, (out, err)
    assert "Traceback" not in err
    assert str(corrupt / "rank0.safetensors") in err
    assert "[model.pos]" in err
    assert "checksum" in err

    rc, out, err = results["inspect"]
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["tensor", "dtype", "shape", "bytes"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert len(rows) == n_tensors
    assert "float32" in rows["model.embed.weight"]
    assert "(97, 32)" in rows["model.embed.weight"]
    assert "(64, 32)" in rows["model.pos"]
    assert "8,192" in rows["model.pos"]
    assert "float32" in rows["optim.state.0.step"]
    assert "()" in rows["optim.state.0.step"]
    # The tied head is listed under its own name, stored in the embedding's entry.
    assert rows["model.head.weight"].split()[-1] == "model.embed.weight"
    assert lines[-1].startswith(f"{n_tensors} tensors")


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
    from pyshmckpt.checkpointer import _no_init, _RankInfo
    from pyshmckpt.storage import TorchSaveWriter

    stager = pyshmckpt.ShmStager(slots=2)
    process = pyshmckpt.CheckpointProcess(
        _RankInfo(), bounded_config(), _no_init, (), TorchSaveWriter, {}
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


# --------------------------------------------------------------------------------------------
# loading to another device
# --------------------------------------------------------------------------------------------


def test_load_to_another_device_keeps_tied_weights_tied(gpt_checkpoint):
    """With a map_location other than the CPU ("meta" stands for any device here), tensors that
    share a storage share one there too (they used to be moved as independent copies)."""
    model = pyshmckpt.load(gpt_checkpoint["path"], map_location="meta")["model"]
    assert model["embed.weight"].device.type == "meta"
    embed = model["embed.weight"].untyped_storage()._cdata
    assert model["head.weight"].untyped_storage()._cdata == embed, (
        "tied weights were moved as two copies"
    )


def test_load_to_another_device_keeps_module_metadata(gpt_checkpoint):
    """The module state dict's OrderedDict keeps its _metadata when moved (it used to be dropped
    by OrderedDict.copy())."""
    model = pyshmckpt.load(gpt_checkpoint["path"], map_location="meta")["model"]
    assert type(model) is collections.OrderedDict
    assert getattr(model, "_metadata", None) == gpt_checkpoint["expected"]["model"]._metadata


def test_moving_differently_typed_views_of_one_entry(shared):
    """Regression: _move reused the storage made for the first (shorter, float32) base of the entry."""
    from pyshmckpt.storage import reader

    u8 = torch.arange(10, dtype=torch.uint8)
    state = {"f": u8[:8].view(torch.float32), "u": u8}
    path = shared.save(state, name="mixed-dtypes").result(timeout=SAVE_TIMEOUT)
    loaded = pyshmckpt.load(path)
    assert same_bytes(loaded["f"], state["f"])
    assert same_bytes(loaded["u"], u8)
    moved = reader._move(loaded, torch.device("cpu"))
    assert same_bytes(moved["f"], state["f"])
    assert same_bytes(moved["u"], u8)
    assert moved["f"].untyped_storage().data_ptr() == moved["u"].untyped_storage().data_ptr()
