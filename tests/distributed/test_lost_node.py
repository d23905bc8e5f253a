"""A node lost during a save: two simulated nodes (tests/simnodes.py: each with an address,
a hostname and a /dev/shm of its own, both writing one shared root) under `torchrun`, two ranks
each; node 1 is SIGKILLed whole (its agent, trainers and writers) while its writers hold a save.
Node 0's saves fail with `CommitError` within seconds (the lost ranks' heartbeats stop), its
`close()` returns, and a fresh launch of both nodes saves and loads.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from simnodes import Node, simulated_nodes, unavailable

import pyshmckpt
from pyshmckpt.storage import commit

from helpers import child_env, wait_until

pytestmark = pytest.mark.slow

RENDEZVOUS_PORT = 29500  # ports are per simulated node: any is free

TRAINER = textwrap.dedent(
    """
    # A training script as users write it (no main guard, no teardown), run by torchrun on a node.
    import json, os, signal, sys, time

    import torch
    import torch.distributed as dist

    import pyshmckpt

    root, phase, reports = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    checkpointer = pyshmckpt.Checkpointer(root, barrier_timeout=600)

    def state(step):
        return {"w": torch.full((256, 1024), float(rank * 100 + step)), "step": step}

    def report(**fields):
        path = os.path.join(reports, f"{phase}{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "node": node, **fields}, f)
        os.replace(path + ".tmp", path)

    if phase == "lose":
        checkpointer.save(state(1), name="step1").result(timeout=120)
        dist.barrier()
        if node == 1:  # its writers hold the next save: node 1 dies in the middle of it
            os.kill(checkpointer.writer_pid, signal.SIGSTOP)
        pending = checkpointer.save(state(2), name="step2")
        report(saved=True)
        if node == 1:
            time.sleep(600)  # the test kills this node
        try:
            pending.result(timeout=300)
            outcome, message = "committed", ""
        except Exception as exc:
            outcome, message = type(exc).__name__, str(exc)
        failed_at = time.time()
        started = time.monotonic()
        checkpointer.close()
        report(outcome=outcome, message=message, failed_at=failed_at,
               close_seconds=time.monotonic() - started)
        os._exit(0)  # the lost node's agent never reaches torchrun's exit barrier
    checkpointer.save(state(3), name="step3").result(timeout=120)
    loaded = pyshmckpt.load(root, rank=rank)
    report(step=loaded["step"], same=bool(torch.equal(loaded["w"], state(3)["w"])))
    """
)


@contextlib.contextmanager
def two_nodes(script: Path, root: Path, phase: str, reports: Path) -> Iterator[list[Node]]:
    """Start torchrun on two fresh simulated nodes (rendezvous on node 0's address); yields the
    nodes; every process of both is killed after."""
    with contextlib.ExitStack() as stack:
        outputs = [
            stack.enter_context((reports / f"{phase}-node{i}.log").open("w")) for i in (0, 1)
        ]
        with simulated_nodes(2, shm_size="512m") as nodes:
            for node, log in zip(nodes, outputs, strict=True):
                command = [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--node-rank", str(node.index), "--nproc-per-node", "2", "--max-restarts", "0",
                    "--master-addr", nodes[0].address, "--master-port", str(RENDEZVOUS_PORT),
                    str(script), str(root), phase, str(reports),
                ]  # fmt: skip
                node.start(command, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
            yield nodes


def reports_of(reports: Path, phase: str, ranks: list[int]) -> dict[int, dict]:
    return {r: json.loads((reports / f"{phase}{r}.json").read_text()) for r in ranks}


def logs(reports: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(reports.glob("*.log"))
    )


@pytest.mark.timeout(600)
def test_a_node_lost_mid_save_fails_the_survivors_saves_in_seconds(tmp_path):
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    script, root, reports = tmp_path / "train.py", tmp_path / "root", tmp_path / "reports"
    script.write_text(TRAINER)
    reports.mkdir()
    with two_nodes(script, root, "lose", reports) as (_, lost):
        wait_until(
            lambda: all((reports / f"lose{r}.json").exists() for r in range(4)),
            300, "every rank's save() of step2 to return",
        )  # fmt: skip
        killed_at = time.time()
        lost.fail()
        wait_until(
            lambda: all("outcome" in reports_of(reports, "lose", [r])[r] for r in (0, 1)),
            120, "node 0's saves to end and its Checkpointers to close",
        )  # fmt: skip
    survivors = reports_of(reports, "lose", [0, 1])
    for r, report in survivors.items():
        assert report["outcome"] == "CommitError", (r, report, logs(reports))
        assert "rank" in report["message"], report
        took = report["failed_at"] - killed_at
        assert took < 15, f"rank {r}'s save failed {took:.1f} s after node 1 was lost"
        assert report["close_seconds"] < 60, report
    assert "are gone" in survivors[0]["message"], survivors[0]
    assert [name for _, name in commit.committed(root)] == ["step1"]

    with two_nodes(script, root, "resume", reports):
        wait_until(
            lambda: all((reports / f"resume{r}.json").exists() for r in range(4)),
            300, "the fresh launch to save and load",
        )  # fmt: skip
    resumed = reports_of(reports, "resume", list(range(4)))
    assert all(r["step"] == 3 and r["same"] for r in resumed.values()), (resumed, logs(reports))
    assert [name for _, name in commit.committed(root)] == ["step1", "step3"]
    assert pyshmckpt.load(root / "step1", rank=3)["step"] == 1
