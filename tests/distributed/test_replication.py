"""Replication across nodes with real parts: two simulated nodes (tests/simnodes.py: each a
network namespace with its own address on a bridge and its own /dev/shm), two ranks each, under
``torchrun --max-restarts 1`` with the c10d rendezvous on node 0's address, training FSDP2 with
AdamW (`replication_worker.py`).

A memory-only save at step 4 is replicated to each rank's buddy on the other node; node 1 is then
lost whole (its agent, trainers and writers killed, its /dev/shm gone) and started again empty.
Every rank resumes from step 4, which exists nowhere on disk: node 0's ranks from their own
memory, node 1's from their replicas on node 0; the next step is bitwise equal to an
uninterrupted run, and nothing of ours is left in either node's /dev/shm when the job ends.
With a byte of one replica flipped before node 1 comes back, that rank's copy fails its checksums
and every rank restores step 2 from disk, warned of the rank and why; with both nodes lost at
once, every rank restores step 2 from disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
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


def freed(nodes: list[Node]) -> None:
    wait_until(
        lambda: not any(ours(n) for n in nodes), 30,
        "every writer to free its memory once the job ended",
    )  # fmt: skip


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with simulated_nodes(2, shm_size="512m") as made:
        yield made


@pytest.fixture(scope="module")
def straight(nodes: list[Node], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run's final local shards: OUT/straight-rank<R>.pt."""
    out = tmp_path_factory.mktemp("straight")
    with (out / "straight.log").open("w") as log:
        finish([torchrun(n, nodes, out / "root", out, "straight", log) for n in nodes], out)
    freed(nodes)
    return out


def lose(nodes: list[Node], tmp_path: Path, mode: str, between: Callable[[], None]) -> Path:
    """Run `mode` until every rank's memory-only save returned, call `between` (the loss), and
    let the job resume to its end; returns OUT."""
    out, root = tmp_path / "out", tmp_path / "root"
    out.mkdir()
    with (out / f"{mode}.log").open("w") as log, (out / f"{mode}-again.log").open("w") as again:
        first = [torchrun(n, nodes, root, out, mode, log) for n in nodes]
        wait_until(
            lambda: all((out / f"saved-rank{r}.json").exists() for r in range(4))
            or any(p.poll() is not None for p in first),
            RUN_TIMEOUT, "every rank's memory-only save of step 4",
        )  # fmt: skip
        assert all((out / f"saved-rank{r}.json").exists() for r in range(4)), logs(out)
        replicas = [n for n in ours(nodes[0]) if "-replica-" in n]
        assert len(replicas) == 2, ours(nodes[0])  # node 1's two ranks, held on node 0
        survivors = between()
        rejoined = [torchrun(n, nodes, root, out, mode, again) for n in survivors]
        finish([first[0], *rejoined] if len(rejoined) == 1 else rejoined, out)
    freed(nodes)
    assert not (root / "step4").exists()
    return out


def resumed(out: Path, mode: str) -> list[dict]:
    attempts = [json.loads(p.read_text()) for p in out.glob(f"{mode}-attempt-rank*.json")]
    found = [a for a in attempts if "resumed_from" in a]
    assert len(found) == 4, (attempts, logs(out))
    for attempt in found:
        assert "step4" not in attempt["on_disk"], attempt
        assert attempt["committed"] == ["step2"], attempt
    return found


def same_as_straight(out: Path, mode: str, straight: Path) -> None:
    for rank in range(4):
        expected = torch.load(straight / f"straight-rank{rank}.pt", weights_only=False)
        got = torch.load(out / f"{mode}-rank{rank}.pt", weights_only=False)
        same(got, expected, f"rank {rank}")


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_lost_node_resumes_from_its_replicas_on_the_other_node(nodes, straight, tmp_path):
    listed: dict = {}

    def replace_node_1() -> list[Node]:
        shown = nodes[0].run(
            [sys.executable, "-m", "pyshmckpt", "inspect", str(tmp_path / "root")],
            timeout=RUN_TIMEOUT, env=child_env(), cwd=tmp_path,  # not a checkout's pyshmckpt
        )  # fmt: skip
        listed["inspect"] = shown.stdout + shown.stderr
        nodes[1].fail()  # its processes killed, its /dev/shm gone with them
        nodes[1].up()  # a replacement: same address, empty memory
        assert not ours(nodes[1])
        return [nodes[1]]

    out = lose(nodes, tmp_path, "lose", replace_node_1)
    lines = listed["inspect"].splitlines()
    for rank in (2, 3):  # node 1's ranks' copies, held on node 0 while their trainers run
        assert any(
            line.startswith("replica") and f"step4  rank {rank} " in line for line in lines
        ), listed["inspect"]
    found = resumed(out, "lose")
    assert [a["resumed_from"] for a in found] == [4] * 4, found
    assert {a["node"] for a in found} == {0, 1}
    assert not any(a["warnings"] for a in found), found
    same_as_straight(out, "lose", straight)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_corrupt_replica_makes_every_rank_restore_from_disk(nodes, straight, tmp_path):
    flipped: dict = {}

    def corrupt_a_replica_and_replace_node_1() -> list[Node]:
        nodes[1].fail()
        nodes[1].up()
        name = next(n for n in ours(nodes[0]) if "-replica-" in n)
        record = json.loads((nodes[0].shm_dir / name).read_text())
        flipped["rank"] = record["rank"]
        segment = nodes[0].shm_dir / record["segment"]["name"]
        with segment.open("r+b") as f:
            f.seek(int(record["segment"]["offset"]) + 64)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
        return [nodes[1]]

    out = lose(nodes, tmp_path, "corrupt", corrupt_a_replica_and_replace_node_1)
    found = resumed(out, "corrupt")
    assert [a["resumed_from"] for a in found] == [2] * 4, found
    for attempt in found:  # every rank is told which rank lacks step4, and why
        assert any(f"rank {flipped['rank']}" in w and "step4" in w for w in attempt["warnings"]), (
            attempt
        )
    assert any("checksum mismatch" in w for a in found for w in a["warnings"]), found
    same_as_straight(out, "corrupt", straight)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_both_nodes_lost_at_once_restore_from_disk(nodes, straight, tmp_path):
    def lose_both() -> list[Node]:
        for node in nodes:
            node.fail()
        for node in nodes:
            node.up()
        return nodes

    out = lose(nodes, tmp_path, "both", lose_both)
    found = resumed(out, "both")
    assert [a["resumed_from"] for a in found] == [2] * 4, found
    same_as_straight(out, "both", straight)


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
