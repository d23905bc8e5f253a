"""The behaviours PyTorch's own tests check of its `_experimental` CheckpointProcess, checked of
ours with torch's config, RankInfo and CheckpointWriter (our own tests, not copies of theirs).

The one behaviour we change on purpose: torch's writer sees the caller's shared-memory tensor
and its in-place changes reach the caller; ours stages a snapshot, so they do not.
"""

from __future__ import annotations

import fractions
import logging
import os
import threading
import time
import types
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._experimental.checkpoint_process import (
    CheckpointProcessConfig as TorchConfig,
)
from torch.distributed.checkpoint._experimental.checkpoint_writer import (
    CheckpointWriter,
    CheckpointWriterConfig,
)
from torch.distributed.checkpoint._experimental.types import RankInfo

import pyshmckpt
from pyshmckpt import CheckpointProcess

from helpers import SAVE_TIMEOUT, assert_same_tree, failure_of, pid_running, wait_until

RANK = RankInfo(global_world_size=1, global_rank=0)


class Marked(torch.Tensor):
    """A tensor subclass with no plain-tensor form of its own."""


def init_in_child(name: str, parent_pid: int) -> None:
    if name != "compat" or os.getppid() != parent_pid or os.getpid() == parent_pid:
        raise RuntimeError(f"init ran in the wrong process or with the wrong args: {name}")


def torch_writer(**kwargs: Any) -> CheckpointWriter:
    return CheckpointWriter(config=kwargs["config"], rank_info=kwargs["rank_info"])


class MutatingWriter(CheckpointWriter):
    """Records what torch's shared-tensor test looks at, then changes the tensor in place."""

    def write(self, state_dict: Any, path: str, **kwargs: Any) -> None:
        tensor = state_dict["shared"]
        Path(path).write_text(f"{tensor.is_shared()} {float(tensor[0, 0])}")
        tensor[0, 0] = 42.0


def mutating_writer(**kwargs: Any) -> CheckpointWriter:
    return MutatingWriter(config=kwargs["config"], rank_info=kwargs["rank_info"])


class RaisingWriter(CheckpointWriter):
    def write(self, state_dict: Any, path: str, **kwargs: Any) -> None:
        raise ValueError(f"refusing {Path(path).name}")


def raising_writer(**kwargs: Any) -> CheckpointWriter:
    return RaisingWriter(config=kwargs["config"], rank_info=kwargs["rank_info"])


@pytest.fixture
def make():
    made: list[CheckpointProcess] = []

    def build(writer_fn: Any = torch_writer, config: Any = None) -> CheckpointProcess:
        cp = CheckpointProcess(
            RANK,
            config if config is not None else TorchConfig(subprocess_init_timeout_secs=120),
            init_in_child,
            ("compat", os.getpid()),
            writer_fn,
            {"config": CheckpointWriterConfig(), "rank_info": RANK},
        )
        made.append(cp)
        return cp

    yield build
    for cp in made:
        cp.close(abort=True)


def training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": torch.nn.Linear(10, 5).state_dict(),
        "optimizer": {"param_groups": [{"lr": 0.01}]},
        "epoch": 5,
        "step": 1000,
    }


def test_torch_config_is_accepted_and_process_watches_the_writer(make):
    cp = make(
        config=TorchConfig(subprocess_init_timeout_secs=120, subprocess_shutdown_timeout_secs=7)
    )
    cp.process_creation_future.result(timeout=SAVE_TIMEOUT)
    [process] = cp.process.processes
    assert process.is_alive()
    assert process.pid == cp.pid
    assert cp.process.pids() == [cp.pid]
    assert cp.process.join(0.1) is False
    assert cp._config.subprocess_shutdown_timeout_secs == 7
    cp.close()
    assert not process.is_alive()
    assert process.exitcode == 0
    assert cp.process.join(1) is True


def test_any_object_with_the_config_fields_is_accepted_and_others_refused(make):
    cp = make(config=types.SimpleNamespace(subprocess_init_timeout_secs=120, write_timeout_secs=9))
    assert cp._config.write_timeout_secs == 9
    assert cp._config.subprocess_shutdown_timeout_secs == 60  # the default
    with pytest.raises(pyshmckpt.ConfigTypeError, match="CheckpointProcessConfig"):
        make(config=object())
    with pytest.raises(pyshmckpt.ConfigError, match="on_trainer_death"):
        make(config=types.SimpleNamespace(on_trainer_death="pray"))


def test_torch_writer_persists_a_state_dict_a_future_of_one_and_kwargs(make, tmp_path):
    cp = make()
    state = training_state()
    future = cp.write(state, str(tmp_path / "sync"), unused_option="passed through")
    assert isinstance(future, Future)
    assert future.result(timeout=SAVE_TIMEOUT) is None
    assert_same_tree(state, torch.load(tmp_path / "sync" / "checkpoint_0.pt"))

    with ThreadPoolExecutor(1) as pool:
        later = pool.submit(lambda: (time.sleep(0.1), training_state())[1])
        cp.write(later, str(tmp_path / "future")).result(timeout=SAVE_TIMEOUT)
    assert_same_tree(state, torch.load(tmp_path / "future" / "checkpoint_0.pt"))


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; they still work
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.linspace(0, 1, 8), 0.1, 0, torch.qint8)


# torch.load of a quantized tensor goes through torch's deprecated TypedStorage.
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_values_a_slot_cannot_hold_travel_pickled_as_torch_would_carry_them(make, tmp_path, caplog):
    """Sparse, quantized and meta tensors, a tensor subclass, any picklable object: written by
    torch's writer as torch's transport would have them, from a snapshot taken by write()."""

    sparse = torch.eye(4).to_sparse()
    state = {
        "dense": torch.arange(6.0),
        "sparse": sparse,
        "quantized": quantized(),
        "meta": torch.empty(3, device="meta"),
        "subclass": torch.ones(3).as_subclass(Marked),
        "fraction": fractions.Fraction(1, 3),
    }
    expected = {
        k: v.clone() if isinstance(v, torch.Tensor) and k != "meta" else v for k, v in state.items()
    }
    cp = make()
    cp.process_creation_future.result(timeout=SAVE_TIMEOUT)
    with caplog.at_level(logging.DEBUG, logger="pyshmckpt.staging"):
        future = cp.write(state, str(tmp_path / "odd"))
    sparse.values().mul_(7)  # training goes on: the write must not see it
    future.result(timeout=SAVE_TIMEOUT)
    assert "4 value(s) the slot cannot hold travel pickled" in caplog.text  # not the Fraction
    loaded = torch.load(tmp_path / "odd" / "checkpoint_0.pt", weights_only=False)
    assert torch.equal(loaded["dense"], expected["dense"])
    assert loaded["sparse"].is_sparse
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(4))
    assert loaded["quantized"].is_quantized
    assert torch.equal(loaded["quantized"].int_repr(), expected["quantized"].int_repr())
    assert loaded["meta"].is_meta
    assert loaded["meta"].shape == (3,)
    assert type(loaded["subclass"]) is Marked
    assert torch.equal(loaded["subclass"].as_subclass(torch.Tensor), torch.ones(3))
    assert loaded["fraction"] == fractions.Fraction(1, 3)


def test_every_error_of_a_write_fails_its_future(make, tmp_path):
    cp = make(writer_fn=raising_writer)
    cp.process_creation_future.result(timeout=SAVE_TIMEOUT)
    future = cp.write(training_state(), str(tmp_path / "refused"))  # does not raise
    exc = failure_of(future)
    assert isinstance(exc, pyshmckpt.WriterError)
    assert "refusing refused" in str(exc)
    unpicklable = cp.write(training_state(), str(tmp_path / "x"), lock=threading.Lock())
    assert isinstance(failure_of(unpicklable), pyshmckpt.PyshmckptError) or "pickle" in str(
        failure_of(unpicklable)
    )


def test_a_pipe_closed_from_outside_fails_the_write_then_the_next_write_restarts(make, tmp_path):
    cp = make()
    cp.process_creation_future.result(timeout=SAVE_TIMEOUT)
    first = cp.pid
    cp._parent_end.close()  # what torch's test does to its transport
    exc = failure_of(cp.write(training_state(), str(tmp_path / "lost")))
    assert isinstance(exc, RuntimeError)
    assert isinstance(exc, pyshmckpt.WriterConnectionError)
    assert "Child process terminated unexpectedly" in str(exc)
    wait_until(lambda: not pid_running(first), 10, "the cut-off writer to be stopped")
    # The dispatcher thread survived (an unhandled thread exception fails the test), and the
    # next write starts a new writer.
    cp.write(training_state(), str(tmp_path / "next")).result(timeout=SAVE_TIMEOUT)
    assert cp.pid != first
    assert (tmp_path / "next" / "checkpoint_0.pt").exists()


def test_the_writer_sees_a_snapshot_not_the_callers_tensor(make, tmp_path):
    """torch's transport hands the writer the caller's shared-memory tensor, so a writer's
    in-place change reaches the caller. Ours hands it a view of the staged snapshot in the slot
    (pyshmckpt's mapping, so ``is_shared()`` is False there): the writer reads the caller's
    values, and the caller's tensor is untouched by what the writer does."""
    cp = make(writer_fn=mutating_writer)
    shared = torch.randn(100, 100)
    shared.share_memory_()
    pointer, original = shared.data_ptr(), shared.clone()
    cp.write({"shared": shared, "regular": torch.randn(50, 50)}, str(tmp_path / "seen")).result(
        timeout=SAVE_TIMEOUT
    )
    _, first = (tmp_path / "seen").read_text().split()
    assert float(first) == float(original[0, 0])
    assert shared.data_ptr() == pointer
    assert shared.is_shared()
    assert torch.equal(shared, original)  # torch's would hold 42.0 here
