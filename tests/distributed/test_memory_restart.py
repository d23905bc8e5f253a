"""Restarts under torchrun resume from a checkpoint held only in memory, or from disk past a
corrupt one.

Two ranks train under ``torchrun --max-restarts 2`` (`memory_restart_worker.py`): step 2 is
saved to disk, step 4 in shared memory only; then rank 1 is SIGKILLed (rank 0 dies of the failed
collective, or of the agent's SIGTERM). The writers keep step 4 in /dev/shm, the agent restarts
the ranks, and they restore step 4 from memory (it is on no disk), train one more step and end
bitwise where an uninterrupted run ends (the state each rank recorded after that step before the
kill). They save step 5 in memory only and rank 1 is killed again; restarted, rank 1 flips a
byte of its held copy first: it finds it as it loads, and both ranks restore step 2 from disk,
warned of rank 1 and why, and again end where an uninterrupted run ends. The last ranks end
without closing after a memory-only save: once torchrun exits, no segment or hold record of the
job is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import SHM, child_env, free_port, same_bytes

WORKER = Path(__file__).with_name("memory_restart_worker.py")
RUN_TIMEOUT = 240  # seconds one torchrun launch may take (20 to 60 on two busy cores)
SHM_DRAIN_TIMEOUT = 15  # seconds the writers may take to end once torchrun has exited

pytestmark = pytest.mark.slow


def torchrun(tmp_path: Path, prefix: str) -> tuple[Path, Path, str]:
    """Run the worker on 2 ranks (root and reports under tmp_path); returns the root, the
    reports folder and torchrun's output. Fails the test on a non-zero exit."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "2", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "memory-restart",
        str(WORKER), str(root), str(out),
    ]  # fmt: skip
    env = child_env()
    # A prefix of this test's under the session's (the leak check covers it too); a bounded hold
    # in case the end of the agent went unnoticed (the test fails first).
    env.update(PYSHMCKPT_SEGMENT_PREFIX=prefix, PYSHMCKPT_HOLD_TIMEOUT="120")
    # The restarted ranks must not read the first attempt's gloo addresses from the agent's
    # shared store (pytorch/pytorch#135712: refused connections or a hang in init).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    log = tmp_path / "torchrun.log"
    with log.open("w") as f:
        process = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=RUN_TIMEOUT)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # the agent stops its workers first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=30)
                process.kill()
                process.wait()
    output = log.read_text()
    assert code == 0, f"torchrun exited with {code}:\n{output[-6000:]}"
    return root, out, output


def ours(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefix + "-"))


def assert_drains(prefix: str, output: str) -> float:
    """Wait until nothing of `prefix` is left in /dev/shm; returns the seconds it took."""
    started = time.monotonic()
    while ours(prefix):
        if time.monotonic() - started > SHM_DRAIN_TIMEOUT:
            pytest.fail(
                f"{ours(prefix)} still in /dev/shm {SHM_DRAIN_TIMEOUT} s after torchrun exited:"
                f"\n{output[-3000:]}"
            )
        time.sleep(0.05)
    return time.monotonic() - started


def reports(out: Path, attempt: int) -> dict[int, dict]:
    return {r: json.loads((out / f"attempt{attempt}-rank{r}.json").read_text()) for r in (0, 1)}


def flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {
            k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()
        }
    if isinstance(tree, (list, tuple)):
        return {
            k: v for i, value in enumerate(tree) for k, v in flat(value, f"{prefix}{i}.").items()
        }
    return {prefix: tree}


def ends_as_uninterrupted(out: Path, attempt: int) -> None:
    """Each rank's state after the last step equals the one it recorded before the first kill."""
    for rank in (0, 1):
        expected, got = (
            flat(torch.load(out / f"expected-rank{rank}.pt", weights_only=True)),
            flat(torch.load(out / f"attempt{attempt}-rank{rank}.pt", weights_only=True)),
        )
        assert list(got) == list(expected)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert isinstance(got[key], torch.Tensor), (rank, key)
                assert same_bytes(got[key], value), f"rank {rank}: {key} differs"
            else:
                assert got[key] == value, (rank, key)


@pytest.mark.timeout(RUN_TIMEOUT + 2 * SHM_DRAIN_TIMEOUT)
def test_restarts_resume_from_memory_bitwise_or_past_a_corrupt_copy_from_disk_leaving_nothing(
    tmp_path,
):
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-restart"
    root, out, output = torchrun(tmp_path, prefix)
    drained = assert_drains(prefix, output)

    first = reports(out, 0)
    assert all("resumed_from" not in r and not r["held"] for r in first.values()), first
    steps = first[0]["steps"]  # the steps saved to disk, to memory only, and the last one
    disk, memory, final = (f"step{steps[k]}" for k in ("disk", "memory", "final"))
    for rank, r in reports(out, 1).items():
        assert r["held"], f"rank {rank}: no checkpoint held in memory at the restart: {r}"
        assert r["resumed_from"] == steps["memory"], (rank, r, output[-3000:])
        # Restored from memory: that step was never written to disk, the older one was.
        assert r["committed"] == [disk], r
        assert memory not in r["on_disk"], r
    ends_as_uninterrupted(out, 1)

    again = reports(out, 2)
    for rank, r in again.items():
        assert r["held"], (rank, r)
        assert r["resumed_from"] == steps["disk"], (rank, r, output[-3000:])
        # Every rank is told that rank 1's copy of the newer step is why.
        assert any("rank 1" in w and final in w for w in r["warnings"]), (rank, r)
    assert any("checksum mismatch" in w for w in again[1]["warnings"]), again[1]
    ends_as_uninterrupted(out, 2)
    assert not (root / memory).exists()
    assert not (root / final).exists()
    assert drained < SHM_DRAIN_TIMEOUT
