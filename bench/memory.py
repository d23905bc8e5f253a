"""Memory per checkpoint size: the shared memory pyshmckpt holds at most, and the writer process's
private memory (what it costs beyond the pages it shares with the trainer), from 64 MiB to a
fifth of the machine's memory.

    python bench/memory.py                  # 64 MiB, 256 MiB, 1 GiB, 4 GiB (up to memory / 5)
    python bench/memory.py --sizes 64 1024  # MiB

For each size a fresh Checkpointer (capacity_bytes = the state's size, 2 slots) saves a state
dict of float32 tensors of 16 MiB three times into a temporary directory (--dir), each save
waited for. A thread samples, every 5 ms, the machine's ``Shmem:`` (/proc/meminfo, against its
value before the Checkpointer existed) and the writer's ``Private_Clean + Private_Dirty`` and
``Rss`` (/proc/<writer>/smaps_rollup). The writer maps the slots it reads: those pages are shared
with the trainer and are not private. Goal (issue 14): the writer's private memory under 64 MiB
at any size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

import pyshmckpt

MIB = 1 << 20
TENSOR_BYTES = 16 * MIB


def proc_kib(path: str, *keys: str) -> int:
    """The sum of the ``key: N kB`` lines of a /proc file, in bytes (0 when unreadable)."""
    total = 0
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, rest = line.partition(":")
        if name in keys:
            total += int(rest.split()[0]) * 1024
    return total


class Peaks:
    """Samples, in a thread, the machine's shared memory and a process's memory; keeps maxima."""

    def __init__(self) -> None:
        self.shmem_base = proc_kib("/proc/meminfo", "Shmem")
        self.pid: int | None = None
        self.shmem = self.private = self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.shmem = max(self.shmem, proc_kib("/proc/meminfo", "Shmem") - self.shmem_base)
            if self.pid is not None:
                rollup = f"/proc/{self.pid}/smaps_rollup"
                self.private = max(self.private, proc_kib(rollup, "Private_Clean", "Private_Dirty"))
                self.rss = max(self.rss, proc_kib(rollup, "Rss"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(size: int, root: Path, saves: int) -> dict[str, float]:
    state = {
        f"t{i}": torch.full((TENSOR_BYTES // 4,), float(i)) for i in range(size // TENSOR_BYTES)
    }
    peaks = Peaks()
    try:
        with pyshmckpt.Checkpointer(root, capacity_bytes=size, keep_last=1) as checkpointer:
            checkpointer.save({"warm-up": torch.zeros(1)}).result()  # the writer is up
            peaks.pid = checkpointer.writer_pid
            time.sleep(0.05)
            idle = proc_kib(f"/proc/{peaks.pid}/smaps_rollup", "Private_Clean", "Private_Dirty")
            start = time.perf_counter()
            for _ in range(saves):
                checkpointer.save(state).result()
            seconds = (time.perf_counter() - start) / saves
            time.sleep(0.05)
    finally:
        peaks.stop()
    return {
        "size": size,
        "shmem": peaks.shmem,
        "private_idle": idle,
        "private": peaks.private,
        "rss": peaks.rss,
        "save_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fifth = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 5
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096], help="MiB")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go")
    args = parser.parse_args()
    sizes = [s * MIB for s in args.sizes if s * MIB <= fifth]
    print(f"machine memory {5 * fifth / 2**30:.1f} GiB: sizes up to {fifth / 2**30:.1f} GiB")
    print(f"\n{'size':>9} {'shm peak':>10} {'x size':>7} {'writer private':>15} {'(idle)':>8} "
          f"{'writer RSS':>11} {'save+write':>11}")  # fmt: skip
    for size in sizes:
        root = Path(tempfile.mkdtemp(dir=args.dir, prefix="pyshmckpt-memory-"))
        try:
            row = measure(size, root, args.saves)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"{size / MIB:6.0f} MiB {row['shmem'] / MIB:6.0f} MiB {row['shmem'] / size:6.2f}x "
            f"{row['private'] / MIB:11.1f} MiB {row['private_idle'] / MIB:5.1f} MiB "
            f"{row['rss'] / MIB:7.0f} MiB {row['save_s']:9.2f} s"
        )


if __name__ == "__main__":
    main()
