"""One rank of test_replication.py: 2 simulated nodes x 2 ranks under ``torchrun --max-restarts 1``.

    replication_worker.py ROOT OUT MODE

Trains the small FSDP2 GPT of sharded_worker.py with AdamW on four ranks for steps 1..FINAL_STEP, saving step
DISK_STEP to disk and step MEMORY_STEP in shared memory only (``persist=False``), replicated to
each rank's buddy on the other node (``Checkpointer(replicate=True)``).

    lose       on the first launch, once every rank's save of MEMORY_STEP returned (its replica
               held on the other node), ranks write OUT/saved-rank<R>.json and wait: the test
               kills node 1 whole (its processes and its /dev/shm); node 0's ranks fail in a
               barrier and its agent restarts them, together with node 1's ranks, which the
               test starts again on an empty node. The restarted ranks restore with
               ``pyshmckpt.load(root, into=...)``: MEMORY_STEP, node 0's ranks from their own
               memory, node 1's from their replicas on node 0; then train on.
    corrupt    as lose, but the test flips a byte of one replica on node 0 before node 1
               comes back: that rank's fetch fails its checksums, and every rank restores
               DISK_STEP from disk, with a warning naming the rank.
    both       as lose, but the test kills both nodes and launches the job afresh: every rank
               restores DISK_STEP from disk.
    straight   the same training without a loss (the reference).

Every attempt writes OUT/MODE-attempt-rank<R>-<pid>.json (where it resumed from, the warnings
the restore issued); after
FINAL_STEP each rank writes its local shards of the model and optimizer state to
OUT/MODE-rank<R>.pt. Checkpoint collectives use a gloo group of their own.
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


def main() -> None:
    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    faulthandler.dump_traceback_later(HANG_TIMEOUT, exit=True)  # a hang fails with its stacks
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    node = int(os.environ["GROUP_RANK"])
    group = dist.new_group(backend="gloo")  # checkpoint collectives never meet training's
    # Resume when an earlier attempt left a root; every rank looks before any rank creates it.
    resume = torch.tensor([int(root.is_dir())])
    dist.all_reduce(resume, op=dist.ReduceOp.MAX)
    checkpointer = pyshmckpt.Checkpointer(
        root, process_group=group, barrier_timeout=TIMEOUT, replicate=True, hold_timeout=300
    )
    model, optimizer = build(seed=0)
    first, seen = 1, {}
    if resume.item():
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
    report(out, f"{mode}-attempt-rank{rank}-{os.getpid()}", node=node, **seen)
    for step in range(first, FINAL_STEP + 1):
        train_step(model, optimizer, step)
        if step == DISK_STEP:
            checkpointer.save(state_of(model, optimizer, step), name=f"step{step}").result(TIMEOUT)
        if step == MEMORY_STEP:
            saved = checkpointer.save(
                state_of(model, optimizer, step), name=f"step{step}", persist=False
            )
            saved.result(TIMEOUT)  # held here and, replicated, on the other node
            if mode != "straight" and not resume.item():
                dist.barrier()
                report(out, f"saved-rank{rank}", node=node)
                if node == 1:
                    time.sleep(HANG_TIMEOUT)  # until the test kills this node
                dist.barrier()  # fails once node 1 is gone, as a survivor's collective does
                raise SystemExit("passed a barrier with node 1 gone")
    torch.save(local(state_of(model, optimizer, FINAL_STEP)), out / f"{mode}-rank{rank}.pt")
    dist.barrier()


main()
