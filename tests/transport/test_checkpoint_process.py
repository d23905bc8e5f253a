"""The drop-in CheckpointProcess: torch's API and writers, staging paths, asyncio, config."""

from __future__ import annotations

import asyncio
import collections
import json
import os
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint._experimental.checkpoint_reader import CheckpointReader
from torch.distributed.checkpoint._experimental.checkpoint_writer import (
    CheckpointWriter,
    CheckpointWriterConfig,
)
from torch.distributed.checkpoint._experimental.checkpointer import AsyncCheckpointer
from torch.distributed.checkpoint._experimental.types import RankInfo

import pyshmckpt
from pyshmckpt import CheckpointProcess, CheckpointProcessConfig, ShmStager

from writer_side import DescribingWriter, describe, no_init

TIMEOUT = 60
RANK = RankInfo(global_rank=0, global_world_size=1)


def describe_local(node):
    """`describe` of a tree here, without where its tensors live (as `strip` leaves the
    writer's)."""
    return strip(describe(node))


def strip(node):
    """A description without where tensors live."""
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k not in ("cpu", "ptr")}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def sample_state() -> dict:
    w = torch.randn(32, 16)
    return {
        "model": collections.OrderedDict(weight=w, tied=w, bias=torch.arange(16.0)),
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(32, 16)}},
            "lr": 0.1,
        },
        "extra": (1, "two", [3.0, None]),
    }


@pytest.fixture
def process():
    cp = CheckpointProcess(
        RANK, CheckpointProcessConfig(), no_init, (), DescribingWriter, {"tag": "t"}
    )
    yield cp
    cp.close()


def read(path) -> dict:
    return json.loads((Path(path) / "description.json").read_text())


def test_plain_state_dict_reaches_the_writer_intact(process, tmp_path):
    source = sample_state()
    process.write(source, str(tmp_path / "c1"), step=5).result(timeout=TIMEOUT)
    got = read(tmp_path / "c1")
    assert strip(got["tree"]) == describe_local(source)
    assert got["kwargs"] == {"step": "5"}
    assert got["rank"] == 0  # rank_info is added to the writer's init kwargs
    assert got["tag"] == "t"
    assert got["pid"] == process.pid != os.getpid()


def test_writer_sees_cpu_tensors_and_aliases(process, tmp_path):
    source = sample_state()
    process.write(
        source,
        str(tmp_path / "c"),
    ).result(timeout=TIMEOUT)
    items = dict((k, v) for k, v in read(tmp_path / "c")["tree"]["items"])
    model = dict((k, v) for k, v in items["'model'"]["items"])
    assert model["'weight'"]["cpu"]
    assert model["'bias'"]["cpu"]
    assert model["'weight'"]["ptr"] == model["'tied'"]["ptr"]  # tied storage stays tied


def test_plain_state_dict_may_change_once_write_returns(process, tmp_path):
    source = {"x": torch.zeros(1000)}
    future = process.write(source, str(tmp_path / "c"))
    source["x"].fill_(7.0)  # staged into a slot before write() returned
    future.result(timeout=TIMEOUT)
    assert strip(read(tmp_path / "c")["tree"]) == describe_local({"x": torch.zeros(1000)})


def test_state_dict_staged_by_shm_stager_crosses_without_a_copy(process, tmp_path):
    with ShmStager() as stager:
        staged = stager.stage(sample_state())
        handle = stager.handle(staged)
        process.write(staged, str(tmp_path / "c")).result(timeout=TIMEOUT)
        assert strip(read(tmp_path / "c")["tree"]) == describe_local(staged)
        assert process.stager.arena is None  # the internal stager never staged anything
        assert stager.handle(staged) is None or stager.handle(staged).slot is handle.slot


def test_future_of_a_state_dict_is_resolved_in_the_background(process, tmp_path):
    pending: Future = Future()
    result = process.write(pending, str(tmp_path / "c"))
    assert not result.done()
    pending.set_result({"a": torch.ones(3)})
    result.result(timeout=TIMEOUT)
    assert strip(read(tmp_path / "c")["tree"]) == describe_local({"a": torch.ones(3)})


def test_failed_future_input_fails_the_write(process, tmp_path):
    pending: Future = Future()
    result = process.write(pending, str(tmp_path / "c"))
    pending.set_exception(ValueError("staging went wrong"))
    with pytest.raises(ValueError, match="staging went wrong"):
        result.result(timeout=TIMEOUT)


def test_asyncio_users_can_await(process, tmp_path):
    async def main() -> None:
        await process.write_async({"a": torch.ones(2)}, str(tmp_path / "a"))
        await asyncio.wrap_future(process.write({"b": torch.ones(2)}, str(tmp_path / "b")))

    asyncio.run(main())
    assert (tmp_path / "a" / "description.json").exists()
    assert (tmp_path / "b" / "description.json").exists()


def test_torch_checkpoint_writer_works_unchanged(tmp_path):
    config = CheckpointProcessConfig()
    cp = CheckpointProcess(
        RANK, config, no_init, (), CheckpointWriter, {"config": CheckpointWriterConfig()}
    )
    try:
        source = sample_state()
        cp.write(source, str(tmp_path / "step1")).result(timeout=TIMEOUT)
        loaded = torch.load(tmp_path / "step1" / "checkpoint_0.pt", weights_only=False)
        assert describe_local(loaded) == describe_local(source)
        # Each block gets its own storage in the writer, so torch.save writes only the data.
        assert (tmp_path / "step1" / "checkpoint_0.pt").stat().st_size < 8 * 32 * 16 * 4
    finally:
        cp.close()


def test_torch_async_checkpointer_with_our_stager_and_process(tmp_path):
    stager = ShmStager()
    cp = CheckpointProcess(
        RANK,
        CheckpointProcessConfig(),
        no_init,
        (),
        CheckpointWriter,
        {"config": CheckpointWriterConfig()},
    )
    checkpointer = AsyncCheckpointer(stager, cp, CheckpointReader(RANK))
    try:
        model = torch.nn.Linear(8, 4)
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            _, write_future = checkpointer.save(str(tmp_path / f"step{step}"), model.state_dict())
            write_future.result(timeout=TIMEOUT)
            loaded = checkpointer.load(str(tmp_path / f"step{step}"))
            assert torch.equal(loaded["weight"], model.weight.detach())
        assert cp.stager.arena is None  # everything crossed from the user's stager
    finally:
        cp.close()
        stager.close()


def test_segments_are_gone_after_close(tmp_path):
    from conftest import our_segments

    before = our_segments()
    cp = CheckpointProcess(RANK, CheckpointProcessConfig(), no_init, (), DescribingWriter, {})
    cp.write({"x": torch.ones(10)}, str(tmp_path / "c")).result(timeout=TIMEOUT)
    assert our_segments() - before
    cp.close()
    cp.close()  # idempotent
    assert our_segments() == before
    with pytest.raises(pyshmckpt.PyshmckptError, match="closed"):
        cp.write({"x": torch.ones(1)}, str(tmp_path / "d"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"subprocess_init_timeout_secs": -1},
        {"subprocess_shutdown_timeout_secs": "1"},
        {"write_timeout_secs": 0},
        {"slots": 0},
        {"max_restarts": -1},
        {"slot_timeout_secs": True},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(pyshmckpt.ConfigError, match=next(iter(kwargs))) as info:
        CheckpointProcessConfig(**kwargs)
    assert isinstance(info.value, ValueError)


def test_constructor_type_checks():
    with pytest.raises(TypeError, match="config"):
        CheckpointProcess(RANK, object(), no_init, (), DescribingWriter, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        CheckpointProcess(RANK, CheckpointProcessConfig(), "no", (), DescribingWriter, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple"):
        CheckpointProcess(RANK, CheckpointProcessConfig(), no_init, [], DescribingWriter, {})  # type: ignore[arg-type]


def test_unpicklable_kwargs_fail_cleanly_and_free_the_slot(process, tmp_path):
    import threading

    future = process.write({"x": torch.ones(4)}, str(tmp_path / "c"), lock=threading.Lock())
    with pytest.raises(Exception, match="pickle"):  # as torch's, through the Future
        future.result(timeout=TIMEOUT)
    process.write({"x": torch.ones(4)}, str(tmp_path / "d")).result(timeout=TIMEOUT)
    assert process.stager.arena.idle()


def test_default_config_matches_torch():
    from torch.distributed.checkpoint._experimental.checkpoint_process import (
        CheckpointProcessConfig as TorchConfig,
    )

    ours, theirs = CheckpointProcessConfig(), TorchConfig()
    assert ours.subprocess_init_timeout_secs == theirs.subprocess_init_timeout_secs == 30
    assert ours.subprocess_shutdown_timeout_secs == theirs.subprocess_shutdown_timeout_secs == 60
