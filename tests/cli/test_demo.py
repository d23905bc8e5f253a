"""``pyshmckpt demo`` as a user runs it: a subprocess of ``python -m pyshmckpt demo``.

Every run is a child interpreter started outside the checkout (the source tree may have no built
extension) with tests/ and the package on PYTHONPATH and this session's segment prefix; every
wait is bounded. A tiny model keeps each run to a few seconds, most of it interpreter and writer
start-up.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import pyshmckpt

from helpers import SHM, child_env, pid_running, wait_until

RUN_TIMEOUT = 180.0  # one tiny demo run: ~10 s here (python, torch, two writer processes)
FIRST_CHECKPOINT_TIMEOUT = 120.0
EXIT_TIMEOUT = 30.0  # from SIGINT until the demo and every process of its group are gone
TINY = [
    "--layers",
    "2",
    "--width",
    "32",
    "--heads",
    "4",
    "--vocab",
    "97",
    "--seq-len",
    "8",
    "--batch-size",
    "2",
]


def demo(*flags: str, cwd: Path, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyshmckpt", "demo", *flags],
        cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def session_segments() -> set[str]:
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-"
    return {p.name for p in SHM.iterdir() if p.name.startswith(prefix)}


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid`."""
    children: list[int] = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return children


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def table_row(stdout: str, label: str) -> list[str]:
    """The cells of the summary table's row that starts with `label`."""
    for line in stdout.splitlines():
        if line.startswith(label):
            return line[len(label) :].split()
    raise AssertionError(f"no table row {label!r} in:\n{stdout}")


def check_report(result: subprocess.CompletedProcess[str], checkpoints: int) -> None:
    out = result.stdout
    where = f"stdout:\n{out}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, where
    assert "Traceback" not in result.stderr, where
    assert len(re.findall(r"^  checkpoint \d+ at step \d+", out, re.M)) == checkpoints, where
    assert f"{checkpoints} checkpoint(s) per transport" in out, where
    for column in ("blocked ms", "durable ms", "throughput", "peak shm MiB", "in trainer"):
        assert column in out, where
    for label in ("pyshmckpt (shared-memory slot)", "torch _experimental (pipe)"):
        blocked, durable, rate, unit, *shm = table_row(out, label)
        assert float(blocked) > 0, where
        assert float(durable) >= float(blocked), where
        assert float(rate) > 0, where
        assert unit in ("MB/s", "GB/s"), where
        assert len(shm) == 2, where
    speedups = table_row(out, "speed-up of pyshmckpt")
    assert len(speedups) == 2, where
    assert all(s.endswith("x") for s in speedups), where
    # Two checks per transport: bitwise state, and the resumed step.
    assert len(re.findall(r"^    OK  ", out, re.M)) == 4, where
    assert "MISMATCH" not in out, where
    assert out.rstrip().endswith("all checks passed"), where


def test_demo_runs_compares_and_restores(tmp_path):
    before = session_segments()
    result = demo(*TINY, "--steps", "5", "--interval", "2", cwd=tmp_path)
    check_report(result, checkpoints=3)  # steps 2, 4 and the last one, 5
    # The default output directory is temporary and removed at the end.
    found = re.search(r"into (\S+) \(temporary, removed at the end\)", result.stdout)
    assert found, result.stdout
    assert not Path(found.group(1)).exists()
    assert session_segments() <= before


def test_demo_keeps_both_transports_checkpoints_in_output(tmp_path):
    out = tmp_path / "out"
    result = demo(
        *TINY, "--steps", "6", "--interval", "2", "--keep", "2", "--output", str(out), cwd=tmp_path
    )
    check_report(result, checkpoints=3)
    assert f"into {out} (kept)" in result.stdout
    # Both restores are timed from the same cache state (tmp_path is on disk here, not tmpfs).
    loads = [line for line in result.stdout.splitlines() if " loaded in " in line]
    assert len(loads) == 2, result.stdout
    assert all("evicted from the page cache first" in line for line in loads), loads

    ours = out / "pyshmckpt"
    assert sorted(p.name for p in ours.iterdir() if not p.name.startswith(".")) == [
        "latest", "step-00000004", "step-00000006",
    ]  # fmt: skip
    for name in ("step-00000004", "step-00000006"):
        assert pyshmckpt.verify(ours / name) > 0
    state = pyshmckpt.load(ours)  # the root: its latest
    assert state["step"] == 6
    assert set(state) == {"model", "optim", "step"}
    model = state["model"]
    assert model["tok.weight"].data_ptr() == model["head.weight"].data_ptr()  # still tied

    theirs = out / "torch"
    assert sorted(p.name for p in theirs.iterdir()) == ["step-00000004", "step-00000006"]
    loaded = torch.load(
        theirs / "step-00000006" / "checkpoint_0.pt", map_location="cpu", weights_only=True
    )
    assert loaded["step"] == 6
    for key, tensor in model.items():
        assert torch.equal(tensor, loaded["model"][key]), key

    # A second run refuses the non-empty directory.
    again = demo(*TINY, "--output", str(out), cwd=tmp_path)
    assert again.returncode == 2
    assert "is not empty" in again.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-size", "two"], "--batch-size: must be a positive integer, not 'two'"),
        (["--width", "30", "--heads", "4"], "--heads 4 must divide --width 30"),
        (["--steps", "5", "--interval", "6"], "--interval 6 is larger than --steps 5"),
        (["--device", "tpu"], "argument --device: invalid choice"),
        (["--output", "{file}"], "is not a directory"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: CUDA is not usable here",
            marks=pytest.mark.skipif(pyshmckpt.cuda_available(), reason="CUDA is usable here"),
        ),
    ],
    ids=["not-an-int", "heads", "interval", "device", "output-file", "no-cuda"],
)
def test_bad_flags_exit_2_with_a_message(tmp_path, flags, message):
    file = tmp_path / "file"
    file.write_text("")
    result = demo(*(flag.format(file=file) for flag in flags), cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result
    assert message in result.stderr, result.stderr
    assert "usage: pyshmckpt demo" in result.stderr
    assert result.stdout == ""


# The demo as a terminal's foreground job runs it: with Ctrl-C's default action. A job started in
# the background by a non-interactive shell (`bash .ci/run &`) inherits SIGINT ignored, and a
# program started so keeps ignoring it (as it should); the same process then execs the demo.
FOREGROUND = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'pyshmckpt', 'demo', *sys.argv[1:]])"
)


def _stacks(pid: int) -> str:
    """What each thread of `pid` is waiting in (the kernel's view), for a report."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            wchan = (task / "wchan").read_text().strip()
            out.append(f"  {task.name} {name}: {wchan}")
    return "\n".join(out)


def _lines(stream, into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


@pytest.mark.parametrize(
    ("flags", "delay"),
    [
        # Tiny state, checkpoints every 3 steps: the SIGINT lands in training (or a checkpoint).
        ([*TINY, "--steps", "100000", "--interval", "3"], 0.0),
        # ~50 MB of state checkpointed at every step: the SIGINT lands while staging or writing.
        (["--layers", "1", "--width", "256", "--heads", "4", "--vocab", "16384", "--seq-len", "8",
          "--batch-size", "2", "--steps", "100000", "--interval", "1"], 0.3),
    ],
    ids=["training", "writing"],
)  # fmt: skip
def test_sigint_to_the_process_group_stops_everything(tmp_path, flags, delay):
    before = session_segments()
    demo_process = subprocess.Popen(
        [sys.executable, "-c", FOREGROUND, *flags],
        cwd=tmp_path, env={**child_env(), "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    pgid = demo_process.pid
    lines: queue.Queue[str | None] = queue.Queue()
    errors: queue.Queue[str | None] = queue.Queue()  # drained, so that the pipe never fills
    readers = [
        threading.Thread(target=_lines, args=(demo_process.stdout, lines), daemon=True),
        threading.Thread(target=_lines, args=(demo_process.stderr, errors), daemon=True),
    ]
    for reader in readers:
        reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + FIRST_CHECKPOINT_TIMEOUT
        while not any(line.startswith("  checkpoint 1 at step") for line in seen):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(
                    f"no checkpoint line within {FIRST_CHECKPOINT_TIMEOUT}s:\n{''.join(seen)}"
                )
            if line is None:
                pytest.fail(
                    f"the demo exited early ({demo_process.wait(EXIT_TIMEOUT)}):\n{''.join(seen)}"
                )
            seen.append(line)
        members = group_members(pgid)
        # torch's writer shares the demo's group; ours runs in a session of its own (a signal
        # to the trainer's group never reaches it: it follows its trainer instead).
        ours = [pid for pid in children_of(pgid) if pid not in members]
        assert len(members) >= 2, f"expected the demo and torch's writer in the group: {members}"
        assert len(ours) == 1, f"expected our writer outside the group: {ours}"
        time.sleep(delay)
        os.killpg(pgid, signal.SIGINT)  # what Ctrl-C in a terminal does
        started = time.monotonic()
        try:
            status = demo_process.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            stacks = _stacks(demo_process.pid)
            os.kill(demo_process.pid, signal.SIGABRT)  # faulthandler prints every thread's stack
            with contextlib.suppress(subprocess.TimeoutExpired):
                demo_process.wait(timeout=5)
            os.killpg(pgid, signal.SIGKILL)
            demo_process.wait(timeout=EXIT_TIMEOUT)
            for reader in readers:
                reader.join(timeout=EXIT_TIMEOUT)
            stderr = "".join(iter(errors.get_nowait, None))
            pytest.fail(
                f"the demo did not exit within {EXIT_TIMEOUT}s of SIGINT\nstdout:\n"
                f"{''.join(seen)}\nstderr:\n{stderr}\nits threads then:\n{stacks}"
            )
        for reader in readers:
            reader.join(timeout=EXIT_TIMEOUT)
        stderr = "".join(iter(errors.get_nowait, None))
        assert status == 130, f"exit status {status}\nstdout:\n{''.join(seen)}\nstderr:\n{stderr}"
        assert "interrupted" in stderr, stderr
        assert "Traceback" not in stderr, stderr
        wait_until(
            lambda: not group_members(pgid) and not pid_running(ours[0]),
            EXIT_TIMEOUT - (time.monotonic() - started),
            "the group and our writer to exit",
        )
        assert session_segments() <= before, sorted(session_segments() - before)
        assert not [
            p
            for p in SHM.iterdir()
            if p.name.startswith(f"{os.environ['PYSHMCKPT_SEGMENT_PREFIX']}-{pgid}-")
        ]
        # The default output directory is removed on Ctrl-C too.
        found = [re.search(r"into (\S+) \(temporary", line) for line in seen]
        paths = [m.group(1) for m in found if m]
        assert paths, seen
        assert not Path(paths[0]).exists(), paths
    finally:
        if demo_process.poll() is None or group_members(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            demo_process.wait(timeout=EXIT_TIMEOUT)
        for reader in readers:
            reader.join(timeout=EXIT_TIMEOUT)
        for stream in (demo_process.stdout, demo_process.stderr):
            if stream is not None:
                stream.close()


# Two peers of multiprocessing's descriptor server (resource_sharer) that connect and vanish
# mid-handshake, as torch's writer killed by the demo's Ctrl-C cleanup does: the first before the
# demo quiets the server's reports, the second after.
CUT_PEERS = """
import os, socket, sys, time
from multiprocessing import resource_sharer

from pyshmckpt.cli.demo import run

read_end, _ = os.pipe()
resource_sharer.DupFd(read_end)  # what pickling a tensor for torch's writer does: starts the server
address = resource_sharer._resource_sharer._address


def cut_peer():
    peer = socket.socket(socket.AF_UNIX)
    peer.connect(address)
    peer.close()  # before answering the server's challenge
    time.sleep(1.0)  # the server thread reports meanwhile


cut_peer()
print("--- quiet from here", file=sys.stderr, flush=True)
run._quiet_fd_server()
cut_peer()
"""


def test_a_writer_killed_mid_descriptor_transfer_prints_no_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", CUT_PEERS], capture_output=True, text=True, env=child_env(),
        cwd=str(tmp_path), timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    before, after = done.stderr.split("--- quiet from here")
    assert "Traceback" in before, before  # what it quiets
    assert "resource_sharer.py" in before, before
    assert after.strip() == "", after
