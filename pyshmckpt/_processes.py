"""Other processes as this one sees them: a parent, a start time, the launcher of a job.

Only for processes of this process's PID namespace, and never to judge a process dead from its
pid alone (a pid is reused, and means nothing in another namespace): a process's end is told by a
pidfd opened while it was known to run (`Launcher`), by a lock it held (`shm.stale`,
`tiers.records`), or by the end of a channel to it.
"""

from __future__ import annotations

import os
import select
from pathlib import Path


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid`, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[1])  # field 4 of the line


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])  # field 22 of the line; fields[0] is field 3


def launcher() -> tuple[int, int] | None:
    """(pid, start ticks) of the launcher whose end ends this job: torchrun's elastic agent,
    which starts each worker in a session of its own (the worker, or a wrapper of it, leads
    that session, and its parent is the agent); None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    agent = parent_pid(os.getsid(0))
    ticks = process_start_ticks(agent) if agent is not None and agent > 1 else None
    return (agent, ticks) if agent is not None and ticks is not None else None


class Launcher:
    """The process whose end ends a job (torchrun's elastic agent), watched through a pidfd
    opened while the trainer runs: its pid is checked against its start time once, when the
    pidfd is opened, and from then on its end is the pidfd's, whatever pid reuse follows."""

    def __init__(self, process: tuple[int, int]) -> None:
        self.process = process
        self._fd: int | None = None
        self._gone = False
        pid, ticks = process
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
            return
        except (OSError, AttributeError):
            return  # no pidfd here (Linux before 5.3): its start time tells instead
        now = process_start_ticks(pid)
        if now is None or (ticks and now != ticks):  # it had ended and its pid was reused
            os.close(fd)
            self._gone = True
            return
        self._fd = fd

    def gone(self) -> bool:
        if self._gone:
            return True
        if self._fd is None:
            pid, ticks = self.process
            now = process_start_ticks(pid)
            self._gone = now is None or bool(ticks and now != ticks)
        else:
            readable, _, _ = select.select([self._fd], [], [], 0)
            self._gone = bool(readable)
        return self._gone
