"""Device-to-host staging of GPU state: ShmStager against what a user would do with torch alone.

    python bench/device_to_host.py                       # 1 GiB as 1 and as 8,192 tensors
    python bench/device_to_host.py --gib 0.25 --counts 1 256 --json out.json

Needs a CUDA device. For each tensor count, a float32 state of --gib GiB on the GPU is staged to
host memory by each way below; every figure is the median over --rounds (first stages: over
--first-rounds, each with a new stager), the time from the call until the bytes are readable on
the host (torch's ways end with a device synchronize). The ways:

  ours         ShmStager.stage into an arena that already exists (pinned shared memory)
  ours-first   ShmStager(capacity_bytes=...) made, then its first stage
  pinned-copy  tensors pre-allocated in pinned memory, copy_(non_blocking=True) each, one sync
  dcp          DCP's DefaultStager (pinned + shared memory, non-blocking copies), steady
  dcp-first    a new DefaultStager each time, its first stage
  torch-exp    torch's _experimental DefaultStager (pinned + shared memory), steady; and -first
  cpu          {k: v.cpu()}: pageable memory, what torch.save of a GPU state does
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from pyshmckpt import ShmStager

import transports  # bench/transports.py: torch's experimental stager as the suite builds it

GIB = 1 << 30


def timed(fn: Callable[[], object], rounds: int, warmup: int) -> float:
    """Median seconds of `fn` (each result dropped before the next call)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        gc.collect()
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def dcp_stager() -> DefaultStager:
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=True,
        )
    )


def steady_and_first(
    make: Callable[[], Any], state: dict[str, torch.Tensor], rounds: int, first_rounds: int
) -> tuple[float, float]:
    """Median seconds of a torch stager's steady stage and of a new stager's first stage."""
    stager = make()

    def stage(into: Any) -> None:
        into.stage(state)
        torch.cuda.synchronize()

    try:
        steady = timed(lambda: stage(stager), rounds, 1)
    finally:
        stager.close()
    samples = []
    for _ in range(first_rounds):
        fresh = make()
        try:
            started = time.perf_counter()
            stage(fresh)
            samples.append(time.perf_counter() - started)
        finally:
            fresh.close()
    return steady, statistics.median(samples)


def measure(total: int, count: int, rounds: int, first_rounds: int) -> dict[str, float]:
    per = total // 4 // count
    g = torch.Generator(device="cuda").manual_seed(count)
    state = {
        f"layers.{i}.weight": torch.rand(per, device="cuda", generator=g) for i in range(count)
    }
    torch.cuda.synchronize()
    capacity = total + (8 << 20)
    out: dict[str, float] = {}

    with ShmStager(capacity_bytes=capacity) as stager:
        out["ours"] = timed(lambda: stager.stage(state), rounds, 2)
        staged = stager.stage(state)
        for key in (next(iter(state)), f"layers.{count - 1}.weight"):
            if not torch.equal(staged[key], state[key].cpu()):
                raise SystemExit(f"ours staged {key} wrong")
        del staged

    def first_ours() -> None:
        with ShmStager(capacity_bytes=capacity) as fresh:
            started = time.perf_counter()
            fresh.stage(state)
            samples.append(time.perf_counter() - started)

    samples: list[float] = []
    for _ in range(first_rounds):
        first_ours()
    out["ours-first"] = statistics.median(samples)

    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}

    def pinned_copy() -> None:
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()

    out["pinned-copy"] = timed(pinned_copy, rounds, 2)
    pinned.clear()

    for way, make in (("dcp", dcp_stager), ("torch-exp", transports.torch_stager)):
        try:
            out[way], out[f"{way}-first"] = steady_and_first(make, state, rounds, first_rounds)
        except Exception as exc:  # a torch whose stager cannot stage this state: say so
            print(f"{way}: failed: {type(exc).__name__}: {exc}")
    out["cpu"] = timed(lambda: {k: v.cpu() for k, v in state.items()}, max(3, rounds // 2), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 8192])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--first-rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    total = int(args.gib * GIB) // 4096 * 4096
    results = {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {total / GIB:.2f} GiB")
    for count in args.counts:
        figures = measure(total, count, args.rounds, args.first_rounds)
        results[count] = figures
        base = figures["pinned-copy"]
        print(f"\n{count} tensors        ms    GB/s  x pinned-copy")
        for way, seconds in figures.items():
            print(
                f"  {way:12s} {seconds * 1e3:8.1f} {total / seconds / 1e9:7.2f} {base / seconds:6.2f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"bytes": total, "seconds": results}, indent=1))


if __name__ == "__main__":
    main()
