"""Staging time per tensor against tensor count, plan reused or not (issue 14).

    python bench/staging_per_tensor.py --plot bench/plots/staging_per_tensor.png

A fixed total (``--mib``, default 256 MiB of float32) is split into N equal tensors for each N;
for each, the median of ``--rounds`` stages with the plan reused (steady state: the stager saw
the same state dict before) and laid out in full (``ShmStager(reuse_plans=False)``), both into an
arena that already exists, against one ``numpy.copyto`` of the same bytes, timed in the same run
right before. Prints a table and writes the plot (and ``--json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from pyshmckpt import ShmStager

MIB = 1 << 20
COUNTS = [16, 64, 256, 1024, 4096, 8192, 16384, 65536]


def median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(total: int, count: int, rounds: int) -> dict[str, float]:
    per = total // 4 // count
    g = torch.Generator().manual_seed(count)
    sd = {f"layers.{i}.weight": torch.rand(per, generator=g) for i in range(count)}
    src = np.ones(total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    np.copyto(dst, src)  # fault in: a warm copy is the reference
    copyto = median_s(lambda d=dst, s=src: np.copyto(d, s), rounds)
    del src, dst
    out = {"tensors": count, "bytes": per * 4 * count, "copyto_s": copyto}
    for name, reuse in (("reused", True), ("full", False)):
        with ShmStager(capacity_bytes=total + (8 << 20), reuse_plans=reuse) as stager:
            stager.stage(sd)  # the first stage of each slot: arena pages touched, plan made
            stager.stage(sd)
            gc.collect()
            out[f"{name}_s"] = median_s(lambda s=stager: s.stage(sd), rounds)
            if reuse and stager.plan_stats.plans != 1:
                raise RuntimeError(f"the plan was not reused: {stager.plan_stats}")
    return out


def plot(rows: list[dict[str, float]], path: Path, total: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["tensors"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (
        ("reused_s", "stage, plan reused (steady state)", "o-"),
        ("full_s", "stage, full plan every save", "s--"),
        ("copyto_s", "one numpy.copyto of the same bytes", "k:"),
    ):
        left.plot(n, [r[key] / r["tensors"] * 1e6 for r in rows], style, label=label)
        right.plot(n, [r["copyto_s"] / r[key] for r in rows], style, label=label)
    left.set(xscale="log", yscale="log", xlabel="tensors", ylabel="µs per tensor",
             title=f"staging time per tensor, {total // MIB} MiB in total")  # fmt: skip
    right.axhline(0.9, color="red", lw=0.8, label="goal 0.9x")
    right.set(xscale="log", xlabel="tensors", ylabel="copyto time / staging time",
              title="staging bandwidth relative to one copy")  # fmt: skip
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total state size (MiB)")
    parser.add_argument("--counts", type=int, nargs="*", default=COUNTS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    total = args.mib * MIB
    rows = []
    print(f"{'tensors':>8} {'copyto ms':>10} {'reused ms':>10} {'us/t':>7} {'x copy':>7} "
          f"{'full ms':>9} {'us/t':>7} {'x copy':>7}")  # fmt: skip
    for count in args.counts:
        r = measure(total, count, args.rounds)
        rows.append(r)
        print(
            f"{count:8d} {r['copyto_s'] * 1e3:10.1f} {r['reused_s'] * 1e3:10.1f} "
            f"{r['reused_s'] / count * 1e6:7.2f} {r['copyto_s'] / r['reused_s']:7.2f} "
            f"{r['full_s'] * 1e3:9.1f} {r['full_s'] / count * 1e6:7.2f} "
            f"{r['copyto_s'] / r['full_s']:7.2f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"total_bytes": total, "cpus": os.cpu_count(),
                                         "torch": torch.__version__, "rows": rows}, indent=2))  # fmt: skip
    if args.plot:
        plot(rows, args.plot, total)


if __name__ == "__main__":
    main()
