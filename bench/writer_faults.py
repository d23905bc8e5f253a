"""Page faults the writer process takes per save: 1 GiB in 8,192 tensors saved four times by one
Checkpointer (2 slots), the writer's minor and major faults (/proc/<writer>/stat) counted around
each save.

    python bench/writer_faults.py

A slot's pages are allocated by the trainer and mapped by the writer once, populated
(MAP_POPULATE) when it attaches the slot: what faults are left per save are the writer's own
memory (decoding the manifest, building its writes), not the slot's 262,144 pages.
"""

from __future__ import annotations

import tempfile

import torch

import pyshmckpt

TENSORS = 8192
TOTAL = 1 << 30


def faults(pid: int) -> tuple[int, int]:
    """(minor, major) page faults of process `pid` so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: PTH123
    return int(fields[7]), int(fields[9])


def main() -> None:
    state = {f"t{i}": torch.full((TOTAL // TENSORS // 4,), float(i)) for i in range(TENSORS)}
    with (
        tempfile.TemporaryDirectory() as root,
        pyshmckpt.Checkpointer(root, capacity_bytes=TOTAL + (16 << 20), keep_last=1) as ck,
    ):
        ck.save({"warm-up": torch.zeros(1)}).result()  # the writer is up
        pid = ck.writer_pid
        if pid is None:
            raise SystemExit("no writer process")
        for save in range(4):
            before = faults(pid)
            ck.save(state).result()
            after = faults(pid)
            print(f"save {save} (slot {save % 2}): writer minor faults {after[0] - before[0]:6d}, "
                  f"major {after[1] - before[1]}")  # fmt: skip


if __name__ == "__main__":
    main()
