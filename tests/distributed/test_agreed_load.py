"""Ranks that load a root together fail together, at once, each with a typed error: the rank that
could not load the agreed checkpoint raises its own error, the others a `RestoreError` naming it,
not a wait for the restore timeout. On a job's first start every rank finds nothing alike.

Two ranks under ``torchrun`` (gloo) save one checkpoint together, then load it with ``into=``;
rank 1's target has another shape. A script as users write it: no ``__main__`` guard.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from helpers import child_env, free_port

RUN_TIMEOUT = 180  # seconds the torchrun launch may take
RESTORE_TIMEOUT = 120  # what the ranks would wait for a rank that never joins

RANK = textwrap.dedent(
    """
    import json, os, sys, time

    import torch
    import torch.distributed as dist

    import pyshmckpt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, out = sys.argv[1], sys.argv[2]
    with pyshmckpt.Checkpointer(root) as ck:
        ck.save({"w": torch.full((4,), float(rank)), "step": 3}, name="s3").result(timeout=60)
    shape = (4,) if rank == 0 else (5,)  # rank 1's model is not the one that was saved
    started = time.monotonic()
    try:
        pyshmckpt.load(root, into={"w": torch.zeros(shape), "step": 0})
        outcome = "loaded"
    except pyshmckpt.PyshmckptError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - started}, f)
    dist.destroy_process_group()
    """
)


def two_ranks(code: str, tmp_path: Path, env: dict[str, str]) -> list[Any]:
    """Run `code` on two ranks under torchrun (arguments: the root, the output folder); what
    each rank wrote to ``rank<r>.json``."""
    script, root, out = tmp_path / "rank.py", tmp_path / "root", tmp_path / "out"
    script.write_text(code)
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(script), str(root), str(out)],
        capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_rank_that_cannot_load_fails_every_rank_at_once(tmp_path):
    env = child_env() | {"PYSHMCKPT_RESTORE_TIMEOUT": str(RESTORE_TIMEOUT)}
    ranks = two_ranks(RANK, tmp_path, env)
    assert ranks[1]["outcome"].startswith("CheckpointMismatchError: "), ranks
    assert ranks[0]["outcome"].startswith("RestoreError: rank 1 cannot restore "), ranks
    assert "CheckpointMismatchError" in ranks[0]["outcome"], ranks
    assert all(r["seconds"] < RESTORE_TIMEOUT / 4 for r in ranks), ranks


FIRST_START = textwrap.dedent(
    """
    import json, os, sys

    import torch
    import torch.distributed as dist

    import pyshmckpt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, out = sys.argv[1], sys.argv[2]
    seen = []
    with pyshmckpt.Checkpointer(root) as ck:
        seen.append(repr(ck.load(missing_ok=True)))
        try:
            ck.load()
        except pyshmckpt.CheckpointNotFoundError as exc:
            seen.append(type(exc).__name__)
        ck.save({"w": torch.full((4,), float(rank)), "step": 3}, name="s3").result(timeout=60)
        state = ck.load(missing_ok=True)
        seen.append([state["step"], state["w"].tolist()])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_every_rank_finds_nothing_on_a_first_start_then_its_own_save(tmp_path):
    for r, seen in enumerate(two_ranks(FIRST_START, tmp_path, child_env())):
        assert seen == ["None", "CheckpointNotFoundError", [3, [float(r)] * 4]], (r, seen)
