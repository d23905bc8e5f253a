"""Checkpoints in object storage (s3://) against a real S3 API server: save, load, latest,
keep_last, replace, remove, verify and inspect, what a reader sees before the commit record,
and what the layout looks like to other tools."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest
import torch

import pyshmckpt
from pyshmckpt.storage import object_commit, object_store

from helpers import SAVE_TIMEOUT, assert_same_tree, child_env, opened

pytestmark = pytest.mark.timeout(180)


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(300, 257), "b": torch.randn(257).to(torch.bfloat16)},
        "optim": {
            "step": step,
            "moments": [torch.randn(1000, dtype=torch.float64), torch.arange(7)],
        },
        "tied": None,
        "lr": 0.5 * step,
    }


def test_save_load_latest_and_keep_last(bucket):
    url = bucket.url()
    states = [state(i) for i in range(1, 5)]
    with opened(url, keep_last=2) as ck:
        names = [ck.save(s).result(SAVE_TIMEOUT) for s in states]
        assert [str(n) for n in names] == [f"{url}/step-{i:08d}" for i in range(1, 5)]
        assert str(ck.latest()) == f"{url}/step-00000004"
        assert_same_tree(states[-1], ck.load())
    # Only the two newest remain, each a checkpoint directory's files plus its commit record.
    keys = bucket.keys("run/")
    assert keys == sorted(
        ["run/latest"]
        + [
            f"run/step-0000000{i}/{f}"
            for i in (3, 4)
            for f in ("commit.json", "rank0.json", "rank0.safetensors")
        ]
    )
    assert (
        json.loads(bucket.client.get_object(Bucket=bucket.name, Key="run/latest")["Body"].read())[
            "name"
        ]
        == "step-00000004"
    )
    assert_same_tree(states[-1], pyshmckpt.load(url))
    assert_same_tree(states[2], pyshmckpt.load(f"{url}/step-00000003"))
    assert bucket.uploads() == []  # every multipart upload was completed


def test_an_upload_is_in_many_parts_each_checked_by_crc32c(bucket):
    big = {"w": torch.randn(1 << 18)}  # 1 MiB: 16 parts of 64 KiB
    with opened(bucket.url()) as ck:
        ck.save(big).result(SAVE_TIMEOUT)
    head = bucket.client.head_object(
        Bucket=bucket.name, Key="run/step-00000001/rank0.safetensors", ChecksumMode="ENABLED"
    )
    assert head["ETag"].strip('"').endswith("-17")  # the header's bytes make a 17th part
    record = object_commit.record_of(object_store.parse(bucket.url()) / "step-00000001")
    assert record["objects"]["rank0.safetensors"]["size"] == head["ContentLength"]


def test_load_into_mmap_and_verify(bucket):
    saved = state(3)
    with opened(bucket.url()) as ck:
        ck.save(saved).result(SAVE_TIMEOUT)
    target = state(9)
    model = target["model"]["w"]
    assert pyshmckpt.load(bucket.url(), into=target) is target
    assert target["model"]["w"] is model  # filled in place
    assert_same_tree(saved, target)
    assert_same_tree(saved, pyshmckpt.load(bucket.url(), mmap=False))
    assert pyshmckpt.verify(bucket.url()) == 4  # tensors checked


def test_names_replace_and_remove(bucket):
    url = bucket.url()
    with opened(url) as ck:
        ck.save(state(1), "best").result(SAVE_TIMEOUT)
        with pytest.raises(pyshmckpt.PathExistsError, match="already exists"):
            ck.save(state(2), "best")
        assert_same_tree(state(1), pyshmckpt.load(f"{url}/best"))
        ck.save(state(2), "best", overwrite=True).result(SAVE_TIMEOUT)
        assert_same_tree(state(2), pyshmckpt.load(f"{url}/best"))
        ck.save(state(3)).result(SAVE_TIMEOUT)
        ck.remove("best").result(SAVE_TIMEOUT)
        assert object_commit.committed(object_store.parse(url)) == [(3, "step-00000001")]
        with pytest.raises(pyshmckpt.WriterOSError) as gone:  # as for a root on a disk
            ck.remove("best").result(SAVE_TIMEOUT)
        assert gone.value.errno == errno.ENOENT


def test_uncommitted_objects_are_not_a_checkpoint(bucket):
    """Objects of a checkpoint whose commit record was never written (a save that died) are
    invisible to listings, latest and load; a reopened root removes them once abandoned, and
    nothing else under the root."""
    url = bucket.url()
    with opened(url) as ck:
        ck.save(state(1)).result(SAVE_TIMEOUT)
    client = bucket.client
    client.put_object(Bucket=bucket.name, Key="run/step-00000002/rank0.safetensors", Body=b"torn")
    client.put_object(Bucket=bucket.name, Key="run/step-00000002/rank0.json", Body=b"{}")
    client.create_multipart_upload(Bucket=bucket.name, Key="run/step-00000002/rank0.safetensors")
    # Not ours, though as old: other data under the root, and an upload of another tool.
    client.put_object(Bucket=bucket.name, Key="run/data/part-0.parquet", Body=b"theirs")
    client.put_object(Bucket=bucket.name, Key="run/mixed/rank0.json", Body=b"{}")
    client.put_object(Bucket=bucket.name, Key="run/mixed/notes.txt", Body=b"theirs")
    client.create_multipart_upload(Bucket=bucket.name, Key="run/data/part-1.parquet")
    root = object_store.parse(url)
    assert object_commit.committed(root) == [(1, "step-00000001")]
    assert str(object_commit.latest(root)) == f"{url}/step-00000001"
    assert_same_tree(state(1), pyshmckpt.load(url))
    with pytest.raises(pyshmckpt.CheckpointNotFoundError):
        pyshmckpt.load(f"{url}/step-00000002")
    # moto dates every upload to 2010: with a bound of a day it counts as abandoned.
    with opened(url) as ck:
        ck.save(state(2)).result(SAVE_TIMEOUT)  # after the cleanup, which the writer ran first
    assert bucket.uploads() == ["run/data/part-1.parquet"]
    for theirs in ("run/data/part-0.parquet", "run/mixed/rank0.json", "run/mixed/notes.txt"):
        assert theirs in bucket.keys("run/")
    assert_same_tree(state(2), pyshmckpt.load(url))


def test_a_missing_root_is_nothing_to_restore(bucket):
    assert pyshmckpt.load(bucket.url("nothing"), missing_ok=True) is None
    with pytest.raises(pyshmckpt.CheckpointNotFoundError):
        pyshmckpt.load(bucket.url("nothing"))
    with opened(bucket.url("fresh")) as ck:
        assert ck.load(missing_ok=True) is None
        assert ck.latest() is None


def test_command_line_verifies_and_inspects(bucket, tmp_path):
    with opened(bucket.url()) as ck:
        ck.save(state(1)).result(SAVE_TIMEOUT)

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pyshmckpt", *args], env=child_env(), capture_output=True,
            text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip

    verified = command("verify", bucket.url())
    assert verified.returncode == 0, verified.stderr
    assert "every checksum matches" in verified.stdout
    shown = command("inspect", bucket.url())
    assert shown.returncode == 0, shown.stderr
    assert "in storage step-00000001" in shown.stdout
    assert "model.w" in shown.stdout
    # A damaged object: CORRUPT, exit 1.
    key = "run/step-00000001/rank0.safetensors"
    data = bytearray(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())
    data[-3] ^= 0xFF
    bucket.client.put_object(Bucket=bucket.name, Key=key, Body=bytes(data))
    broken = command("verify", bucket.url())
    assert broken.returncode == 1
    assert "CORRUPT" in broken.stderr
    assert "changed after its checkpoint was committed" in broken.stderr


def test_a_copy_of_the_objects_is_a_checkpoint_directory(bucket, tmp_path):
    """What standard tools copy out of the bucket loads as a directory, and passes safetensors."""
    from safetensors.torch import load_file

    saved = state(4)
    with opened(bucket.url()) as ck:
        ck.save(saved).result(SAVE_TIMEOUT)
    copy = tmp_path / "step-00000004"
    copy.mkdir()
    for key in bucket.keys("run/step-00000001/"):
        data = bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read()
        (copy / key.rpartition("/")[2]).write_bytes(data)
    assert_same_tree(saved, pyshmckpt.load(copy))
    assert torch.equal(load_file(copy / "rank0.safetensors")["model.w"], saved["model"]["w"])


def test_unsupported_settings_are_refused(bucket):
    with pytest.raises(pyshmckpt.NotSupportedError, match="safetensors"):
        pyshmckpt.Checkpointer(bucket.url(), writer="torch")
    with pytest.raises(pyshmckpt.NotSupportedError, match="hold"):
        pyshmckpt.Checkpointer(bucket.url(), hold=True)
    with pytest.raises(pyshmckpt.UnsupportedLocationError, match="bucket name"):
        pyshmckpt.Checkpointer("s3://No_Such/run")
    with pytest.raises(pyshmckpt.UnsupportedLocationError, match="Azure Blob Storage"):
        pyshmckpt.load("az://container/run")
    with pytest.raises(pyshmckpt.UnsupportedLocationError, match="write gs://"):
        pyshmckpt.load("gcs://bucket/run")
