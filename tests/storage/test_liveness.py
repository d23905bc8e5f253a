"""Heartbeats on a shared root (`storage/liveness.py`): names no one without the run's secret can
predict, never written or read through a link or another user's file, with the mode setting."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from pyshmckpt.storage import liveness

NOBODY = 65534
ROOT = os.geteuid() == 0


def test_a_heartbeats_name_reveals_neither_the_run_nor_the_rank(tmp_path):
    path = liveness.beat_path(tmp_path, "run1", 1)
    assert path.parent == tmp_path
    assert path.name.startswith(liveness.PREFIX)
    assert "run1" not in path.name
    assert "rank" not in path.name
    others = {
        liveness.beat_path(tmp_path, run, rank) for run in ("run1", "run2") for rank in (0, 1)
    }
    assert len(others) == 4


@pytest.mark.skipif(not ROOT, reason="needs root, to give entries to another user")
@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_heartbeat_never_writes_through_another_users_entry(tmp_path, caplog, planted):
    caplog.set_level(logging.WARNING, logger=liveness.__name__)
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = liveness.beat_path(root, "run1", 1)
    if planted == "link":
        path.symlink_to(victim)
    else:
        path.write_text("theirs")
        path.chmod(0o666)
    os.lchown(path, NOBODY, NOBODY)
    heartbeat = liveness.Heartbeat(path)
    try:
        watch = liveness.Watch(root, "run1", timeout=0.0)
        assert watch.gone([1]) == [1]  # what is there is not its heartbeat
        assert "not ours to use" in watch.describe(1)
    finally:
        heartbeat.stop()
    assert victim.read_text() == "precious"
    if planted == "file":
        assert path.read_text() == "theirs"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert str(path) in warned[0], warned


def test_a_heartbeat_takes_the_mode_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("PYSHMCKPT_FILE_MODE", "640")
    path = liveness.beat_path(tmp_path, "run1", 0)
    heartbeat = liveness.Heartbeat(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        assert liveness.Watch(tmp_path, "run1").gone([0]) == []
    finally:
        heartbeat.stop(remove=True)
    assert not path.exists()
