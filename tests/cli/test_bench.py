"""`pyshmckpt bench`: the comparison table, the plots, and one small run of the real suite."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import pyshmckpt
from pyshmckpt.cli import bench as bench_runner

from helpers import HERE, child_env

SUITE = HERE.parent / "bench"  # HERE is tests/
MIB = 1 << 20
RUN_TIMEOUT = 300


def rows() -> list[dict]:
    out = []
    for nbytes, tensors, ours, torch_s in [
        (64 * MIB, 256, 0.01, 0.1),
        (256 * MIB, 256, 0.03, 0.2),
        (64 * MIB, 16, 0.004, 0.09),
    ]:
        for transport, median in (("ours", ours), ("torch", torch_s)):
            out.append({"phase": "e2e", "transport": transport, "nbytes": nbytes, "tensors": tensors,
                        "median_s": median, "GiB_per_s": nbytes / 2**30 / median})  # fmt: skip
    out.append({"phase": "e2e", "transport": "ours", "nbytes": 64 * MIB, "tensors": 16384, "median_s": 0.2,
                "GiB_per_s": 0.31})  # fmt: skip
    out.append({"phase": "e2e", "transport": "torch", "nbytes": 64 * MIB, "tensors": 16384, "median_s": None,
                "GiB_per_s": None, "error": "EMFILE: too many descriptors"})  # fmt: skip
    return out


def test_comparison_pairs_the_transports_and_computes_the_speed_up():
    lines = bench_runner.comparison(rows())
    by_case = {(line["nbytes"], line["tensors"]): line for line in lines}
    assert by_case[(64 * MIB, 256)]["speedup"] == pytest.approx(10.0)
    assert by_case[(64 * MIB, 256)]["ours_GiB_per_s"] == pytest.approx(6.25)
    failed = by_case[(64 * MIB, 16384)]
    assert "speedup" not in failed
    assert failed["torch_error"].startswith("EMFILE")
    table = bench_runner.format_table(lines)
    assert "10.0x" in table
    assert "failed" in table
    assert "torch failed at 64 MiB, 16384 tensors: EMFILE" in table
    assert [line["tensors"] for line in lines if line["nbytes"] == 64 * MIB] == [16, 256, 16384]


def test_plots_are_written_as_png(tmp_path):
    results = {
        "rows": rows(),
        "axes": {"size_axis_tensors": 256, "count_axis_bytes": 64 * MIB},
        "machine": {"cpu": "x"},
    }
    written = bench_runner.plot(results, tmp_path)
    assert [p.name for p in written] == ["throughput_vs_size.png", "throughput_vs_tensors.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000


def test_the_suite_is_found_outside_a_clone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./bench here
    suite = bench_runner.find_suite(None)
    assert (suite / "test_sweep.py").is_file()
    assert (suite / "conftest.py").is_file()
    package = Path(pyshmckpt.__file__).resolve().parent
    if package.parent != HERE.parent:  # an installed wheel (as CI installs it), not the clone
        assert suite == package / "bench"
        assert sorted(p.name for p in suite.glob("*.py")) == sorted(
            p.name for p in SUITE.glob("*.py")
        )


def test_a_missing_suite_is_a_clear_error(tmp_path, capsys):
    args = argparse.Namespace(quick=True, output=tmp_path / "out", suite=tmp_path, timeout=10.0, pytest_args=[],
                              report_only=False)  # fmt: skip
    assert bench_runner.main(args) == 2
    assert "no benchmark suite found" in capsys.readouterr().err


def test_report_only_reads_results_again(tmp_path, capsys):
    results = {
        "rows": rows(),
        "axes": {"size_axis_tensors": 256, "count_axis_bytes": 64 * MIB},
        "ratios": {"r": 2.5},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    args = argparse.Namespace(output=tmp_path, report_only=True)
    assert bench_runner.main(args) == 0
    out = capsys.readouterr().out
    assert "10.0x" in out
    assert "2.50" in out
    assert (tmp_path / "throughput_vs_size.png").exists()
    assert (tmp_path / "comparison.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert bench_runner.main(argparse.Namespace(output=empty, report_only=True)) == 1
    assert "no results to report" in capsys.readouterr().err


@pytest.mark.skipif(
    not (SUITE / "test_sweep.py").exists(), reason="needs the repository's bench/ directory"
)
@pytest.mark.slow  # it runs the suite without -O in either pass, so the -O pass leaves it out
def test_quick_run_of_a_slice_of_the_suite_reports_and_plots(tmp_path):
    env = child_env()
    env.pop("PYTHONOPTIMIZE", None)  # the suite asserts its own set-up; run it as users do
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = 512  # too few descriptors for torch's transport with 256 tensors, unless the suite raises it
    if hard != resource.RLIM_INFINITY and hard < 4 * low:
        pytest.skip(
            f"the hard RLIMIT_NOFILE ({hard}) leaves no room to test that the suite raises it"
        )
    done = subprocess.run(
        [sys.executable, "-m", "pyshmckpt", "bench", "--quick",  # the suite it finds itself
         "--output", str(tmp_path / "out"), "--", "-k", "64MiB-256t"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_sweep[e2e-64MiB-256t-torch] PASSED" in done.stdout  # pytest's progress lines
    assert "speed-up" in done.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    limits = results["machine"]["rlimit_nofile"]
    assert limits["initial_soft"] == low
    assert limits["soft"] == limits["hard"] == hard
    measured = {(r["phase"], r["transport"]) for r in results["rows"]}
    assert measured == {
        ("staging", "ours"),
        ("staging", "torch"),
        ("e2e", "ours"),
        ("e2e", "torch"),
    }
    assert all(r["GiB_per_s"] > 0 and r["nbytes"] == 64 * MIB for r in results["rows"])
    for name in (
        "throughput_vs_size.png",
        "throughput_vs_tensors.png",
        "pytest-benchmark.json",
        "comparison.json",
    ):
        assert (tmp_path / "out" / name).stat().st_size > 0, name


OUTPUT_NAMES = ("results.json", "comparison.json", "pytest-benchmark.json", "throughput_vs_size.png",
                "throughput_vs_tensors.png")  # fmt: skip
STALE = {name: b"stale from an earlier run" for name in OUTPUT_NAMES}
STALE["results.json"] = json.dumps(
    {"rows": rows(), "axes": {}, "ratios": {"stale ratio": 9.75}}
).encode()


@pytest.mark.skipif(
    not (SUITE / "test_sweep.py").exists(), reason="needs the repository's bench/ directory"
)
@pytest.mark.slow  # as above: never run under -O
def test_a_run_that_measures_nothing_reports_no_earlier_results(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name, content in STALE.items():
        (out / name).write_bytes(content)
    (out / "notes.txt").write_text("not ours")
    env = child_env()
    env.pop("PYTHONOPTIMIZE", None)
    done = subprocess.run(
        [sys.executable, "-m", "pyshmckpt", "bench", "--quick", "--suite", str(SUITE), "--output", str(out),
         "--", "-k", "nothing-matches"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the benchmark suite failed" in done.stderr
    assert "speed-up" not in done.stdout
    assert "9.75" not in done.stdout
    left = {p.name: p.read_bytes() for p in out.iterdir()}
    # pytest-benchmark writes its (empty) record of this run; nothing of the earlier run is left,
    # and only what a run writes was removed.
    assert sorted(left) in (["notes.txt"], ["notes.txt", "pytest-benchmark.json"])
    assert left.get("pytest-benchmark.json") != STALE["pytest-benchmark.json"]


def test_previous_outputs_are_removed_before_pytest_starts(tmp_path, monkeypatch):
    for name, content in STALE.items():
        (tmp_path / name).write_bytes(content)
    seen: list[list[str]] = []

    class Started:
        def __init__(self, command, cwd):
            seen.append(sorted(p.name for p in tmp_path.iterdir()))

        def wait(self, timeout):
            return 5  # pytest: no tests collected

    monkeypatch.setattr(bench_runner.subprocess, "Popen", Started)
    assert bench_runner.run_suite(SUITE, tmp_path, True, [], 10.0) == 5
    assert seen == [[]]


def test_an_output_that_cannot_be_removed_is_a_clear_error(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    (out / "results.json").mkdir(parents=True)  # a directory: unlink fails
    (out / "results.json" / "x").write_text("x")
    monkeypatch.setattr(bench_runner, "missing_packages", lambda: [])
    started: list[object] = []
    monkeypatch.setattr(bench_runner.subprocess, "Popen", lambda *a, **k: started.append(a))
    args = argparse.Namespace(
        quick=True, output=out, suite=SUITE, timeout=10.0, pytest_args=[], report_only=False
    )
    assert bench_runner.main(args) == 2
    err = capsys.readouterr().err
    assert "cannot remove the previous run's" in err
    assert "results.json" in err
    assert started == []  # pytest never ran
