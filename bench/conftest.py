"""Shared pieces of the benchmark suite: state dicts, GiB/s bookkeeping and the ratio summary.

Run with ``pytest bench/`` (see bench/RESULTS.md). Each benchmark records its median time under a
name; the summary at the end prints the ratios the issues set goals for, all from this one run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
from pathlib import Path
from typing import Any

import pytest
import torch

GIB = 1 << 30
MIB = 1 << 20
MEDIANS: dict[str, float] = {}
ROWS: list[dict[str, Any]] = []  # one per sweep benchmark: phase, transport, bytes, tensors, times

SIZE_AXIS_TENSORS = 256  # tensor count of the size sweep
COUNT_AXIS_BYTES = {False: 256 * MIB, True: 64 * MIB}  # size of the count sweep (quick: True)
COUNTS = {False: [16, 64, 256, 1024, 4096, 16384], True: [16, 256, 4096, 16384]}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench-gib", type=float, default=float(os.environ.get("PYSHMCKPT_BENCH_GIB", "1")),
        help="state dict size in GiB (default 1)",
    )  # fmt: skip
    parser.addoption("--bench-json", default=None, help="write the medians and ratios here")
    parser.addoption("--bench-dir", default=None, help="directory the persist benchmarks write to")
    parser.addoption(
        "--bench-quick", action="store_true", help="sweeps: only the small sizes, fewer rounds"
    )
    parser.addoption(
        "--bench-max-gib", type=float, default=None,
        help="sweeps: largest state size (default: a fifth of the available memory)",
    )  # fmt: skip


# RLIMIT_NOFILE of this session: the soft limit found at start (initial_soft), the soft limit after
# raising it (soft) and the hard limit (hard).
OPEN_FILES: dict[str, int] = {}


def raise_open_file_limit() -> dict[str, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit, once, for the whole benchmark session.

    torch's transport needs about two descriptors per tensor (see test_sweep.py); a default soft
    limit of 1024 would make it fail at sizes it handles under the limit users can set. Returns
    the limits, also kept in OPEN_FILES for `machine()`.
    """
    if not OPEN_FILES:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        OPEN_FILES["initial_soft"] = soft
        if hard != soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            except (ValueError, OSError):  # e.g. an infinite hard limit the kernel will not grant
                pass
        OPEN_FILES["soft"], OPEN_FILES["hard"] = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OPEN_FILES


def pytest_configure(config: pytest.Config) -> None:  # noqa: ARG001
    raise_open_file_limit()


@dataclasses.dataclass(frozen=True)
class SweepCase:
    phase: str  # "staging" or "e2e"
    nbytes: int
    tensors: int
    transport: str  # "ours" or "torch"
    rounds: int

    @property
    def id(self) -> str:
        return f"{self.phase}-{self.nbytes // MIB}MiB-{self.tensors}t-{self.transport}"


def available_bytes() -> int:
    """Memory the sweeps may use: the smaller of MemAvailable and free /dev/shm."""
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    shm = os.statvfs("/dev/shm")
    return min(avail, shm.f_bavail * shm.f_frsize)


def sweep_cases(config: pytest.Config) -> list[SweepCase]:
    """Size axis (64 MiB x 4 up to the limit, SIZE_AXIS_TENSORS tensors), then the count axis;
    each case staging then e2e, ours then torch, so the two transports run back to back."""
    quick = bool(config.getoption("--bench-quick"))
    max_gib = config.getoption("--bench-max-gib")
    # The state, our two slots, torch's staged copy and the writer's view: about 5x the state.
    limit = int(max_gib * GIB) if max_gib else available_bytes() // 5
    sizes = [64 * MIB * 4**k for k in range(8) if 64 * MIB * 4**k <= limit] or [64 * MIB]
    if quick:
        sizes = sizes[:2]
    points = [(size, SIZE_AXIS_TENSORS) for size in sizes]
    points += [
        (COUNT_AXIS_BYTES[quick], n)
        for n in COUNTS[quick]
        if (COUNT_AXIS_BYTES[quick], n) not in points
    ]
    cases = []
    for nbytes, tensors in points:
        for phase in ("staging", "e2e"):
            for transport in ("ours", "torch"):
                if phase == "staging":  # cheap; more rounds keep gen-2 GC pauses out of the median
                    rounds = 5 if quick else 9
                else:
                    rounds = 3 if quick or transport == "torch" else 5
                cases.append(SweepCase(phase, nbytes, tensors, transport, rounds))
    return cases


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                            "torch": torch.__version__, "python": platform.python_version()}  # fmt: skip
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.startswith("model name")
        )
        meminfo = Path("/proc/meminfo").read_text().split()
        info["memory_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["rlimit_nofile"] = dict(raise_open_file_limit())  # soft limit the run used, and before
    return info


def add_row(benchmark: Any, **fields: Any) -> None:
    """Record a sweep result: median and min seconds, GiB/s in extra_info and in ROWS."""
    stats = benchmark.stats.stats
    gib_s = fields["nbytes"] / GIB / stats.median if stats.median > 0 else None
    benchmark.extra_info.update(fields)
    benchmark.extra_info["GiB/s"] = round(gib_s, 3) if gib_s else None
    ROWS.append(
        {
            **fields,
            "median_s": stats.median,
            "min_s": stats.min,
            "rounds": len(stats.data),
            "GiB_per_s": gib_s,
        }
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import pyshmckpt

    if pyshmckpt.cuda_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (pyshmckpt cuda-info says why CUDA is not usable here)"
    )
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
    (
        "ours vs torch DefaultStager speed-up, steady, 8192 tensors",
        "torch_steady_8192",
        "ours_steady_8192",
    ),
    (
        "end to end speed-up over torch, ShmStager, 8192 tensors",
        "e2e_torch_8192",
        "e2e_ours_shm_8192",
    ),
    (
        "end to end speed-up over torch, plain dict, 8192 tensors",
        "e2e_torch_8192",
        "e2e_ours_plain_8192",
    ),
    ("end to end speed-up over torch, ShmStager, 256 tensors", "e2e_torch_256", "e2e_ours_shm_256"),
    (
        "end to end speed-up over torch, plain dict, 256 tensors",
        "e2e_torch_256",
        "e2e_ours_plain_256",
    ),
    ("handoff speed-up over torch, 8192 tensors", "handoff_torch_8192", "handoff_ours_8192"),
    ("persist bandwidth, ours (writer) / dd conv=fsync", "persist_dd", "persist_ours"),
    (
        "persist bandwidth, ours O_DIRECT (writer) / dd conv=fsync",
        "persist_dd",
        "persist_ours_direct",
    ),
    (
        "persist bandwidth, ours O_DIRECT (writer) / dd oflag=direct",
        "persist_dd_direct",
        "persist_ours_direct",
    ),
    ("save end to end bandwidth, ours / dd conv=fsync", "persist_dd", "save_ours"),
    ("save end to end bandwidth, ours / torch.save + fsync", "persist_torch_save", "save_ours"),
]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not MEDIANS and not ROWS:
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
            "machine": machine(),
            "medians_s": MEDIANS,
            "ratios": dict(rows),
            "rows": ROWS,
            "axes": {"size_axis_tensors": SIZE_AXIS_TENSORS,
                     "count_axis_bytes": COUNT_AXIS_BYTES[bool(config.getoption("--bench-quick"))]},
        }  # fmt: skip
        Path(path).write_text(json.dumps(payload, indent=2))
