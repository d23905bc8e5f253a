"""One rank of test_replication_faults.py: two simulated nodes, one rank each (gloo, env://).

    replication_faults_worker.py ROOT OUT

Both ranks make a ``Checkpointer(replicate=True)`` with a short stall timeout (``STALL``; the
test sets ``PYSHMCKPT_REPLICA_TIMEOUT`` short too) and write OUT/port-rank<R>.json (the replica
port, the writer's pid). Then:

1. Flooded: once OUT/flooding exists (the test floods both replica ports with connections that
   never authenticate), each rank saves ``FLOODED`` memory-only checkpoints, each replicated to
   the other node, and writes OUT/flooded-rank<R>.json (the ReplicationWarnings, none expected).
2. Stopped: rank 1 writes OUT/stop-me and sleeps (the test SIGSTOPs its node whole, writer
   included); rank 0, once OUT/stopped exists, saves memory-only for ``STOPPED_FOR`` seconds
   (longer than the stall and replica timeouts), every save waited for, and writes
   OUT/stopped-rank0.json (per save: seconds, warnings, the writer's pid, errors), then ends
   without closing: its writer holds the newest checkpoint for the test to load.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import pyshmckpt

STALL = 6.0  # the writer's stall timeout (seconds)
FLOODED = 3  # saves while the replica ports are flooded
STOPPED_FOR = 20.0  # seconds rank 0 keeps saving while node 1 is stopped
TIMEOUT = 120.0  # seconds a save may take, or a file of the test be waited for
HANG_TIMEOUT = 400  # seconds after which a rank prints every thread's stack and exits


def write(path: Path, data: object) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").replace(path)


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never came")
        time.sleep(0.05)


def save(checkpointer: pyshmckpt.Checkpointer, step: int, rank: int) -> dict:
    """A memory-only save of step `step`, waited for: what happened."""
    state = {"w": torch.full((1 << 18,), float(rank * 1000 + step)), "step": step}
    started = time.monotonic()
    outcome: dict = {"step": step, "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            checkpointer.save(state, name=f"step{step}", persist=False).result(TIMEOUT)
        except Exception:  # noqa: BLE001 - reported to the test
            outcome["error"] = traceback.format_exc()
    outcome["seconds"] = time.monotonic() - started
    outcome["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    outcome["writer_pid"] = checkpointer.writer_pid
    return outcome


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    faulthandler.dump_traceback_later(HANG_TIMEOUT, exit=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpointer = pyshmckpt.Checkpointer(
        root, replicate=True, stall_timeout=STALL, hold_timeout=120
    )
    config = checkpointer._replica
    write(
        out / f"port-rank{rank}.json",
        {"address": config.listen[0], "port": config.listen[1], "writer": checkpointer.writer_pid},
    )
    wait_for(out / "flooding")
    flooded = [save(checkpointer, step, rank) for step in range(1, FLOODED + 1)]
    dist.barrier()  # each rank's last save is held on the other node now
    write(out / f"flooded-rank{rank}.json", flooded)
    dist.barrier()
    if rank == 1:
        write(out / "stop-me", {})
        time.sleep(HANG_TIMEOUT)
        return
    wait_for(out / "stopped")
    saves, step, began = [], FLOODED, time.monotonic()
    while time.monotonic() - began < STOPPED_FOR:
        step += 1
        saves.append(save(checkpointer, step, rank))
        time.sleep(0.2)
    write(out / "stopped-rank0.json", saves)
    sys.stdout.flush()
    os._exit(0)  # as a trainer that dies: its writer holds the newest checkpoint


main()
