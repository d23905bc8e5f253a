"""One ``/dev/shm`` shared by several jobs or processes at once.

- Jobs in PID namespaces of their own share ``/dev/shm`` wherever containers run with
  ``docker run --ipc=host`` or pods mount one volume: another job's writer, collecting stale
  segments when it starts, must leave this job's live slots and its held checkpoint alone (a pid
  means nothing across namespaces; the lock every open segment holds does).
- Ranks of one node allocate at once: a ``/dev/shm`` too small for all of them gives each a typed
  error or its memory, never a SIGBUS, on kernels with ``MADV_POPULATE_WRITE`` and on the path of
  older ones (forced here).

Both need namespaces (``unshare``, as root); they are skipped where those cannot be made. The jobs
are scripts as users write them (no ``__main__`` guard, no teardown).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pyshmckpt.cli import main as cli_main

from helpers import SHM, child_env, pid_running, wait_until

PREFIX_VARIABLE = "PYSHMCKPT_SEGMENT_PREFIX"
UNSHARE = shutil.which("unshare")
RUN_TIMEOUT = 240  # seconds a job may take to start (torch's import) and save; a bound only
HOLD_TIMEOUT = 600  # the hold this test ends itself: a bound should the session die
TEST_TIMEOUT = 4 * RUN_TIMEOUT
SEGMENT = re.compile(r"-\d+-[0-9a-f]{32}$")


def namespaces_unavailable(*flags: str) -> str | None:
    """Why `unshare` with `flags` cannot run here, or None when it can."""
    if UNSHARE is None:
        return "needs util-linux's unshare"
    if os.geteuid() != 0:
        return "needs root to make PID and mount namespaces"
    try:
        done = subprocess.run(
            [UNSHARE, *flags, "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run unshare: {exc}"
    return None if done.returncode == 0 else f"cannot make namespaces: {done.stderr.strip()}"


PID_NAMESPACES = ["--pid", "--fork", "--mount-proc"]
_NO_PID_NAMESPACES = namespaces_unavailable(*PID_NAMESPACES)
_NO_MOUNT_NAMESPACE = namespaces_unavailable("--mount")
needs_pid_namespaces = pytest.mark.skipif(
    _NO_PID_NAMESPACES is not None, reason=str(_NO_PID_NAMESPACES)
)
needs_mount_namespace = pytest.mark.skipif(
    _NO_MOUNT_NAMESPACE is not None, reason=str(_NO_MOUNT_NAMESPACE)
)


# -- two jobs in PID namespaces of their own ------------------------------------------------------

# PID 1 of a job's namespace, as tini is in a container: starts the job's trainer and reaps every
# process left to it (the writer, once the trainer is gone) until none is left; the namespace ends
# with it. PID 1 ignores signals it has no handler for: its alarm has one.
INIT = textwrap.dedent(
    """
    import os, signal, subprocess, sys

    signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
    signal.alarm(int(sys.argv[1]))
    subprocess.Popen([sys.executable, *sys.argv[2:]])
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    """
)

# Job A's trainer: holds its newest checkpoint in memory, saves one in memory only, and trains on.
TRAINER = textwrap.dedent(
    """
    import json, sys, time

    import torch

    import pyshmckpt

    ck = pyshmckpt.Checkpointer(sys.argv[1], hold=True)
    state = {"weights": torch.arange(1 << 20, dtype=torch.float32), "step": 7}
    ck.save(state, name="step-7", persist=False).result(timeout=120)
    print(json.dumps({"saved": "step-7"}), flush=True)
    time.sleep(600)
    """
)

# A new trainer of job A: takes the held checkpoint over as its first slot, then dies before
# saving (its writer then holds that checkpoint, which was never described to it).
TAKEOVER = textwrap.dedent(
    """
    import json, os, signal, sys

    import pyshmckpt

    ck = pyshmckpt.Checkpointer(sys.argv[1], hold=True)
    print(json.dumps({"started": True}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)

# Job B: another job of the same user, starting its own writer, saving and exiting.
OTHER_JOB = textwrap.dedent(
    """
    import sys

    import torch

    import pyshmckpt

    ck = pyshmckpt.Checkpointer(sys.argv[1])
    ck.save({"b": torch.ones(1024)}, name="b").result(timeout=120)
    """
)

# A new process restoring job A's checkpoint from memory (waiting, bounded, for its writer to
# hold it after the trainer's death).
RESTORE = textwrap.dedent(
    """
    import json, sys, time

    import torch

    import pyshmckpt

    deadline = time.monotonic() + float(sys.argv[2])
    while True:
        try:
            state = pyshmckpt.load(sys.argv[1], source="memory")
            break
        except pyshmckpt.PyshmckptError as exc:
            if time.monotonic() > deadline:
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
                sys.exit(0)
            time.sleep(0.1)
    expected = torch.arange(1 << 20, dtype=torch.float32)
    print(json.dumps({"step": state["step"], "same": bool(torch.equal(state["weights"], expected))}))
    """
)


def segments(prefix: str) -> set[str]:
    """Names of the segments (not hold records) under `prefix` in /dev/shm."""
    return {
        p.name for p in SHM.iterdir() if p.name.startswith(prefix + "-") and SEGMENT.search(p.name)
    }


def children(pid: int) -> list[int]:
    """The child processes of `pid` (as this PID namespace numbers them)."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                found += [int(p) for p in (task / "children").read_text().split()]
    return found


def read_json_line(process: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The next line `process` prints, as JSON, waited for at most `timeout` seconds."""
    lines: list[str] = []
    assert process.stdout is not None
    stdout = process.stdout
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or not lines[0]:
        process.kill()
        _, err = process.communicate(timeout=30)
        pytest.fail(f"job printed nothing within {timeout} s:\n{err}")
    return dict(json.loads(lines[0]))


def run_other_job(directory: Path, root: Path, env: dict[str, str]) -> None:
    """Job B, in a PID namespace of its own, to its end."""
    done = subprocess.run(
        [str(UNSHARE), *PID_NAMESPACES, sys.executable, str(directory / "other_job.py"), str(root)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env, cwd=directory, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (root / "b").is_dir()


@contextlib.contextmanager
def job_in_its_own_namespace(
    directory: Path, root: Path, env: dict[str, str], trainer: str = "trainer.py"
) -> Iterator[subprocess.Popen[str]]:
    """A job of A's: its init and trainer in a PID namespace of their own; all of it killed at
    the end."""
    init = directory / "init.py"
    args = [str(UNSHARE), *PID_NAMESPACES, sys.executable, str(init), str(TEST_TIMEOUT)]
    args += [str(directory / trainer), str(root)]
    job = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=directory
    )
    try:
        yield job
    finally:
        for pid in children(job.pid):  # the namespace's init: every process of it dies with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.kill()
        job.communicate(timeout=30)


@pytest.fixture
def job_prefix(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The segment prefix both jobs share (one user's jobs use the same one); whatever the jobs
    leave under it (segments, hold records) is collected afterwards, once they are gone."""
    prefix = f"{os.environ[PREFIX_VARIABLE]}-jobs"
    yield prefix
    monkeypatch.setenv(PREFIX_VARIABLE, prefix)
    with contextlib.redirect_stdout(None):
        cli_main(["gc"])
    for path in SHM.glob(f"{prefix}-*"):  # what gc cannot judge (a record cut short)
        path.unlink(missing_ok=True)


@needs_pid_namespaces
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_another_jobs_writer_leaves_this_jobs_live_slots_and_held_checkpoint(tmp_path, job_prefix):
    for name, source in [
        ("init.py", INIT),
        ("trainer.py", TRAINER),
        ("takeover.py", TAKEOVER),
        ("other_job.py", OTHER_JOB),
        ("restore.py", RESTORE),
    ]:
        (tmp_path / name).write_text(source)
    env = child_env() | {PREFIX_VARIABLE: job_prefix, "PYSHMCKPT_HOLD_TIMEOUT": str(HOLD_TIMEOUT)}
    root = tmp_path / "job-a"
    with job_in_its_own_namespace(tmp_path, root, env) as job:
        assert read_json_line(job, RUN_TIMEOUT) == {"saved": "step-7"}
        # Its second slot is made in the background after the first save.
        wait_until(lambda: len(segments(job_prefix)) >= 2, RUN_TIMEOUT, "job A's second slot")
        live = segments(job_prefix)

        run_other_job(tmp_path, tmp_path / "job-b", env)
        assert live <= segments(job_prefix), "another job's writer removed job A's live slots"

        (init,) = children(job.pid)
        (trainer,) = children(init)
        os.kill(trainer, signal.SIGKILL)  # an OOM kill: its writer holds the newest checkpoint
        wait_until(lambda: not pid_running(trainer), 30, "the trainer to die")
        run_other_job(tmp_path, tmp_path / "job-c", env)

        assert restored_from_memory(tmp_path, root, env) == {"step": 7, "same": True}
        assert segments(job_prefix) & live, "job A's held checkpoint is gone"

        # A new trainer takes it over and dies before saving: its writer, which was never told of
        # that segment, holds it now, through other jobs' collections too.
        with job_in_its_own_namespace(tmp_path, root, env, "takeover.py") as newcomer:
            assert read_json_line(newcomer, RUN_TIMEOUT) == {"started": True}
            job.wait(timeout=RUN_TIMEOUT)  # A's writer gave the checkpoint up: A's namespace ended
            assert restored_from_memory(tmp_path, root, env) == {"step": 7, "same": True}
            run_other_job(tmp_path, tmp_path / "job-d", env)
            assert restored_from_memory(tmp_path, root, env) == {"step": 7, "same": True}


def restored_from_memory(directory: Path, root: Path, env: dict[str, str]) -> dict[str, Any]:
    """What a new process restores of `root` from memory (waiting, bounded, for a hold)."""
    restored = subprocess.run(
        [sys.executable, str(directory / "restore.py"), str(root), str(RUN_TIMEOUT)],
        capture_output=True, text=True, timeout=2 * RUN_TIMEOUT, env=env, cwd=directory,
        check=False,
    )  # fmt: skip
    assert restored.returncode == 0, restored.stderr
    return dict(json.loads(restored.stdout.splitlines()[-1]))


# -- a small /dev/shm filled by two processes at once ---------------------------------------------

# Allocates at the parent's word (a line on stdin), reports how it went as one JSON line, and
# keeps what it got until stdin closes: a rank of a node creating its slots with the others.
ALLOCATOR = textwrap.dedent(
    """
    import json, sys

    from pyshmckpt import _C

    path, how, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if path == "fallback":
        _C._force_populate_fallback(True)  # the kernels before 5.14: pages touched one by one
    kept = _C.Segment.create(size, "pyshmckpt", False) if how == "lazy" else None
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        if kept is None:
            kept = _C.Segment.create(size, "pyshmckpt", True)
        else:  # the arena's background thread filling a slot made empty
            kept.populate(0, kept.mapped_size)
        out = {"result": "allocated"}
    except OSError as exc:
        out = {"result": "error", "errno": exc.errno, "message": str(exc)}
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    """
)

# Runs in a mount namespace of its own: mounts a small tmpfs over /dev/shm, then, for each way of
# allocating, starts two allocators, lets them go at once, and prints what each reported and how
# it ended, as one JSON line (or why it cannot mount). Every wait is bounded.
SMALL_SHM = textwrap.dedent(
    """
    import contextlib, json, os, subprocess, sys

    allocator, path, rounds, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), 60
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", "/dev/shm"],
        capture_output=True, text=True, timeout=30,
    )
    if mounted.returncode != 0:
        print(json.dumps({"skip": mounted.stderr.strip()}), flush=True)
        sys.exit(0)
    out = []
    for how in ("create", "lazy"):
        for _ in range(rounds):
            procs = [
                subprocess.Popen(
                    [sys.executable, allocator, path, how, str(40 << 20)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
                for _ in range(2)
            ]
            try:
                ready = [p.stdout.readline().strip() for p in procs]
                for p in procs:  # one killed by a SIGBUS is read as such below
                    with contextlib.suppress(BrokenPipeError):
                        p.stdin.write("go\\n")
                        p.stdin.flush()
                reports = [p.stdout.readline().strip() for p in procs]
                for p in procs:
                    with contextlib.suppress(BrokenPipeError):
                        p.stdin.close()
                codes = [p.wait(timeout=timeout) for p in procs]
                errors = [p.stderr.read()[-2000:] for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait(timeout=timeout)
            out.append({"how": how, "ready": ready, "reports": reports, "codes": codes,
                        "errors": errors, "left": sorted(os.listdir("/dev/shm"))})
    print(json.dumps(out), flush=True)
    """
)


@needs_mount_namespace
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("path", ["populate", "fallback"])
def test_two_processes_filling_a_small_dev_shm_at_once_get_typed_errors_never_sigbus(
    tmp_path, path
):
    (tmp_path / "allocator.py").write_text(ALLOCATOR)
    (tmp_path / "small_shm.py").write_text(SMALL_SHM)
    args = [str(UNSHARE), "--mount", "--propagation", "private", sys.executable]
    args += [str(tmp_path / "small_shm.py"), str(tmp_path / "allocator.py"), path, "3"]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=child_env(), cwd=tmp_path,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    if isinstance(result, dict) and "skip" in result:
        pytest.skip(f"cannot mount a tmpfs over /dev/shm: {result['skip']}")
    assert len(result) == 6
    for run in result:
        # Exit codes, not reports, first: a SIGBUS shows as -7 here and an empty report.
        assert run["codes"] == [0, 0], run
        assert run["ready"] == ["ready", "ready"], run
        reports = [json.loads(line) for line in run["reports"]]
        for report in reports:
            assert report["result"] in ("allocated", "error"), run
            if report["result"] == "error":
                assert report["errno"] == 28, run  # ENOSPC, with what was allocated given back
                assert "shared memory" in report["message"], run
        assert sum(r["result"] == "allocated" for r in reports) <= 1, run  # 80 MiB into 64 MiB
        assert run["left"] == [], run  # every segment removed by its process at exit
