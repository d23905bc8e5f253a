"""Replication across nodes with real parts: two simulated nodes (tests/simnodes.py: each a
network namespace with its own address on a bridge and its own /dev/shm), two ranks each, under
``torchrun --max-restarts 1`` with the c10d rendezvous on node 0's address, training FSDP2 with
AdamW (`replication_worker.py`).

A memory-only save at step 4 is replicated to each rank's buddy on the other node; node 1 is then
lost whole (its agent, trainers and writers killed, its /dev/shm gone) and started again empty.
Every rank resumes from step 4, which exists nowhere on disk: node 0's ranks from their own
memory, node 1's from their replicas on node 0; the next step is bitwise equal to an
uninterrupted run, and nothing of ours is left in either node's /dev/shm when the job ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest
import torch
from simnodes import Node, simulated_nodes, unavailable

from helpers import child_env, wait_until

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("replication_worker.py")
RENDEZVOUS_PORT = 29400  # ports are per simulated node: any is free
RUN_TIMEOUT = 300  # seconds a launch may take (tens on an idle machine)


def torchrun(node: Node, nodes: list[Node], root: Path, out: Path, mode: str, log: IO[str]):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{nodes[0].address}:{RENDEZVOUS_PORT}", "--rdzv-id", f"repl-{mode}",
        str(WORKER), str(root), str(out), mode,
    ]  # fmt: skip
    env = child_env() | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return node.start(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def ours(node: Node) -> list[str]:
    prefix = os.environ.get("PYSHMCKPT_SEGMENT_PREFIX", "pyshmckpt")
    return [name for name in node.shm_files() if name.startswith(prefix)]


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(out.glob("*.log")))


def finish(processes: list[subprocess.Popen], out: Path) -> None:
    for process in processes:
        try:
            code = process.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a launch ran past {RUN_TIMEOUT} s\n{logs(out)}")
        assert code == 0, logs(out)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_lost_node_resumes_from_its_replicas_on_the_other_node(tmp_path):
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "out"
    out.mkdir()
    with simulated_nodes(2, shm_size="512m") as nodes:
        with (out / "straight.log").open("w") as log:
            straight = [
                torchrun(n, nodes, tmp_path / "straight", out, "straight", log) for n in nodes
            ]
            finish(straight, out)
        wait_until(
            lambda: not ours(nodes[0]) and not ours(nodes[1]), 30, "the straight job's memory freed"
        )

        root = tmp_path / "root"
        with (out / "lose.log").open("w") as log, (out / "lose-again.log").open("w") as again:
            first = [torchrun(n, nodes, root, out, "lose", log) for n in nodes]
            wait_until(
                lambda: all((out / f"saved-rank{r}.json").exists() for r in range(4))
                or any(p.poll() is not None for p in first),
                RUN_TIMEOUT, "every rank's memory-only save of step 4",
            )  # fmt: skip
            assert all((out / f"saved-rank{r}.json").exists() for r in range(4)), logs(out)
            replicas = [n for n in ours(nodes[0]) if "-replica-" in n]
            assert len(replicas) == 2, ours(nodes[0])  # node 1's two ranks, held on node 0
            nodes[1].fail()  # its processes killed, its /dev/shm gone with them
            nodes[1].up()  # a replacement: same address, empty memory
            assert not ours(nodes[1])
            rejoined = torchrun(nodes[1], nodes, root, out, "lose", again)
            finish([first[0], rejoined], out)
        wait_until(
            lambda: not ours(nodes[0]) and not ours(nodes[1]), 30,
            "every writer to free its memory once the job ended",
        )  # fmt: skip

    attempts = [json.loads(p.read_text()) for p in out.glob("lose-attempt-rank*.json")]
    resumed = [a for a in attempts if "resumed_from" in a]
    assert len(resumed) == 4, (attempts, logs(out))
    for attempt in resumed:
        assert attempt["resumed_from"] == 4, attempt
        assert "step4" not in attempt["on_disk"], attempt
        assert attempt["committed"] == ["step2"], attempt
    assert {a["node"] for a in resumed} == {0, 1}
    assert not (root / "step4").exists()
    for rank in range(4):
        expected = torch.load(out / f"straight-rank{rank}.pt", weights_only=False)
        got = torch.load(out / f"lose-rank{rank}.pt", weights_only=False)
        same(got, expected, f"rank {rank}")


def same(got: object, expected: object, where: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(got, dict), where
        assert got.keys() == expected.keys(), where
        for key in expected:
            same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)), where
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            same(g, e, f"{where}.{i}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == expected.dtype, where
        assert torch.equal(got, expected), f"{where} differs"
    else:
        assert got == expected, where
