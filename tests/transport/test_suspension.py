"""pyshmckpt/transport/suspension.py: the time a process was stopped, told apart from a thread
of it that was only busy or blocked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pyshmckpt.transport import suspension

from helpers import child_env

# Reports once a clock ticks, then, when asked, how long it was stopped since it started.
STOPPED = textwrap.dedent(
    """
    import sys, time

    from pyshmckpt.transport import suspension

    stops = suspension.clock()
    started = time.monotonic()
    time.sleep(2 * suspension.TICK)
    print("ticking", flush=True)
    sys.stdin.readline()
    print(round(stops.stopped_since(started), 1), flush=True)
    """
)


def test_a_stopped_process_counts_the_time_it_was_stopped():
    child = subprocess.Popen(
        [sys.executable, "-c", STOPPED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=child_env(), cwd="/",  # not the checkout, whose source has no extension
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ticking"  # type: ignore[union-attr]
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(suspension.PAUSED + 2.0)
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate("\n", timeout=60)
    finally:
        child.kill()
        child.wait(60)
    assert suspension.PAUSED + 1.0 < float(out) < suspension.PAUSED + 10.0, out


def test_a_thread_blocked_or_busy_is_not_a_stop():
    stops = suspension.clock()
    started = time.monotonic()
    blocker = threading.Lock()
    blocker.acquire()

    def waits() -> None:  # blocked for longer than a stop would take to count
        blocker.acquire(timeout=suspension.PAUSED + 1.0)

    thread = threading.Thread(target=waits)
    thread.start()
    thread.join()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # and busy
        pass
    assert stops.stopped_since(started) == 0.0


def test_a_clock_whose_thread_is_not_scheduled_counts_the_open_gap():
    class Unscheduled(suspension.StopClock):
        """A stand-in for a process whose threads the node does not schedule: it never ticks."""

        def _run(self) -> None:
            return

    stops = Unscheduled()
    started = time.monotonic()
    time.sleep(2 * suspension.TICK)  # its last tick is late by now
    stopped = stops.stopped_since(started)  # waits for a tick that never comes
    assert suspension.PAUSED - suspension.TICK - 0.1 <= stopped < suspension.PAUSED + 5.0


def test_only_the_part_of_a_stop_after_the_time_asked_about_counts():
    stops = suspension.StopClock()
    now = time.monotonic()
    stops._gaps.append((now - 30.0, now - 20.0))  # a stop of 10 s, ended 20 s ago
    assert stops.stopped_since(now - 40.0) == pytest.approx(10.0)
    assert stops.stopped_since(now - 24.0) == pytest.approx(4.0)  # its last 4 s only
    assert stops.stopped_since(now - 10.0) == 0.0  # over before: an idle stop delays nothing
