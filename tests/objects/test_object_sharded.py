"""Sharded state (FSDP2) saved by 4 ranks under torchrun to object storage, each rank uploading
its shards and rank 0 committing once every rank's objects are up; loaded back on 2 ranks (each
reading only the entries that hold its shards) and without torch.distributed (resharding), and
verified rank by rank from the bucket. The ranks run `sharded_worker.py` with OURS_URL naming
the root."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyshmckpt import cli
from pyshmckpt.storage import object_commit, object_store

from helpers import run_plain, torchrun
from s3servers import FaultProxy, point_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = Path(__file__).parent.parent / "distributed" / "sharded_worker.py"


def test_fsdp2_saved_by_4_ranks_reshards_from_object_storage(bucket, tmp_path, monkeypatch):
    url = bucket.url("sharded")
    monkeypatch.setenv("OURS_URL", url)
    torchrun(WORKER, 4, "save", str(tmp_path))  # and loads on the same 4 ranks
    record = object_commit.record_of(object_store.parse(url) / "step3")
    assert record is not None
    assert record["world_size"] == 4
    assert sorted(record["objects"]) == sorted(
        f"rank{r}.{ext}" for r in range(4) for ext in ("json", "safetensors")
    )
    assert bucket.keys("sharded/.pending/") == []  # the ranks' markers are gone once committed
    data = sum(o["size"] for name, o in record["objects"].items() if name.endswith(".safetensors"))
    proxy = FaultProxy(bucket.server.endpoint)  # counts the bytes the loads read
    try:
        point_at(monkeypatch, proxy.endpoint)
        torchrun(WORKER, 2, "load", str(tmp_path))
        # Each of the 2 ranks read the headers, and the entries holding its shards of what its
        # target holds: each rank reading every rank's objects would be twice the data. (The
        # headers are a large part of so small a checkpoint: 8 of 19 KiB.)
        assert 0 < proxy.read_bytes < data * 1.5, (proxy.read_bytes, data)
        proxy.read_bytes = 0
        run_plain(WORKER, "plain", str(tmp_path))  # the model alone, unsharded
        assert 0 < proxy.read_bytes < data * 0.6, (proxy.read_bytes, data)
        assert cli.main(["verify", f"{url}/step3"]) == 0
    finally:
        proxy.close()
