"""Checkpointer(overlap=True): save() returns before the copies, and training that goes on right
away never tears the snapshot: an optimizer's step and the forward of a module with buffers wait
for the copies, `wait_staged` waits for them, `load(into=)` waits for them."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pyshmckpt
from pyshmckpt.staging import guards

from helpers import (
    SAVE_TIMEOUT,
    assert_same_tree,
    child_env,
    opened,
    pid_running,
    snapshot,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)


class BatchNormNet(torch.nn.Module):
    """Big enough (16 MiB of weights, 48 MiB with AdamW's state) that the copies take a while;
    BatchNorm changes its buffers in every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(1024, 2048)
        self.norm = torch.nn.BatchNorm1d(2048)
        self.second = torch.nn.Linear(2048, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.norm(self.first(x))))


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(32, 1024, generator=torch.Generator().manual_seed(seed))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def net() -> tuple[BatchNormNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = BatchNormNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optimizer, 0)
    return model, optimizer


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": n}


def test_training_right_after_save_leaves_every_snapshot_whole(tmp_path: Path, net) -> None:
    model, optimizer = net
    seen: list[tuple[str, int]] = []  # what was in flight when each guarded writer started
    # Hooks of the optimizer and module themselves run after the global ones (its guards).
    probe_step = optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(("step", guards.in_flight()))
    )
    probe_norm = model.norm.register_forward_pre_hook(
        lambda module, args: seen.append(("norm", guards.in_flight()))
    )
    try:
        with opened(tmp_path / "ckpt", overlap=True) as ck:
            expected, futures = [], []
            for n in range(4):
                state = state_of(model, optimizer, n)
                expected.append(snapshot(state))
                futures.append(ck.save(state, name=f"s{n}"))
                state["step"] = -1  # a leaf changed at once: captured by save() itself
                step(model, optimizer, n + 1)  # forward (BatchNorm), backward, step: at once
            for n, future in enumerate(futures):
                assert_same_tree(expected[n], pyshmckpt.load(future.result(timeout=SAVE_TIMEOUT)))
    finally:
        probe_step.remove()
        probe_norm.remove()
    assert [what for what, _ in seen].count("step") == 4
    assert [what for what, _ in seen].count("norm") == 4
    assert all(count == 0 for _, count in seen), seen


def test_wait_staged_lets_any_change_follow(tmp_path: Path, net) -> None:
    model, optimizer = net
    with opened(tmp_path / "ckpt", overlap=True) as ck:
        state = state_of(model, optimizer, 1)
        expected = snapshot(state)
        future = ck.save(state)
        ck.wait_staged(timeout=SAVE_TIMEOUT)
        assert guards.in_flight() == 0
        with torch.no_grad():  # an update no hook sees: an EMA, a hand-written step
            for parameter in model.parameters():
                parameter.mul_(0.5).add_(1.0)
        assert_same_tree(expected, pyshmckpt.load(future.result(timeout=SAVE_TIMEOUT)))
        ck.wait_staged()  # nothing in flight: returns at once


def test_load_into_waits_for_the_copies(tmp_path: Path, net) -> None:
    model, optimizer = net
    with opened(tmp_path / "ckpt", overlap=True) as ck:
        first = snapshot(state_of(model, optimizer, 1))
        path = ck.save(state_of(model, optimizer, 1), name="first").result(timeout=SAVE_TIMEOUT)
        step(model, optimizer, 7)
        second = snapshot(state_of(model, optimizer, 2))
        future = ck.save(state_of(model, optimizer, 2), name="second")
        # Filling the live state from the first checkpoint while the second is copied from it.
        pyshmckpt.load(path, into={"model": model.state_dict(), "optim": optimizer.state_dict(),
                                   "step": 0})  # fmt: skip
        assert_same_tree(second, pyshmckpt.load(future.result(timeout=SAVE_TIMEOUT)))
        assert_same_tree(first["model"], model.state_dict())


def test_bad_input_raises_at_once_and_the_next_save_works(tmp_path: Path, net) -> None:
    model, optimizer = net
    with opened(tmp_path / "ckpt", overlap=True) as ck:
        with pytest.raises(pyshmckpt.UnsupportedValueError, match="object"):
            ck.save({"model": model.state_dict(), "bad": object()})
        assert guards.in_flight() == 0
        state = state_of(model, optimizer, 5)
        expected = snapshot(state)
        assert_same_tree(expected, pyshmckpt.load(ck.save(state).result(timeout=SAVE_TIMEOUT)))


def test_a_failed_staging_fails_its_save_and_wait_staged(tmp_path: Path) -> None:
    # One slot, held by a staged state dict the caller keeps: the next staging finds no free
    # slot within the slot timeout, on the staging thread.
    with opened(tmp_path / "ckpt", overlap=True, slots=1, hold=False) as ck:
        ck._stager._slot_timeout = 0.5
        kept = ck._stager.stage({"w": torch.ones(1024)})
        future = ck.save({"w": torch.zeros(1024)})
        with pytest.raises(pyshmckpt.SlotsBusyError):
            ck.wait_staged(timeout=SAVE_TIMEOUT)
        with pytest.raises(pyshmckpt.SlotsBusyError):
            future.result(timeout=SAVE_TIMEOUT)
        assert guards.in_flight() == 0
        del kept
        state = {"w": torch.full((1024,), 3.0)}
        assert_same_tree(state, pyshmckpt.load(ck.save(state).result(timeout=SAVE_TIMEOUT)))


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import pyshmckpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = pyshmckpt.Checkpointer(sys.argv[1], overlap=True)
    for n in range(3):
        model(torch.randn(16, 512)).sum().backward()
        optimizer.step()
        ck.save({"model": model.state_dict(), "n": n}, name=f"step-{n}")
    torch.save(model.state_dict(), sys.argv[2])  # the state at the last save
    print(ck.writer_pid, flush=True)
    if sys.argv[3] == "kill":
        ck.wait_staged()
        os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill: no cleanup of any kind
    # else: the script just ends, with the last save perhaps still staging
    """
)


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_script_that_ends_or_dies_after_its_last_save_keeps_it(tmp_path: Path, end: str) -> None:
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), str(expected), end],
        env=child_env(), cwd=tmp_path,  # not the checkout: its package is not built in place
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == (-signal.SIGKILL if end == "kill" else 0), done.stderr
    # The writer (orphaned by the kill) commits the staged save, then exits.
    writer = int(done.stdout.split()[-1])
    wait_until(lambda: not pid_running(writer), timeout=60, what="the writer to exit")
    assert (root / "latest").readlink() == Path("step-2")
    loaded = pyshmckpt.load(root / "step-2")
    assert loaded["n"] == 2
    assert_same_tree(torch.load(expected), loaded["model"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_async_save_with_an_asynchronous_shm_stager_is_guarded_too(tmp_path: Path, net) -> None:
    """DCP's async_save with ShmStager(async_staging=True): the next training step right away
    waits for the copies, so the checkpoint DCP writes is the state at async_save."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = net
    state = {"model": model.state_dict()}
    expected = snapshot(state)
    with pyshmckpt.ShmStager(async_staging=True) as stager:
        response = dcp.async_save(state, checkpoint_id=str(tmp_path), async_stager=stager)
        step(model, optimizer, 11)  # no wait for DCP's staging future in between
        assert guards.in_flight() == 0
        getattr(response, "upload_completion", response).result(timeout=SAVE_TIMEOUT)
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(target, checkpoint_id=str(tmp_path))
    assert_same_tree(dict(expected["model"]), target["model"])
