"""The scripts in examples/ run as a user runs them (``python examples/x.py``, or under torchrun),
each in a subprocess bounded by a timeout, in a temporary directory, and do what they say: their
checkpoints are on disk and verify, what is restored is what was saved, and a run killed right
after a save resumes from that save. The framework and torchrun examples are `slow`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyshmckpt

from helpers import REPO_ROOT, SHM, assert_same_tree, child_env, free_port, wait_until

# The checkout's examples (pyshmckpt itself may be installed elsewhere: REPO_ROOT is its parent).
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_TIMEOUT = 180  # seconds one run of an example may take, generous for a busy machine
COMMIT_TIMEOUT = 60  # seconds the writer of a killed run may take to commit its last save


def example_env(**extra: str) -> dict[str, str]:
    """The user's environment: pyshmckpt importable, nothing of tests/ (examples must not need
    it), and the session's segment prefix (for the leak check)."""
    env = child_env()
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(extra)
    return env


def launch(
    script: str, *args: str, cwd: Path, ranks: int = 0, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start an example: ``python examples/<script> ARGS``, or under torchrun with `ranks`."""
    command = [sys.executable, str(EXAMPLES / script), *args]
    if ranks:
        command[1:1] = [
            "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "0",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        ]  # fmt: skip
    # A process group of its own, so that a run past its time is killed with torchrun's workers.
    return subprocess.Popen(
        command, cwd=cwd, env=env or example_env(), text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def kill(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill an example's process group; returns what it printed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.communicate()


def finish(process: subprocess.Popen[str], returncode: int = 0) -> str:
    """Wait for an example (bounded); returns its stdout once it exited with `returncode`."""
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        out, err = kill(process)
        pytest.fail(f"{process.args} ran past {RUN_TIMEOUT} s:\n{(out + err)[-4000:]}")
    assert process.returncode == returncode, (
        f"{process.args} exited with {process.returncode}:\n{(out + err)[-4000:]}"
    )
    return out


def run(
    script: str, *args: str, cwd: Path, ranks: int = 0, env: dict[str, str] | None = None
) -> str:
    return finish(launch(script, *args, cwd=cwd, ranks=ranks, env=env))


def checkpoints(root: Path) -> list[str]:
    """What a reader of `root` sees: names not starting with '.', without pyshmckpt's `latest`."""
    return sorted(p.name for p in root.iterdir() if p.name[0] != "." and p.name != "latest")


def test_every_example_is_listed_with_its_command_and_run_here() -> None:
    listed = (EXAMPLES / "README.md").read_text()
    tests = Path(__file__).read_text()
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert "plain_loop.py" in scripts
    for name in scripts:
        assert f"examples/{name}" in listed, f"examples/README.md has no command for {name}"
        assert f'"{name}"' in tests, f"no test runs {name}"


def assert_resumed_loss_matches(out: str, step: str, reference: str) -> None:
    """The example printed "<step>: loss X (<reference>: Y)" with X == Y: the restored state
    trains on exactly as the state it was saved from."""
    losses = re.search(rf"{step}: loss (\S+) \({reference}: (\S+)\)", out)
    assert losses is not None, out
    assert losses[1] == losses[2], losses[0]


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_plain_loop_keeps_the_last_checkpoints_and_restores_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = run("plain_loop.py", "--output", str(root), cwd=tmp_path)
    # 30 steps saved every 10, keep_last=2.
    assert checkpoints(root) == ["step-000020", "step-000030"]
    assert (root / "latest").readlink() == Path("step-000030")
    for name in checkpoints(root):
        pyshmckpt.verify(root / name)  # raises on a bad checksum
    state = pyshmckpt.load(root)
    assert state["step"] == 30
    assert pyshmckpt.load(root / "step-000020")["step"] == 20
    assert not torch.equal(
        state["model"]["0.weight"], pyshmckpt.load(root / "step-000020")["model"]["0.weight"]
    )
    assert state["optimizer"]["state"][0]["step"].item() == 30  # AdamW's own count
    assert "restored step 30: parameters equal to the trained model's: True" in out
    continued = re.findall(r"^step +(\d+) +loss (\S+) +\(uninterrupted: (\S+)\)$", out, re.M)
    assert [int(step) for step, _, _ in continued] == [31, 32, 33, 34, 35]
    assert all(ours == theirs for _, ours, theirs in continued), out


@pytest.mark.timeout(3 * RUN_TIMEOUT + COMMIT_TIMEOUT)
def test_a_run_killed_after_a_save_resumes_from_it_and_ends_as_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    crashed, uninterrupted = tmp_path / "crashed", tmp_path / "uninterrupted"
    # The crashed runs' segments apart from the reference's (under the leak check's prefix too).
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-crashed"
    env = example_env(PYSHMCKPT_SEGMENT_PREFIX=prefix)
    # The uninterrupted run, alongside (the same 40 steps, never killed).
    reference = launch("restore_after_crash.py", "--output", str(uninterrupted), cwd=tmp_path)
    try:
        out = finish(
            launch("restore_after_crash.py", "--output", str(crashed), "--crash-at-step", "20",
                   cwd=tmp_path, env=env),
            returncode=-signal.SIGKILL,
        )  # fmt: skip
        staged = re.findall(r"^step +(\d+) .* checkpoint staged$", out, re.M)
        assert staged == ["5", "10", "15", "20"], out
        assert out.rstrip().endswith("crashing at step 20 (SIGKILL)"), out
        # The killed trainer's writer commits the save that had returned, then removes the
        # shared memory and exits; a restart some time later finds it.
        wait_until(
            lambda: (crashed / "step-000020").is_dir() and not list(SHM.glob(f"{prefix}-*")),
            COMMIT_TIMEOUT,
            "the killed run's writer to commit step 20 and exit",
        )
        assert checkpoints(crashed) == ["step-000010", "step-000015", "step-000020"]  # keep_last=3
        assert (crashed / "latest").readlink() == Path("step-000020")

        out = run("restore_after_crash.py", "--output", str(crashed), cwd=tmp_path, env=env)
        assert out.splitlines()[0] == "resumed from step 20", out
        assert f"finished at step 40; newest checkpoint: {crashed / 'step-000040'}" in out
        assert checkpoints(crashed) == ["step-000030", "step-000035", "step-000040"]

        assert "training from step 0" in finish(reference)
        assert checkpoints(uninterrupted) == checkpoints(crashed)
        for name in checkpoints(crashed):
            assert_same_tree(pyshmckpt.load(uninterrupted / name), pyshmckpt.load(crashed / name))
        assert pyshmckpt.load(crashed)["step"] == 40
    finally:
        if reference.poll() is None:
            kill(reference)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_fsdp2_with_dcp_async_save_and_shm_stager_loads_back(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = tmp_path / "ckpt"
    out = run("fsdp2_dcp.py", "--output", str(root), cwd=tmp_path, ranks=2)
    assert checkpoints(root) == ["step-000003", "step-000006"]
    for step in (3, 6):
        directory = root / f"step-{step:06d}"
        assert sorted(p.name for p in directory.iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp",
        ]  # fmt: skip
        # DCP's own tools read it, without torch.distributed: the whole (unsharded) state.
        dcp_to_torch_save(directory, tmp_path / f"{step}.pt")
        state = torch.load(tmp_path / f"{step}.pt", weights_only=True)
        assert {k: tuple(v.shape) for k, v in state["model"].items()} == {
            "0.weight": (64, 16), "0.bias": (64,), "2.weight": (64, 64), "2.bias": (64,),
            "4.weight": (1, 64), "4.bias": (1,),
        }  # fmt: skip
        assert state["optim"]["state"]["0.weight"]["step"].item() == step
    assert f"loaded {root / 'step-000006'} on 2 ranks" in out
    assert "parameters equal to the trained model's: True" in out
    assert_resumed_loss_matches(out, "next step", "the trained model")


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_lightning_checkpoints_through_shm_checkpoint_io_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    root = tmp_path / "ckpt"
    out = run("lightning_fit.py", "--output", str(root), cwd=tmp_path)
    assert "last.ckpt: global step 16, equal to the trained model: True" in out
    assert "resumed from step 16, trained to step 32" in out
    # ModelCheckpoint's choice: the 2 best of 8 epochs and last.ckpt, nothing else in its folder.
    kept = sorted(p.name for p in root.iterdir())
    assert len(kept) == 3, kept
    assert "last.ckpt" in kept
    assert all(re.fullmatch(r"epoch=\d-step=\d+\.ckpt", n) for n in kept if n != "last.ckpt")
    for name in kept:
        pyshmckpt.verify(root / name)
    last = pyshmckpt.load(root / "last.ckpt", allow_pickle=True)
    assert (last["epoch"], last["global_step"]) == (7, 32)
    assert sorted(last["state_dict"]) == [
        f"net.{i}.{p}" for i in (0, 2) for p in ("bias", "weight")
    ]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_deepspeed_saves_through_the_shm_engine_and_resumes_from_latest(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    root = tmp_path / "ckpt"
    out = run(
        "deepspeed_train.py", "--output", str(root), cwd=tmp_path, ranks=2,
        env=example_env(DS_ACCELERATOR="cpu"),
    )  # fmt: skip
    assert (root / "latest").read_text() == "step6"
    files = ["mp_rank_00_model_states.pt"] + [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)
    ]
    for tag in ("step3", "step6"):
        # Exactly DeepSpeed's files, no bookkeeping of ours left.
        assert sorted(p.name for p in (root / tag).iterdir()) == files
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert f"resumed from step 6 ({root / 'step6' / files[0]})" in out
    assert "parameters equal to the trained engine's: True" in out
    assert_resumed_loss_matches(out, "next step", "the trained engine")


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_accelerate_saves_with_shm_state_saver_and_resumes_the_newest(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    root = tmp_path / "project"
    out = run("accelerate_train.py", "--output", str(root), cwd=tmp_path)
    assert "kept (total_limit=2): checkpoint_1, checkpoint_2" in out
    assert "resumed from checkpoint_2: parameters equal to the trained model's: True" in out
    assert_resumed_loss_matches(out, "next epoch", "the trained model")
    assert sorted(p.name for p in root.iterdir()) == ["checkpoints"]
    assert checkpoints(root / "checkpoints") == ["checkpoint_2", "checkpoint_3"]
    saved = {}
    for name in ("checkpoint_2", "checkpoint_3"):
        pyshmckpt.verify(root / "checkpoints" / name)
        saved[name] = pyshmckpt.load(root / "checkpoints" / name)
    # 4 optimizer steps per epoch: 3 epochs, then one more after resuming.
    assert saved["checkpoint_2"]["optimizers"][0]["state"][0]["step"].item() == 12
    assert saved["checkpoint_3"]["optimizers"][0]["state"][0]["step"].item() == 16
