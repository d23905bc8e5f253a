"""Filling a slot whose pages were never allocated: what a first save without ``capacity_bytes``
does (issue 14), against creating the slot and copying into it.

    python bench/slot_fill.py                 # 256 MiB, 7 rounds each
    python bench/slot_fill.py --mib 1024 --busy

Ways, each into a fresh segment of 1.25x the bytes (the default headroom), medians:

- ``file, 1 thread``: ``Segment.write_from_host`` with the native thread pool at one thread: the
  whole batch through the segment's file (``pwritev``).
- ``file + mapping``: the same with two threads: 4 MiB pieces through the file from the front
  and through the mapping (allocated with ``MADV_POPULATE_WRITE``) from the back until they meet.
- ``create + copy``: a populated segment (every page allocated and mapped, as ``Arena`` creates a
  slot given ``capacity_bytes``), then ``Segment.copy_from_host``.

With ``--busy`` a process spinning on one core runs meanwhile, as a writer process starting beside
a first save does.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

from pyshmckpt import _C

MIB = 1 << 20


def fill(source: np.ndarray, threads: int) -> float:
    _C.set_num_threads(threads)
    with _C.Segment.create(source.nbytes * 5 // 4, populate=False) as segment:
        rows = np.array([[source.ctypes.data, segment.data_offset, source.nbytes]], np.uint64)
        start = time.perf_counter()
        segment.write_from_host(rows)
        return time.perf_counter() - start


def create_and_copy(source: np.ndarray, threads: int) -> float:
    _C.set_num_threads(threads)
    start = time.perf_counter()
    with _C.Segment.create(source.nbytes * 5 // 4, populate=True) as segment:
        rows = np.array([[source.ctypes.data, segment.data_offset, source.nbytes]], np.uint64)
        segment.copy_from_host(rows)
        return time.perf_counter() - start


@contextlib.contextmanager
def busy_core(busy: bool) -> Iterator[None]:
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        yield
    finally:
        spinner.kill()
        spinner.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--busy", action="store_true", help="one core kept busy meanwhile")
    args = parser.parse_args()
    source = np.random.default_rng(0).integers(0, 256, args.mib * MIB, dtype=np.uint8)
    threads = _C.num_threads()
    ways: dict[str, Callable[[], float]] = {
        "file, 1 thread": lambda: fill(source, 1),
        "file + mapping": lambda: fill(source, 2),
        "create + copy": lambda: create_and_copy(source, threads),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    with busy_core(args.busy):
        for _ in range(args.rounds):  # ways interleaved
            for way, run in ways.items():
                times[way].append(run())
    _C.set_num_threads(threads)
    print(
        f"{args.mib} MiB into a fresh slot, medians of {args.rounds}{', one core busy' * args.busy}"
    )
    for way, measured in times.items():
        print(f"{way:16} {statistics.median(measured) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
