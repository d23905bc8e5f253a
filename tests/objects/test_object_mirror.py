"""A local root mirrored to object storage: ``Checkpointer(root, mirror="s3://...")``. Saves
commit on the disk, then the writer uploads them in the background; a restart on the same node
reads its disk, a new node (an empty root) the mirror, and the newest of memory, disk and the
mirror wins."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import pyshmckpt
from pyshmckpt.storage import commit, object_commit, object_store

from helpers import SAVE_TIMEOUT, assert_same_tree, child_env, opened, wait_until
from s3servers import FaultProxy, point_at

pytestmark = pytest.mark.timeout(240)


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": [torch.randn(1 << 14) for _ in range(4)], "step": step}


def stored_names(url: str) -> list[str]:
    return [name for _, name in object_commit.committed(object_store.parse(url))]


def test_saves_are_mirrored_with_the_same_names_and_retention(bucket, tmp_path):
    url = bucket.url("mirror")
    with opened(tmp_path / "root", keep_last=2, mirror=url) as ck:
        for step in (1, 2, 3):
            ck.save(state(step)).result(SAVE_TIMEOUT)  # committed on the disk
    # close() waited for the uploads.
    assert stored_names(url) == ["step-00000002", "step-00000003"]
    assert [name for _, name in commit.committed(tmp_path / "root")] == stored_names(url)
    record = object_commit.record_of(object_store.parse(url) / "step-00000003")
    assert isinstance(record["staged_ns"], int)
    assert_same_tree(state(3), pyshmckpt.load(url))


def test_a_new_node_restores_from_the_mirror_and_the_same_node_from_its_disk(
    bucket, tmp_path, monkeypatch
):
    url = bucket.url("mirror")
    with opened(tmp_path / "node-a", mirror=url) as ck:
        ck.save(state(1)).result(SAVE_TIMEOUT)
        ck.save(state(2)).result(SAVE_TIMEOUT)
    proxy = FaultProxy(bucket.server.endpoint)  # counts the bytes of checkpoints read from it
    try:
        point_at(monkeypatch, proxy.endpoint)
        with opened(tmp_path / "node-b", mirror=url) as fresh:  # an empty root
            assert_same_tree(state(2), fresh.load())
        assert proxy.read_bytes > 0
        proxy.read_bytes = 0
        with opened(tmp_path / "node-a", mirror=url) as again:
            assert_same_tree(state(2), again.load())
        assert proxy.read_bytes == 0  # the same checkpoint on the disk: nothing downloaded
        assert_same_tree(state(2), pyshmckpt.load(tmp_path / "node-c", mirror=url))
    finally:
        proxy.close()


def test_the_newest_wins_whichever_tier_holds_it(bucket, tmp_path):
    url = bucket.url("mirror")
    root = tmp_path / "root"
    with opened(root, mirror=url) as ck:
        ck.save(state(1)).result(SAVE_TIMEOUT)
        ck.save(state(2)).result(SAVE_TIMEOUT)
    # The mirror lags (its newest upload failed): the disk's newer checkpoint is restored.
    object_commit.remove(object_store.parse(url), "step-00000002")
    assert_same_tree(state(2), pyshmckpt.load(root, mirror=url))
    # The disk lost its newest: the mirror's is newer than what is left there.
    with opened(tmp_path / "other", mirror=url) as ck:
        ck.save(state(3), "newer").result(SAVE_TIMEOUT)
    assert_same_tree(state(3), pyshmckpt.load(root, mirror=url))


def test_remove_removes_the_checkpoint_from_the_mirror_too(bucket, tmp_path):
    url = bucket.url("mirror")
    root = tmp_path / "root"
    with opened(root, mirror=url) as ck:
        for step in (1, 2):
            ck.save(state(step)).result(SAVE_TIMEOUT)
        # The newest is removed while its upload may still be queued: uploaded, then removed.
        ck.save(state(3), "pending")
        ck.remove("pending").result(SAVE_TIMEOUT)
        ck.remove("step-00000001").result(SAVE_TIMEOUT)
        assert not (root / "step-00000001").exists()
        with pytest.raises(pyshmckpt.WriterOSError) as missing:
            ck.remove("never-saved").result(SAVE_TIMEOUT)
        assert missing.value.errno == errno.ENOENT
    # close() waited for the mirror's removals.
    assert stored_names(url) == ["step-00000002"]
    assert bucket.keys("mirror/pending/") == []
    assert bucket.keys("mirror/step-00000001/") == []
    assert [n for _, n in commit.committed(root)] == ["step-00000002"]


def test_a_failed_upload_leaves_the_local_save_standing(bucket, tmp_path, monkeypatch, caplog):
    proxy = FaultProxy(bucket.server.endpoint)
    proxy.throttle_matching = "step-00000001"  # the service refuses everything of the first
    try:
        point_at(monkeypatch, proxy.endpoint)
        monkeypatch.setenv("PYSHMCKPT_OBJECT_ATTEMPTS", "1")
        url = bucket.url("mirror")
        with caplog.at_level("WARNING"), opened(tmp_path / "root", mirror=url) as ck:
            assert ck.save(state(1)).result(SAVE_TIMEOUT).name == "step-00000001"
            ck.save(state(2)).result(SAVE_TIMEOUT)
        assert stored_names(url) == ["step-00000002"]
        assert [n for _, n in commit.committed(tmp_path / "root")] == [
            "step-00000001",
            "step-00000002",
        ]
        assert any(
            "could not mirror" in r.getMessage() and "SlowDown" in r.getMessage()
            for r in caplog.records
        )
    finally:
        proxy.close()


KILLED_AFTER_SAVE = textwrap.dedent(
    """
    import os, signal, torch, pyshmckpt
    torch.manual_seed(5)
    state = {"w": [torch.randn(1 << 14) for _ in range(4)], "step": 5}
    checkpointer = pyshmckpt.Checkpointer(os.environ["ROOT"], mirror=os.environ["URL"])
    checkpointer.save(state)
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_trainer_killed_after_save_is_mirrored_by_its_writer(bucket, tmp_path, monkeypatch):
    proxy = FaultProxy(bucket.server.endpoint, delay=0.3)  # the upload outlives the trainer
    try:
        point_at(monkeypatch, proxy.endpoint)
        url = bucket.url("mirror")
        env = {**child_env(), "URL": url, "ROOT": str(tmp_path / "root")}
        log = tmp_path / "trainer.log"
        with log.open("w") as out:  # not a pipe: the orphaned writer inherits it
            trainer = subprocess.Popen(
                [sys.executable, "-c", KILLED_AFTER_SAVE], env=env, cwd=tmp_path, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            assert trainer.wait(timeout=120) == -signal.SIGKILL, log.read_text()
        assert log.read_text().startswith("saved")
        wait_until(lambda: stored_names(url) == ["step-00000001"], 120, "the mirror", poll=0.2)
        assert_same_tree(state(5), pyshmckpt.load(url))
    finally:
        proxy.close()


def test_a_mirror_must_be_object_storage(bucket, tmp_path):
    with pytest.raises(pyshmckpt.ConfigError, match="object storage root"):
        pyshmckpt.Checkpointer(tmp_path / "root", mirror=str(tmp_path / "elsewhere"))
    with pytest.raises(pyshmckpt.ConfigError, match="filesystem"):
        pyshmckpt.Checkpointer(bucket.url("a"), mirror=bucket.url("b"))
    with pytest.raises(pyshmckpt.BucketNotFoundError):
        pyshmckpt.Checkpointer(tmp_path / "root", mirror=f"s3://{bucket.name}-none/run")


def test_two_ranks_mirror_one_checkpoint(bucket, tmp_path):
    """Two ranks (two writers) on a shared root: each uploads its own files, rank 0 commits
    the checkpoint in the mirror once both are up; a new node restores either rank from it."""
    url = bucket.url("mirror")
    ranks = [
        pyshmckpt.Checkpointer(tmp_path / "root", rank=r, world_size=2, run_id="b" * 32, mirror=url)
        for r in (0, 1)
    ]
    try:
        saved = [ck.save(state(10 + r), "both") for r, ck in enumerate(ranks)]
        for future in saved:
            future.result(SAVE_TIMEOUT)
    finally:
        for ck in ranks:
            ck.close()  # each waits for its own upload; rank 0's for the commit too
    record = object_commit.record_of(object_store.parse(url) / "both")
    assert record["world_size"] == 2
    assert sorted(record["objects"]) == [
        "rank0.json",
        "rank0.safetensors",
        "rank1.json",
        "rank1.safetensors",
    ]
    assert bucket.keys("mirror/.pending/") == []
    for r in (0, 1):
        assert_same_tree(state(10 + r), pyshmckpt.load(tmp_path / "new-node", mirror=url, rank=r))
