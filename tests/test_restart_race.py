"""A restart that comes while the dead trainer's writer is still persisting: the restore waits for
that writer and gets the newest checkpoint (held in memory only), not an older one from disk.

The trainer writes to a filesystem throttled to a few MiB/s (`slowfs`: a loop device under a
blkio cgroup), saves step 1 (small, durable), then step 2 (large, persisted: seconds to write)
and step 3 (in memory only), and is SIGKILLed. A new process loads the root at once, as a
launcher's restart does: its writer is still writing step 2 then, and only once that is done
does it hold step 3.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import slowfs
from helpers import SHM, child_env

WRITE_BPS = 16 << 20  # bytes per second the trainer's writer writes to the slow filesystem
BIG = 96 << 20  # bytes of step 2: about 6 s to write at WRITE_BPS
RUN_TIMEOUT = 120  # seconds each script may take

TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys

    import torch

    import pyshmckpt

    root, big = sys.argv[1], int(sys.argv[2])
    ck = pyshmckpt.Checkpointer(
        root, direct_io=True, capacity_bytes=big + (4 << 20), hold_timeout=120
    )
    ck.save({"w": torch.full((256,), 1.0), "step": 1}, name="step-1").result(timeout=60)
    ck.save({"w": torch.full((big // 4,), 2.0), "step": 2}, name="step-2")  # seconds to write
    ck.save({"w": torch.full((big // 4,), 3.0), "step": 3}, name="step-3", persist=False)
    print(json.dumps({"writer": ck.writer_pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill, right after the saves returned
    """
)

# The restart: loads the root at once (pyshmckpt.load), then as a new trainer would
# (Checkpointer, which takes a held checkpoint over, and its load).
RESTART = textwrap.dedent(
    """
    import json, os, sys, time

    import pyshmckpt

    root = sys.argv[1]
    started = time.monotonic()
    state = pyshmckpt.load(root)
    out = {"load": [state["step"], float(state["w"][0])], "waited": time.monotonic() - started}
    out["on_disk"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    with pyshmckpt.Checkpointer(root) as ck:
        state = ck.load()
        out["checkpointer"] = [state["step"], float(state["w"][0])]
        out["took_over"] = ck._stager.arena is not None
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_restart_during_the_dead_trainers_persist_restores_the_newest_step(tmp_path):
    reason = slowfs.unavailable()
    if reason is not None:
        pytest.skip(reason)
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-race"
    env = child_env() | {"PYSHMCKPT_SEGMENT_PREFIX": prefix, "PYSHMCKPT_ORPHAN_WAIT": "60"}
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "restart.py").write_text(RESTART)
    try:
        with slowfs.slow_filesystem(tmp_path, WRITE_BPS) as slow:
            root = slow.mountpoint / "ckpt"
            log = tmp_path / "trainer.log"
            with log.open("w") as out:  # a file: its writer keeps the trainer's output open
                trainer = subprocess.Popen(
                    slow.command([sys.executable, str(tmp_path / "trainer.py"), str(root), str(BIG)]),
                    stdout=out, stderr=subprocess.STDOUT, env=env,
                )  # fmt: skip
                assert trainer.wait(timeout=RUN_TIMEOUT) == -signal.SIGKILL, log.read_text()
            assert not (root / "step-2").exists(), "the filesystem was not slow enough to test"
            restart = subprocess.run(
                [sys.executable, str(tmp_path / "restart.py"), str(root)],
                capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT,
            )  # fmt: skip
            assert restart.returncode == 0, restart.stderr
            out = json.loads(restart.stdout.splitlines()[-1])
            assert out["load"] == [3, 3.0], out  # the memory-only step, not step 1 from disk
            assert out["on_disk"] == ["latest", "step-1", "step-2"], out  # waited for step 2
            assert out["waited"] > 1.0, out
            assert out["checkpointer"] == [3, 3.0], out
            assert out["took_over"], out
            assert not list(SHM.glob(prefix + "-*"))
    except slowfs.SlowFilesystemUnavailable as exc:
        pytest.skip(str(exc))
    finally:  # a failed run's holder was killed with the cgroup: its names go too
        for path in SHM.glob(prefix + "-*"):
            with contextlib.suppress(FileNotFoundError):
                Path(path).unlink()
