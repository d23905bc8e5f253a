"""``pyshmckpt bench``: run the benchmark suite (``bench/``), print the comparison, write plots.

The suite is the pytest-benchmark suite of the repository's ``bench/`` directory, which also ships
inside the installed package (``pyshmckpt/bench``): given with ``--suite``, else ./bench,
else the one of the installed package or beside an editable install. Its results go to
``DIR/results.json`` (our medians, ratios and sweep rows) and ``DIR/pytest-benchmark.json``
(pytest-benchmark's own record); the plots to ``DIR/throughput_vs_size.png`` and
``DIR/throughput_vs_tensors.png``, one line per transport. A run first deletes those files of an
earlier run, so a run that measures nothing reports nothing.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import from_os_error, os_error

GIB = 1 << 30
MIB = 1 << 20
PHASES = {"staging": "staging", "e2e": "stage + handoff + writer reads every page"}
TRANSPORTS = {
    "ours": "pyshmckpt (ShmStager + CheckpointProcess)",
    "torch": "torch (DefaultStager + pipe)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the small end of the sweeps, fewer rounds (about 1 min)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="where results and plots go (default %(default)s)",
    )
    parser.add_argument(
        "--suite", type=Path, default=None, help="the bench/ directory (default: found)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3 * 3600,
        help="seconds the whole run may take (default %(default)s: 3 hours)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="only print the table and plot DIR/results.json again",
    )
    parser.add_argument(
        "pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments"
    )


def find_suite(given: Path | None) -> Path:
    """The bench/ directory: `given`, ./bench, the installed package's copy, or the one beside
    the package's source tree (an editable install)."""
    package = Path(__file__).resolve().parents[1]
    candidates = (
        [given]
        if given is not None
        else [Path.cwd() / "bench", package / "bench", package.parent / "bench"]
    )
    for candidate in candidates:
        if (
            candidate is not None
            and (candidate / "conftest.py").is_file()
            and (candidate / "test_sweep.py").is_file()
        ):
            return candidate.resolve()
    where = ", ".join(str(c) for c in candidates)
    raise os_error(
        errno.ENOENT,
        f"no benchmark suite found (looked in {where}); run from a clone of the repository or pass --suite DIR",
    )


def missing_packages() -> list[str]:
    missing = []
    for module, package in (("pytest_benchmark", "pytest-benchmark"), ("matplotlib", "matplotlib")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    return missing


# What a run writes into the output directory: removed before each run, so that a run that
# produces nothing can never report (or leave beside its own) the figures of an earlier one.
OUTPUT_FILES = (
    "results.json", "comparison.json", "pytest-benchmark.json",
    "throughput_vs_size.png", "throughput_vs_tensors.png",
)  # fmt: skip


def remove_previous_outputs(output: Path) -> None:
    """Delete the files of an earlier run from `output` (OUTPUT_FILES; nothing else).

    Raises OSError naming the file when one exists but cannot be removed.
    """
    for name in OUTPUT_FILES:
        path = output / name
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise from_os_error(exc, f"cannot remove the previous run's {path}") from exc


def run_suite(suite: Path, output: Path, quick: bool, extra: list[str], timeout: float) -> int:
    """Run pytest on the suite with its progress on this terminal; returns pytest's exit status.

    The previous run's results and plots in `output` are deleted first (see OUTPUT_FILES).
    """
    remove_previous_outputs(output)
    command = [
        sys.executable, "-m", "pytest", str(suite if not quick else suite / "test_sweep.py"), "-v",
        f"--bench-json={output / 'results.json'}", f"--benchmark-json={output / 'pytest-benchmark.json'}",
    ]  # fmt: skip
    if quick:
        command.append("--bench-quick")
    command += [a for a in extra if a != "--"]
    print("running:", " ".join(command), flush=True)
    # cwd: the suite itself, never the repository root, whose source tree (python -m puts the
    # cwd first on sys.path) would shadow the installed, built package.
    process = subprocess.Popen(command, cwd=suite)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=60)
        print(f"the benchmark suite ran past {timeout:g} s and was stopped", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        process.wait(timeout=120)  # pytest got the SIGINT too: let it clean up
        raise


def _label(nbytes: int) -> str:
    return f"{nbytes / GIB:g} GiB" if nbytes >= GIB else f"{nbytes // MIB} MiB"


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (phase, size, tensor count): each transport's GiB/s and ours / torch."""
    cases: dict[tuple[str, int, int], dict[str, float]] = {}
    errors: dict[tuple[str, int, int], dict[str, str]] = {}
    for row in rows:
        key = (row["phase"], int(row["nbytes"]), int(row["tensors"]))
        cases.setdefault(key, {})
        if row.get("median_s"):
            cases[key][row["transport"]] = float(row["median_s"])
        else:
            errors.setdefault(key, {})[row["transport"]] = str(row.get("error", "failed"))
    out = []
    for (phase, nbytes, tensors), medians in sorted(
        cases.items(), key=lambda kv: (list(PHASES).index(kv[0][0]), kv[0][1], kv[0][2])
    ):
        line: dict[str, Any] = {"phase": phase, "nbytes": nbytes, "tensors": tensors}
        for transport, error in errors.get((phase, nbytes, tensors), {}).items():
            line[f"{transport}_error"] = error
        for transport in TRANSPORTS:
            if transport in medians:
                line[f"{transport}_ms"] = medians[transport] * 1e3
                line[f"{transport}_GiB_per_s"] = nbytes / GIB / medians[transport]
        if "ours" in medians and "torch" in medians:
            line["speedup"] = medians["torch"] / medians["ours"]
        out.append(line)
    return out


def _cell(line: dict[str, Any], key: str, fmt: str, width: int) -> str:
    if key in line:
        return format(line[key], fmt).rjust(width)
    failed = f"{key.split('_')[0]}_error" in line and key.endswith("_ms")
    return ("failed" if failed else "-").rjust(width)


def format_table(lines: list[dict[str, Any]]) -> str:
    header = (
        f"{'phase':8s} {'size':>8s} {'tensors':>8s} {'ours ms':>10s} {'GiB/s':>7s} "
        f"{'torch ms':>10s} {'GiB/s':>7s} {'speed-up':>9s}"
    )
    text = [header, "-" * len(header)]
    notes = []
    for line in lines:
        notes += [
            f"  {t} failed at {_label(line['nbytes'])}, {line['tensors']} tensors: {line[f'{t}_error']}"
            for t in TRANSPORTS
            if f"{t}_error" in line
        ]
        text.append(
            f"{line['phase']:8s} {_label(line['nbytes']):>8s} {line['tensors']:8d} "
            f"{_cell(line, 'ours_ms', ',.1f', 10)} {_cell(line, 'ours_GiB_per_s', '.2f', 7)} "
            f"{_cell(line, 'torch_ms', ',.1f', 10)} {_cell(line, 'torch_GiB_per_s', '.2f', 7)} "
            f"{_cell(line, 'speedup', '.1f', 8)}" + ("x" if "speedup" in line else " ")
        )
    return "\n".join(text + notes)


def plot(results: dict[str, Any], output: Path) -> list[Path]:
    """Throughput against size and against tensor count, one line per transport and phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.get("rows", [])
    axes_info = results.get("axes", {})
    machine = results.get("machine", {})
    subtitle = f"{machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores" + (
        f", {machine['gpu']}" if machine.get("gpu") else ""
    )
    size_tensors = axes_info.get("size_axis_tensors")
    count_bytes = axes_info.get("count_axis_bytes")
    plots = [
        (
            "throughput_vs_size.png", "nbytes", "tensors", size_tensors, "state size (MiB)", MIB,
            f"throughput against state size ({size_tensors} tensors)",
        ),
        (
            "throughput_vs_tensors.png", "tensors", "nbytes", count_bytes, "tensors in the state dict", 1,
            f"throughput against tensor count ({_label(int(count_bytes or 0))})",
        ),
    ]  # fmt: skip
    written = []
    for name, x_key, fixed_key, fixed_value, x_label, x_unit, title in plots:
        fig, panels = plt.subplots(1, len(PHASES), figsize=(11, 4.2), squeeze=False)
        for panel, (phase, phase_title) in zip(panels[0], PHASES.items(), strict=True):
            for transport, label in TRANSPORTS.items():
                points = sorted(
                    (r[x_key] / x_unit, r["GiB_per_s"])
                    for r in rows
                    if r["phase"] == phase
                    and r["transport"] == transport
                    and r[fixed_key] == fixed_value
                    and r["GiB_per_s"]
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    panel.plot(xs, ys, marker="o", label=label)
            failed = [
                f"{TRANSPORTS[r['transport']].split(' ')[0]} fails at {r[x_key] // x_unit:g}: "
                f"{r['error'].split(':')[0]}"
                for r in rows
                if r["phase"] == phase and r[fixed_key] == fixed_value and r.get("error")
            ]
            if failed:
                panel.text(0.98, 0.98, "\n".join(failed), transform=panel.transAxes, fontsize=8, color="crimson",
                           ha="right", va="top")  # fmt: skip
            panel.set_xscale("log", base=2 if x_key == "tensors" else 4)
            ticks = sorted({x for line in panel.get_lines() for x in line.get_xdata()})
            if ticks:
                panel.set_xticks(ticks, [f"{t:,.0f}" for t in ticks])
                panel.minorticks_off()
            panel.set_yscale("log")
            panel.set_xlabel(x_label)
            panel.set_ylabel("GiB/s (median)")
            panel.set_title(phase_title, fontsize=10)
            panel.grid(True, which="both", alpha=0.3)
            if panel.get_lines():
                panel.legend(fontsize=8)
            else:
                panel.text(
                    0.5, 0.5, "not measured", transform=panel.transAxes, ha="center", color="gray"
                )
        fig.suptitle(f"{title}\n{subtitle}", fontsize=10)
        fig.tight_layout()
        path = output / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def report(output: Path) -> int:
    """Print the comparison of `output/results.json` and write its plots."""
    results_path = output / "results.json"
    try:
        results = json.loads(results_path.read_text())
    except (OSError, ValueError) as exc:
        print(f"no results to report: {results_path}: {exc}", file=sys.stderr)
        return 1
    lines = comparison(results.get("rows", []))
    print()
    print("ours against torch's transport (medians; speed-up = torch time / ours):")
    print(format_table(lines))
    for label, value in results.get("ratios", {}).items():
        print(f"  {label:62s} {value:7.2f}")
    (output / "comparison.json").write_text(json.dumps(lines, indent=2))
    for path in plot(results, output):
        print(f"wrote {path}")
    print(f"wrote {results_path}, {output / 'comparison.json'}")
    return 0


def main(args: argparse.Namespace) -> int:
    missing = missing_packages()
    if args.report_only:
        missing = [m for m in missing if m == "matplotlib"]
    if missing:
        print(
            f"pyshmckpt bench needs {', '.join(missing)}: python -m pip install "
            f"{' '.join(missing)} (the bench extra)",
            file=sys.stderr,
        )
        return 2
    if args.report_only:
        return report(args.output.resolve())
    try:
        suite = find_suite(args.suite)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    output = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    if not os.access(output, os.W_OK):
        print(f"cannot write to {output}", file=sys.stderr)
        return 2
    try:
        status = run_suite(suite, output, args.quick, list(args.pytest_args), args.timeout)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        print(exc, file=sys.stderr)
        return 2
    if status != 0:
        print(f"the benchmark suite failed (pytest exit status {status})", file=sys.stderr)
        if not (output / "results.json").exists():
            return status
    reported = report(output)
    return status or reported
