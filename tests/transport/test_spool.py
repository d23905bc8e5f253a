"""Writes made while the writer process starts: spooled, handed over once it is ready, finished
even when the trainer dies first, failed (never lost silently) when the start fails."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import pyshmckpt
from pyshmckpt import CheckpointProcess, CheckpointProcessConfig
from pyshmckpt.transport import RankInfo
from pyshmckpt.transport.spool import Spool, SpoolReader

from helpers import SHM, child_env, failure_of, pid_running, wait_until
from writer_side import TensorFileWriter, die_in_init, fail_init, wait_for_file

TIMEOUT = 60


def spooling_process(init: object, *args: object) -> CheckpointProcess:
    """A CheckpointProcess that spools writes while its writer runs `init(*args)`."""
    return CheckpointProcess(
        RankInfo(0, 1),
        CheckpointProcessConfig(wait_for_start=False, subprocess_init_timeout_secs=TIMEOUT),
        init, args, TensorFileWriter, {},
    )  # fmt: skip


def gated_process(gate: Path) -> CheckpointProcess:
    return spooling_process(wait_for_file, str(gate))


def test_spool_reads_complete_records_in_order_and_stops_at_a_torn_one():
    spool = Spool()
    try:
        for i in range(3):
            spool.append({"n": i, "data": bytes(i * 1000)})
        assert spool.count == 3
        reader = SpoolReader(os.dup(spool.fd))
        assert [r["n"] for r in reader.read(2)] == [0, 1]
        # A record whose length never landed (the trainer died mid-append) ends the spool.
        torn = pickle.dumps({"n": 99})
        os.pwrite(spool.fd, torn, os.fstat(spool.fd).st_size + 8)
        assert [r["n"] for r in reader.read()] == [2]
        assert reader.read() == []
        reader.close()
        assert reader.read() == []  # closed: nothing more, no error
    finally:
        spool.close()
        spool.close()  # idempotent


def test_a_spooled_record_that_cannot_be_read_costs_only_itself(caplog):
    spool = Spool()
    try:
        for i in range(3):
            spool.append({"n": i})
        # Record 2's bytes damaged in place (its length intact): unpickling it fails.
        first = pickle.dumps({"n": 0}, protocol=pickle.HIGHEST_PROTOCOL)
        second = 8 + len(first) + 8  # records are a length (8 bytes) and a pickle each
        os.pwrite(spool.fd, b"\xff" * len(first), second)
        reader = SpoolReader(os.dup(spool.fd))
        with caplog.at_level("ERROR", logger="pyshmckpt.transport.spool"):
            assert [r["n"] for r in reader.read()] == [0, 2]
        errors = [r.getMessage() for r in caplog.records]
        assert len(errors) == 1, errors
        assert "spooled write 2 cannot be read" in errors[0]
        reader.close()
    finally:
        spool.close()


def test_unpicklable_requests_raise_before_anything_is_spooled():
    spool = Spool()
    try:
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
            spool.append({"f": lambda: None})
        assert spool.count == 0
        spool.append({"n": 1})
        assert [r["n"] for r in SpoolReader(os.dup(spool.fd)).read()] == [1]
    finally:
        spool.close()


@pytest.mark.timeout(120)
def test_writes_made_while_the_writer_starts_are_spooled_and_written_once_it_is_ready(tmp_path):
    gate = tmp_path / "gate"
    process = gated_process(gate)
    try:
        state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
        futures = [process.write(state, str(tmp_path / f"ckpt{i}.pt")) for i in range(2)]
        state["w"].zero_()  # staged before write() returned: the change is not saved
        time.sleep(0.5)
        assert not process.process_creation_future.done()
        assert not any(f.done() for f in futures)
        assert process.pid is not None
        assert pid_running(process.pid)
        gate.touch()
        for future in futures:
            future.result(timeout=TIMEOUT)
        for i in range(2):
            loaded = torch.load(tmp_path / f"ckpt{i}.pt")
            assert torch.equal(loaded["w"], torch.arange(1000, dtype=torch.float32))
            assert loaded["step"] == 3
        # Once it is ready, writes go over the control channel as usual.
        process.write({"x": torch.ones(3)}, str(tmp_path / "later.pt")).result(timeout=TIMEOUT)
        assert torch.equal(torch.load(tmp_path / "later.pt")["x"], torch.ones(3))
    finally:
        gate.touch()
        process.close()


@pytest.mark.timeout(120)
def test_close_finishes_spooled_writes(tmp_path):
    gate = tmp_path / "gate"
    process = gated_process(gate)
    future = process.write({"w": torch.ones(10)}, str(tmp_path / "c.pt"))
    gate.touch()
    process.close()
    assert future.done()
    assert future.exception() is None
    assert torch.equal(torch.load(tmp_path / "c.pt")["w"], torch.ones(10))


@pytest.mark.timeout(120)
def test_a_failed_start_fails_the_spooled_writes_and_later_writes_raise(tmp_path):
    process = spooling_process(fail_init)
    try:
        future = process.write({"w": torch.ones(4)}, str(tmp_path / "x.pt"))
        with pytest.raises(pyshmckpt.WriterStartError, match="failed on purpose"):
            future.result(timeout=TIMEOUT)
        with pytest.raises(pyshmckpt.WriterStartError):
            process.write({"w": torch.ones(4)}, str(tmp_path / "y.pt"))
        assert not (tmp_path / "x.pt").exists()
    finally:
        process.close()


@pytest.mark.timeout(120)
def test_a_writer_that_dies_while_starting_fails_its_spooled_writes_and_is_not_restarted(
    tmp_path,
):
    process = spooling_process(die_in_init)
    try:
        future = process.write({"w": torch.ones(4)}, str(tmp_path / "x.pt"))
        with pytest.raises(pyshmckpt.WriterStartError, match="exit code 3"):
            future.result(timeout=TIMEOUT)
        with pytest.raises(pyshmckpt.WriterStartError, match="exit code 3"):
            process.write({"w": torch.ones(4)}, str(tmp_path / "y.pt"))
        assert len(process._writers) == 1  # a start that failed is not retried behind its back
    finally:
        process.close()


def test_wait_for_start_is_validated():
    with pytest.raises(pyshmckpt.ConfigTypeError, match="wait_for_start"):
        CheckpointProcessConfig(wait_for_start="no")  # type: ignore[arg-type]


TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys

    import torch

    from pyshmckpt import CheckpointProcess, CheckpointProcessConfig
    from pyshmckpt.transport import RankInfo
    from writer_side import TensorFileWriter, wait_for_file

    if __name__ == "__main__":
        gate, target, policy = sys.argv[1:4]
        process = CheckpointProcess(
            RankInfo(0, 1),
            CheckpointProcessConfig(wait_for_start=False, on_trainer_death=policy),
            wait_for_file, (gate,), TensorFileWriter, {},
        )
        process.write({"w": torch.arange(50), "step": 9}, target)
        ready = process.process_creation_future.done()
        print(json.dumps({"writer": process.pid, "ready": ready}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def segments_of_session() -> set[str]:
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-"
    return {p.name for p in SHM.iterdir() if p.name.startswith(prefix)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["finish", "abandon"])
def test_a_write_spooled_before_the_trainer_was_killed(tmp_path, policy):
    """The trainer is SIGKILLed right after write() returned, while its writer is still starting,
    and stale segments are collected before the writer looks: with "finish" the writer still
    writes it once started, and either way it removes the shared memory and exits."""
    before = segments_of_session()
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    gate, target = tmp_path / "gate", tmp_path / "saved.pt"
    # The writer inherits the trainer's output: read the report line, not until EOF.
    with (tmp_path / "stderr").open("w") as stderr:
        trainer = subprocess.Popen(
            [sys.executable, str(script), str(gate), str(target), policy],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env(), cwd=str(tmp_path),
        )  # fmt: skip
    try:
        line = trainer.stdout.readline()  # type: ignore[union-attr]
        assert trainer.wait(timeout=120) == -9, (tmp_path / "stderr").read_text()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.stdout.close()  # type: ignore[union-attr]
    report = json.loads(line)
    assert report["ready"] is False  # the write really was spooled
    # Another job's writer starting on the node meanwhile: the segment of the spooled write is
    # not one of a dead owner's (the trainer handed it to its writer by descriptor).
    pyshmckpt.collect_stale_segments()
    gate.touch()
    wait_until(lambda: not pid_running(report["writer"]), 60, "the writer to exit")
    if policy == "finish":
        saved = torch.load(target)
        assert torch.equal(saved["w"], torch.arange(50))
        assert saved["step"] == 9
    else:
        assert not target.exists()
    assert segments_of_session() - before == set()


@pytest.mark.timeout(120)
def test_a_writer_killed_while_starting_is_restarted_by_the_next_write(tmp_path):
    """Killed while starting (the OOM killer, an operator), a writer is dead like any other: the
    write it held fails and says so, and the next write restarts it and lands."""
    gate = tmp_path / "gate"
    process = gated_process(gate)
    try:
        held = process.write({"w": torch.ones(4)}, str(tmp_path / "held.pt"))
        os.kill(process.pid, signal.SIGKILL)
        error = failure_of(held, TIMEOUT)
        assert isinstance(error, pyshmckpt.WriterDiedError), repr(error)
        assert "killed while starting" in str(error)
        gate.touch()  # the restarted writer's init passes at once
        process.write({"w": torch.arange(3)}, str(tmp_path / "later.pt")).result(TIMEOUT)
        assert torch.equal(torch.load(tmp_path / "later.pt")["w"], torch.arange(3))
        assert not (tmp_path / "held.pt").exists()
    finally:
        process.close()
