"""CPU time a save costs the trainer and the writer process: what a checkpoint takes from training
that runs on every core (see bench/training_overhead.py).

    python bench/writer_cpu.py [--saves 10]

The demo's GPT with AdamW (one optimizer step taken, so its state exists) is saved --saves times
by one Checkpointer, each save waited for, once with buffered writes and once with
``direct_io=True``. The writer's CPU time comes from /proc/<writer>/stat (user + system), the
trainer's from ``time.process_time()`` (every thread of it, the copy threads included).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import pyshmckpt
from pyshmckpt.cli.demo import gpt


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=10)
    args = parser.parse_args()
    config = gpt.GPTConfig(vocab=8192, seq_len=64, width=256, layers=4, heads=8)
    torch.manual_seed(0)
    model = gpt.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = gpt.batch(1, 8, config.seq_len, config.vocab)
    model.loss(inputs, targets).backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    mib = sum(t.nbytes for t in model.state_dict().values()) / 2**20
    print(f"GPT with AdamW, the model {mib:.1f} MiB (AdamW twice that); {args.saves} saves each")
    for direct_io in (False, True):
        with tempfile.TemporaryDirectory() as root:
            checkpointer = pyshmckpt.Checkpointer(root, keep_last=2, direct_io=direct_io)
            checkpointer.save(state).result()  # start-up and first save outside the figures
            writer, trainer, wall = (
                cpu_seconds(checkpointer.writer_pid), time.process_time(), time.perf_counter()
            )  # fmt: skip
            for _ in range(args.saves):
                checkpointer.save(state).result()
            writer = cpu_seconds(checkpointer.writer_pid) - writer
            trainer, wall = time.process_time() - trainer, time.perf_counter() - wall
            checkpointer.close()
        print(
            f"direct_io={direct_io!s:5}: per save, writer CPU {writer / args.saves * 1e3:.0f} ms, "
            f"trainer CPU {trainer / args.saves * 1e3:.0f} ms, until durable "
            f"{wall / args.saves * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
