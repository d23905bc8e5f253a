"""The torch.save and DCP writers (pyshmckpt/storage/torch_writers.py) through the Checkpointer:
files torch's own readers load, committed like the default writer's."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import pyshmckpt
from pyshmckpt import CheckpointCorruptError
from pyshmckpt.storage import commit

from helpers import (
    SAVE_TIMEOUT,
    assert_same_tree,
    gpt_state,
    link_target,
    names_in,
    opened,
    same_bytes,
    snapshot,
    visible,
)

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
