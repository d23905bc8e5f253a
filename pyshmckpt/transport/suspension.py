"""How long this process was not running: stopped (SIGSTOP), frozen with its cgroup, suspended
with its job by a scheduler.

A thread of its own ticks every `TICK` seconds; a tick that comes more than `PAUSED` seconds late
is a time the whole process was stopped (every thread of a stopped process stops), not a thread
of it that was merely busy or waiting on a lock (this one would have ticked meanwhile). The
dispatcher of a writer process asks it before it judges a write stalled or late: a job stopped
and continued stopped its writer too, and that time is no fault of the write.
"""

from __future__ import annotations

import collections
import threading
import time

# Seconds between two ticks, and how much later a tick may come before it counts as a stop
# rather than a busy node (which delays a thread by a second or two at the most).
TICK = 0.5
PAUSED = 3.0


class StopClock:
    """The stops of this process, as the gaps between the ticks of a daemon thread: each one
    the time (start, end) when the thread should have ticked and did not."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._last = time.monotonic()
        self._gaps: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        threading.Thread(target=self._run, name="pyshmckpt-stop-clock", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            with self._cond:
                if now - self._last - TICK > PAUSED:
                    self._gaps.append((self._last + TICK, now))
                self._last = now
                self._cond.notify_all()

    def stopped_since(self, since: float) -> float:
        """Seconds this process was stopped between `since` (a `time.monotonic()` reading) and
        now: only what of each stop falls after `since`. When the clock's last tick is late, a
        stop may just have ended: it waits for the next tick (at most `PAUSED` seconds), so
        that the stop is counted. A tick that has not come by then leaves a gap still open: the
        process has hardly run at all (a node so loaded that neither thread was scheduled),
        which counts as a stop too."""
        asked = time.monotonic()
        with self._cond:
            ticked = asked - self._last < 2 * TICK or self._cond.wait_for(
                lambda: self._last >= asked, timeout=PAUSED
            )
            gaps = list(self._gaps)
            if not ticked:
                gaps.append((self._last + TICK, time.monotonic()))
        return sum(max(0.0, end - max(start, since)) for start, end in gaps)


_CLOCK: StopClock | None = None
_CLOCK_LOCK = threading.Lock()


def clock() -> StopClock:
    """This process's clock (started on first use)."""
    global _CLOCK
    with _CLOCK_LOCK:
        if _CLOCK is None:
            _CLOCK = StopClock()
        return _CLOCK
