"""Replication across nodes with real parts: two simulated nodes (tests/simnodes.py: each a
network namespace with its own address on a bridge and its own /dev/shm), two ranks each, under
``torchrun --max-restarts 2`` with the c10d rendezvous on node 0's address, training FSDP2 with
AdamW (`replication_worker.py`). One job, four phases (one launch each saves its start-up):

1. A memory-only save at step 4 is replicated to each rank's buddy on the other node; node 1 is
   then lost whole (its agent, trainers and writers killed, its /dev/shm gone) and started again
   empty.
2. Every rank resumes from step 4, which exists nowhere on disk: node 0's ranks from their own
   memory, node 1's from their replicas on node 0; the next step is bitwise equal to an
   uninterrupted run (the ranks' own, recorded before the loss). Step 5 is saved in memory only;
   a byte of one of its replicas is flipped and node 1 is replaced again.
3. That rank's copy fails its checksums as it is fetched: every rank restores step 2 from disk,
   warned of the rank and why. After another memory-only save, both nodes are lost at once.
4. The job launched afresh restores step 2 from disk.

Nothing of ours is left in either node's /dev/shm when the job ends.
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
# A lost node's agent stays a participant of the rendezvous until its heartbeats are missed:
# keep_alive_interval x keep_alive_max_attempt seconds (5 x 3 by default), which every restart
# with a replaced node would wait. Heartbeats every second, 5 missed: a lost agent is dropped
# within 5 s, and a live one on a busy machine is not.
RENDEZVOUS_CONF = "keep_alive_interval=1,keep_alive_max_attempt=5"


def torchrun(node: Node, nodes: list[Node], root: Path, out: Path, log: IO[str]):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--max-restarts", "2", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{nodes[0].address}:{RENDEZVOUS_PORT}", "--rdzv-id", "replication",
        "--rdzv-conf", RENDEZVOUS_CONF,
        str(WORKER), str(root), str(out),
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
    return [torchrun(n, nodes, out.parent / "root", out, log) for n in on]


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
    found = [json.loads(p.read_text()) for p in out.glob(f"attempt-p{phase}-rank*.json")]
    assert len(found) == 4, (found, logs(out))
    for attempt in found:
        assert not {"step4", "step5"} & set(attempt["on_disk"]), attempt
        assert attempt["committed"] == ["step2"], attempt
    return found


def ends_as_uninterrupted(out: Path, phase: int) -> None:
    """Each rank's state after the last step equals the one it recorded before any loss."""
    for rank in range(4):
        expected = torch.load(out / f"expected-rank{rank}.pt", weights_only=False)
        got = torch.load(out / f"p{phase}-rank{rank}.pt", weights_only=False)
        same(got, expected, f"rank {rank} in phase {phase}")


def flip_a_replica(node: Node, name: str) -> int:
    """Flip a byte of the data of one replica of checkpoint `name` held on `node`; returns the
    rank it was held for."""
    held = [json.loads((node.shm_dir / n).read_text()) for n in ours(node) if "-replica-" in n]
    record = next(r for r in held if r["name"] == name)
    segment = node.shm_dir / record["segment"]["name"]
    with segment.open("r+b") as f:
        f.seek(int(record["segment"]["offset"]) + 64)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    return int(record["rank"])


@pytest.mark.timeout(5 * RUN_TIMEOUT)
def test_a_lost_node_resumes_from_replicas_then_a_corrupt_replica_and_two_lost_nodes_from_disk(
    nodes, tmp_path
):
    out, root = tmp_path / "out", tmp_path / "root"
    out.mkdir()
    with (out / "first.log").open("w") as log, (out / "again.log").open("w") as again:
        first = launch(nodes, nodes, out, 1, log)
        saved(out, "saved1", first)
        assert len([n for n in ours(nodes[0]) if "-replica-" in n]) == 2, ours(nodes[0])
        shown = nodes[0].run(
            [sys.executable, "-m", "pyshmckpt", "inspect", str(root)],
            timeout=RUN_TIMEOUT, env=child_env(), cwd=tmp_path,  # not a checkout's pyshmckpt
        )  # fmt: skip
        for rank in (2, 3):  # node 1's ranks' copies, held on node 0 while their trainers run
            assert any(
                line.startswith("replica") and f"step4  rank {rank} " in line
                for line in shown.stdout.splitlines()
            ), shown.stdout + shown.stderr

        # 2: node 1 replaced, its ranks restore from their replicas on node 0.
        replace(nodes[1])
        saved(out, "saved2", [first[0], *launch(nodes, [nodes[1]], out, 2, again)])
        found = attempts(out, 2)
        assert [a["resumed_from"] for a in found] == [4] * 4, found
        assert {a["node"] for a in found} == {0, 1}
        assert not any(a["warnings"] for a in found), found
        ends_as_uninterrupted(out, 2)

        # 3: node 1 replaced again, a replica of step 5 corrupt: every rank restores from disk.
        replace(nodes[1])
        flipped = flip_a_replica(nodes[0], "step5")
        saved(out, "saved3", [first[0], *launch(nodes, [nodes[1]], out, 3, again)])
        found = attempts(out, 3)
        assert [a["resumed_from"] for a in found] == [2] * 4, found
        for attempt in found:  # every rank is told which rank lacks step5, and why
            assert any(f"rank {flipped}" in w and "step5" in w for w in attempt["warnings"]), (
                attempt
            )
        assert any("checksum mismatch" in w for a in found for w in a["warnings"]), found
        ends_as_uninterrupted(out, 3)

        # 4: both nodes lost after a memory-only save of step 5: only the disk is left.
        for node in nodes:
            node.fail()
        for node in nodes:
            node.up()
        finish(launch(nodes, nodes, out, 4, again), out)
    freed(nodes)
    found = attempts(out, 4)
    assert [a["resumed_from"] for a in found] == [2] * 4, found
    ends_as_uninterrupted(out, 4)
    assert not (root / "step4").exists()
    assert not (root / "step5").exists()


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
