"""Replication across nodes with real parts: two simulated nodes (tests/simnodes.py: each a
network namespace with its own address on a bridge and its own /dev/shm), two ranks each, under
``torchrun --max-restarts 1`` with the c10d rendezvous on node 0's address, training FSDP2 with
AdamW (`replication_worker.py`).

A memory-only save at step 4 is replicated to each rank's buddy on the other node; node 1 is then
lost whole (its agent, trainers and writers killed, its /dev/shm gone) and started again empty.
Every rank resumes from step 4, which exists nowhere on disk: node 0's ranks from their own
memory, node 1's from their replicas on node 0; the next step is bitwise equal to an
uninterrupted run (the ranks' own, recorded before the loss). Then both nodes are lost at once
after a memory-only save: the job launched afresh restores step 2 from disk. With a byte of one
replica flipped before node 1 comes back, that rank's copy fails its checksums and every rank
restores step 2 from disk, warned of the rank and why. Nothing of ours is left in either node's
/dev/shm when a job ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
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


def launch(nodes: list[Node], on: list[Node], out: Path, phase: int, log: IO[str]):
    """Start the job's agents on the nodes `on`, in `phase` (the worker reads OUT/phase)."""
    (out / "phase").write_text(str(phase))
    return [torchrun(n, nodes, out.parent / "root", out, out.name, log) for n in on]


def saved(out: Path, stem: str, processes: list[subprocess.Popen]) -> None:
    """Wait until every rank wrote OUT/<stem>-rank<R>.json (fails if the launch ends first)."""
    wait_until(
        lambda: all((out / f"{stem}-rank{r}.json").exists() for r in range(4))
        or any(p.poll() is not None for p in processes),
        RUN_TIMEOUT, f"every rank to say {stem}",
    )  # fmt: skip
    assert all((out / f"{stem}-rank{r}.json").exists() for r in range(4)), logs(out)


def replace(node: Node) -> None:
    node.fail()  # its processes killed, its /dev/shm gone with them
    node.up()  # a replacement: same address, empty memory
    assert not ours(node)


def attempts(out: Path, phase: int) -> list[dict]:
    """The reports of the ranks that resumed in `phase`: one per rank."""
    found = [json.loads(p.read_text()) for p in out.glob(f"{out.name}-attempt-p{phase}-rank*.json")]
    assert len(found) == 4, (found, logs(out))
    for attempt in found:
        assert "step4" not in attempt["on_disk"], attempt
        assert attempt["committed"] == ["step2"], attempt
    return found


def ends_as_uninterrupted(out: Path, phase: int) -> None:
    """Each rank's state after the last step equals the one it recorded before any loss."""
    for rank in range(4):
        expected = torch.load(out / f"expected-rank{rank}.pt", weights_only=False)
        got = torch.load(out / f"{out.name}-p{phase}-rank{rank}.pt", weights_only=False)
        same(got, expected, f"rank {rank} in phase {phase}")


@pytest.mark.timeout(4 * RUN_TIMEOUT)
def test_a_lost_node_resumes_from_replicas_and_two_lost_nodes_from_disk(nodes, tmp_path):
    out = tmp_path / "lose"
    out.mkdir()
    with (out / "lose.log").open("w") as log, (out / "lose-again.log").open("w") as again:
        first = launch(nodes, nodes, out, 1, log)
        saved(out, "saved1", first)
        assert len([n for n in ours(nodes[0]) if "-replica-" in n]) == 2, ours(nodes[0])
        shown = nodes[0].run(
            [sys.executable, "-m", "pyshmckpt", "inspect", str(tmp_path / "root")],
            timeout=RUN_TIMEOUT, env=child_env(), cwd=tmp_path,  # not a checkout's pyshmckpt
        )  # fmt: skip
        for rank in (2, 3):  # node 1's ranks' copies, held on node 0 while their trainers run
            assert any(
                line.startswith("replica") and f"step4  rank {rank} " in line
                for line in shown.stdout.splitlines()
            ), shown.stdout + shown.stderr
        replace(nodes[1])
        rejoined = launch(nodes, [nodes[1]], out, 2, again)
        saved(out, "saved2", [first[0], *rejoined])

        found = attempts(out, 2)
        assert [a["resumed_from"] for a in found] == [4] * 4, found
        assert {a["node"] for a in found} == {0, 1}
        assert not any(a["warnings"] for a in found), found
        ends_as_uninterrupted(out, 2)

        # Both nodes lost after a memory-only save of step 5: only the disk is left.
        for node in nodes:
            node.fail()
        for node in nodes:
            node.up()
        finish(launch(nodes, nodes, out, 3, again), out)
    freed(nodes)
    found = attempts(out, 3)
    assert [a["resumed_from"] for a in found] == [2] * 4, found
    ends_as_uninterrupted(out, 3)
    assert not (tmp_path / "root" / "step4").exists()
    assert not (tmp_path / "root" / "step5").exists()


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_corrupt_replica_makes_every_rank_restore_from_disk(nodes, tmp_path):
    out = tmp_path / "corrupt"
    out.mkdir()
    with (out / "corrupt.log").open("w") as log, (out / "corrupt-again.log").open("w") as again:
        first = launch(nodes, nodes, out, 1, log)
        saved(out, "saved1", first)
        replace(nodes[1])
        name = next(n for n in ours(nodes[0]) if "-replica-" in n)
        record = json.loads((nodes[0].shm_dir / name).read_text())
        segment = nodes[0].shm_dir / record["segment"]["name"]
        with segment.open("r+b") as f:
            f.seek(int(record["segment"]["offset"]) + 64)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
        finish([first[0], *launch(nodes, [nodes[1]], out, 2, again)], out)
    freed(nodes)
    assert not (tmp_path / "root" / "step4").exists()
    found = attempts(out, 2)
    assert [a["resumed_from"] for a in found] == [2] * 4, found
    for attempt in found:  # every rank is told which rank lacks step4, and why
        assert any(f"rank {record['rank']}" in w and "step4" in w for w in attempt["warnings"]), (
            attempt
        )
    assert any("checksum mismatch" in w for a in found for w in a["warnings"]), found
    ends_as_uninterrupted(out, 2)


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
