"""How much shared memory is in use, as the demo measures it.

The machine's ``Shmem:`` (/proc/meminfo) and this process's ``RssShmem:`` (/proc/self/status),
sampled every few ms by a background thread (ShmemMonitor); ShmAccount turns the windows it
reports into what one transport held at most; on_shmem_filesystem tells whether files under a
path count as shared memory themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_INTERVAL = 0.002  # seconds between two samples of /proc/meminfo
SHMEM_FILESYSTEMS = ("tmpfs", "ramfs")  # files on these count as shared memory


def _read_kib(path: str, key: bytes) -> int | None:
    """The ``key: N kB`` line of a /proc file in bytes, or None."""
    try:
        data = b"\n" + Path(path).read_bytes()
    except OSError:
        return None
    start = data.find(b"\n" + key + b":")
    if start < 0:
        return None
    start += len(key) + 2
    fields = data[start : data.find(b"\n", start)].split()
    try:
        return int(fields[0]) * (1024 if fields[1:] == [b"kB"] else 1)
    except (IndexError, ValueError):
        return None


def read_shmem() -> int | None:
    """Shared memory in use on the whole machine (``Shmem:`` of /proc/meminfo), in bytes."""
    return _read_kib("/proc/meminfo", b"Shmem")


def read_process_shmem() -> int | None:
    """Shared memory mapped by this process (``RssShmem:`` of /proc/self/status), in bytes."""
    return _read_kib("/proc/self/status", b"RssShmem")


# What the monitor samples. "machine" (Shmem:) counts all shared memory, torch's included, which
# is unlinked as soon as it is made and so never shows in /dev/shm; other processes on the
# machine move it too. "trainer" (RssShmem:) counts what this process maps: both transports
# allocate and map every staged byte here (their writers map the same pages), and nothing else
# moves it, so it backs the machine-wide figure up on a busy machine.
GAUGES: dict[str, Callable[[], int | None]] = {"machine": read_shmem, "trainer": read_process_shmem}


class ShmemMonitor:
    """Samples the GAUGES every few ms in a daemon thread and keeps the highest of a window.

    ``begin()`` starts a window and returns the current levels; ``end()`` returns (highest levels
    seen since begin, current levels). Levels are bytes by gauge name, None where unreadable.
    """

    def __init__(self, interval: float = SAMPLE_INTERVAL) -> None:
        self.interval = interval
        self.baseline = self._read()
        self.available = any(v is not None for v in self.baseline.values())
        self._lock = threading.Lock()
        self._high = dict(self.baseline)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _read() -> dict[str, int | None]:
        return {name: read() for name, read in GAUGES.items()}

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="pyshmckpt-demo-shmem", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._note(self._read())

    def _note(self, levels: dict[str, int | None]) -> None:
        with self._lock:
            for name, value in levels.items():
                high = self._high.get(name)
                if value is not None:
                    self._high[name] = value if high is None else max(high, value)

    def begin(self) -> dict[str, int | None]:
        levels = self._read()
        with self._lock:
            self._high = dict(levels)
        return levels

    def end(self) -> tuple[dict[str, int | None], dict[str, int | None]]:
        levels = self._read()
        self._note(levels)
        with self._lock:
            return dict(self._high), levels


@dataclass
class ShmAccount:
    """The shared memory one transport accounts for, by gauge.

    Only the two transports change this run's shared memory, and only one of them is active at a
    time, so during a transport's checkpoint a gauge moves by what that transport allocates or
    frees; what it still holds between its checkpoints (ours: its slots; torch: its cached staging
    storages) is carried over. The peak is the most it held at any moment.
    """

    held: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)

    def add_window(
        self, start: dict[str, int | None], high: dict[str, int | None], end: dict[str, int | None]
    ) -> None:
        for name in GAUGES:
            s, h, e = start.get(name), high.get(name), end.get(name)
            if s is None or h is None or e is None:
                continue
            held = self.held.get(name, 0)
            self.peak[name] = max(self.peak.get(name, 0), held + h - s)
            self.held[name] = max(0, held + e - s)


def _filesystem_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path` (from /proc/self/mounts), or None."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, kind = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def on_shmem_filesystem(path: Path) -> bool:
    """Whether files under `path` are themselves shared memory (tmpfs, ramfs), so that writing
    checkpoints there moves the gauges too."""
    return _filesystem_type(path) in SHMEM_FILESYSTEMS


__all__ = [
    "GAUGES",
    "SAMPLE_INTERVAL",
    "ShmAccount",
    "ShmemMonitor",
    "on_shmem_filesystem",
    "read_process_shmem",
    "read_shmem",
]
