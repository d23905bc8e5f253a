"""Fault injection for the writer subprocess of CheckpointProcess.

Real spawned writers are killed, stopped, hung, made to raise, to exit, to time out and to answer
the wrong generation; the trainer itself is SIGKILLed; stale segments of dead owners are
collected. Every wait is bounded, and every CheckpointProcess is closed by a fixture, so no writer
process and no segment of this session outlives its test (conftest checks the segments).

Code that runs in the writer (RecordingWriter and the init functions) is in writer_side.py, which
the writer process imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import pyshmckpt
from pyshmckpt import (
    _C,
    CheckpointAbortedError,
    CheckpointProcess,
    CheckpointProcessConfig,
    ProtocolError,
    WriterDiedError,
    WriterError,
    WriterStartError,
    WriterStartTimeoutError,
    WriteStalledError,
    WriteTimeoutError,
    _processes,
)
from pyshmckpt.shm import stale
from pyshmckpt.transport import parent as writer_process
from pyshmckpt.transport.channel import Kind, Request

from helpers import (
    SHM,
    child_env,
    failure_of,
    pid_running,
    proc_state,
    thread_waits,
    wait_until,
)
from writer_side import (
    ProgressingWriter,
    RecordingWriter,
    digest_tree,
    init_exit,
    init_ok,
    init_raise,
    init_sleep,
)

SPAWN_TIMEOUT = 60.0  # a real spawn takes 1-3 s here; generous for loaded machines


# --------------------------------------------------------------------------------------------
# helpers (parent side)
# --------------------------------------------------------------------------------------------


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.arange(32, dtype=torch.int64) * (step + 1),
        },
        "optim": {"step": torch.tensor(float(step)), "lr": 1e-3},
        "step": step,
    }


def expected_digest(state_dict: Any) -> dict[str, Any]:
    return json.loads(json.dumps(digest_tree(state_dict)))


def read_record(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def wait_started(target: Path, timeout: float = SPAWN_TIMEOUT) -> int:
    """Wait until the writer entered write() for `target`; returns the writer's pid."""
    marker = Path(f"{target}.started")
    wait_until(marker.exists, timeout, f"the writer to start {target.name}")
    return int(marker.read_text())


def pid_exists(pid: int) -> bool:
    """True while `pid` exists at all (a zombie not yet reaped counts)."""
    return proc_state(pid) is not None


class OnDone:
    """A done-callback recording, at the moment `future` fails, whether `pid` still exists."""

    def __init__(self, future: Future[Any], pid: int) -> None:
        self.pid = pid
        self.exists: bool | None = None
        self.at: float | None = None
        self._event = threading.Event()
        future.add_done_callback(self)

    def __call__(self, future: Future[Any]) -> None:
        self.exists = pid_exists(self.pid)
        self.at = time.monotonic()
        self._event.set()

    def wait(self, timeout: float = 5.0) -> None:
        # set_exception() wakes waiters before it runs the callbacks: wait for ours to have run.
        assert self._event.wait(timeout), "the done-callback did not run"


def kill_quietly(pid: int | None) -> None:
    if pid is not None and pid_running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def make_cp(tmp_path: Path) -> Iterator[Callable[..., CheckpointProcess]]:
    """Build CheckpointProcesses with a RecordingWriter writing under tmp_path; all are closed
    (abort) and all their writer processes killed at teardown."""
    made: list[CheckpointProcess] = []
    pids: set[int] = set()

    def make(
        mode: str = "ok",
        delay: float = 0.0,
        init_fn: Callable[..., Any] = init_ok,
        init_args: tuple[Any, ...] = (),
        close_error: str | None = None,
        close_mode: str = "ok",
        writer: type[RecordingWriter] = RecordingWriter,
        **overrides: Any,
    ) -> CheckpointProcess:
        settings: dict[str, Any] = {
            "subprocess_init_timeout_secs": SPAWN_TIMEOUT,
            "subprocess_shutdown_timeout_secs": 2,
            "write_timeout_secs": 30,
            "slot_timeout_secs": 10,
        }
        settings.update(overrides)
        cp = CheckpointProcess(
            {"rank": 0, "world_size": 1},
            CheckpointProcessConfig(**settings),
            init_fn,
            init_args,
            writer,
            {
                "out_dir": str(tmp_path),
                "mode": mode,
                "delay": delay,
                "close_error": close_error,
                "close_mode": close_mode,
            },  # fmt: skip
        )
        made.append(cp)
        return cp

    yield make
    for cp in made:
        if cp.pid is not None:
            pids.add(cp.pid)
        with contextlib.suppress(Exception):
            cp.close(abort=True)
    for pid in pids:
        kill_quietly(pid)


def started(cp: CheckpointProcess) -> int:
    cp.process_creation_future.result(timeout=SPAWN_TIMEOUT)
    pid = cp.pid
    assert pid is not None
    assert pid_running(pid)
    return pid


def write_ok(cp: CheckpointProcess, target: Path, step: int, **kwargs: Any) -> dict[str, Any]:
    """A write that must succeed; returns the writer's record, checked against the source."""
    state = make_state(step)
    digest = expected_digest(state)
    cp.write(state, str(target), **kwargs).result(timeout=SPAWN_TIMEOUT)
    record = read_record(target)
    assert record["digest"] == digest
    assert record["rank_info"] == {"rank": 0, "world_size": 1}
    return record


# --------------------------------------------------------------------------------------------
# the writer dies
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_sigkill_mid_write_fails_the_write_at_once_then_the_next_write_restarts(make_cp, tmp_path):
    cp = make_cp(mode="hang", max_restarts=3)
    started(cp)
    killed: list[int] = []
    for i in range(3):
        target = tmp_path / f"killed-{i}"
        future = cp.write(make_state(i), str(target))  # restarts the writer for i > 0
        pid = wait_started(target)
        assert pid == cp.pid
        assert pid not in killed
        assert not future.done()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        exc = failure_of(future, 10)
        latency = time.monotonic() - killed_at
        assert isinstance(exc, WriterDiedError), repr(exc)
        assert isinstance(exc, RuntimeError)
        assert "signal SIGKILL" in str(exc)
        assert f"pid {pid}" in str(exc)
        assert latency < 8.0, (
            f"the write failed {latency:.2f}s after the kill"
        )  # not at its timeout
        assert not pid_running(pid)
        assert not target.exists()
        killed.append(pid)

    # The third restart: a write that succeeds, on a fresh process, with the right bytes.
    target = tmp_path / "survivor"
    record = write_ok(cp, target, 42, mode="ok", tag="final")
    assert record["pid"] == cp.pid
    assert record["pid"] not in killed
    assert record["kwargs"] == {"tag": "final"}
    assert not any(target.with_name(f"killed-{i}").exists() for i in range(3))


# What a writer that holds checkpoints leaves when it is killed: a segment and its record, held
# by nobody once this process dies (SIGKILL).
LEFTOVERS = textwrap.dedent(
    """
    import os, signal

    from pyshmckpt.shm.native import Segment
    from pyshmckpt.tiers import records

    segment = Segment.create(4096, os.environ["PYSHMCKPT_SEGMENT_PREFIX"], True)
    info = records.HoldInfo("/nowhere", 0, 1, "step-1", 1, False, 60.0, None, False)
    record = dict(records.pending_record(info), pending=False, segment={"name": segment.name})
    path = records.publish(record, os.getpid(), None, None)
    print(segment.name, path.name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_dead_writers_leftovers_are_collected_when_it_is_replaced(make_cp, tmp_path):
    cp = make_cp(mode="ok", max_restarts=1)
    first = started(cp)
    done = subprocess.run(
        [sys.executable, "-c", LEFTOVERS], capture_output=True, text=True, env=child_env(),
        cwd="/", timeout=SPAWN_TIMEOUT,  # not the checkout, whose source has no extension
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    segment, record = done.stdout.split()
    assert (SHM / segment).exists()
    assert (SHM / record).exists()
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: not pid_exists(first), 10, "the dispatcher to reap the writer")
    write_ok(cp, tmp_path / "after", 1)  # restarts the writer
    assert not (SHM / segment).exists()
    assert not (SHM / record).exists()


def test_restart_budget(make_cp, tmp_path):
    cp = make_cp(mode="ok", max_restarts=1)
    first = started(cp)
    write_ok(cp, tmp_path / "first", 0)

    # Death 1, while idle: noticed (and reaped) without any write pending.
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: not pid_exists(first), 10, "the idle writer to be reaped")

    # The next write restarts it (budget 1 -> spent) and dies in write(): death 2.
    target = tmp_path / "dies"
    future = cp.write(make_state(1), str(target), mode="exit")
    second = cp.pid
    assert second != first
    exc = failure_of(future, 30)
    assert isinstance(exc, WriterDiedError), repr(exc)
    assert "exit code 7" in str(exc)
    assert f"pid {second}" in str(exc)
    assert wait_started(target, 1) == second
    assert not target.exists()

    # Third write: no restart left.
    exc = failure_of(cp.write(make_state(2), str(tmp_path / "never")), 1)
    assert isinstance(exc, WriterDiedError), repr(exc)
    assert "restart budget (1) is spent" in str(exc)
    assert cp.pid == second
    assert not Path(f"{tmp_path / 'never'}.started").exists()
    cp.close()  # a dead writer closes cleanly


# --------------------------------------------------------------------------------------------
# hung and stopped writers
# --------------------------------------------------------------------------------------------


def test_close_with_a_writer_hung_in_close_escalates_to_sigterm_and_returns(
    make_cp, tmp_path, caplog
):
    """The writer hangs on TERMINATE (its close() never returns): close() sends SIGTERM after the
    shutdown timeout, logs it, and returns normally: the cleanup succeeded."""
    cp = make_cp(mode="ok", close_mode="hang", subprocess_shutdown_timeout_secs=1)
    pid = started(cp)
    record = write_ok(cp, tmp_path / "saved", 0)
    assert record["pid"] == pid

    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pyshmckpt"):
        cp.close()
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 15.0, f"close() took {elapsed:.2f}s"
    assert not pid_running(pid)
    assert (tmp_path / f"closed-{pid}").exists()  # it was in its close() when signalled
    assert cp.process.processes[0].exitcode == -signal.SIGTERM
    assert any("sending SIGTERM" in r.getMessage() for r in caplog.records), caplog.text
    cp.close()  # idempotent
    with pytest.raises(pyshmckpt.PyshmckptError, match="closed"):
        cp.write(make_state(1), str(tmp_path / "after-close"))


def test_close_with_a_writer_ignoring_sigterm_escalates_to_sigkill(make_cp, tmp_path, caplog):
    cp = make_cp(mode="ok", close_mode="hang_ignoring_sigterm", subprocess_shutdown_timeout_secs=1)
    pid = started(cp)
    write_ok(cp, tmp_path / "saved", 0)

    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pyshmckpt"):
        cp.close()
    elapsed = time.monotonic() - t0
    assert 1.8 <= elapsed < 20.0, f"close() took {elapsed:.2f}s"
    assert not pid_running(pid)
    assert cp.process.processes[0].exitcode == -signal.SIGKILL
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("sending SIGTERM" in m for m in messages), messages
    assert any("ignored SIGTERM" in m and "SIGKILL" in m for m in messages), messages


def test_close_lets_a_write_longer_than_the_shutdown_timeout_finish(make_cp, tmp_path):
    """The final checkpoint of a large model on a slow disk: close() waits for it (bounded by
    the write timeout, not the shutdown timeout), and its Future succeeds."""
    cp = make_cp(mode="ok", delay=2.5, subprocess_shutdown_timeout_secs=0.5, write_timeout_secs=30)
    pid = started(cp)
    target = tmp_path / "final"
    state = make_state(5)
    future = cp.write(state, str(target))
    wait_started(target)
    cp.close()
    assert future.done()
    assert future.exception() is None
    record = read_record(target)
    assert record["pid"] == pid
    assert record["digest"] == expected_digest(state)
    assert (tmp_path / f"closed-{pid}").exists()  # then shut down gracefully
    assert cp.process.processes[0].exitcode == 0


def test_close_after_the_write_timeout_killed_a_hung_writer_returns_normally(make_cp, tmp_path):
    cp = make_cp(mode="hang", write_timeout_secs=1, subprocess_shutdown_timeout_secs=1)
    started(cp)
    target = tmp_path / "hung"
    future = cp.write(make_state(0), str(target))
    pid = wait_started(target)
    t0 = time.monotonic()
    cp.close()  # waits for the write, which the timeout ends by killing the writer
    assert time.monotonic() - t0 < 20.0
    assert not pid_running(pid)
    assert isinstance(failure_of(future, 1), pyshmckpt.WriteTimeoutError)
    assert not target.exists()


def test_graceful_close_finishes_the_pending_write_and_closes_the_writer(make_cp, tmp_path):
    cp = make_cp(mode="ok", delay=0.5, subprocess_shutdown_timeout_secs=10)
    pid = started(cp)
    target = tmp_path / "last"
    state = make_state(3)
    future = cp.write(state, str(target))
    t0 = time.monotonic()
    cp.close()  # no error: TERMINATE is served after the queued write
    elapsed = time.monotonic() - t0
    assert elapsed < 10.0, f"close() took {elapsed:.2f}s"  # no escalation (10 s each)
    assert future.done()
    assert future.exception() is None
    assert read_record(target)["digest"] == expected_digest(state)
    assert (tmp_path / f"closed-{pid}").exists()  # writer.close() ran in the child
    assert not pid_exists(pid)


@pytest.mark.parametrize("mode", ["hang", "stop"])
def test_write_timeout_kills_the_writer_first_then_the_next_writes_restart(make_cp, tmp_path, mode):
    cp = make_cp(mode=mode, write_timeout_secs=1.5, slots=2, slot_timeout_secs=2)
    old = started(cp)

    t0 = time.monotonic()
    target = tmp_path / "overrun"
    first = cp.write(make_state(0), str(target))
    seen = OnDone(first, old)
    assert wait_started(target) == old
    # A second write, queued 0.5 s later (so its own deadline is not yet reached when the first
    # one's is), fails too: the writer that would serve it is killed.
    time.sleep(0.5)
    second = cp.write(make_state(1), str(tmp_path / "queued"))
    if mode == "stop":
        wait_until(lambda: proc_state(old) == "T", 5, "the writer to stop itself")

    exc = failure_of(first, 15)
    assert isinstance(exc, (WriteTimeoutError, WriterStartTimeoutError)), repr(exc)
    assert isinstance(exc, TimeoutError), repr(exc)
    assert "timed out" in str(exc)
    assert "killed" in str(exc)
    assert "signal SIGKILL" in str(exc)
    seen.wait()
    assert seen.exists is False, "the write failed before its writer was killed and reaped"
    took = seen.at - t0
    assert 1.4 <= took < 12.0, f"the timeout fired after {took:.2f}s"
    exc2 = failure_of(second, 1)
    assert isinstance(exc2, WriterDiedError), repr(exc2)
    assert "another write timed out" in str(exc2)
    assert not Path(f"{tmp_path / 'queued'}.started").exists()

    # Both slots were freed and the writer is restarted: two back-to-back writes succeed
    # (a slot still held would fail the second with SlotsBusyError after 2 s).
    states = [make_state(10), make_state(11)]
    futures = [cp.write(s, str(tmp_path / f"after-{i}"), mode="ok") for i, s in enumerate(states)]
    for future in futures:
        future.result(timeout=SPAWN_TIMEOUT)
    new = cp.pid
    assert new != old
    for i, state in enumerate(states):
        record = read_record(tmp_path / f"after-{i}")
        assert record["pid"] == new
        assert record["digest"] == expected_digest(state)


def test_abort_with_writes_pending_returns_at_once(make_cp, tmp_path):
    cp = make_cp(mode="hang", subprocess_shutdown_timeout_secs=30)
    started(cp)
    target = tmp_path / "hung"
    first = cp.write(make_state(0), str(target))
    second = cp.write(make_state(1), str(tmp_path / "queued"))
    pid = wait_started(target)

    t0 = time.monotonic()
    cp.close(abort=True)
    elapsed = time.monotonic() - t0
    assert elapsed < 15.0, f"close(abort=True) took {elapsed:.2f}s"  # not the 30 s shutdown
    for future in (first, second):
        exc = failure_of(future, 1)
        assert isinstance(exc, CheckpointAbortedError), repr(exc)
    assert not pid_running(pid)
    cp.close(abort=True)
    cp.close()


# --------------------------------------------------------------------------------------------
# the writer raises; initialisation fails
# --------------------------------------------------------------------------------------------


def test_writer_that_raises_fails_that_write_only(make_cp, tmp_path):
    # One slot: a failed write that kept its slot would make the next one time out waiting.
    cp = make_cp(mode="ok", slots=1, slot_timeout_secs=2)
    pid = started(cp)
    future = cp.write(make_state(0), str(tmp_path / "bad"), mode="raise")
    exc = failure_of(future, 30)
    assert type(exc) is WriterError, repr(exc)
    assert isinstance(exc, RuntimeError)
    text = str(exc)
    assert "Traceback (most recent call last)" in text
    assert "ValueError: writer refused bad: disk on fire" in text
    assert "in write" in text  # the frame of RecordingWriter.write
    assert not (tmp_path / "bad").exists()

    record = write_ok(cp, tmp_path / "good", 1)
    assert record["pid"] == pid == cp.pid  # same process: no restart
    assert pid_running(pid)


@pytest.mark.parametrize("where", ["subprocess_init_fn", "checkpoint_writer_init_fn"])
def test_init_failure_carries_the_child_traceback(make_cp, tmp_path, where):
    if where == "subprocess_init_fn":
        cp = make_cp(init_fn=init_raise, init_args=("no scratch space at /nonexistent",))
        expected = ["OSError: no scratch space at /nonexistent", "in init_raise"]
    else:
        cp = make_cp(mode="fail_init")
        expected = ["LookupError: RecordingWriter cannot find its storage backend", "in __init__"]
    exc = failure_of(cp.process_creation_future, SPAWN_TIMEOUT)
    assert type(exc) is WriterStartError, repr(exc)
    assert isinstance(exc, RuntimeError), repr(exc)
    text = str(exc)
    assert "Traceback (most recent call last)" in text
    for part in expected:
        assert part in text
    pid = cp.pid
    assert pid is not None
    wait_until(lambda: not pid_running(pid), 10, "the failed writer to exit")

    with pytest.raises(RuntimeError, match="failed to initialize") as info:
        cp.write(make_state(0), str(tmp_path / "never"))
    assert expected[0] in str(info.value)
    assert cp.pid == pid  # no restart of a writer that never initialised
    cp.close()


def test_init_that_exits_is_reported_with_its_exit_code(make_cp, tmp_path):
    cp = make_cp(init_fn=init_exit, init_args=(3,))
    exc = failure_of(cp.process_creation_future, SPAWN_TIMEOUT)
    assert type(exc) is WriterStartError, repr(exc)
    assert isinstance(exc, RuntimeError), repr(exc)
    assert "exited during initialization" in str(exc)
    assert "exit code 3" in str(exc)
    with pytest.raises(RuntimeError, match="exit code 3"):
        cp.write(make_state(0), str(tmp_path / "never"))
    cp.close()


def test_init_timeout(make_cp, tmp_path):
    t0 = time.monotonic()
    cp = make_cp(init_fn=init_sleep, init_args=(120,), subprocess_init_timeout_secs=1)
    exc = failure_of(cp.process_creation_future, 15)
    elapsed = time.monotonic() - t0
    assert isinstance(exc, (WriteTimeoutError, WriterStartTimeoutError)), repr(exc)
    assert isinstance(exc, TimeoutError), repr(exc)
    assert str(exc).startswith("Timed out"), str(exc)
    assert elapsed < 30.0, f"the init timeout fired after {elapsed:.2f}s"  # not the 120 s init
    pid = cp.pid
    assert pid is not None
    assert not pid_running(pid)  # killed before the future failed
    with pytest.raises(TimeoutError, match="^Timed out"):
        cp.write(make_state(0), str(tmp_path / "never"))
    cp.close()


# --------------------------------------------------------------------------------------------
# queueing and the protocol
# --------------------------------------------------------------------------------------------


def test_back_to_back_writes_with_two_slots_all_land_in_order(make_cp, tmp_path):
    cp = make_cp(mode="ok", delay=0.2, slots=2, slot_timeout_secs=20)
    pid = started(cp)
    source = {"w": torch.zeros(128, 64), "step": torch.tensor(0), "meta": {"name": "run"}}
    futures, digests, overlapped = [], [], 0
    for i in range(6):
        with torch.no_grad():
            source["w"].copy_(torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64) * i)
            source["step"].fill_(i)
        digests.append(expected_digest(source))
        futures.append(cp.write(source, str(tmp_path / f"step-{i}"), step=i))
        # write() has staged a copy: the writer must still see step i after this.
        with torch.no_grad():
            source["w"].fill_(-1.0)
        if i and not futures[i - 1].done():
            overlapped += 1  # write i was queued while write i-1 was being persisted
    for future in futures:
        future.result(timeout=30)
    assert overlapped >= 1
    for i in range(6):
        record = read_record(tmp_path / f"step-{i}")
        assert record["pid"] == pid
        assert record["kwargs"] == {"step": i}
        assert record["digest"] == digests[i], f"step {i} was not written from its snapshot"
    log = (tmp_path / "log.txt").read_text().split("\n")
    starts = [line.split()[-1] for line in log if " start " in line]
    assert starts == [f"step-{i}" for i in range(6)]


def test_reply_with_the_wrong_generation_is_a_protocol_error(make_cp, tmp_path, monkeypatch):
    cp = make_cp(mode="ok")
    old = started(cp)
    real_send = writer_process.send

    def skewed_send(conn: Any, message: Any) -> bool:
        # Parent side only: the WRITE request that reaches the child carries another generation
        # than the one the parent recorded, so the child's (faithful) reply cannot match it.
        if isinstance(message, Request) and message.kind is Kind.WRITE:
            message = dataclasses.replace(message, generation=message.generation + 1)
        return real_send(conn, message)

    monkeypatch.setattr(writer_process, "send", skewed_send)
    state = make_state(0)
    target = tmp_path / "skewed"
    future = cp.write(state, str(target))
    seen = OnDone(future, old)
    exc = failure_of(future, 30)
    assert type(exc) is ProtocolError, repr(exc)
    assert isinstance(exc, RuntimeError)
    assert "does not match any pending request" in str(exc)
    assert "generation" in str(exc)
    seen.wait()
    assert seen.exists is False, "the write failed before the writer was killed and reaped"
    # The child did write it (it got a consistent request); only the reply was rejected.
    assert read_record(target)["digest"] == expected_digest(state)

    monkeypatch.undo()
    record = write_ok(cp, tmp_path / "after", 1)
    assert record["pid"] == cp.pid != old


# --------------------------------------------------------------------------------------------
# races and lost errors (each of these failed on commit 4a18028)
# --------------------------------------------------------------------------------------------


def _widen_reap_race(
    monkeypatch: pytest.MonkeyPatch, pid: int, reaper: str, late: str, pause: float
) -> None:
    """Make the thread named `reaper` collect `pid` first and stall before multiprocessing stores
    the exit code, while the thread named `late` looks only afterwards.

    Both the dispatcher and close() (or write()) wait for the same child. Whichever calls
    waitpid() second gets ECHILD, which multiprocessing's Popen.poll() reports as "still
    running" until the first thread has stored the return code. The pauses only widen a window
    that a GIL switch opens naturally (about one close() in five here without them).
    """
    real_waitpid = os.waitpid

    def waitpid(target: int, options: int) -> tuple[int, int]:
        name = threading.current_thread().name
        if target == pid and name == late:
            time.sleep(0.2)
        result = real_waitpid(target, options)
        if target == pid and result[0] == pid and name == reaper:
            time.sleep(pause)
        return result

    monkeypatch.setattr(os, "waitpid", waitpid)


def test_exit_of_a_writer_reaped_by_close_is_described_in_the_error(make_cp, tmp_path, monkeypatch):
    """close() and the dispatcher both wait for the writer; the one that does not reap it must
    still learn how it exited (it said "still running" instead of "signal SIGTERM")."""
    cp = make_cp(mode="ok", close_mode="hang", subprocess_shutdown_timeout_secs=1)
    pid = started(cp)
    write_ok(cp, tmp_path / "saved", 0)
    _widen_reap_race(
        monkeypatch, pid, reaper="MainThread", late="pyshmckpt-writer-dispatch", pause=1.0
    )
    cp.close()
    monkeypatch.undo()
    assert "signal SIGTERM" in cp._writer.failure_text()


def test_write_right_after_a_writer_death_restarts_it(make_cp, tmp_path, monkeypatch):
    """A writer the dispatcher has reaped but not yet recorded as dead must not look alive: the
    next write() restarts it (it raised WriterDiedError "still running" from the broken pipe)."""
    cp = make_cp(mode="ok")
    pid = started(cp)
    _widen_reap_race(monkeypatch, pid, reaper="pyshmckpt-writer-dispatch", late="-", pause=1.0)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_exists(pid), 10, "the dispatcher to reap the writer")
    try:
        record = write_ok(cp, tmp_path / "after", 1)  # should restart the writer
    finally:
        monkeypatch.undo()
    assert record["pid"] == cp.pid != pid


def test_error_raised_by_the_writers_close_is_logged_by_close(make_cp, tmp_path, caplog):
    """The child sends the traceback of the user writer's close() in its TERMINATE reply; close()
    logs it as an error (it was dropped), and returns: the writer is gone all the same."""
    cp = make_cp(mode="ok", close_error="flush to the object store failed")
    pid = started(cp)
    write_ok(cp, tmp_path / "one", 0)
    try:
        with caplog.at_level(logging.ERROR, logger="pyshmckpt"):
            cp.close()
        assert "flush to the object store failed" in caplog.text
    finally:
        assert (tmp_path / f"closed-{pid}").exists()  # close() did run in the child
        assert not pid_exists(pid)


# --------------------------------------------------------------------------------------------
# the trainer dies; stale segments
# --------------------------------------------------------------------------------------------

TRAINER = textwrap.dedent(
    """
    import json, os, sys, time

    import torch

    from pyshmckpt import CheckpointProcess, CheckpointProcessConfig
    from writer_side import RecordingWriter, init_ok


    def main():
        out_dir, phase = sys.argv[1], sys.argv[2]
        cp = CheckpointProcess(
            {"rank": 0, "world_size": 1},
            CheckpointProcessConfig(
                subprocess_init_timeout_secs=60, subprocess_shutdown_timeout_secs=2,
                write_timeout_secs=3,
            ),
            init_ok, (), RecordingWriter,
            {"out_dir": out_dir, "close_error": "close refused" if phase == "close-error" else None},
        )
        state = {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
        cp.write(state, os.path.join(out_dir, "first"), mode="ok").result(timeout=60)
        if phase == "mid-write":
            cp.write(state, os.path.join(out_dir, "second"), mode="hang")
            marker = os.path.join(out_dir, "second.started")
            deadline = time.monotonic() + 60
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
        info = {"writer": cp.pid, "segments": [name for name, _, _ in cp.stager.segments()]}
        tmp = os.path.join(out_dir, "info.json.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(out_dir, "info.json"))
        time.sleep(300)


    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["idle", "mid-write", "close-error"])
def test_sigkill_of_the_trainer_stops_the_writer_and_removes_the_segments(tmp_path, phase):
    """Idle, the orphaned writer exits at once; mid-write (a write that hangs), it tries to
    finish that write for the write timeout (3 s here), then gives up; either way it removes the
    trainer's segments. A writer whose close() raises then says so in its log (close-error)."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    stderr = (tmp_path / "trainer.err").open("w")
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(out), phase],
        stdout=subprocess.DEVNULL, stderr=stderr, env=child_env(), cwd=str(tmp_path),
    )  # fmt: skip
    info_file = out / "info.json"
    writer_pid: int | None = None
    segments: list[str] = []
    try:

        def ready() -> bool:
            if trainer.poll() is not None:
                raise AssertionError(
                    f"the trainer exited ({trainer.returncode}):\n"
                    + (tmp_path / "trainer.err").read_text()
                )
            return info_file.exists()

        wait_until(ready, 90, "the trainer to write once")
        info = json.loads(info_file.read_text())
        writer_pid, segments = info["writer"], info["segments"]
        assert segments
        assert all((SHM / name).exists() for name in segments)
        assert pid_running(writer_pid)
        assert read_record(out / "first")["digest"] == expected_digest(
            {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
        )

        trainer.kill()
        trainer.wait(10)
        try:
            wait_until(
                lambda: (
                    not pid_running(writer_pid)
                    and not any((SHM / name).exists() for name in segments)
                ),
                15 if phase == "mid-write" else 10,
                "the orphaned writer to exit and unlink the trainer's segments",
            )
            if phase == "close-error":
                log = (tmp_path / "trainer.err").read_text()
                assert "closing the writer after the trainer's death failed" in log, log
                assert "RuntimeError: close refused" in log, log
        except AssertionError as exc:
            left = [name for name in segments if (SHM / name).exists()]
            raise AssertionError(
                f"{exc}: writer state {proc_state(writer_pid)!r}, segments left {left}, "
                f"threads {thread_waits(writer_pid)}"
            ) from None
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        kill_quietly(writer_pid)
        stderr.close()
        for name in segments:  # only after a failure above; the leak check reports it too
            (SHM / name).unlink(missing_ok=True)


UNLINKER = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path

    from pyshmckpt.shm import AttachedSegments
    from pyshmckpt.transport.child import OrphanPolicy, _TrainerWatch

    marker, name = Path(sys.argv[1]), sys.argv[2]
    attached = AttachedSegments()
    attached._known = {name}
    # As writer_main does, with staged writes abandoned when the trainer dies.
    _TrainerWatch(os.getppid(), OrphanPolicy(finish=False), attached).arm()
    real_unlink = os.unlink
    slowed = []


    def slow_unlink(path, *args, **kwargs):
        # The main thread's first unlink takes a while (a busy /dev/shm, a descheduled thread):
        # the parent dies meanwhile.
        if threading.current_thread() is threading.main_thread() and not slowed:
            slowed.append(path)
            ready = marker.with_suffix(".tmp")  # renamed into place: never read half written
            ready.write_text(str(os.getpid()))
            os.replace(ready, marker)
            time.sleep(3)
        return real_unlink(path, *args, **kwargs)


    os.unlink = slow_unlink
    attached.unlink_all()  # what writer_main does when the channel reaches EOF
    time.sleep(60)  # (the parent-death path exits before this)
    """
)


def test_parent_death_signal_during_unlink_all_does_not_deadlock(tmp_path):
    """The writer's main thread is inside unlink_all (the channel-EOF path) when its parent dies;
    the SIGUSR2 handler, which runs on that same thread and calls unlink_all too, and the pidfd
    watcher must still get it to exit. (With a non-reentrant lock it deadlocked for good, which
    the idle case of the trainer test above hit about one run in two.)"""
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"]
    name = f"{prefix}-{os.getpid()}-{os.urandom(16).hex()}"
    (SHM / name).write_bytes(bytes(4096))
    script = tmp_path / "unlinker.py"
    script.write_text(UNLINKER)
    marker = tmp_path / "unlinking"
    parent = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" "{script}" "{marker}" "{name}" & wait'],
        env=child_env(), stderr=subprocess.DEVNULL,
    )  # fmt: skip
    child: int | None = None
    try:
        wait_until(marker.exists, 60, "the child to enter unlink_all")
        child = int(marker.read_text())
        parent.kill()
        parent.wait(10)
        wait_until(
            lambda: not pid_running(child) and not (SHM / name).exists(),
            8,
            "the child to unlink the segment and exit after its parent died",
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        kill_quietly(child)
        (SHM / name).unlink(missing_ok=True)


NOTICER = textwrap.dedent(
    """
    import os, signal

    from pyshmckpt.shm import AttachedSegments
    from pyshmckpt.transport.child import OrphanPolicy, _TrainerWatch

    watch = _TrainerWatch(os.getppid(), OrphanPolicy(finish=True), AttachedSegments())
    watch.arm()
    watch.parent_pid = -1  # the trainer is "gone": the parent-death handler acts on its signal
    real_set = watch.dead.set


    def set_then_signal():
        # The parent-death signal arrives while the main thread is inside died(), as when the
        # channel's EOF and the trainer's death come together: its handler runs right here.
        real_set()
        os.kill(os.getpid(), signal.SIGUSR2)


    watch.dead.set = set_then_signal
    watch.died()  # the main thread's own notice (the channel-EOF path)
    print("noticed once", flush=True)
    """
)


def test_the_parent_death_signal_inside_died_does_not_deadlock(tmp_path):
    """The writer's main thread notices the trainer's death (channel EOF) while the parent-death
    signal arrives: only one notice acts, neither waits for the other. (With a lock around the
    notice, and the handler acting on the main thread, it waited for its own thread forever: a
    writer left sleeping with the trainer's segments, seen once in CI.)"""
    script = tmp_path / "noticer.py"
    script.write_text(NOTICER)
    done = subprocess.run(
        [sys.executable, str(script)], env=child_env(), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "noticed once"
    assert done.stderr.count("is gone: finishing the writes") == 1, done.stderr


REPLIER = textwrap.dedent(
    """
    import multiprocessing, os, signal

    from pyshmckpt.shm import AttachedSegments
    from pyshmckpt.transport import logs
    from pyshmckpt.transport.child import OrphanPolicy, _Outbox, _TrainerWatch

    ours, theirs = multiprocessing.Pipe()
    outbox = _Outbox(ours)
    logs.install({"": 30, "pyshmckpt": 30}, outbox.log)  # records go over the channel
    watch = _TrainerWatch(os.getppid(), OrphanPolicy(finish=True), AttachedSegments())
    watch.arm()
    watch.parent_pid = -1  # the trainer is "gone": its death signal is taken as such
    with outbox._lock:  # the main thread is sending a reply when the signal lands
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(100_000):  # Python runs the signal's handler between these bytecodes
            pass
    if not watch.dead.wait(20):
        raise SystemExit("the death signal was not noticed")
    print(theirs.recv().payload["msg"], flush=True)  # the warning, forwarded once the lock is free
    """
)


def test_the_parent_death_signal_while_a_reply_is_sent_does_not_deadlock(tmp_path):
    """The parent-death signal lands while the writer's main thread holds the channel's send lock
    (sending a reply): the trainer's death is still noticed and logged. (Its handler used to act
    on the main thread, and the warning it logged, forwarded over the channel, waited for that
    thread's own lock forever.)"""
    script = tmp_path / "replier.py"
    script.write_text(REPLIER)
    done = subprocess.run(
        [sys.executable, str(script)], env=child_env(), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert "is gone: finishing the writes" in done.stdout
    assert done.stderr.count("is gone: finishing the writes") == 1, done.stderr


IDLER = textwrap.dedent(
    """
    import os, time

    from pyshmckpt.shm import AttachedSegments
    from pyshmckpt.transport import child

    watch = child._TrainerWatch(os.getpid() + 1, child.OrphanPolicy(), AttachedSegments())
    watch.busy(False)
    time.sleep(0.3)
    child._ORPHAN_IDLE_LIMIT = 0.25  # stands for a writer idle for minutes before the death
    watch.died()
    time.sleep(0.1)  # the orphan reads what is left in the spool and the pipe meanwhile
    print("still finishing", flush=True)
    time.sleep(1.0)  # nothing came: the idle limit ends it now
    print("not ended", flush=True)
    """
)


def test_an_orphan_idle_limit_counts_from_the_trainers_death(tmp_path):
    """A writer idle for longer than the orphan's idle limit before its trainer died still gets
    that long to read and finish the writes handed over (its watchdog used to end it at once)."""
    script = tmp_path / "idler.py"
    script.write_text(IDLER)
    done = subprocess.run(
        [sys.executable, str(script)], env=child_env(), capture_output=True, text=True, timeout=30
    )
    assert done.stdout.splitlines() == ["still finishing"], (done.stdout, done.stderr)
    assert done.returncode == 1
    assert "the rest of a request never arrived" in done.stderr


def _make_orphan_segment(prefix: str) -> str:
    """A segment created by a process that exited without closing it."""
    code = (
        "import os, sys\n"
        "from pyshmckpt import _C\n"
        "segment = _C.Segment.create(4096, sys.argv[1])\n"
        "print(segment.name, flush=True)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, prefix],
        capture_output=True, text=True, timeout=120, env=child_env(), check=True,
        cwd="/",  # not the checkout, whose source tree would shadow the installed package
    )  # fmt: skip
    name = done.stdout.strip()
    assert name.startswith(prefix + "-")
    return name


def _fake_header_segment(prefix: str, owner_pid: int, start_ticks: int) -> str:
    """A segment file whose header names `owner_pid` with the given start time."""
    name = f"{prefix}-{owner_pid}-{os.urandom(16).hex()}"
    header = stale._HEADER.pack(
        stale._MAGIC, 1, stale._HEADER.size, 4096, bytes(16), owner_pid, start_ticks
    )
    (SHM / name).write_bytes(header + b"\0" * 64)
    return name


def test_stale_segments_of_dead_owners_are_collected_and_live_ones_kept(tmp_path):
    # A prefix of this test's own: every CheckpointProcess the other worker starts collects the
    # session prefix's stale segments, these among them.
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "_gc"
    created: list[str] = []
    live = None
    try:
        orphan = _make_orphan_segment(prefix)
        created.append(orphan)
        # Our own pid with another start time: the pid was reused by a new process.
        ticks = _processes.process_start_ticks(os.getpid())
        assert ticks is not None
        reused = _fake_header_segment(prefix, os.getpid(), ticks + 1)
        created.append(reused)
        live = _C.Segment.create(4096, prefix)
        assert (SHM / orphan).exists()
        assert (SHM / live.name).exists()

        dry = subprocess.run(
            [sys.executable, "-m", "pyshmckpt", "gc", "--dry-run"],
            capture_output=True, text=True, timeout=120, check=True,
            env={**child_env(), "PYSHMCKPT_SEGMENT_PREFIX": prefix},
            cwd="/",  # not the checkout, whose source tree would shadow the installed package
        )  # fmt: skip
        lines = dry.stdout.splitlines()
        assert any(line.startswith("would remove") and orphan in line for line in lines), dry.stdout
        assert any(line.startswith("would remove") and reused in line for line in lines), dry.stdout
        assert any(line.startswith("kept") and live.name in line for line in lines), dry.stdout
        assert (SHM / orphan).exists()  # a dry run removes nothing
        assert (SHM / reused).exists()

        removed = {info.name: info for info in pyshmckpt.collect_stale_segments(prefix)}
        assert orphan in removed
        assert reused in removed
        assert removed[orphan].reason == "no process has it open"
        assert removed[reused].reason == "no process has it open"
        assert live.name not in removed
        assert not (SHM / orphan).exists()
        assert not (SHM / reused).exists()
        assert (SHM / live.name).exists()
        assert pyshmckpt.collect_stale_segments(prefix) == []  # nothing stale is left
    finally:
        if live is not None:
            live.close()
        for name in created:
            (SHM / name).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# stalls: a write judged by its progress
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_slow_write_that_keeps_progressing_outlasts_the_stall_timeout(make_cp, tmp_path):
    cp = make_cp(writer=ProgressingWriter, mode="crawl", delay=5.0, write_stall_timeout_secs=1.5)
    pid = started(cp)
    record = write_ok(cp, tmp_path / "slow", 0)
    assert record["pid"] == pid, "the slow write was cut short and retried by a new writer"


@pytest.mark.timeout(120)
def test_a_writer_without_progress_reports_keeps_the_write_timeout(make_cp, tmp_path):
    cp = make_cp(mode="ok", delay=4.0, write_stall_timeout_secs=1.0)  # reports nothing
    pid = started(cp)
    assert write_ok(cp, tmp_path / "quiet", 0)["pid"] == pid


@pytest.mark.timeout(120)
def test_a_stopped_write_fails_at_the_stall_timeout_and_close_returns(make_cp, tmp_path):
    stall = 3.0
    cp = make_cp(
        writer=ProgressingWriter, mode="crawl", delay=600.0, write_timeout_secs=600,
        write_stall_timeout_secs=stall,
    )  # fmt: skip
    pid = started(cp)
    target = tmp_path / "stopped"
    future = cp.write(make_state(0), str(target))
    assert wait_started(target) == pid
    time.sleep(1.0)  # it is progressing now
    os.kill(pid, signal.SIGSTOP)  # a hung filesystem looks the same from the trainer
    stopped = time.monotonic()
    cp.close()
    closed = time.monotonic() - stopped
    exc = failure_of(future, 1)
    assert isinstance(exc, WriteStalledError), repr(exc)
    assert isinstance(exc, WriteTimeoutError)
    assert isinstance(exc, TimeoutError)
    assert "made no progress for 3 s" in str(exc), exc
    assert "signal SIGKILL" in str(exc), exc
    assert not pid_running(pid)
    # The stall timeout (counted from the last report, at most a second before the stop) plus a
    # kill and reap: nowhere near the 600 s write timeout.
    assert stall - 1.5 <= closed < stall + 30, f"close() returned after {closed:.1f} s"
    assert not target.exists()
