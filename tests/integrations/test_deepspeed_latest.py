"""The writer processes' publication of DeepSpeed's ``latest`` (`TagWriter.seal` as rank 0's writer
runs it), here in this process: rank 0 waits for ranks that are alive, and not for a rank whose
heartbeat stopped. DeepSpeed itself is not needed."""

from __future__ import annotations

import threading
import time

import pytest

from pyshmckpt.integrations.deepspeed_latest import LATEST, TagWriter, marker, write_marker
from pyshmckpt.storage import TorchFileWriter, liveness
from pyshmckpt.transport import RankInfo

HEARTBEAT_TIMEOUT = 1.0


@pytest.fixture
def rank0(tmp_path, monkeypatch):
    monkeypatch.setenv("PYSHMCKPT_HEARTBEAT_TIMEOUT", str(HEARTBEAT_TIMEOUT))
    (tmp_path / "tag1").mkdir()
    return TagWriter(RankInfo(0, 2), writer=TorchFileWriter, run="run1", commit_timeout=600.0)


@pytest.mark.timeout(60)
def test_rank_zero_does_not_wait_for_a_rank_that_is_gone(tmp_path, rank0):
    started = time.monotonic()
    assert rank0.seal(str(tmp_path), "tag1", []) is False  # rank 1 never beats, never seals
    took = time.monotonic() - started
    assert took < 30, f"rank 0 waited {took:.0f} s, as for the commit timeout"
    assert not (tmp_path / LATEST).exists()


@pytest.mark.timeout(60)
def test_rank_zero_waits_for_a_slow_rank_that_is_alive(tmp_path, rank0):
    heartbeat = liveness.Heartbeat(liveness.beat_path(tmp_path, "run1", 1))
    try:

        def seal_late() -> None:
            time.sleep(4 * HEARTBEAT_TIMEOUT)
            write_marker(marker(str(tmp_path), "tag1", "run1", 1, durable=True))

        late = threading.Thread(target=seal_late)
        late.start()
        assert rank0.seal(str(tmp_path), "tag1", []) is True
        late.join()
    finally:
        heartbeat.stop(remove=True)
    assert (tmp_path / LATEST).read_text() == "tag1"
