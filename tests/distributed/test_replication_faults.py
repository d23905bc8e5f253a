"""Replication never costs the writer, whatever the other node does: two simulated nodes
(tests/simnodes.py), one rank each (`replication_faults_worker.py`), short stall and replica
timeouts.

1. Both replica ports flooded from the other node with hundreds of connections that never
   authenticate (silent ones, and ones trickling a byte at a time, reopened as the writers drop
   them): replicated memory-only saves complete without a warning, each node holding the
   other's replica.
2. Node 1 stopped whole (SIGSTOP: its trainer and writer): node 0 keeps saving memory-only for
   longer than the stall and replica timeouts. Every save returns and resolves, with a
   ReplicationWarning, each well within the stall timeout; its writer is never replaced (no
   WriteStalledError); when its trainer then dies, its writer holds the newest checkpoint, which
   a new process on node 0 loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from simnodes import Node, simulated_nodes, unavailable

from flood import FLOOD
from helpers import child_env, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("replication_faults_worker.py")
STALL = 6.0  # as the worker's
REPLICA_TIMEOUT = 4.0
STOPPED_FOR = 20.0  # as the worker's
START_TIMEOUT = 240  # seconds both ranks may take to start (torch, gloo, writers)
STEP_TIMEOUT = 120  # seconds any later step of the job may take
IDLE, TRICKLING = 240, 60  # flooding connections from each node


LOAD = textwrap.dedent(
    """
    import sys, pyshmckpt
    state = pyshmckpt.load(sys.argv[1], rank=0)
    print(int(state["step"]), float(state["w"][0]))
    """
)


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with simulated_nodes(2, shm_size="256m") as made:
        yield made


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-5000:]}" for p in sorted(out.glob("*.log")))


def ours(node: Node) -> list[str]:
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"]
    return [name for name in node.shm_files() if name.startswith(prefix)]


def test_a_flooded_then_stopped_buddy_never_costs_the_writer(nodes, tmp_path):
    out, root = tmp_path / "out", tmp_path / "root"
    out.mkdir()
    env = child_env() | {
        "MASTER_ADDR": nodes[0].address, "MASTER_PORT": "29600", "WORLD_SIZE": "2",
        "LOCAL_RANK": "0", "PYSHMCKPT_REPLICA_TIMEOUT": str(REPLICA_TIMEOUT),
    }  # fmt: skip
    logs_open = [(out / f"rank{r}.log").open("w") for r in range(2)]
    ranks = [
        node.start(
            [sys.executable, str(WORKER), str(root), str(out)],
            env=env | {"RANK": str(r)},
            stdout=logs_open[r],
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for r, node in enumerate(nodes)
    ]
    flooders: list[subprocess.Popen] = []
    try:

        def arrived(name: str, timeout: float = STEP_TIMEOUT) -> object:
            wait_until(
                lambda: (out / name).exists() or any(p.poll() is not None for p in ranks),
                timeout, name,
            )  # fmt: skip
            assert (out / name).exists(), logs(out)
            return json.loads((out / name).read_text())

        ports = [arrived(f"port-rank{r}.json", START_TIMEOUT) for r in range(2)]
        writer = ports[0]["writer"]

        # 1: each node floods the other's replica port.
        for node, target in ((nodes[0], ports[1]), (nodes[1], ports[0])):
            flood = [target["address"], target["port"], IDLE, TRICKLING]
            flooders.append(
                node.start(
                    [sys.executable, "-c", FLOOD, *map(str, flood)],
                    env=child_env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
            )
        for flooder in flooders:
            assert flooder.stdout.readline().strip() == "flooding"
        (out / "flooding").write_text("")
        for r in range(2):
            for saved in arrived(f"flooded-rank{r}.json"):
                assert saved["error"] is None, saved
                assert not saved["warnings"], saved
        for node in nodes:  # each holds the other node's rank's replica
            assert any("-replica-" in name for name in ours(node)), ours(node)
        for flooder in flooders:
            flooder.stdin.close()
            assert flooder.stdout.readline().startswith("reopened")  # the writers dropped some
            flooder.wait(STEP_TIMEOUT)

        # 2: node 1 stopped whole while node 0 saves on.
        arrived("stop-me")
        for pid in nodes[1].processes():
            os.kill(pid, signal.SIGSTOP)
        (out / "stopped").write_text("")
        saves = arrived("stopped-rank0.json", STOPPED_FOR + STEP_TIMEOUT)
        assert ranks[0].wait(STEP_TIMEOUT) == 0, logs(out)
    finally:
        for pid in nodes[1].processes():
            os.kill(pid, signal.SIGCONT)
        for process in flooders:
            process.kill()
            process.wait(STEP_TIMEOUT)
            for stream in (process.stdin, process.stdout):
                stream.close()
        for log in logs_open:
            log.close()
    assert len(saves) >= 5, saves
    for saved in saves:
        assert saved["error"] is None, saved  # no WriteStalledError, nor any other
        assert saved["writer_pid"] == writer, saved  # never replaced
        assert saved["seconds"] < STALL, saved
        assert any(w.startswith("ReplicationWarning") for w in saved["warnings"]), saved
    assert any("was not tried" in w for s in saves for w in s["warnings"]), saves  # backed off

    # The trainer is gone: its writer holds the newest checkpoint, for a new process to load.
    loaded = nodes[0].run(
        [sys.executable, "-c", LOAD, str(root)], timeout=STEP_TIMEOUT, env=child_env(),
        cwd=tmp_path,
    )  # fmt: skip
    step, value = loaded.stdout.split()
    assert int(step) == saves[-1]["step"], loaded.stdout + loaded.stderr
    assert float(value) == saves[-1]["step"]  # rank 0's state of that step
