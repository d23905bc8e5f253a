"""A slow filesystem for tests that must act while a save is still being written (needs root).

An ext4 filesystem on a loop device over a sparse file, mounted on a fresh directory, and a
blkio cgroup (cgroup v1) that throttles writes to that device: a process started in the cgroup
(`SlowFilesystem.command` wraps a command so that it enters it first) and its children, a writer
process among them, write to it at `write_bps` bytes per second. Only direct I/O is throttled by
cgroup v1 (buffered writes are written back outside the cgroup), so checkpoints are written with
``direct_io=True``: their tensor bytes go to the device as they are written, at that rate.

Usage (tests skip where it cannot be made)::

    with slowfs.slow_filesystem(tmp_path, write_bps=16 << 20) as slow:
        subprocess.run(slow.command([sys.executable, "trainer.py", str(slow.mountpoint)]))

The mount, the loop device and the cgroup are removed when the block ends (a process still in
the cgroup is SIGKILLed first).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")
COMMAND_TIMEOUT = 30.0  # seconds a mkfs, mount or losetup may take


class SlowFilesystemUnavailable(RuntimeError):
    """A loop device, ext4 or a blkio cgroup cannot be made here (the message says why)."""


@dataclass(frozen=True)
class SlowFilesystem:
    """A mounted, throttled filesystem (valid inside `slow_filesystem`'s block)."""

    mountpoint: Path
    device: str
    cgroup: Path
    write_bps: int

    def command(self, argv: list[str]) -> list[str]:
        """`argv`, run inside the throttling cgroup (it and every process it starts)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs"), *argv]


def unavailable() -> str | None:
    """Why a slow filesystem cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "a throttled loop filesystem needs root"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"a throttled loop filesystem needs `{tool}`, not found on PATH"
    if not (BLKIO / "cgroup.procs").exists():
        return "a throttled loop filesystem needs the cgroup v1 blkio controller"
    return None


def _run(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlowFilesystemUnavailable(f"{argv[0]}: {exc}") from None
    if done.returncode != 0:
        raise SlowFilesystemUnavailable(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout.strip()


@contextlib.contextmanager
def slow_filesystem(
    directory: Path, write_bps: int, size: int = 1 << 30
) -> Iterator[SlowFilesystem]:
    """A filesystem of `size` bytes (sparse) mounted under `directory`, whose direct writes from
    processes of its cgroup run at `write_bps` bytes per second.

    Raises:
        SlowFilesystemUnavailable: a step could not be done here.
    """
    reason = unavailable()
    if reason is not None:
        raise SlowFilesystemUnavailable(reason)
    image, mountpoint = directory / "slowfs.img", directory / "slowfs"
    cgroup = BLKIO / f"pyshmckpt-slowfs-{os.getpid()}-{time.monotonic_ns()}"
    with contextlib.ExitStack() as cleanup:
        with image.open("wb") as f:
            f.truncate(size)
        cleanup.callback(image.unlink, missing_ok=True)
        _run("mkfs.ext4", "-q", "-F", str(image))
        device = _run("losetup", "--find", "--show", str(image))
        cleanup.callback(_run, "losetup", "--detach", device)
        mountpoint.mkdir()
        _run("mount", device, str(mountpoint))
        cleanup.callback(_run, "umount", "--lazy", str(mountpoint))
        rdev = Path(device).stat().st_rdev
        major, minor = os.major(rdev), os.minor(rdev)
        try:
            cgroup.mkdir()
            (cgroup / "blkio.throttle.write_bps_device").write_text(f"{major}:{minor} {write_bps}")
        except OSError as exc:
            raise SlowFilesystemUnavailable(f"cannot throttle {device}: {exc}") from None
        cleanup.callback(_remove_cgroup, cgroup)
        yield SlowFilesystem(mountpoint, device, cgroup, write_bps)


def _remove_cgroup(cgroup: Path) -> None:
    """SIGKILL whatever is left in `cgroup`, then remove it (bounded)."""
    deadline = time.monotonic() + COMMAND_TIMEOUT
    while time.monotonic() < deadline:
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        cgroup.rmdir()
