"""Sharded training state (FSDP2, DTensors) across real ranks: staged by ShmStager, saved through
DCP and through the Checkpointer, loaded back on other numbers of ranks (resharding).

Each test launches `sharded_worker.py` on several processes with real torch.distributed (gloo)
under torchrun, bounded by a timeout; the checks run in the ranks and fail their exit status.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyshmckpt import cli
from pyshmckpt.storage import commit

import helpers
from helpers import child_env, free_port

WORKER = Path(__file__).with_name("sharded_worker.py")
RUN_TIMEOUT = 240  # seconds one launch may take (well under a minute here)
BARRIER_TIMEOUT = 5  # what the `die` ranks give a missing rank, in sharded_worker.py

pytestmark = pytest.mark.slow


def torchrun(nproc: int, *args: str) -> None:
    helpers.torchrun(WORKER, nproc, *args, timeout=RUN_TIMEOUT)


def plain_run(*args: str) -> None:
    helpers.run_plain(WORKER, *args, timeout=RUN_TIMEOUT)


def launch(nproc: int, *args: str) -> list[int]:
    """Start the ranks as separate processes (not torchrun, which would stop the others when
    one dies); returns their exit codes."""
    env = child_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    ranks = []
    with contextlib.ExitStack() as logs:
        for r in range(nproc):
            log = logs.enter_context((Path(args[-1]) / f"rank{r}.log").open("w"))
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), *args],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
        codes = []
        try:
            for process in ranks:
                process.wait(timeout=RUN_TIMEOUT)
                codes.append(process.returncode)
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    return codes


def test_fsdp2_saved_on_4_ranks_loads_on_2_4_and_8_and_unsharded(tmp_path: Path) -> None:
    # One test, as the loads need what the save wrote (and each launch costs seconds).
    torchrun(4, "save", str(tmp_path))  # and loads on the same 4 ranks
    for nproc in (2, 8):
        torchrun(nproc, "load", str(tmp_path))
    plain_run("plain", str(tmp_path))
    # The Checkpointer's sharded checkpoint verifies, rank by rank.
    assert cli.main(["verify", str(tmp_path / "ours" / "step3")]) == 0


def test_2d_mesh_replicate_and_uneven_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torchrun(4, "mesh2d", str(tmp_path))
    path = tmp_path / "mesh2d" / "ck"
    capsys.readouterr()
    assert cli.main(["inspect", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "a  float32 global (7, 5)  mesh (2, 2) [Shard(0), Shard(1)]" in shown
    assert "    rank 3: [4:7, 3:5]  24 bytes" in shown
    assert "b  float64 global (6, 9)  mesh (2, 2) [Replicate(), Shard(1)]" in shown
    assert "plain  float32 (3,)  plain, on every rank" in shown
    assert cli.main(["verify", str(path)]) == 0
    (path / "rank2.safetensors").unlink()
    capsys.readouterr()
    assert cli.main(["verify", str(path)]) == 1
    assert "rank 2's data file is missing" in capsys.readouterr().err


def test_a_dead_rank_fails_every_save_within_the_barrier_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    codes = launch(3, "die", str(tmp_path))
    assert codes == [0, -9, 0]
    for rank in (0, 2):
        report = json.loads((tmp_path / f"die-rank{rank}.json").read_text())
        # Rank 0 gave up waiting for rank 1; the others learned it from rank 0's tombstone.
        assert "ranks [1]" in report["message"], report
        # The barrier timeout plus the time the writers take to notice and write a tombstone.
        assert report["seconds"] < BARRIER_TIMEOUT + 30, report
    root = tmp_path / "die"
    assert commit.committed(root) == []
    assert commit.latest(root) is None
    assert not (root / "ck").exists()
    assert time.monotonic() - started < RUN_TIMEOUT
    # A fresh launch (a restarted job) saves into the same root.
    torchrun(3, "again", str(tmp_path))
    assert [name for _, name in commit.committed(root)] == ["ck2"]
    assert sorted(p.name for p in (root / "ck2").iterdir()) == sorted(
        ["commit.json"] + [f"rank{r}.{ext}" for r in range(3) for ext in ("json", "safetensors")]
    )
