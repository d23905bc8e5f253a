"""Checkpoints in Google Cloud Storage (``gs://``) against a real GCS API server
(fake-gcs-server): save, load, ``latest``, ``keep_last``, ``into=``, verify and inspect; an upload
in parts composed into one object (a tree of composes beyond 32 parts), the parts removed; the
conditional commit; an object replaced after its commit refused; a missing bucket, the server
gone and throttling; two ranks meeting in the bucket; a mirror; the leftovers of a dead upload
cleaned up; a trainer SIGKILLed after save() committed by its writer."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import pyshmckpt
from pyshmckpt import cli
from pyshmckpt.storage import object_commit, object_store

from helpers import SAVE_TIMEOUT, assert_same_tree, child_env, opened, wait_until
from s3servers import FaultProxy

pytestmark = pytest.mark.timeout(180)


def state(step: int, size: int = 1 << 14) -> dict:
    torch.manual_seed(step)
    return {
        "w": [torch.randn(size) for _ in range(3)],
        "b": torch.full((3,), step * 1.0),
        "step": step,
    }


def committed(url: str) -> list[str]:
    return [name for _, name in object_commit.committed(object_store.parse(url))]


def test_save_load_latest_keep_last_verify_and_inspect(gcs_bucket, capsys):
    url = gcs_bucket.url()
    states = [state(i) for i in (1, 2, 3)]
    with opened(url, keep_last=2) as ck:
        names = [str(ck.save(s).result(SAVE_TIMEOUT)) for s in states]
        assert names == [f"{url}/step-{i:08d}" for i in (1, 2, 3)]
        assert str(ck.latest()) == f"{url}/step-00000003"
        assert_same_tree(states[-1], ck.load())
    assert committed(url) == ["step-00000002", "step-00000003"]
    # A checkpoint directory's files and the record; no part object left behind.
    assert gcs_bucket.keys("run/") == sorted(
        ["run/latest"]
        + [
            f"run/step-0000000{i}/{f}"
            for i in (2, 3)
            for f in ("commit.json", "rank0.json", "rank0.safetensors")
        ]
    )
    assert_same_tree(states[-1], pyshmckpt.load(url))
    assert_same_tree(states[1], pyshmckpt.load(f"{url}/step-00000002"))
    target = state(0)
    pyshmckpt.load(url, into=target)  # ranged reads straight into the tensors
    assert_same_tree(states[-1], target)
    assert cli.main(["verify", url]) == 0
    assert cli.main(["inspect", url]) == 0
    assert "step-00000003" in capsys.readouterr().out


def test_an_upload_in_many_parts_is_composed_and_checked(gcs_bucket):
    big = {"w": torch.randn(1 << 20)}  # 4 MiB in parts of 64 KiB: 65 parts, composed in a tree
    with opened(gcs_bucket.url()) as ck:
        ck.save(big).result(SAVE_TIMEOUT)
    blob = gcs_bucket.client.bucket(gcs_bucket.name).get_blob("run/step-00000001/rank0.safetensors")
    record = object_commit.record_of(object_store.parse(gcs_bucket.url()) / "step-00000001")
    assert record["objects"]["rank0.safetensors"] == {
        "etag": str(blob.generation),
        "size": blob.size,
        "header": record["objects"]["rank0.safetensors"]["header"],
    }
    assert [k for k in gcs_bucket.keys() if "pyshmckpt-part" in k] == []
    assert_same_tree(big, pyshmckpt.load(gcs_bucket.url()))


def test_the_commit_is_conditional_and_a_replaced_object_is_refused(gcs_bucket):
    url = gcs_bucket.url()
    with opened(url) as ck:
        ck.save(state(1), "named").result(SAVE_TIMEOUT)
        with pytest.raises(pyshmckpt.PathExistsError):
            ck.save(state(2), "named")
        ck.save(state(3), "named", overwrite=True).result(SAVE_TIMEOUT)
    assert_same_tree(state(3), pyshmckpt.load(f"{url}/named"))
    bucket = gcs_bucket.client.bucket(gcs_bucket.name)
    bucket.blob("run/named/rank0.safetensors").upload_from_string(b"something else")
    with pytest.raises(pyshmckpt.CheckpointCorruptError, match="changed"):
        pyshmckpt.load(f"{url}/named")


def test_a_missing_bucket_and_a_server_gone_are_typed_errors(gcs_bucket, monkeypatch):
    with pytest.raises(pyshmckpt.BucketNotFoundError, match="gs://no-such-"):
        pyshmckpt.Checkpointer(f"gs://no-such-{gcs_bucket.name}/run")
    monkeypatch.setenv("PYSHMCKPT_OBJECT_ATTEMPTS", "2")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nothing listens
    with pytest.raises(pyshmckpt.ObjectStoreUnavailableError, match="gs://"):
        pyshmckpt.load(gcs_bucket.url())


def test_throttling_is_retried(gcs_bucket, monkeypatch):
    proxy = FaultProxy(gcs_bucket.endpoint, throttle_every=3)  # a 503 for every third request
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        with opened(gcs_bucket.url()) as ck:
            ck.save(state(4)).result(SAVE_TIMEOUT)
        assert_same_tree(state(4), pyshmckpt.load(gcs_bucket.url()))
        assert proxy.throttled > 0
    finally:
        proxy.close()


def test_the_server_gone_mid_upload_commits_nothing_and_the_next_save_works(
    gcs_bucket, monkeypatch
):
    proxy = FaultProxy(gcs_bucket.endpoint)
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        monkeypatch.setenv("PYSHMCKPT_OBJECT_ATTEMPTS", "2")
        with opened(gcs_bucket.url()) as ck:
            ck.save(state(1)).result(SAVE_TIMEOUT)
            proxy.throttle_matching = "pyshmckpt-part"  # the parts' uploads fail, then ...
            proxy.drop = True  # ... every connection is cut without an answer
            with pytest.raises(pyshmckpt.ObjectStoreUnavailableError):
                ck.save(state(2)).result(SAVE_TIMEOUT)
            proxy.throttle_matching, proxy.drop = None, False
            assert committed(gcs_bucket.url()) == ["step-00000001"]
            ck.save(state(3)).result(SAVE_TIMEOUT)
        assert committed(gcs_bucket.url()) == ["step-00000001", "step-00000003"]
        assert_same_tree(state(3), pyshmckpt.load(gcs_bucket.url()))
    finally:
        proxy.close()


def test_a_read_cut_off_mid_answer_is_tried_again(gcs_bucket, monkeypatch):
    with opened(gcs_bucket.url()) as ck:
        ck.save(state(6)).result(SAVE_TIMEOUT)
    proxy = FaultProxy(gcs_bucket.endpoint)
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        proxy.cut_reads = 2
        assert_same_tree(state(6), pyshmckpt.load(gcs_bucket.url()))
        assert proxy.cut_reads == 0
    finally:
        proxy.close()


def test_two_ranks_meet_in_the_bucket_and_a_mirror_to_gcs(gcs_bucket, tmp_path):
    url = gcs_bucket.url("ranks")
    ranks = [pyshmckpt.Checkpointer(url, rank=r, world_size=2, run_id="c" * 32) for r in (0, 1)]
    try:
        for future in [ck.save(state(10 + r), "both") for r, ck in enumerate(ranks)]:
            future.result(SAVE_TIMEOUT)
    finally:
        for ck in ranks:
            ck.close()
    assert gcs_bucket.keys("ranks/.pending/") == []
    for r in (0, 1):
        assert_same_tree(state(10 + r), pyshmckpt.load(url, rank=r))
    mirror = gcs_bucket.url("mirror")
    with opened(tmp_path / "root", mirror=mirror) as ck:
        ck.save(state(5)).result(SAVE_TIMEOUT)
    assert committed(mirror) == ["step-00000001"]
    assert_same_tree(state(5), pyshmckpt.load(tmp_path / "new-node", mirror=mirror))


def test_the_parts_of_a_dead_upload_are_cleaned_up(gcs_bucket, monkeypatch):
    bucket = gcs_bucket.client.bucket(gcs_bucket.name)
    leftover = "run/step-00000007/rank0.safetensors.pyshmckpt-part-0123456789abcdef-3"
    bucket.blob(leftover).upload_from_string(b"a part of an upload that died")
    bucket.blob("run/notes.txt").upload_from_string(b"not ours")
    monkeypatch.setenv("PYSHMCKPT_OBJECT_ABANDONED_AFTER", "0")
    removed = object_commit.clean_leftovers(gcs_bucket.url())
    assert removed == ["upload of run/step-00000007/rank0.safetensors"]
    assert gcs_bucket.keys("run/") == ["run/notes.txt"]


KILLED_AFTER_SAVE = textwrap.dedent(
    """
    import os, signal, torch, pyshmckpt
    torch.manual_seed(5)
    state = {"w": [torch.randn(1 << 14) for _ in range(4)], "step": 5}
    checkpointer = pyshmckpt.Checkpointer(os.environ["URL"])
    checkpointer.save(state)
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_trainer_killed_after_save_is_committed_by_its_writer(gcs_bucket, tmp_path, monkeypatch):
    proxy = FaultProxy(gcs_bucket.endpoint, delay=0.2)  # the upload outlives the trainer
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        log = tmp_path / "trainer.log"
        with log.open("w") as out:  # not a pipe: the orphaned writer inherits it
            trainer = subprocess.Popen(
                [sys.executable, "-c", KILLED_AFTER_SAVE], env={**child_env(), "URL": gcs_bucket.url()},
                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            assert trainer.wait(timeout=120) == -signal.SIGKILL, log.read_text()
        assert log.read_text().startswith("saved")
        wait_until(
            lambda: committed(gcs_bucket.url()) == ["step-00000001"], 120, "the commit", poll=0.2
        )
    finally:
        proxy.close()
    torch.manual_seed(5)
    assert_same_tree(
        {"w": [torch.randn(1 << 14) for _ in range(4)], "step": 5}, pyshmckpt.load(gcs_bucket.url())
    )
