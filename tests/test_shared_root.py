"""Ranks that commit together in a root other users may write (a sticky, world-writable scratch
directory), with another user (``setpriv``, as nobody) planting links at every name of theirs
that used to be predictable, and taking a name of theirs first: none of our writes lands where
those entries point, and a save succeeds, or fails on every rank with a typed error naming the
entry in the way.

The ranks are Checkpointers in this process (rank=, world_size=) with their writer processes, as
in test_multirank.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pyshmckpt
from pyshmckpt.storage import liveness, shared_commit

from helpers import SAVE_TIMEOUT, failure_of, opened

NOBODY = 65534


def as_nobody(*command: str) -> None:
    subprocess.run(
        ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", *command],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory others can enter, holding the shared root (mode 1777) and what only we may
    write: ``victim/`` and ``victim.txt``."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to act as another user")
    base = Path(tempfile.mkdtemp(prefix="pyshmckpt-scratch-"))  # tmp_path's parents are 0700
    try:
        base.chmod(0o755)
        (base / "root").mkdir()
        (base / "root").chmod(0o1777)
        (base / "victim").mkdir()
        (base / "victim.txt").write_text("precious")
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def rank_state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(rank * 100 + step)), "rank": rank, "step": step}


def save_everywhere(cks: list[pyshmckpt.Checkpointer], name: str, step: int) -> list[Any]:
    return [ck.save(rank_state(r, step), name=name) for r, ck in enumerate(cks)]


@pytest.mark.timeout(180)
def test_another_user_in_a_shared_root_redirects_none_of_our_writes(scratch):
    root, victim, victim_file = scratch / "root", scratch / "victim", scratch / "victim.txt"
    run = "r" + secrets.token_hex(8)
    with contextlib.ExitStack() as stack:
        zero = stack.enter_context(opened(root, rank=0, world_size=2, run_id=run))
        # Planted once rank 0 cleaned the root up, before rank 1 beats: the names the run id and
        # the save's number gave the first save's temporary, tombstone and rank 1's heartbeat.
        as_nobody("ln", "-s", str(victim), str(root / f".tmp-c-{run}.1"))
        as_nobody("ln", "-s", str(victim_file), str(root / f".failed-c-{run}.1.rank1"))
        as_nobody("ln", "-s", str(victim_file), str(root / f".alive-{run}.rank1"))
        one = stack.enter_context(opened(root, rank=1, world_size=2, run_id=run))
        cks = [zero, one]

        futures = save_everywhere(cks, "c", 1)
        assert {f.result(timeout=SAVE_TIMEOUT) for f in futures} == {root / "c"}
        assert list(victim.iterdir()) == []
        assert victim_file.read_text() == "precious"
        assert (root / "c").is_dir()
        assert not (root / "c").is_symlink()
        for r in range(2):
            assert pyshmckpt.load(root / "c", rank=r)["rank"] == r
        # Nothing on the root shows the run id, the secret the names derive from.
        ours = [p for p in root.iterdir() if p.lstat().st_uid != NOBODY]
        assert {p.name for p in ours if p.name.startswith(liveness.PREFIX)} == {
            liveness.beat_path(root, run, r).name for r in range(2)
        }
        assert not [p.name for p in ours if run in p.name]
        assert run not in (root / "c" / "commit.json").read_text()
        assert json.loads((root / "c" / "commit.json").read_text())["attempt"].endswith(".1")

        # The next save's temporary taken first (as if the secret had leaked): it fails on every
        # rank with an error naming it, and nothing is written into it.
        taken = shared_commit.SharedCommit(root / "d", 0, 2, f"{run}.2", 0.0, False).temp
        as_nobody("mkdir", "-m", "777", str(taken))
        for exc in [failure_of(f) for f in save_everywhere(cks, "d", 2)]:
            assert isinstance(exc, pyshmckpt.PyshmckptError), repr(exc)
            assert str(taken) in str(exc), exc
        assert list(taken.iterdir()) == []

        # The ranks go on: the next save commits, and removes the failed attempt's tombstone.
        futures = save_everywhere(cks, "e", 3)
        assert {f.result(timeout=SAVE_TIMEOUT) for f in futures} == {root / "e"}
        left = {
            p.name
            for p in root.iterdir()
            if p.name.startswith(".") and not p.name.startswith(liveness.PREFIX)
        }
        assert {n for n in left if (root / n).lstat().st_uid != NOBODY} == set(), left
    assert list(victim.iterdir()) == []
    assert victim_file.read_text() == "precious"
