"""One rank of test_memory_restart.py, run by ``torchrun --nproc-per-node 2 --max-restarts 2``.

    memory_restart_worker.py ROOT OUT

Trains a small MLP with AdamW on two ranks (seeded initialization, fixed batches per step and
rank, gradients averaged over the ranks) for steps 1..FINAL_STEP, saving step DISK_STEP to disk
and step MEMORY_STEP in shared memory only (``persist=False``). Three attempts:

    0  once both ranks' saves of MEMORY_STEP have returned, each rank trains FINAL_STEP and
       writes its state to ``OUT/expected-rank<R>.pt`` (where an uninterrupted run ends); then
       rank 1 SIGKILLs itself; rank 0 waits in a barrier, which fails (an uncaught exception)
       unless the agent stops rank 0 first: either way its writer keeps the checkpoint, as
       rank 1's does.
    1  restores with ``pyshmckpt.load(root)`` (MEMORY_STEP, from memory: not on disk), trains to
       FINAL_STEP, saves it in memory only, and rank 1 SIGKILLs itself again.
    2  rank 1 first flips a byte of the checkpoint its node holds for it (FINAL_STEP): rank 1
       finds it as it loads (``pyshmckpt.load(root, rank=rank)``: whose files, which does not
       let a rank restore alone), and both ranks load DISK_STEP from disk instead, warned of
       rank 1 and why (rank 0 does not restore FINAL_STEP from its memory); they train to
       FINAL_STEP and end without closing their Checkpointer after a memory-only save, so that
       their writers hold that checkpoint until torchrun's agent exits.

Every attempt writes ``OUT/attempt<N>-rank<R>.json`` (where it resumed from, what the root held
on disk, whether a checkpoint was held in memory for it); after step FINAL_STEP, each rank
writes its model and optimizer state to ``OUT/attempt<N>-rank<R>.pt``. Checkpoint collectives
(the run id, the restore's agreement) use a gloo group of their own.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

import pyshmckpt
from pyshmckpt.storage import commit
from pyshmckpt.tiers import records

DISK_STEP = 2
MEMORY_STEP = 4
FINAL_STEP = MEMORY_STEP + 1
TIMEOUT = 60.0  # seconds a save may take (well under one here)
HANG_TIMEOUT = 150  # seconds after which a rank prints every thread's stack and exits


def name_of(step: int) -> str:
    return f"step{step}"


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on this rank's fixed batch of `step`, gradients averaged over the ranks."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    inputs, targets = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)  # a sum of two: the same bits whatever the order
        p.grad.div_(dist.get_world_size())
    optimizer.step()


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}


def final_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)


def report(out: Path, stem: str, **fields: Any) -> None:
    path = out / f"{stem}.json"
    path.with_suffix(".tmp").write_text(json.dumps(fields))
    path.with_suffix(".tmp").replace(path)


def kill_rank_1(rank: int) -> NoReturn:
    """Once both ranks got here, rank 1 SIGKILLs itself; rank 0 fails in a barrier."""
    dist.barrier()  # both ranks' saves have returned
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # raises once rank 1 is gone, as a survivor's collective does
    raise SystemExit("rank 0 passed a barrier without rank 1")


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    faulthandler.dump_traceback_later(HANG_TIMEOUT, exit=True)  # a hang fails with its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")  # checkpoint collectives never meet training's
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # Resume when an earlier attempt left a root; every rank looks before any rank creates it.
    resume = torch.tensor([int(root.is_dir())])
    dist.all_reduce(resume, op=dist.ReduceOp.MAX)
    record = records.find(root, rank)
    held = record is not None
    if attempt == 2 and rank == 1 and record is not None:
        segment = Path("/dev/shm") / record["segment"]["name"]
        with segment.open("r+b") as f:  # a byte of the first entry, flipped
            f.seek(int(record["segment"]["offset"]) + 8)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x01]))
    checkpointer = pyshmckpt.Checkpointer(root, process_group=group, barrier_timeout=TIMEOUT)
    model, optimizer = build()
    first = 1
    seen: dict[str, Any] = {}
    if resume.item():
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", pyshmckpt.MemoryTierWarning)
            # The last attempt names its rank, as many scripts do: the ranks still agree.
            whose = {"rank": rank} if attempt == 2 else {}
            loaded = pyshmckpt.load(root, process_group=group, **whose)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optim"])
        first = int(loaded["step"]) + 1
        seen = {
            "resumed_from": int(loaded["step"]),
            "load_seconds": time.monotonic() - started,
            # From memory: the restored step was never written to disk.
            "on_disk": sorted(p.name for p in root.iterdir() if not p.name.startswith(".")),
            "committed": [name for _, name in commit.committed(root)],
            "warnings": [str(w.message) for w in caught],
        }
        del loaded
    steps = {"disk": DISK_STEP, "memory": MEMORY_STEP, "final": FINAL_STEP}
    report(out, f"attempt{attempt}-rank{rank}", held=held, steps=steps, **seen)
    for step in range(first, FINAL_STEP + 1):
        train_step(model, optimizer, step)
        if step == DISK_STEP:
            state = state_of(model, optimizer, step)
            checkpointer.save(state, name=name_of(step)).result(timeout=TIMEOUT)
        if step == MEMORY_STEP:
            checkpointer.save(state_of(model, optimizer, step), name=name_of(step), persist=False)
            if attempt == 0:
                train_step(model, optimizer, FINAL_STEP)  # the step an uninterrupted run ends with
                final_state(model, optimizer, out / f"expected-rank{rank}.pt")
                kill_rank_1(rank)
    final_state(model, optimizer, out / f"attempt{attempt}-rank{rank}.pt")
    final = state_of(model, optimizer, FINAL_STEP)
    checkpointer.save(final, name=name_of(FINAL_STEP), persist=False).result(timeout=TIMEOUT)
    if attempt == 1:
        kill_rank_1(rank)
    # Ends as a crash does: the writer holds this checkpoint until torchrun's agent exits.
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
