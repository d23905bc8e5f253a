"""Crash consistency of durable checkpoints: SIGKILL at random moments never exposes a partial one.

A trainer process (a script written to tmp_path) opens a Checkpointer on a root shared by every
iteration and saves in a loop a state dict whose every tensor holds the step number (and is
overwritten right after save() returns, as training would). It is SIGKILLed at a random moment,
alone or together with its writer (its whole process group), many times over. After each kill:
the writer is gone (bounded wait), the trainer's shared-memory segments are gone (removed by its
writer, or by collect_stale_segments()), every visible checkpoint loads, verifies and holds
exactly one step, `latest` points to one of them, and the next Checkpointer on the root removes
what the crash left behind.

The random delays come from a seed printed in every failure message; set
PYSHMCKPT_TEST_CRASH_SEED to replay one. Code that runs in the trainer uses no bare ``assert``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pyshmckpt
from pyshmckpt import WriterDiedError
from pyshmckpt.storage import commit

from helpers import (
    SHM,
    child_env,
    hidden,
    link_target,
    names_in,
    opened,
    pid_running,
    thread_waits,
    visible,
    wait_until,
)

# Kills: at least MIN_ITERATIONS, more (up to MAX_ITERATIONS) while under BUDGET seconds. Each
# costs a trainer start (python, torch, the writer's spawn: 4-5 s here, twice that under
# PYTHONOPTIMIZE without bytecode caches) plus the random delay.
MIN_ITERATIONS, MAX_ITERATIONS, BUDGET = 6, 10, 40.0
KEEP_LAST = 3
STEP_BASE = 100_000  # iteration i saves steps i*STEP_BASE+1, ...: exact in float32 (< 2**24)
START_TIMEOUT = 90.0  # python + torch import + the writer's spawn: 3-8 s here
EXIT_TIMEOUT = 15.0

TRAINER = textwrap.dedent(
    """
    import collections, json, os, sys

    import torch

    import pyshmckpt


    def make_state():
        tied = torch.empty(256 * 1024, dtype=torch.float32)  # 1 MiB
        model = collections.OrderedDict()
        model["embed.weight"] = tied
        model["head.weight"] = tied  # tied weights: one tensor under two keys
        model["proj.weight"] = torch.empty(256, 512, dtype=torch.float32)
        model["proj.bias"] = torch.empty(512, dtype=torch.float64)
        model["window"] = tied[1024:9216]  # a view into the tied weight
        optim = {
            "state": {
                0: {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.empty(128 * 1024, dtype=torch.float32),
                    "exp_avg_sq": torch.empty(64 * 1024, dtype=torch.float64),
                },
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        }
        tokens = torch.empty(4096, dtype=torch.int64)
        state = {"model": model, "optim": optim, "tokens": tokens, "step": 0}
        moments = list(optim["state"][0].values())
        owners = [tied, model["proj.weight"], model["proj.bias"], tokens, *moments]
        return state, owners


    def fill(state, owners, value):
        for tensor in owners:
            tensor.fill_(value)
        state["step"] = value


    def main():
        root, start, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        config = pyshmckpt.CheckpointProcessConfig(
            subprocess_init_timeout_secs=60,
            subprocess_shutdown_timeout_secs=10,
            write_timeout_secs=120,
        )
        ck = pyshmckpt.Checkpointer(root, keep_last=int(sys.argv[4]), config=config)
        leftovers = sorted(name for name in os.listdir(root) if name.startswith("."))
        ck._process.process_creation_future.result(timeout=60)
        info = {"pid": os.getpid(), "writer": ck._process.pid, "leftovers_after_open": leftovers}
        with open(ready + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(ready + ".tmp", ready)

        state, owners = make_state()
        step = start
        while True:  # until killed
            step += 1
            fill(state, owners, step)
            future = ck.save(state)
            fill(state, owners, -step)  # training goes on: this must never reach a checkpoint
            if step % 3 == 0:
                future.result(timeout=120)
            elif step % 5 == 0:
                ck.wait(timeout=120)


    if __name__ == "__main__":
        main()
    """
)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/pid/stat after the command name (state, ppid, pgrp, ...), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rfind(")") + 2 :].split()


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (the trainer, its writer, its resource tracker)."""
    members = []
    for entry in names_in(Path("/proc")):
        if not entry.isdigit():
            continue
        fields = proc_stat(int(entry))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def segments_of(pid: int) -> list[str]:
    """This session's segments in /dev/shm owned by `pid` (name: <prefix>-<pid>-<hex>)."""
    start = f"{os.environ['PYSHMCKPT_SEGMENT_PREFIX']}-{pid}-"
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(start))


def tensors_of(tree: Any, path: str = "state") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensors_of(value, f"{path}[{key!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from tensors_of(value, f"{path}[{i}]")


def check_checkpoint(path: Path, where: str) -> int:
    """Load and verify one committed checkpoint; return the single step it holds."""
    count = pyshmckpt.verify(path)
    state = pyshmckpt.load(path)
    step = state["step"]
    assert type(step) is int, f"{where}: {path.name} has step leaf {step!r}"
    assert step > 0, f"{where}: {path.name} has step leaf {step!r}"
    found = dict(tensors_of(state))  # 5 model keys (2 tied), 3 optimizer tensors, tokens
    assert len(found) == 9, f"{where}: {path.name} holds {sorted(found)}"
    assert count >= 8, f"{where}: verify() counted {count} tensors in {path.name}"
    for name, tensor in found.items():
        bad = tensor.ne(step)
        if bool(bad.any()):
            values = sorted({float(v) for v in tensor[bad].flatten()[:1000].tolist()})[:5]
            raise AssertionError(
                f"{where}: {path.name} mixes steps: its step leaf is {step}, {name} holds {values}"
            )
    model = state["model"]
    assert type(model) is collections.OrderedDict, f"{where}: {type(model)}"
    assert model["embed.weight"].data_ptr() == model["head.weight"].data_ptr(), f"{where}: untied"
    assert state["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    return step


def check_root(root: Path, where: str, history: dict[str, int]) -> list[tuple[str, int]]:
    """Every visible checkpoint is committed, loads, verifies and holds one step; newer commits
    hold later steps; `latest` points to one of them; a checkpoint never changes once seen.
    Returns (name, step) in commit order."""
    names = visible(root)
    committed = commit.committed(root)
    assert sorted(name for _, name in committed) == names, (
        f"{where}: visible entries {names} are not exactly the committed ones {committed}"
    )
    assert len(names) <= KEEP_LAST + 1, (
        f"{where}: {len(names)} checkpoints kept with keep_last={KEEP_LAST}"
    )
    strays = [
        n
        for n in hidden(root)
        if not n.startswith((commit.TMP_PREFIX, commit.TRASH_PREFIX, ".latest-"))
    ]
    assert not strays, f"{where}: unexpected hidden entries {strays}"

    ordered = []
    for _, name in committed:
        step = check_checkpoint(root / name, where)
        if name in history:
            assert history[name] == step, (
                f"{where}: {name} changed from step {history[name]} to {step}"
            )
        history[name] = step
        ordered.append((name, step))
    steps = [step for _, step in ordered]
    assert steps == sorted(set(steps)), f"{where}: commit order and steps disagree: {ordered}"

    link = root / commit.LATEST
    if link.is_symlink():
        target = link_target(link)
        assert target in names, f"{where}: latest -> {target!r}, not one of {names}"
        assert pyshmckpt.load(root)["step"] == history[target]
    else:
        assert not link.exists(), f"{where}: latest is not a symbolic link"
    return ordered


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def run_and_kill(
    script: Path, root: Path, i: int, kill_group_too: bool, delay: float, where: str
) -> int:
    """Start trainer number `i` on `root`, SIGKILL it (with its writer when `kill_group_too`)
    `delay` seconds after it reports it started, and wait until all its processes are gone.
    Returns its pid."""
    ready = script.parent / f"ready-{i}.json"
    log = script.parent / f"trainer-{i}.log"
    args = [sys.executable, str(script), str(root), str(i * STEP_BASE), str(ready), str(KEEP_LAST)]
    with log.open("w") as out:
        trainer = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=str(script.parent),
            start_new_session=True,  # its own process group, which the writer joins
        )  # fmt: skip
    writer_pid: int | None = None
    try:
        started = lambda: ready.exists() or trainer.poll() is not None  # noqa: E731
        wait_until(started, START_TIMEOUT, f"{where}: start")
        if not ready.exists():
            pytest.fail(f"{where}: the trainer exited ({trainer.returncode}):\n{log.read_text()}")
        info = json.loads(ready.read_text())
        writer_pid = info["writer"]
        assert info["pid"] == trainer.pid
        assert writer_pid != trainer.pid
        # Opening the root removed what the previous crash left behind.
        assert info["leftovers_after_open"] == [], f"{where}: {info['leftovers_after_open']}"

        time.sleep(delay)
        if trainer.poll() is not None:
            pytest.fail(f"{where}: the trainer exited ({trainer.returncode}):\n{log.read_text()}")
        if kill_group_too:
            os.killpg(trainer.pid, signal.SIGKILL)
        else:
            os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=EXIT_TIMEOUT)
        assert trainer.returncode == -signal.SIGKILL
        # An orphaned writer notices (pidfd, pipe EOF, parent-death signal) and exits.
        writer_gone = lambda: not pid_running(writer_pid)  # noqa: E731
        try:
            wait_until(writer_gone, EXIT_TIMEOUT, f"{where}: writer {writer_pid} to exit")
        except AssertionError as exc:  # what it is stuck in, for the next look at it
            raise AssertionError(f"{exc}; its threads: {thread_waits(writer_pid)}") from None
        group_gone = lambda: not group_members(trainer.pid)  # noqa: E731
        wait_until(group_gone, EXIT_TIMEOUT, f"{where}: every process of the trainer to exit")
    finally:
        if trainer.poll() is None:
            kill_group(trainer.pid)
            trainer.wait(timeout=EXIT_TIMEOUT)
        kill_group(trainer.pid)  # a writer or tracker left behind by a failure above
        if writer_pid is not None and pid_running(writer_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer_pid, signal.SIGKILL)
    return trainer.pid


@pytest.mark.slow
@pytest.mark.timeout(290)
def test_sigkill_at_random_moments_never_exposes_a_partial_checkpoint(tmp_path):
    seed_text = os.environ.get("PYSHMCKPT_TEST_CRASH_SEED")
    seed = int(seed_text) if seed_text else random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    root = tmp_path / "root"
    root.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    history: dict[str, int] = {}  # every checkpoint name seen -> its step
    trainer_pids: list[int] = []
    stats = {"leftovers_seen": 0, "segments_left_by_writer": 0}

    started = time.monotonic()
    i = 0
    while i < MIN_ITERATIONS or (i < MAX_ITERATIONS and time.monotonic() - started < BUDGET):
        group = i % 2 == 1
        delay = rng.uniform(0.2, 2.5)
        who = "process group" if group else "trainer"
        where = f"iteration {i} (seed {seed}: SIGKILL of the {who} {delay:.2f}s after start)"
        stats["leftovers_seen"] += bool(hidden(root))
        pid = run_and_kill(script, root, i, group, delay, where)
        trainer_pids.append(pid)

        # Shared memory: the writer removed the segments it knew of when the trainer died; any
        # other (created but not yet sent, or the writer died too) is stale and collected.
        left = segments_of(pid)
        if not group:
            stats["segments_left_by_writer"] += len(left)
        pyshmckpt.collect_stale_segments()
        assert segments_of(pid) == [], f"{where}: segments left: {segments_of(pid)} (were {left})"

        for _, step in check_root(root, where, history):
            assert step <= (i + 1) * STEP_BASE, f"{where}: step {step} from a later trainer?"
        i += 1

    assert i >= MIN_ITERATIONS
    assert history, f"seed {seed}: no checkpoint was ever committed in {i} runs"

    # A Checkpointer opened on the root now removes every leftover and keeps every checkpoint.
    before = visible(root)
    with opened(root, keep_last=KEEP_LAST) as ck:
        assert hidden(root) == [], f"seed {seed}: left after opening: {hidden(root)}"
        assert visible(root) == before
        if before:
            assert ck.latest() is not None
            assert ck.latest().name in before
    check_root(root, f"after reopening (seed {seed})", history)

    pyshmckpt.collect_stale_segments()
    for pid in trainer_pids:
        assert segments_of(pid) == [], f"seed {seed}: segments of trainer {pid} remain"
    print(f"seed {seed}: {len(history)} checkpoints seen across {i} kills; {stats}")


@pytest.mark.timeout(120)
def test_writer_sigkilled_mid_write_leaves_only_complete_checkpoints(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with opened(root, keep_last=2) as ck:
        ck.save({"x": torch.full((1000,), 1.0), "step": 1}, name="a").result(timeout=60)
        writer_pid = ck._process.pid
        big = {"x": torch.full((16 << 20,), 2.0), "step": 2}  # 64 MiB: written and fsynced slowly
        pending = ck.save(big, name="b")
        big["x"].fill_(-1.0)
        wait_until(
            lambda: any(n.startswith(".tmp-b-") for n in names_in(root)),
            30,
            "the write",
            poll=0.001,
        )
        os.kill(writer_pid, signal.SIGKILL)
        exc = pending.exception(timeout=30)
        if exc is None:
            pytest.skip("the 64 MiB write finished before the writer could be killed")
        assert isinstance(exc, WriterDiedError), repr(exc)
        assert "SIGKILL" in str(exc)
        wait_until(
            lambda: not pid_running(writer_pid), EXIT_TIMEOUT, "the killed writer to be reaped"
        )

        assert visible(root) == ["a"]
        assert [n for n in hidden(root) if n.startswith(".tmp-b-")], hidden(root)
        assert link_target(root / "latest") == "a"
        assert pyshmckpt.verify(root / "a") == 1
        assert pyshmckpt.load(root)["step"] == 1

        # The next save restarts the writer and commits; nothing partial ever became visible.
        path = ck.save({"x": torch.full((1000,), 3.0), "step": 3}, name="c").result(timeout=60)
        assert ck._process.pid != writer_pid
        assert visible(root) == ["a", "c"]
        assert ck.latest() == path
        assert torch.equal(pyshmckpt.load(root)["x"], torch.full((1000,), 3.0))

    with opened(root):  # the next Checkpointer removes the partial write
        assert hidden(root) == []
        assert visible(root) == ["a", "c"]
