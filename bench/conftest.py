"""Shared pieces of the benchmark suite: state dicts, GiB/s bookkeeping and the ratio summary.

Run with ``pytest bench/`` (see bench/RESULTS.md). Each benchmark records its median time under a
name; the summary at the end prints the ratios the issues set goals for, all from this one run.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest
import torch

GIB = 1 << 30
MEDIANS: dict[str, float] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench-gib", type=float, default=float(os.environ.get("PYSHMCKPT_BENCH_GIB", "1")),
        help="state dict size in GiB (default 1)",
    )  # fmt: skip
    parser.addoption("--bench-json", default=None, help="write the medians and ratios here")
    parser.addoption("--bench-dir", default=None, help="directory the persist benchmarks write to")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import pyshmckpt

    if pyshmckpt.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and the CUDA build of pyshmckpt")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def total_bytes(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--bench-gib") * GIB) // 4096 * 4096


def make_state(total: int, count: int) -> dict[str, torch.Tensor]:
    """`total` bytes of float32 as `count` equal tensors, filled (so every page is resident)."""
    per = total // 4 // count
    g = torch.Generator().manual_seed(count)
    return {f"layers.{i}.weight": torch.rand(per, generator=g) for i in range(count)}


@pytest.fixture(scope="module", params=[256, 8192], ids=lambda n: f"{n}tensors")
def state(request: pytest.FixtureRequest, total_bytes: int):
    sd = make_state(total_bytes, request.param)
    yield request.param, sd
    del sd


def record(benchmark, name: str, nbytes: int) -> None:
    """Store the median under `name` and GiB/s in extra_info (call after the benchmark ran)."""
    stats = benchmark.stats.stats
    median = stats.median
    MEDIANS[name] = median
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GiB/s"] = round(nbytes / GIB / median, 3) if median > 0 else None


RATIOS = [
    # (label, numerator, denominator, "higher is better" description)
    ("staging bandwidth, 256 tensors / single numpy.copyto", "copyto", "ours_steady_256"),
    ("staging bandwidth, 8192 tensors / single numpy.copyto", "copyto", "ours_steady_8192"),
    ("first stage / steady state, 256 tensors (ours)", "ours_first_256", "ours_steady_256"),
    ("first stage / steady state, 8192 tensors (ours)", "ours_first_8192", "ours_steady_8192"),
    ("torch DefaultStager bandwidth, 8192 tensors / numpy.copyto", "copyto", "torch_steady_8192"),
    ("torch DefaultStager first / steady, 8192 tensors", "torch_first_8192", "torch_steady_8192"),
    ("ours vs torch DefaultStager speed-up, steady, 8192 tensors", "torch_steady_8192", "ours_steady_8192"),
    ("end to end speed-up over torch, ShmStager, 8192 tensors", "e2e_torch_8192", "e2e_ours_shm_8192"),
    ("end to end speed-up over torch, plain dict, 8192 tensors", "e2e_torch_8192", "e2e_ours_plain_8192"),
    ("end to end speed-up over torch, ShmStager, 256 tensors", "e2e_torch_256", "e2e_ours_shm_256"),
    ("end to end speed-up over torch, plain dict, 256 tensors", "e2e_torch_256", "e2e_ours_plain_256"),
    ("handoff speed-up over torch, 8192 tensors", "handoff_torch_8192", "handoff_ours_8192"),
    ("persist bandwidth, ours (writer) / dd conv=fsync", "persist_dd", "persist_ours"),
    ("save end to end bandwidth, ours / dd conv=fsync", "persist_dd", "save_ours"),
    ("save end to end bandwidth, ours / torch.save + fsync", "persist_torch_save", "save_ours"),
]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not MEDIANS:
        return
    rows = []
    for label, num, den in RATIOS:
        if num in MEDIANS and den in MEDIANS:
            value = MEDIANS[num] / MEDIANS[den]
            rows.append((label, value))
    tr = terminalreporter
    tr.section("pyshmckpt ratios (medians from this run)")
    for name, median in sorted(MEDIANS.items()):
        tr.write_line(f"  {name:28s} median {median * 1e3:9.2f} ms")
    for label, value in rows:
        tr.write_line(f"  {label:62s} {value:6.2f}")
    path = config.getoption("--bench-json")
    if path:
        payload = {
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "torch": torch.__version__, "python": platform.python_version()},
            "medians_s": MEDIANS,
            "ratios": dict(rows),
        }  # fmt: skip
        Path(path).write_text(json.dumps(payload, indent=2))
