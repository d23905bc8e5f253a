"""Write-behind in pyshmckpt's writers: a durable write (write + fsync) with and without it, the
time it takes and its longest stretch without progress (what the stall timeout judges a write by).

    python bench/write_behind.py [--gib 1] [--rounds 3] [--dir DIR]

Each round writes the same bytes through `storage.file_output.write_all` (pieces of 64 MiB) and
fsyncs them, once with write-behind (each piece handed to the disk as the next is written) and
once without (the bytes go to the page cache and the final fsync flushes them all), alternating,
into DIR (default: a temporary directory under the current one, so on the disk a root would be
on). A thread samples `storage.progress` every 5 ms; the longest time between two changes, and
from the last change to the end of the fsync, is the write's longest silence.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from pyshmckpt.storage import file_output, progress

MIB = 1 << 20


def durable_write(path: Path, data: memoryview, behind: bool) -> tuple[float, float]:
    """(seconds, longest seconds without progress) of writing `data` to `path` and fsyncing it."""
    original = file_output._sync_file_range
    if not behind:
        file_output._sync_file_range = lambda: None  # type: ignore[assignment]
    done = threading.Event()
    longest = [0.0]

    def watch() -> None:
        last, since = progress.current(), time.monotonic()
        while not done.wait(0.005):
            now = progress.current()
            if now != last:
                longest[0] = max(longest[0], time.monotonic() - since)
                last, since = now, time.monotonic()
        longest[0] = max(longest[0], time.monotonic() - since)

    watcher = threading.Thread(target=watch)
    started = time.perf_counter()
    watcher.start()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            file_output.write_all(fd, [data])
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        file_output._sync_file_range = original
        done.set()
        watcher.join()
    return time.perf_counter() - started, longest[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    args = parser.parse_args()
    size = int(args.gib * 1024) * MIB
    data = memoryview(bytearray(os.urandom(64 * MIB)) * (size // (64 * MIB)))
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="write-behind-") as directory:
        target = Path(directory) / "data"
        for _ in range(args.rounds):
            for behind in (True, False):
                results[behind].append(durable_write(target, data, behind))
                target.unlink()
    print(f"{size / 2**30:g} GiB written and fsynced, {args.rounds} rounds each, in {args.dir}")
    for behind, label in ((True, "with write-behind"), (False, "without")):
        seconds = [s for s, _ in results[behind]]
        silence = [q for _, q in results[behind]]
        print(
            f"  {label:18s} median {statistics.median(seconds):6.2f} s "
            f"({size / statistics.median(seconds) / MIB:6.0f} MiB/s), "
            f"longest silence median {statistics.median(silence):5.2f} s, max {max(silence):5.2f} s"
        )


if __name__ == "__main__":
    main()
