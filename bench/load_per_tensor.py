"""What a tensor costs a load: the same bytes in few and in many tensors, loaded fresh and into=.

    python bench/load_per_tensor.py                          # 1 GiB in 64 and in 8,192 tensors
    python bench/load_per_tensor.py --gib 0.25 --counts 64 65536 --rounds 3

For each count, --gib of float32 in that many equal tensors is saved once by a Checkpointer
(into --dir, a temporary directory by default) and read back warm (the page cache holds the
file after the first load), in rounds, the counts and modes interleaved:

* ``fresh``  ``pyshmckpt.load(path)``: new tensors, every checksum checked
* ``into``   ``pyshmckpt.load(path, into=state)``: the tensors of a state of the same structure
             filled in place, every checksum checked

Prints the median of each, and for every count past the first the cost per extra tensor:
(median at that count - median at the first count) / (that count - the first count). Goals
(issue 40): <= 3 us per tensor beyond a load of the same bytes in 64 tensors; ``into`` never
slower than ``fresh``. --json writes the medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import pyshmckpt

GIB = 1 << 30


def make_state(total: int, count: int) -> dict[str, torch.Tensor]:
    per = total // 4 // count
    g = torch.Generator().manual_seed(count)
    return {f"layers.{i}.weight": torch.rand(per, generator=g) for i in range(count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes of every state (GiB)")
    parser.add_argument("--counts", type=int, nargs="+", default=[64, 8192])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp)")
    parser.add_argument("--json", default=None, help="write the medians here")
    args = parser.parse_args()
    total = int(args.gib * GIB)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="load-per-tensor-"))
    paths, targets = {}, {}
    try:
        for count in args.counts:
            state = make_state(total, count)
            with pyshmckpt.Checkpointer(base / f"n{count}") as checkpointer:
                paths[count] = checkpointer.save(state, name="ck").result(timeout=600)
            targets[count] = {k: torch.empty_like(v) for k, v in state.items()}
            del state
            pyshmckpt.load(paths[count], into=targets[count])  # warms the page cache
        times: dict[tuple[int, str], list[float]] = {}
        for r in range(args.rounds):
            order = [(c, m) for c in args.counts for m in ("fresh", "into")]
            order = order[r % len(order) :] + order[: r % len(order)]
            for count, mode in order:
                started = time.perf_counter()
                if mode == "fresh":
                    loaded = pyshmckpt.load(paths[count])
                else:
                    loaded = pyshmckpt.load(paths[count], into=targets[count])
                times.setdefault((count, mode), []).append(time.perf_counter() - started)
                del loaded
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    medians = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    first = args.counts[0]
    print(f"{args.gib:g} GiB of float32, warm page cache, median of {args.rounds} rounds")
    print(f"{'tensors':>8} {'fresh ms':>9} {'into ms':>8} {'us/tensor fresh':>16} {'into':>6}")
    for count in args.counts:
        fresh, into = medians[(count, "fresh")], medians[(count, "into")]
        extra = ""
        if count != first:
            per = [
                (medians[(count, m)] - medians[(first, m)]) * 1e3 / (count - first)
                for m in ("fresh", "into")
            ]
            extra = f"{per[0]:>16.1f} {per[1]:>6.1f}"
        print(f"{count:>8,} {fresh:>9.1f} {into:>8.1f} {extra}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({f"{c}/{m}": v for (c, m), v in medians.items()}, indent=1)
        )


if __name__ == "__main__":
    main()
