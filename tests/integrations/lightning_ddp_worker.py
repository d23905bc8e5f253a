"""One rank of a 2-process DDP run (under torchrun) with ShmCheckpointIO: checkpoints written by
rank 0's writer alone, kept as ModelCheckpoint chose, and resuming gives the uninterrupted run's
parameters on every rank. Writes <dir>/ok-<rank> when every check passed."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from pyshmckpt import cli
from pyshmckpt.integrations.lightning import ShmCheckpointIO

from helpers import end_distributed
from lightning_app import STEPS_PER_EPOCH, checkpoint_names, fit, same_parameters


def main() -> None:
    root = Path(sys.argv[1])
    io = ShmCheckpointIO(root / "run", write_timeout=120.0)  # rank 0 starts its writer now
    model, _, trainer = fit(
        root / "run", [io], every_n_train_steps=STEPS_PER_EPOCH, save_top_k=2,
        monitor="train_loss", save_last=True,
    )  # fmt: skip
    rank = trainer.global_rank
    if trainer.world_size != 2:
        raise SystemExit(f"expected 2 DDP ranks, got {trainer.world_size}")
    if rank != 0 and io._checkpointers:
        raise SystemExit("a rank other than 0 started a writer")
    dist.barrier()  # rank 0's teardown finished its writes
    names = checkpoint_names(root / "run")
    if len(names) != 3 or "last.ckpt" not in names:
        raise SystemExit(f"unexpected checkpoints {names}")
    if rank == 0:
        for name in names:
            if cli.main(["verify", str(root / "run" / name)]) != 0:
                raise SystemExit(f"{name} does not verify")
    oldest = min(
        (n for n in names if n != "last.ckpt"), key=lambda n: int(n.split("step=")[1][:-5])
    )
    resumed, _, _ = fit(
        root / "resumed", [ShmCheckpointIO()], ckpt_path=root / "run" / oldest,
        every_n_train_steps=STEPS_PER_EPOCH, save_top_k=2, monitor="train_loss", save_last=True,
    )  # fmt: skip
    if not same_parameters(resumed, model):
        raise SystemExit(f"rank {rank}: resuming from {oldest} diverged")
    (root / f"ok-{rank}").touch()
    end_distributed()


if __name__ == "__main__":
    main()
