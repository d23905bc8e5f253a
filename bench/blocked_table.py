"""What the framework benchmarks (``*_blocked.py``) share: making a framework's files durable
the way pyshmckpt's are, and their table of how long training was blocked per checkpoint."""

from __future__ import annotations

import statistics
from pathlib import Path

from pyshmckpt.storage.commit import fsync_path


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory`, and itself (frameworks that write with
    plain ``torch.save`` do not)."""
    for path in [*directory.rglob("*"), directory]:
        fsync_path(path)


def print_blocked(
    ways: list[str], blocked: dict[str, list[float]], medians: dict[str, dict[str, list[float]]]
) -> None:
    """Per way: the blocked time (median, min, max) and the median of each other column."""
    print(f"\n{'':12} {'blocked per checkpoint (s)':>28}" + "".join(f" {c:>12}" for c in medians))
    print(f"{'way':12} {'median':>10} {'min':>8} {'max':>8}" + f" {'median':>12}" * len(medians))
    for way in ways:
        times = blocked[way]
        row = f"{way:12} {statistics.median(times):10.3f} {min(times):8.3f} {max(times):8.3f}"
        print(row + "".join(f" {statistics.median(c[way]):12.3f}" for c in medians.values()))
