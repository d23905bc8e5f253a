"""A restart under torchrun resumes from a checkpoint held only in memory.

Two ranks train under ``torchrun --max-restarts 1`` (`memory_restart_worker.py`): step 2 is saved
to disk, step 4 in shared memory only; then rank 1 is SIGKILLed (rank 0 dies of the failed
collective, or of the agent's SIGTERM). The writers keep step 4 in /dev/shm, the agent restarts
the ranks, and they restore step 4 from memory (it is on no disk), train one more step and end
bitwise where an uninterrupted run ends (the state each rank recorded after that step before the
kill). The restarted ranks end without
closing after a memory-only save: once torchrun exits, no segment or hold record of the job is
left in /dev/shm.
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


def torchrun(tmp_path: Path, mode: str, prefix: str) -> tuple[Path, Path, str]:
    """Run the worker on 2 ranks in `mode` (root and reports under tmp_path); returns the root,
    the reports folder and torchrun's output. Fails the test on a non-zero exit."""
    root, out = tmp_path / f"{mode}-root", tmp_path / f"{mode}-out"
    out.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"memory-{mode}",
        str(WORKER), str(root), str(out), mode,
    ]  # fmt: skip
    env = child_env()
    # A prefix of this test's under the session's (the leak check covers it too); a bounded hold
    # in case the end of the agent went unnoticed (the test fails first).
    env.update(PYSHMCKPT_SEGMENT_PREFIX=prefix, PYSHMCKPT_HOLD_TIMEOUT="120")
    # The restarted ranks must not read the first attempt's gloo addresses from the agent's
    # shared store (pytorch/pytorch#135712: refused connections or a hang in init).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    log = tmp_path / f"{mode}.log"
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
    assert code == 0, f"torchrun {mode} exited with {code}:\n{output[-6000:]}"
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


def reports(out: Path, mode: str, attempt: int) -> dict[int, dict]:
    return {
        r: json.loads((out / f"{mode}-attempt{attempt}-rank{r}.json").read_text()) for r in (0, 1)
    }


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


def ends_as_uninterrupted(out: Path, mode: str) -> None:
    """Each rank's state after the last step equals the one it recorded before the kill."""
    for rank in (0, 1):
        expected, got = (
            flat(torch.load(out / f"{mode}-expected-rank{rank}.pt", weights_only=True)),
            flat(torch.load(out / f"{mode}-rank{rank}.pt", weights_only=True)),
        )
        assert list(got) == list(expected)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert isinstance(got[key], torch.Tensor), (rank, key)
                assert same_bytes(got[key], value), f"rank {rank}: {key} differs"
            else:
                assert got[key] == value, (rank, key)


@pytest.mark.timeout(RUN_TIMEOUT + 2 * SHM_DRAIN_TIMEOUT)
def test_a_restart_resumes_from_memory_bitwise_and_the_job_leaves_no_segment(tmp_path):
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-restart"
    root, out, output = torchrun(tmp_path, "kill", prefix)
    drained = assert_drains(prefix, output)

    first = reports(out, "kill", 0)
    assert all("resumed_from" not in r and not r["held"] for r in first.values()), first
    steps = first[0]["steps"]  # the steps saved to disk, to memory only, and the last one
    disk, memory, final = (f"step{steps[k]}" for k in ("disk", "memory", "final"))
    resumed = reports(out, "kill", 1)
    for rank, r in resumed.items():
        assert r["held"], f"rank {rank}: no checkpoint held in memory at the restart: {r}"
        assert r["resumed_from"] == steps["memory"], (rank, r, output[-3000:])
        # Restored from memory: that step was never written to disk, the older one was.
        assert r["committed"] == [disk], r
        assert memory not in r["on_disk"], r
    assert not (root / memory).exists()
    assert not (root / final).exists()

    ends_as_uninterrupted(out, "kill")
    assert drained < SHM_DRAIN_TIMEOUT


@pytest.mark.timeout(RUN_TIMEOUT + 2 * SHM_DRAIN_TIMEOUT)
def test_a_memory_copy_that_fails_as_it_loads_makes_every_rank_restore_from_disk(tmp_path):
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-corrupt"
    root, out, output = torchrun(tmp_path, "corrupt", prefix)
    assert_drains(prefix, output)
    resumed = reports(out, "corrupt", 1)
    steps = resumed[0]["steps"]
    for rank, r in resumed.items():
        assert r["held"], (rank, r)
        assert r["resumed_from"] == steps["disk"], (rank, r, output[-3000:])
        # Every rank is told that rank 1's copy of the newer step is why.
        assert any("rank 1" in w and f"step{steps['memory']}" in w for w in r["warnings"]), (
            rank,
            r,
        )
    assert any("checksum mismatch" in w for w in resumed[1]["warnings"]), resumed[1]
    assert not (root / f"step{steps['memory']}").exists()
    ends_as_uninterrupted(out, "corrupt")
