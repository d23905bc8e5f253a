"""The first save of a run: how long it blocks training, against a steady save, and how long until
it is durable, against the writer's start-up plus one write.

    python bench/first_save.py                          # 256 MiB in 256 tensors, 5 repeats
    python bench/first_save.py --mib 1024 --tensors 8192 --repeats 3

Each repeat runs every way in a fresh Python process (a job's start: torch imported, nothing of
pyshmckpt's started), the ways interleaved. A process builds the state, constructs a
Checkpointer and saves at once, then saves --steady more times, each once the previous one is
durable. Ways:

- ``capacity``: ``Checkpointer(root, capacity_bytes=state size)`` (the arena is made by the
  constructor); the writer starts in the background and the first save is spooled for it.
- ``no-capacity``: no capacity given: the first save creates the one slot it needs, the other is
  created in the background.
- ``capacity-wait``: as ``capacity`` but with ``wait_for_start=True``: the first save waits for
  the writer to start (the behaviour torch's CheckpointProcess has).
- ``no-capacity-overlap``: as ``no-capacity`` with ``overlap=True``: save() returns once the
  state is laid out and the copies (and the first save's slot) are made on the staging thread;
  "staged" adds the wait for them (``wait_staged()``), which a training step would meet at its
  optimizer step unless its forward and backward take longer.

Per way, medians over the repeats: the first save's blocked time, the median steady save's, their
ratio (goal <= 1.3 with capacity, <= 2 without); for ``no-capacity`` also the time to create one
slot of that size (measured in the same process, after the run); the time from
constructing the Checkpointer to the first durable checkpoint against the writer's start-up
(constructor to the writer's readiness) plus the first write's time in the writer (goal: no more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WAYS = ("capacity", "no-capacity", "capacity-wait", "no-capacity-overlap")


def worker(way: str, mib: int, tensors: int, steady: int, directory: str) -> dict[str, float]:
    import torch

    import pyshmckpt
    from pyshmckpt.shm import Arena

    numel = (mib << 20) // 4 // tensors
    state = {f"layer{i}.weight": torch.randn(numel) for i in range(tensors)}
    nbytes = sum(t.nbytes for t in state.values())
    capacity = None if way.startswith("no-capacity") else nbytes
    config = pyshmckpt.CheckpointProcessConfig(wait_for_start=way == "capacity-wait")
    with tempfile.TemporaryDirectory(dir=directory) as root:
        started = time.perf_counter()
        checkpointer = pyshmckpt.Checkpointer(
            root, capacity_bytes=capacity, config=config, overlap=way.endswith("overlap")
        )
        constructed = time.perf_counter()
        ready: list[float] = []
        process = checkpointer._process
        process.process_creation_future.add_done_callback(
            lambda _: ready.append(time.perf_counter())
        )
        future = checkpointer.save(state)
        first = time.perf_counter() - constructed
        checkpointer.wait_staged()
        first_staged = time.perf_counter() - constructed
        future.result()
        durable = time.perf_counter() - started
        first_write = process.last_write_seconds or 0.0
        steady_times, steady_staged = [], []
        for _ in range(steady):
            before = time.perf_counter()
            future = checkpointer.save(state)
            steady_times.append(time.perf_counter() - before)
            checkpointer.wait_staged()
            steady_staged.append(time.perf_counter() - before)
            future.result()
        checkpointer.close()
    before = time.perf_counter()
    Arena(nbytes, 1).close()  # one slot of the size the first save created
    slot = time.perf_counter() - before
    return {
        "constructor": constructed - started,
        "first": first,
        "steady": statistics.median(steady_times),
        "first_staged": first_staged,
        "steady_staged": statistics.median(steady_staged),
        "slot": slot,
        "durable": durable,
        "startup": (ready[0] if ready else float("nan")) - started,
        "first_write": first_write,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--tensors", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steady", type=int, default=5, help="saves after the first, per run")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = args.dir or tempfile.gettempdir()
    if args.worker:
        print(json.dumps(worker(args.worker, args.mib, args.tensors, args.steady, directory)))
        return
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for repeat in range(args.repeats):
        for way in WAYS[repeat % len(WAYS) :] + WAYS[: repeat % len(WAYS)]:
            command = [sys.executable, __file__, "--worker", way, "--mib", str(args.mib)]
            command += ["--tensors", str(args.tensors), "--steady", str(args.steady)]
            command += ["--dir", directory]
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=600, check=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )  # fmt: skip
            runs[way].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"repeat {repeat} {way}: {runs[way][-1]}", file=sys.stderr)

    def median(way: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[way])

    print(f"\n{args.mib} MiB in {args.tensors} tensors, medians of {args.repeats} fresh processes")
    print(
        f"{'way':20} {'first ms':>9} {'steady ms':>10} {'first/steady':>13} {'goal':>12}"
        f" {'first staged ms':>16} {'steady staged ms':>17}"
    )
    for way in WAYS:
        first, steady = median(way, "first") * 1e3, median(way, "steady") * 1e3
        goal = {"capacity": "<= 1.3", "no-capacity": "<= 2"}.get(way, "")
        print(
            f"{way:20} {first:9.1f} {steady:10.1f} {first / steady:13.2f} {goal:>12}"
            f" {median(way, 'first_staged') * 1e3:16.1f}"
            f" {median(way, 'steady_staged') * 1e3:17.1f}"
        )
    print(f"\n{'way':20} {'durable s':>10} {'start-up s':>11} {'1st write s':>12} {'goal s':>8}")
    for way in WAYS:
        startup, write = median(way, "startup"), median(way, "first_write")
        durable = median(way, "durable")
        print(f"{way:20} {durable:10.2f} {startup:11.2f} {write:12.2f} {startup + write:8.2f}")
    print(f"\none slot of this size created in {median('no-capacity', 'slot') * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
