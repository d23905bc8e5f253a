"""One rank of test_replication.py: 2 simulated nodes x 2 ranks under ``torchrun --max-restarts 2``.

    replication_worker.py ROOT OUT

Trains the small FSDP2 GPT of sharded_worker.py with AdamW on four ranks for steps 1..FINAL_STEP,
saving step DISK_STEP to disk and step MEMORY_STEP in shared memory only (``persist=False``),
replicated to each rank's buddy on the other node (``Checkpointer(replicate=True)``). The test
writes the phase of the job (1 to 4) to OUT/phase before it launches or relaunches ranks; from
phase 2 on, the ranks first restore with ``pyshmckpt.load(root, into=...)``.

    phase 1    once every rank's save of MEMORY_STEP returned (its replica held on the other
               node), the ranks train FINAL_STEP, write their local shards to
               OUT/expected-rank<R>.pt (where an uninterrupted run ends), write
               OUT/saved1-rank<R>.json and wait: the test kills node 1 whole (its processes and
               its /dev/shm); node 0's ranks fail in a barrier and its agent restarts them,
               together with node 1's ranks, which the test starts again on an empty node.
    phase 2    they restore MEMORY_STEP (node 0's ranks from their own memory, node 1's from
               their replicas on node 0) and train to FINAL_STEP, which they save in memory
               only (replicated); then as in phase 1 (OUT/saved2-rank<R>.json): the test flips
               a byte of one replica of FINAL_STEP on node 0 and replaces node 1 again.
    phase 3    that rank's copy fails its checksums as it is fetched: every rank restores
               DISK_STEP from disk, with a warning naming the rank, and trains to FINAL_STEP,
               saved in memory only; every rank writes OUT/saved3-rank<R>.json and waits: the
               test kills both nodes and launches the job afresh.
    phase 4    every rank restores DISK_STEP from disk and trains to FINAL_STEP.

Every attempt writes OUT/attempt-p<PHASE>-rank<R>-<pid>.json (where it resumed from, the
warnings the restore issued); after FINAL_STEP each rank writes its local shards of the model
and optimizer state to OUT/p<PHASE>-rank<R>.pt. Checkpoint collectives use a gloo group of their
own.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from memory_restart_worker import report
from sharded_worker import build, train_step
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import pyshmckpt
from pyshmckpt.storage import commit

DISK_STEP = 2
MEMORY_STEP = 4
FINAL_STEP = MEMORY_STEP + 1
TIMEOUT = 120.0
HANG_TIMEOUT = 400  # seconds after which a rank prints every thread's stack and exits


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def local(tree: Any) -> Any:
    """The tree with each DTensor as a copy of its local shard."""
    if isinstance(tree, dict):
        return {k: local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local(v) for v in tree)
    if hasattr(tree, "to_local"):
        return tree.to_local().clone()
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def wait_for_loss(out: Path, stem: str, rank: int, node: int, everyone: bool) -> None:
    """Say OUT/<stem>-rank<R>.json once every rank got here, then wait to be killed: node 1's
    ranks (or every rank when `everyone`) until the test kills them, node 0's in a barrier
    that fails once node 1 is gone, as a survivor's collective does."""
    dist.barrier()
    report(out, f"{stem}-rank{rank}", node=node)
    if node == 1 or everyone:
        time.sleep(HANG_TIMEOUT)  # until the test kills this node
    dist.barrier()
    raise SystemExit("passed a barrier with node 1 gone")


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    faulthandler.dump_traceback_later(HANG_TIMEOUT, exit=True)  # a hang fails with its stacks
    phase = int((out / "phase").read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    node = int(os.environ["GROUP_RANK"])
    group = dist.new_group(backend="gloo")  # checkpoint collectives never meet training's
    checkpointer = pyshmckpt.Checkpointer(
        root, process_group=group, barrier_timeout=TIMEOUT, replicate=True, hold_timeout=300
    )
    model, optimizer = build(seed=0)
    first, seen = 1, {}
    if phase > 1:
        started = time.monotonic()
        target = state_of(model, optimizer, 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", pyshmckpt.MemoryTierWarning)
            pyshmckpt.load(root, into=target, process_group=group)
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
        first = int(target["step"]) + 1
        seen = {
            "resumed_from": int(target["step"]),
            "load_seconds": time.monotonic() - started,
            "on_disk": sorted(p.name for p in root.iterdir() if not p.name.startswith(".")),
            "committed": [name for _, name in commit.committed(root)],
            "warnings": [str(w.message) for w in caught],
        }
    report(out, f"attempt-p{phase}-rank{rank}-{os.getpid()}", node=node, **seen)
    for step in range(first, FINAL_STEP + 1):
        train_step(model, optimizer, step)
        if step == DISK_STEP:
            checkpointer.save(state_of(model, optimizer, step), name=f"step{step}").result(TIMEOUT)
        if step == MEMORY_STEP:
            saved = checkpointer.save(
                state_of(model, optimizer, step), name=f"step{step}", persist=False
            )
            saved.result(TIMEOUT)  # held here and, replicated, on the other node
            if phase == 1:
                train_step(model, optimizer, FINAL_STEP)  # the step an uninterrupted run ends with
                expected = local(state_of(model, optimizer, FINAL_STEP))
                torch.save(expected, out / f"expected-rank{rank}.pt")
                wait_for_loss(out, "saved1", rank, node, everyone=False)
    final = state_of(model, optimizer, FINAL_STEP)
    torch.save(local(final), out / f"p{phase}-rank{rank}.pt")
    if phase in (2, 3):
        checkpointer.save(final, name=f"step{FINAL_STEP}", persist=False).result(TIMEOUT)
        wait_for_loss(out, f"saved{phase}", rank, node, everyone=phase == 3)
    dist.barrier()


main()
