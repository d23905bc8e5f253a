"""ShmCheckpointIO with the real Lightning Trainer: ModelCheckpoint's names and top-k choice
unchanged, every kept checkpoint verified, resuming bitwise, removal and failures, and DDP with 2
processes under torchrun."""

from __future__ import annotations

import errno
import logging
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import pyshmckpt
from pyshmckpt import cli
from pyshmckpt.integrations.lightning import ShmCheckpointIO

from helpers import (
    SAVE_TIMEOUT,
    bounded_config,
    child_env,
    free_port,
    hidden,
    small_tmpfs,
    wait_until,
)
from lightning_app import STEPS_PER_EPOCH, Hyper, checkpoint_names, fit, same_parameters
from slow_writer import register_slow_writer

DDP_WORKER = Path(__file__).with_name("lightning_ddp_worker.py")
TOP_K = {"every_n_train_steps": STEPS_PER_EPOCH, "save_top_k": 2, "monitor": "train_loss"}


def shm_io(dirpath: Path | None = None, **options: object) -> ShmCheckpointIO:
    return ShmCheckpointIO(dirpath, config=bounded_config(), write_timeout=SAVE_TIMEOUT, **options)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resumed runs save elsewhere
def test_kept_checkpoints_are_lightnings_choice_and_resuming_continues_bitwise(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    model, callback, _ = fit(ours, [shm_io(dirpath=ours)], save_last=True, **TOP_K)
    reference, reference_callback, _ = fit(theirs, [], save_last=True, **TOP_K)
    assert same_parameters(model, reference)  # saving changed nothing in training

    # The same names kept as with Lightning's own torch.save files: top 2 by loss, and last.
    kept = checkpoint_names(ours)
    assert kept == checkpoint_names(theirs)
    assert len(kept) == 3
    assert "last.ckpt" in kept
    assert sorted(Path(p).name for p in callback.best_k_models) == sorted(
        Path(p).name for p in reference_callback.best_k_models
    )
    wait_until(lambda: hidden(ours) == [], SAVE_TIMEOUT, "removed checkpoints' deletion")
    # The directory as Lightning's own CheckpointIO leaves it: its entries, nothing of ours.
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for name in kept:
        assert (ours / name).is_dir()
        assert cli.main(["verify", str(ours / name)]) == 0
        ours_dict = pyshmckpt.load(ours / name, allow_pickle=True)
        theirs_dict = torch.load(theirs / name, weights_only=False)
        assert ours_dict.keys() == theirs_dict.keys()
        for key, tensor in theirs_dict["state_dict"].items():
            assert torch.equal(ours_dict["state_dict"][key], tensor)
        assert ours_dict["hyper_parameters"]["hyper"] == Hyper(16)
        assert ours_dict["global_step"] == theirs_dict["global_step"]
        assert ours_dict["loops"] == theirs_dict["loops"]

    # Resume from the oldest kept checkpoint: the same parameters as the uninterrupted run.
    first = min((n for n in kept if n != "last.ckpt"), key=lambda n: int(n.split("step=")[1][:-5]))
    resumed, _, _ = fit(tmp_path / "resumed", [shm_io()], ckpt_path=ours / first, **TOP_K)
    assert same_parameters(resumed, model)
    resumed_last, _, _ = fit(
        tmp_path / "again", [shm_io()], ckpt_path=ours / "last.ckpt", save_last=True, **TOP_K
    )
    assert same_parameters(resumed_last, model)  # resumed at max_steps: nothing left to train


@pytest.mark.slow
def test_remove_and_load_wait_for_the_pending_write(tmp_path):
    io = shm_io(writer=register_slow_writer())
    state = {"state_dict": {"w": torch.arange(10.0)}, "epoch": 1, "hyper": Hyper(3)}
    try:
        io.save_checkpoint(state, tmp_path / "a.ckpt")
        state["state_dict"]["w"].add_(1)  # staged: training may change it right away
        assert not (tmp_path / "a.ckpt").exists()
        loaded = io.load_checkpoint(tmp_path / "a.ckpt")
        assert torch.equal(loaded["state_dict"]["w"], torch.arange(10.0))
        assert loaded["hyper"] == Hyper(3)

        io.save_checkpoint(state, tmp_path / "b.ckpt")
        io.remove_checkpoint(tmp_path / "b.ckpt")  # still being written: removed once committed
        io.save_checkpoint(state, tmp_path / "d.ckpt")
        io.remove_checkpoint(tmp_path / "d.ckpt")
        io.save_checkpoint(state, tmp_path / "d.ckpt")  # saved again after its removal: kept

        io.save_checkpoint(state, tmp_path / "a.ckpt")  # replaces a.ckpt once durable
        io.teardown()
        assert torch.equal(
            io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], state["state_dict"]["w"]
        )
        wait_until(lambda: hidden(tmp_path) == [], SAVE_TIMEOUT, "removed checkpoints' deletion")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "d.ckpt"]

        # Saving after teardown starts a writer again (a second fit on the same Trainer).
        io.save_checkpoint(state, tmp_path / "c.ckpt")
        assert torch.equal(
            io.load_checkpoint(tmp_path / "c.ckpt")["state_dict"]["w"], state["state_dict"]["w"]
        )
    finally:
        io.teardown()


@pytest.mark.slow
def test_a_failed_write_is_raised_by_the_next_call(tmp_path):
    io = shm_io()
    try:
        with small_tmpfs(tmp_path / "small") as small:
            io.save_checkpoint({"w": torch.ones(1_000_000)}, small / "big.ckpt")  # 4 MB on 2 MB
            with pytest.raises(pyshmckpt.WriterOSError) as failed:
                io.teardown()
            assert failed.value.errno == errno.ENOSPC
            assert checkpoint_names(small) == []
            io.save_checkpoint({"w": torch.ones(10)}, small / "small.ckpt")
            io.teardown()
            assert checkpoint_names(small) == ["small.ckpt"]
    finally:
        io.teardown()


def test_bad_input_is_refused_with_typed_errors(tmp_path, caplog):
    for option in ({"rank": 1}, {"keep_last": 2}, {"writer": "torch"}):
        with pytest.raises(pyshmckpt.NotSupportedError):
            ShmCheckpointIO(**option)
    with pytest.raises(pyshmckpt.ConfigTypeError, match="write_timeout"):
        ShmCheckpointIO(write_timeout="soon")
    io = shm_io()
    try:
        with pytest.raises(pyshmckpt.NotSupportedError, match="storage_options"):
            io.save_checkpoint({}, tmp_path / "a.ckpt", storage_options={"x": 1})
        with pytest.raises(pyshmckpt.UnsupportedLocationError, match="Azure"):
            io.save_checkpoint({}, "az://container/a.ckpt")
        with pytest.raises(pyshmckpt.ConfigTypeError, match="path"):
            io.save_checkpoint({}, 42)
        torch.save({"w": torch.zeros(2), "epoch": 3}, tmp_path / "theirs.ckpt")  # a run without us
        with pytest.raises(pyshmckpt.PathExistsError, match="not a pyshmckpt checkpoint"):
            io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "theirs.ckpt")
        theirs = io.load_checkpoint(tmp_path / "theirs.ckpt")  # read as Lightning would
        assert torch.equal(theirs["w"], torch.zeros(2))
        assert theirs["epoch"] == 3
        (tmp_path / "garbage.ckpt").write_bytes(b"not a checkpoint")
        with pytest.raises(pyshmckpt.PyshmckptError):
            io.load_checkpoint(tmp_path / "garbage.ckpt")

        io.save_checkpoint({"w": torch.ones(2), "hyper": Hyper(1)}, tmp_path / "a.ckpt")
        with pytest.raises(pyshmckpt.CheckpointCorruptError, match="allow_pickle"):
            io.load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
        with pytest.raises(pyshmckpt.NotSupportedError, match="map_location"):
            io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda s, _: s)
        with caplog.at_level(logging.WARNING, logger="pyshmckpt.integrations.lightning"):
            io.remove_checkpoint(tmp_path / "never-saved.ckpt")
        assert "no such checkpoint" in caplog.text
        io.remove_checkpoint(tmp_path / "theirs.ckpt")  # a file: removed like Lightning's own
        assert not (tmp_path / "theirs.ckpt").exists()

        # Lightning's ddp_spawn pickles the Trainer, with its plugins.
        copied = pickle.loads(pickle.dumps(io))
        copied.save_checkpoint({"w": torch.ones(3)}, tmp_path / "copied.ckpt")
        assert torch.equal(copied.load_checkpoint(tmp_path / "copied.ckpt")["w"], torch.ones(3))
        copied.teardown()
    finally:
        io.teardown()


def stored(url: str) -> list[str]:
    from pyshmckpt.storage import object_commit, object_store

    return sorted(name for _, name in object_commit.committed(object_store.parse(url)))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resumed runs save elsewhere
def test_a_mirrored_dirpath_keeps_lightnings_choice_in_the_bucket_and_resumes_on_a_new_node(
    tmp_path, bucket
):
    url = bucket.url("lightning")
    local = tmp_path / "node-a"
    model, _, _ = fit(local, [shm_io(dirpath=local, mirror=url)], save_last=True, **TOP_K)
    # fit's teardown waited for the uploads and for the removals of what top-k dropped.
    kept = checkpoint_names(local)
    assert len(kept) == 3
    assert stored(url) == kept
    # A new node: the local path is not on its disk, the mirror holds it.
    node_b = tmp_path / "node-b"
    io = shm_io(dirpath=node_b, mirror=url)
    try:
        again = io.load_checkpoint(node_b / "last.ckpt")
        assert again["global_step"] == 3 * STEPS_PER_EPOCH
    finally:
        io.teardown()
    # Resumed from the bucket's URL by Lightning itself: the run ends where the first ended.
    first = min((n for n in kept if n != "last.ckpt"), key=lambda n: int(n.split("step=")[1][:-5]))
    resumed, _, _ = fit(node_b, [shm_io()], ckpt_path=f"{url}/{first}", **TOP_K)
    assert same_parameters(resumed, model)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resumed runs save elsewhere
def test_checkpoints_in_object_storage_save_load_and_remove(tmp_path, bucket):
    url = bucket.url("run")
    model, _, trainer = fit(tmp_path / "local", [shm_io()], max_steps=STEPS_PER_EPOCH)
    trainer.save_checkpoint(f"{url}/manual.ckpt")  # Lightning hands the URL to the plugin
    trainer.save_checkpoint(f"{url}/other.ckpt")
    io = trainer.strategy.checkpoint_io
    io.remove_checkpoint(f"{url}/other.ckpt")  # queued behind its own upload
    io.teardown()
    assert stored(url) == ["manual.ckpt"]
    assert cli.main(["verify", f"{url}/manual.ckpt"]) == 0
    loaded = shm_io().load_checkpoint(f"{url}/manual.ckpt")
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][f"{key}"], tensor)
    resumed, _, _ = fit(
        tmp_path / "resumed", [shm_io()], max_steps=STEPS_PER_EPOCH, ckpt_path=f"{url}/manual.ckpt"
    )
    assert same_parameters(resumed, model)
    # A checkpoint of an earlier run, with no writer of this object for its root.
    fresh = shm_io()
    fresh.remove_checkpoint(f"{url}/manual.ckpt")
    assert stored(url) == []
    with pytest.raises(pyshmckpt.CheckpointNotFoundError):
        fresh.load_checkpoint(f"{url}/manual.ckpt")
    with pytest.raises(pyshmckpt.ConfigError, match="mirror"):
        ShmCheckpointIO(mirror=url)
    with pytest.raises(pyshmckpt.ConfigError, match="mirror"):
        ShmCheckpointIO(tmp_path, mirror=str(tmp_path / "elsewhere"))
    with pytest.raises(pyshmckpt.UnsupportedLocationError, match="Azure"):
        ShmCheckpointIO("az://container/run")


@pytest.mark.slow
def test_ddp_on_two_processes_saves_on_rank_zero_and_resumes_bitwise(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(DDP_WORKER), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]
