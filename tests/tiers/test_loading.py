"""Loading a checkpoint root on a job's first start (pyshmckpt/tiers/loading.py): nothing to
restore is `CheckpointNotFoundError`, or None with ``missing_ok=True``, from every source; a root
that holds a damaged checkpoint is never taken for an empty one.
"""

from __future__ import annotations

import pytest
import torch

import pyshmckpt

from helpers import SAVE_TIMEOUT, opened


@pytest.mark.parametrize("source", ["auto", "memory", "disk"])
@pytest.mark.parametrize("exists", [True, False], ids=["empty-root", "no-root"])
def test_a_root_with_nothing_to_restore_is_not_found_or_none(tmp_path, source, exists):
    root = tmp_path / "root"
    if exists:
        root.mkdir()
    with pytest.raises(pyshmckpt.CheckpointNotFoundError, match="checkpoint missing"):
        pyshmckpt.load(root, source=source)
    target = {"w": torch.zeros(3)}
    assert pyshmckpt.load(root, source=source, into=target, missing_ok=True) is None
    assert torch.equal(target["w"], torch.zeros(3))  # nothing was filled
    assert root.exists() == exists  # loading creates nothing


def test_the_first_start_of_a_checkpointer_resumes_nothing_then_its_save(tmp_path):
    with opened(tmp_path / "root") as checkpointer:
        assert checkpointer.load(missing_ok=True) is None
        with pytest.raises(pyshmckpt.CheckpointNotFoundError):
            checkpointer.load()
        checkpointer.save({"w": torch.arange(4.0), "step": 7}).result(SAVE_TIMEOUT)
        state = checkpointer.load(missing_ok=True)
    assert state["step"] == 7
    assert torch.equal(state["w"], torch.arange(4.0))


def test_a_damaged_checkpoint_is_not_taken_for_a_first_start(tmp_path):
    root = tmp_path / "root"
    with opened(root) as checkpointer:
        path = checkpointer.save({"w": torch.ones(1024)}, name="only").result(SAVE_TIMEOUT)
    (path / "rank0.safetensors").unlink()
    for source in ("auto", "disk"):
        with pytest.raises(pyshmckpt.CheckpointCorruptError) as raised:
            pyshmckpt.load(root, source=source, missing_ok=True)
        assert not isinstance(raised.value, pyshmckpt.CheckpointNotFoundError)


def test_a_root_whose_checkpoints_are_damaged_is_never_taken_for_a_first_start(tmp_path):
    root = tmp_path / "root"
    with opened(root) as checkpointer:
        for step in (5, 7):
            checkpointer.save({"step": step}, name=f"step-{step}").result(SAVE_TIMEOUT)
    (root / "step-7" / "commit.json").unlink()  # the newest lost its commit record
    assert pyshmckpt.load(root, missing_ok=True)["step"] == 5  # the newest committed
    with pytest.raises(pyshmckpt.CheckpointCorruptError) as raised:  # `latest` names step-7
        pyshmckpt.load(root, source="disk", missing_ok=True)
    assert not isinstance(raised.value, pyshmckpt.CheckpointNotFoundError)
    (root / "step-5" / "commit.json").write_text("{")  # and the other's is truncated
    for source in ("auto", "disk"):
        with pytest.raises(pyshmckpt.CheckpointCorruptError) as raised:
            pyshmckpt.load(root, source=source, missing_ok=True)
        assert not isinstance(raised.value, pyshmckpt.CheckpointNotFoundError), source
