"""ShmStateSaver with the real Accelerate: a save is a snapshot of everything save_state saves,
loading it into fresh objects restores it bitwise and resumes like an uninterrupted run (one
process here, DDP on 2 processes under torchrun), automatic naming with total_limit, a failed
save raised by the next call, one writer process at a time, typed errors.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.register_assert_rewrite("accelerate_worker")  # its checks must hold under python -O too

from accelerate.utils import ProjectConfiguration  # noqa: E402

import pyshmckpt  # noqa: E402
from pyshmckpt.integrations.accelerate import ShmStateSaver  # noqa: E402
from pyshmckpt.storage import object_commit, object_store  # noqa: E402

from accelerate_worker import build, save_load_resume, train  # noqa: E402
from helpers import (  # noqa: E402
    SAVE_TIMEOUT,
    assert_same_tree,
    bounded_config,
    child_env,
    child_pids,
    free_port,
    hidden,
    small_tmpfs,
    visible,
    wait_until,
)

WORKER = Path(__file__).with_name("accelerate_worker.py")
RUN_TIMEOUT = 240  # seconds the 2-process run may take (about 10 here)
SCRIPT = WORKER.with_name("accelerate_script.py")


def test_save_is_a_snapshot_and_resuming_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    save_load_resume(tmp_path)


@pytest.mark.slow
def test_ddp_on_two_processes_saves_every_rank_and_resumes(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(WORKER), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def test_a_checkpoint_in_object_storage_is_a_snapshot_and_resumes(bucket) -> None:
    save_load_resume(object_store.parse(bucket.url("run")))


@pytest.mark.slow
def test_ddp_on_two_processes_saves_to_object_storage_and_resumes(tmp_path: Path, bucket) -> None:
    """The two processes meet in the bucket: no filesystem is shared for the checkpoint."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(WORKER), str(tmp_path), bucket.url("ddp"),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert bucket.keys("ddp/.pending/") == []
    assert list(tmp_path.iterdir()) == []  # nothing written to the disk


def test_automatic_naming_in_object_storage_and_a_mirrored_project(tmp_path: Path, bucket) -> None:
    url = bucket.url("project")
    project = ProjectConfiguration(project_dir=url, automatic_checkpoint_naming=True, total_limit=2)
    run = build(seed=3, project_config=project)
    with ShmStateSaver(run.accelerator, config=bounded_config()) as saver:
        for _ in range(3):
            train(run, 1)
            saver.save_state()
        assert [str(p) for p in saver.wait(timeout=SAVE_TIMEOUT)][
            -1
        ] == f"{url}/checkpoints/checkpoint_2"
        newest = {k: v.clone() for k, v in run.model.state_dict().items()}
        train(run, 1)
        assert str(saver.load_state()) == f"{url}/checkpoints/checkpoint_2"
        assert run.accelerator.save_iteration == 3  # the next save is checkpoint_3
    assert_same_tree(newest, dict(run.model.state_dict()))
    assert stored(f"{url}/checkpoints") == ["checkpoint_1", "checkpoint_2"]

    # A local project mirrored to the bucket; a new node (another project_dir) resumes from it.
    mirror = bucket.url("mirror")
    local = ProjectConfiguration(
        project_dir=str(tmp_path / "node-a"), automatic_checkpoint_naming=True, total_limit=1
    )
    run = build(seed=4, project_config=local)
    with ShmStateSaver(run.accelerator, config=bounded_config(), mirror=mirror) as saver:
        for _ in range(2):
            train(run, 1)
            saver.save_state()
        saver.wait(timeout=SAVE_TIMEOUT)
        saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert stored(mirror) == ["checkpoint_1"]
    assert visible(tmp_path / "node-a" / "checkpoints") == ["checkpoint_1"]
    fresh_project = ProjectConfiguration(
        project_dir=str(tmp_path / "node-b"), automatic_checkpoint_naming=True
    )
    fresh = build(seed=5, project_config=fresh_project)
    with ShmStateSaver(fresh.accelerator, config=bounded_config(), mirror=mirror) as loader:
        assert str(loader.load_state()) == f"{mirror}/checkpoint_1"
        assert fresh.accelerator.save_iteration == 2
    assert_same_tree(saved, dict(fresh.model.state_dict()))
    with pytest.raises(pyshmckpt.ConfigError, match="mirror"):
        ShmStateSaver(fresh.accelerator, mirror=str(tmp_path))
    with pytest.raises(pyshmckpt.ConfigError, match="automatic naming"):
        ShmStateSaver(build(seed=6).accelerator, mirror=mirror)  # which directory to mirror?
    with (
        ShmStateSaver(fresh.accelerator, config=bounded_config()) as saver,
        pytest.raises(pyshmckpt.UnsupportedLocationError, match="Azure"),
    ):
        saver.load_state("az://container/run/ck")


def stored(url: str) -> list[str]:
    return [name for _, name in object_commit.committed(object_store.parse(url))]


def test_automatic_naming_keeps_the_newest_total_limit(tmp_path: Path) -> None:
    project = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    run = build(seed=3, project_config=project)
    saved = []
    with ShmStateSaver(run.accelerator, config=bounded_config()) as saver:
        for _ in range(4):  # back to back: older ones are pruned while newer ones are written
            train(run, 1)
            saved.append({k: v.clone() for k, v in run.model.state_dict().items()})
            saver.save_state()
        paths = saver.wait(timeout=SAVE_TIMEOUT)
        root = tmp_path / "checkpoints"
        assert paths[-1] == root / "checkpoint_3"
        assert run.accelerator.save_iteration == 4
        assert visible(root) == ["checkpoint_2", "checkpoint_3"]
        wait_until(lambda: hidden(root) == [], SAVE_TIMEOUT, "pruned checkpoints' deletion")
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint_2", "checkpoint_3"]
        for index in (2, 3):
            state = pyshmckpt.load(root / f"checkpoint_{index}")
            for key, tensor in saved[index].items():
                assert torch.equal(state["models"][0][key], tensor)
        train(run, 1)
        assert saver.load_state() == root / "checkpoint_3"  # the newest
        for key, tensor in run.model.state_dict().items():
            assert torch.equal(tensor, saved[3][key])
        assert run.accelerator.save_iteration == 4  # the next save is checkpoint_4
        run.accelerator.project_configuration.iteration = 3
        with pytest.raises(pyshmckpt.PathExistsError):
            saver.save_state()
        assert visible(root) == ["checkpoint_2", "checkpoint_3"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_save_is_raised_by_the_next_call_and_one_writer_runs_at_a_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = build(seed=6)
    run.accelerator.prepare(torch.nn.Linear(1000, 1000))  # 4 MB of weights
    others = child_pids()
    with small_tmpfs(tmp_path / "small") as small:
        saver = ShmStateSaver(run.accelerator, config=bounded_config())
        try:
            with caplog.at_level(logging.ERROR, logger="pyshmckpt.integrations.accelerate"):
                saver.save_state(small / "full")  # on 2 MB
                with pytest.raises(pyshmckpt.WriterOSError) as failed:
                    saver.wait(timeout=SAVE_TIMEOUT)
            assert failed.value.errno == errno.ENOSPC
            assert [r.levelname for r in caplog.records] == ["ERROR"]
            assert str(small / "full") in caplog.records[0].getMessage()
            assert saver.wait(timeout=SAVE_TIMEOUT) == []  # raised once
            assert visible(small) == []

            saver.save_state(small / "full")
            # Saving elsewhere finishes the writes under small first: this save raises, saves
            # nothing, and the one after it works.
            with pytest.raises(pyshmckpt.WriterOSError):
                saver.save_state(tmp_path / "ok")
            assert not (tmp_path / "ok").exists()
            ok = saver.save_state(tmp_path / "ok").result(timeout=SAVE_TIMEOUT)
            (writer,) = child_pids() - others  # small's is stopped
            os.kill(writer, signal.SIGSTOP)
            try:
                late = saver.save_state(tmp_path / "late")
                with pytest.raises(pyshmckpt.WriteTimeoutError):
                    saver.wait(timeout=0.2)
                assert not late.done()
            finally:
                os.kill(writer, signal.SIGCONT)
            assert saver.wait(timeout=SAVE_TIMEOUT) == [tmp_path / "late"]
            assert saver.load_state(ok) == ok
        finally:
            saver.close()
    assert visible(tmp_path) == ["late", "ok", "small"]


def test_bad_input_raises_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(pyshmckpt.ConfigTypeError):
        ShmStateSaver(object())  # type: ignore[arg-type]
    run = build(seed=4)
    unnamed = ProjectConfiguration(automatic_checkpoint_naming=True)
    with pytest.raises(pyshmckpt.ConfigError, match="project_dir"):
        ShmStateSaver(build(seed=4, project_config=unnamed).accelerator)
    theirs = tmp_path / "theirs"
    run.accelerator.save_state(theirs)  # Accelerate's own format
    saver = ShmStateSaver(run.accelerator, config=bounded_config())
    try:
        with pytest.raises(pyshmckpt.ConfigError, match="no output_dir"):
            saver.save_state()
        with pytest.raises(pyshmckpt.ConfigTypeError):
            saver.save_state(7)  # type: ignore[arg-type]
        with pytest.raises(pyshmckpt.ConfigError, match="no input_dir"):
            saver.load_state()
        with pytest.raises(pyshmckpt.PathNotFoundError):
            saver.load_state(tmp_path / "missing")
        with pytest.raises(pyshmckpt.CheckpointCorruptError, match="accelerator.load_state"):
            saver.load_state(theirs)
        ours = tmp_path / "ours"
        saver.save_state(ours).result(timeout=SAVE_TIMEOUT)
        with pytest.raises(pyshmckpt.PathExistsError, match="not a pyshmckpt checkpoint"):
            saver.save_state(theirs)  # Accelerate's own directory is never replaced
        train(run, 1)
        replaced = saver.save_state(ours).result(timeout=SAVE_TIMEOUT)  # as Accelerate overwrites
        assert torch.equal(
            pyshmckpt.load(replaced)["models"][0]["0.weight"], run.model.state_dict()["0.weight"]
        )
        more = build(seed=5)
        more.accelerator.prepare(torch.nn.Linear(2, 2))  # a second model
        with (
            ShmStateSaver(more.accelerator) as loader,
            pytest.raises(pyshmckpt.CheckpointMismatchError, match="1 models, the accelerator 2"),
        ):
            loader.load_state(ours)
    finally:
        saver.close()
    saver.close()  # idempotent
    with pytest.raises(pyshmckpt.ClosedError):
        saver.save_state(tmp_path / "after")
    assert visible(tmp_path) == ["ours", "theirs"]


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_an_unguarded_script_saves_and_a_new_launch_resumes_bitwise(tmp_path: Path) -> None:
    """A script as people write them (no main guard, no close()): it saves with automatic naming
    and ends; a new launch resumes with load_state() from the newest checkpoint, bitwise, and
    its next save continues the numbering. The project directory holds Accelerate's names only."""

    def launch(mode: str) -> str:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), str(tmp_path), mode], env=child_env(), cwd=tmp_path,
            capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return done.stdout

    launch("save")
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert "resumed checkpoint_1, saved checkpoint_2" in launch("resume")
    assert sorted(p.name for p in root.iterdir()) == [f"checkpoint_{i}" for i in range(3)]
