"""Object storage when things go wrong, against a real S3 API server and a proxy in front of it:
throttling retried, wrong credentials and missing buckets as typed errors naming the URL
(whichever process met them), a server gone mid-upload, a trainer SIGKILLed right after save()
returned, a write that stalls."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import pyshmckpt
from pyshmckpt.storage import object_commit, object_store

from helpers import SAVE_TIMEOUT, assert_same_tree, bounded_config, child_env, opened, wait_until
from s3servers import FaultProxy, MotoServer, point_at

pytestmark = pytest.mark.timeout(240)


def state(seed: int, count: int = 8, size: int = 1 << 15) -> dict:
    torch.manual_seed(seed)
    return {"w": [torch.randn(size) for _ in range(count)], "seed": seed}


@pytest.fixture
def proxy(bucket, monkeypatch):
    """The bucket's server behind a FaultProxy, which this process and its writers talk to."""
    made = FaultProxy(bucket.server.endpoint)
    point_at(monkeypatch, made.endpoint)
    yield made
    made.close()


def test_throttling_is_retried_with_backoff(bucket, proxy):
    proxy.throttle_every = 3  # a third of all requests: 503 SlowDown
    saved = state(1)
    with opened(bucket.url()) as ck:
        ck.save(saved).result(SAVE_TIMEOUT)
        assert_same_tree(saved, ck.load())
    assert proxy.throttled >= 5, proxy.throttled
    assert bucket.uploads() == []


def test_throttling_beyond_the_tries_is_a_typed_error_from_the_writer(bucket, proxy, monkeypatch):
    monkeypatch.setenv("PYSHMCKPT_OBJECT_ATTEMPTS", "2")
    with opened(bucket.url()) as ck:
        proxy.throttle_every = 1  # every request from now on
        failure = ck.save(state(2))
        with pytest.raises(pyshmckpt.ObjectStoreUnavailableError) as raised:
            failure.result(SAVE_TIMEOUT)
        assert raised.value.status == 503
        assert raised.value.code == "SlowDown"
        assert bucket.url() in str(raised.value)
        proxy.throttle_every = 0
        ck.save(state(3)).result(SAVE_TIMEOUT)  # the writer lives on
    assert_same_tree(state(3), pyshmckpt.load(bucket.url()))


def test_a_read_cut_off_mid_answer_is_tried_again(bucket, proxy, monkeypatch):
    saved = state(4)
    with opened(bucket.url()) as ck:
        ck.save(saved).result(SAVE_TIMEOUT)
    proxy.cut_reads = 2  # two answers end halfway (a connection reset while the load reads)
    assert_same_tree(saved, pyshmckpt.load(bucket.url()))
    assert proxy.cut_reads == 0
    monkeypatch.setenv("PYSHMCKPT_OBJECT_ATTEMPTS", "2")
    proxy.cut_reads = 1000  # every answer: a typed error once the tries are spent
    with pytest.raises(pyshmckpt.ObjectStoreUnavailableError, match="after 2 tries"):
        pyshmckpt.load(bucket.url())


def test_two_ranks_uploading_one_object_name_commit_nothing(bucket):
    root = object_store.parse(bucket.url())

    def rank(r: int) -> None:
        def upload(target):
            etag = object_store.put(target / "same.bin", f"rank {r}".encode())
            return {"same.bin": {"etag": etag, "size": 6}}

        object_commit.save(root / "both", upload, None, files=("same.bin",), rank=r,
                           world_size=2, attempt=f"{'d' * 32}.1", barrier_timeout=30)  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = [pool.submit(rank, r) for r in (0, 1)]
        errors = [future.exception(timeout=SAVE_TIMEOUT) for future in results]
    assert all(isinstance(e, pyshmckpt.CommitError) for e in errors), errors
    assert "another rank uploaded too" in str(errors[0])
    assert object_commit.record_of(root / "both") is None


def test_a_missing_bucket_is_a_typed_error_naming_it(bucket):
    url = f"s3://{bucket.name}-gone/run"
    with pytest.raises(pyshmckpt.BucketNotFoundError, match=f"{bucket.name}-gone"):
        pyshmckpt.Checkpointer(url)
    with pytest.raises(FileNotFoundError):  # the builtin it also is
        pyshmckpt.load(url)
    # The bucket removed under an open Checkpointer: the writer meets it, the caller gets it.
    gone = f"{bucket.name}-later"
    bucket.client.create_bucket(Bucket=gone)
    with opened(f"s3://{gone}/run") as ck:
        bucket.client.delete_bucket(Bucket=gone)
        with pytest.raises(pyshmckpt.BucketNotFoundError, match=gone):
            ck.save(state(4)).result(SAVE_TIMEOUT)


SERVER_WITH_AUTH = textwrap.dedent(
    """
    # moto's S3 server checking every request's credentials: none it knows of.
    import sys
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
    server.stop()
    """
)


def test_wrong_credentials_are_a_typed_error_naming_the_url(monkeypatch, tmp_path):
    env = {**child_env(), "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_WITH_AUTH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=env, cwd=tmp_path, text=True,
    )  # fmt: skip
    try:
        port = int(server.stdout.readline())
        point_at(monkeypatch, f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        with pytest.raises(pyshmckpt.ObjectStoreAccessError) as raised:
            pyshmckpt.Checkpointer("s3://locked-bucket/run")
        assert raised.value.status == 403
        assert "s3://locked-bucket/run" in str(raised.value)
        with pytest.raises(PermissionError):
            pyshmckpt.load("s3://locked-bucket/run")
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        with pytest.raises(pyshmckpt.ObjectStoreAccessError, match="no credentials"):
            pyshmckpt.load("s3://locked-bucket/run")
    finally:
        server.stdin.close()
        server.wait(timeout=30)
        server.stdout.close()


def test_a_server_gone_mid_upload_leaves_nothing_committed(bucket, monkeypatch):
    """The server stops while parts are in flight: the save fails (typed, after its tries), no
    checkpoint is committed, and once the server is back the next save commits and the
    unfinished upload is removed by the root's cleanup."""
    server = MotoServer()  # of its own: stopped and started again below
    proxy = FaultProxy(server.endpoint, delay=0.2)
    try:
        point_at(monkeypatch, proxy.endpoint)
        monkeypatch.setenv("PYSHMCKPT_OBJECT_ATTEMPTS", "2")
        url = bucket.url("gone")
        with opened(url) as ck:
            pending = ck.save(state(5, count=32))  # 4 MiB: 64 parts, 4 rounds of 16
            wait_until(lambda: bucket.uploads(), 30, "an upload in flight", poll=0.05)
            server.stop()
            with pytest.raises(pyshmckpt.ObjectStoreUnavailableError, match=url):
                pending.result(SAVE_TIMEOUT)
            server.start()
            assert object_commit.committed(object_store.parse(url)) == []
            assert pyshmckpt.load(url, missing_ok=True) is None
            ck.save(state(6)).result(SAVE_TIMEOUT)
        assert_same_tree(state(6), pyshmckpt.load(url))
        with opened(url):  # opening the root removes the upload left (moto dates it to 2010)
            wait_until(lambda: not bucket.uploads(), 30, "the upload left removed", poll=0.1)
    finally:
        proxy.close()
        server.stop()


KILLED_AFTER_SAVE = textwrap.dedent(
    """
    import os, signal, torch, pyshmckpt
    torch.manual_seed(7)
    state = {"w": [torch.randn(1 << 15) for _ in range(32)], "seed": 7}
    checkpointer = pyshmckpt.Checkpointer(os.environ["URL"])
    checkpointer.save(state)
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_trainer_killed_after_save_returned_is_committed_by_its_writer(bucket, proxy, tmp_path):
    proxy.delay = 0.5  # the upload takes seconds: the trainer is long dead when it ends
    url = bucket.url("killed")
    env = {**child_env(), "URL": url}
    log = tmp_path / "trainer.log"
    with log.open("w") as out:  # not a pipe: the orphaned writer inherits it and lives on
        trainer = subprocess.Popen(
            [sys.executable, "-c", KILLED_AFTER_SAVE], env=env, cwd=tmp_path, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert trainer.wait(timeout=120) == -signal.SIGKILL, log.read_text()
    assert log.read_text().startswith("saved"), log.read_text()
    root = object_store.parse(url)
    assert object_commit.committed(root) == []  # still uploading
    wait_until(lambda: object_commit.committed(root), 120, "the orphaned writer's commit", poll=0.1)
    torch.manual_seed(7)
    expected = {"w": [torch.randn(1 << 15) for _ in range(32)], "seed": 7}
    assert_same_tree(expected, pyshmckpt.load(url))


def test_the_stall_timeout_counts_uploaded_parts(bucket, proxy):
    """Parts that keep landing are progress: a slow upload longer than the stall timeout
    lands. A server that stops answering stalls the write, which fails in bounded time."""
    proxy.delay = 1.0  # 64 parts in 4 rounds of 16: over 4 s, a round every second or so
    config = bounded_config(write_stall_timeout_secs=3.0)
    with opened(bucket.url(), config=config) as ck:
        ck.save(state(8, count=32)).result(SAVE_TIMEOUT)
        proxy.delay = 30.0  # no answer within the stall timeout
        started = time.monotonic()
        with pytest.raises(pyshmckpt.WriteStalledError):
            ck.save(state(9, count=32)).result(SAVE_TIMEOUT)
        assert time.monotonic() - started < 20
        proxy.delay = 0.0
    assert_same_tree(state(8, count=32), pyshmckpt.load(bucket.url()))


def test_a_rank_that_fails_stops_every_rank_and_the_next_save_cleans_up(bucket, proxy, monkeypatch):
    """Two ranks (two writers) save one checkpoint; rank 1's parts are refused: it fails with
    the service's error, rank 0 with a CommitError naming rank 1 at once (not at the barrier
    timeout), nothing is committed; the run's next checkpoint commits and removes what the
    failed attempt left."""
    url = bucket.url("ranks")
    run = "a" * 32
    direct = bucket.server.endpoint
    point_at(monkeypatch, direct)
    first = pyshmckpt.Checkpointer(
        url, rank=0, world_size=2, run_id=run, barrier_timeout=60, config=bounded_config()
    )
    point_at(monkeypatch, proxy.endpoint)
    monkeypatch.setenv("PYSHMCKPT_OBJECT_ATTEMPTS", "1")
    second = pyshmckpt.Checkpointer(
        url, rank=1, world_size=2, run_id=run, barrier_timeout=60, config=bounded_config()
    )
    try:
        proxy.throttle_matching = "partNumber="  # rank 1's parts, and nothing else
        started = time.monotonic()
        mine = first.save(state(11), "ck")
        theirs = second.save(state(12), "ck")
        with pytest.raises(pyshmckpt.ObjectStoreUnavailableError):
            theirs.result(SAVE_TIMEOUT)
        with pytest.raises(pyshmckpt.CommitError, match="rank 1 failed to upload"):
            mine.result(SAVE_TIMEOUT)
        assert time.monotonic() - started < 30
        root = object_store.parse(url)
        assert object_commit.committed(root) == []
        proxy.throttle_matching = None
        both = [first.save(state(13), "ck2"), second.save(state(14), "ck2")]
        for saved in both:
            saved.result(SAVE_TIMEOUT)
    finally:
        first.close()
        second.close()
    assert [name for _, name in object_commit.committed(root)] == ["ck2"]
    assert bucket.keys("ranks/.pending/") == []
    assert bucket.keys("ranks/ck/") == []  # the failed attempt's objects
    assert_same_tree(state(13), pyshmckpt.load(url, rank=0))
    assert_same_tree(state(14), pyshmckpt.load(url, rank=1))
