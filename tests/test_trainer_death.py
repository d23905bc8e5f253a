"""A staged checkpoint outlives its trainer: SIGKILL right after save() returned, and the writer
still finishes the write, commits it (multi-rank too), removes the shared memory and exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import pyshmckpt

from helpers import SHM, assert_same_tree, child_env, pid_running, wait_until

TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys

    import torch

    import pyshmckpt
    from slow_writer import register_slow_writer

    def main():
        root, rank, world, policy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        config = pyshmckpt.CheckpointProcessConfig(write_timeout_secs=60, on_trainer_death=policy)
        checkpointer = pyshmckpt.Checkpointer(
            root, writer=register_slow_writer(), rank=rank, world_size=world, run_id="deadtrainer",
            barrier_timeout=60, config=config,
        )
        torch.manual_seed(rank)
        state = {"w": torch.randn(256, 64), "b": torch.arange(10) * rank, "step": 7}
        checkpointer.save(state, name="final")  # staged and handed over; written in the background
        print(json.dumps({"writer": checkpointer._process.pid}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill, a segfault: no cleanup of any kind


    if __name__ == "__main__":
        main()
    """
)


def expected_state(rank: int) -> dict[str, object]:
    torch.manual_seed(rank)
    return {"w": torch.randn(256, 64), "b": torch.arange(10) * rank, "step": 7}


def segments_of_session() -> set[str]:
    import os

    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-"
    return {p.name for p in SHM.iterdir() if p.name.startswith(prefix)}


def run_trainers(tmp_path: Path, world: int, policy: str) -> list[int]:
    """Start `world` trainers that save once and SIGKILL themselves; returns their writers' pids
    once every trainer is dead."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    root = tmp_path / "ckpt"
    root.mkdir(exist_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), str(rank), str(world), policy],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=str(tmp_path),
        )  # fmt: skip
        for rank in range(world)
    ]
    writers = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == -9, f"the trainer exited with {proc.returncode}:\n{err}"
            writers.append(json.loads(out.splitlines()[-1])["writer"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return writers


def wait_for_writers(writers: list[int], timeout: float) -> None:
    wait_until(lambda: not any(pid_running(pid) for pid in writers), timeout, "the writers to exit")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2])
def test_a_save_staged_before_the_trainer_was_killed_is_committed(tmp_path, world):
    before = segments_of_session()
    writers = run_trainers(tmp_path, world, "finish")
    wait_for_writers(writers, 120)
    root = tmp_path / "ckpt"
    latest = root / "latest"
    assert latest.is_symlink()
    assert latest.readlink() == Path("final")
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "final",
        "latest",
    ]
    for rank in range(world):
        loaded = pyshmckpt.load(root, rank=rank)  # checksums verified
        assert_same_tree(expected_state(rank), loaded)
    assert segments_of_session() - before == set()


@pytest.mark.timeout(240)
def test_abandon_on_trainer_death_drops_the_staged_save(tmp_path):
    before = segments_of_session()
    writers = run_trainers(tmp_path, 1, "abandon")
    wait_for_writers(writers, 15)
    root = tmp_path / "ckpt"
    assert not (root / "final").exists()
    assert not (root / "latest").exists()
    assert segments_of_session() - before == set()
    with pyshmckpt.Checkpointer(root) as checkpointer:  # the next run cleans what was left
        assert [p.name for p in root.iterdir()] == []
        assert checkpointer.latest() is None


CRASHING_TRAINER = textwrap.dedent(
    """
    import json, sys

    import torch

    import pyshmckpt
    from slow_writer import register_slow_writer


    def main():
        checkpointer = pyshmckpt.Checkpointer(sys.argv[1], writer=register_slow_writer())
        torch.manual_seed(0)
        checkpointer.save({"w": torch.randn(256, 64), "b": torch.arange(10) * 0, "step": 7}, name="final")
        print(json.dumps({"writer": checkpointer._process.pid}), flush=True)
        raise RuntimeError("training crashed")  # never closed: the exit path must do it


    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(240)
def test_a_trainer_that_dies_of_an_exception_still_persists_its_staged_save(tmp_path):
    """An uncaught exception ends the trainer through the interpreter's exit: the Checkpointer's
    finalizer finishes the pending save there, and nothing else is raised or printed."""
    before = segments_of_session()
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_TRAINER)
    root = tmp_path / "ckpt"
    root.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(root)],
        capture_output=True, text=True, env=child_env(), cwd=str(tmp_path), timeout=180,
        check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr
    assert "RuntimeError: training crashed" in done.stderr
    wait_for_writers([json.loads(done.stdout.splitlines()[-1])["writer"]], 30)
    assert (root / "latest").readlink() == Path("final")
    assert_same_tree(expected_state(0), pyshmckpt.load(root))
    assert segments_of_session() - before == set()


RESTARTED = textwrap.dedent(
    """
    # A training script under `torchrun --max-restarts 1`: its first attempt saves, then its
    # worker's process group gets SIGTERM right after save() returned (what torch's elastic agent
    # sends each worker's group to stop a worker group); the restarted attempt finds the save.
    import json, os, signal, sys, time

    import torch

    import pyshmckpt

    # The ranks meet through the shared root alone (no process group: gloo's reconnection
    # after a restart is torch's to get right, not what this checks).
    root = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    state = {"w": torch.full((1024, 64), float(rank)), "step": 12}
    checkpointer = pyshmckpt.Checkpointer(
        root, rank=rank, world_size=world, run_id=f"attempt{attempt}", barrier_timeout=60,
        config=pyshmckpt.CheckpointProcessConfig(write_timeout_secs=60),
    )
    if attempt == 0:
        checkpointer.save(state, name="step00012")
        # Once every rank's save() returned (a barrier through files), each worker's group gets
        # SIGTERM, as the agent sends it: the worker dies, its writer must not.
        saved = os.path.join(os.path.dirname(root), f"saved{rank}")
        open(saved, "w").close()
        deadline = time.monotonic() + 60
        while not all(os.path.exists(saved[:-1] + str(r)) for r in range(world)):
            if time.monotonic() > deadline:
                sys.exit("the other ranks never saved")
            time.sleep(0.01)
        os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(60)
    deadline = time.monotonic() + 60
    while checkpointer.latest() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    loaded = pyshmckpt.load(root, rank=rank)
    same = bool(torch.equal(loaded["w"], state["w"])) and loaded["step"] == 12
    print(json.dumps({"rank": rank, "attempt": attempt, "same": same}), flush=True)
    checkpointer.close()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_outlives_its_worker_group_sigtermed_by_a_torchrun_restart(tmp_path):
    from helpers import free_port

    script = tmp_path / "train.py"
    script.write_text(RESTARTED)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(script), str(tmp_path / "root")],
        env=child_env(),
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["rank"], r["attempt"], r["same"]) for r in reports) == [
        (0, 1, True), (1, 1, True),
    ]  # fmt: skip
    assert [name for _, name in pyshmckpt.storage.commit.committed(tmp_path / "root")] == [
        "step00012"
    ]


# A trainer whose save is written slowly, with a short stall timeout; it waits for the save and
# says how it ended. With "handed-over", its writer is stopped first (the trainer says when it
# may be) and the trainer stops itself right after save() returns: the write was handed over,
# and the trainer's dispatcher, idle until then, had not yet looked at it when the job stopped.
SUSPENDED_TRAINER = textwrap.dedent(
    """
    import json, logging, os, signal, sys

    import torch

    import pyshmckpt
    from slow_writer import register_slow_writer

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(processName)s %(message)s")
    ck = pyshmckpt.Checkpointer(sys.argv[1], writer=register_slow_writer(), stall_timeout=10)
    ck.wait_for_writer()  # the save goes to the writer at once, not to its spool
    writer = ck._process
    print(json.dumps({"writer": writer.pid}), flush=True)
    handed_over = sys.argv[2] == "handed-over"
    if handed_over:
        sys.stdin.readline()  # the writer is stopped
    future = ck.save({"w": torch.arange(1000.0)}, name="final")
    if handed_over:
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        print("saved", flush=True)
    try:
        future.result(timeout=120)
        print(json.dumps({"saved": True, "writer": writer.pid}), flush=True)
    except pyshmckpt.PyshmckptError as exc:
        print(json.dumps({"saved": False, "error": repr(exc)}), flush=True)
    ck.close()
    """
)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("when", ["mid-write", "handed-over"])
def test_a_job_stopped_and_continued_mid_save_finishes_it(tmp_path, when):
    """A job's processes all stopped (SIGSTOP: a scheduler suspending the job, a frozen cgroup)
    for longer than the stall timeout, then continued: the time they were stopped is not a
    stalled write, so the writer is not killed and the save lands. Whether the job stops while
    the write is written, or right after it was handed over, before the trainer's dispatcher
    (waiting without a deadline until then) has seen it."""
    script = tmp_path / "trainer.py"
    script.write_text(SUSPENDED_TRAINER)
    root = tmp_path / "ckpt"
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(root), when], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        cwd=str(tmp_path),
    )  # fmt: skip
    try:
        writer = json.loads(trainer.stdout.readline())["writer"]  # type: ignore[union-attr]
        if when == "handed-over":
            os.kill(writer, signal.SIGSTOP)
            trainer.stdin.write("go\n")  # type: ignore[union-attr]
            trainer.stdin.flush()  # type: ignore[union-attr]
            wait_until(lambda: _stopped(trainer.pid), 60, "the trainer stopping itself")
        else:
            assert trainer.stdout.readline().strip() == "saved"  # type: ignore[union-attr]
            for pid in (trainer.pid, writer):
                os.kill(pid, signal.SIGSTOP)
        time.sleep(25)  # over twice the stall timeout
        for pid in (trainer.pid, writer):
            os.kill(pid, signal.SIGCONT)
        out, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate(timeout=30)
    assert trainer.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    if result != {"saved": True, "writer": writer}:
        pytest.fail(f"{result}\nthe trainer's log:\n{err}", pytrace=False)
    assert (root / "final" / "commit.json").exists()
