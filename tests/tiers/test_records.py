"""pyshmckpt/tiers/records.py: hold records under names no one else can take first, whose holder's
life is proven by a lock (not a pid), pending while a writer finishes its dead trainer's saves.

Another user (``setpriv``, as nobody) plants files and links at every name of a root's records
they could guess; ours are still published, found, claimed and waited for, and theirs are never
read, followed or removed. A real trainer then dies beside those plants, and its checkpoint is
restored from memory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pyshmckpt
from pyshmckpt.tiers import records

from helpers import SHM, child_env, wait_until

NOBODY = 65534
RUN_TIMEOUT = 120  # seconds a child may take
PIDS = 3000  # pids ahead of the last one given out, whose temporaries another user plants
ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv, to act as another user",
)


def as_nobody(code: str, *args: str) -> None:
    """Run Python `code` (argv: `args`) as nobody, in the standard library only."""
    done = subprocess.run(
        ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
         sys.executable, "-I", "-c", code, *args],
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def plant(prefix: str, key: str) -> list[str]:
    """As nobody: a forged record and a pending one at names of `key`'s records, a link to a file
    of ours, the record name a holder would take without a token of its own, a temporary of a
    guessed name, the temporaries named after the pids the next processes will get (what a
    name made of a pid would meet), and FIFOs (an open of one for reading waits for a writer).
    Returns their names."""
    forged = {"version": records.RECORD_VERSION, "root": "/", "rank": 0, "name": "forged",
              "staged_ns": 2**62, "pending": False, "segment": {"name": "x", "size": 1,
              "token": "00" * 16, "offset": 4096}}  # fmt: skip
    names = [
        f"{prefix}-held-{key}",
        f"{prefix}-held-{key}-{'a' * 32}",
        f"{prefix}-held-{key}-{'b' * 32}",
        f"{prefix}-held-{key}-link",
        f"{prefix}-held-{key}-{'c' * 32}.{'d' * 16}.tmp",
        f"{prefix}-held-{key}-fifo",
        f"{prefix}-replica-{key}-fifo",
    ]
    next_pid = int(Path("/proc/sys/kernel/ns_last_pid").read_text()) + 1
    names += [f"{prefix}-held-{key}.{pid}.tmp" for pid in range(next_pid, next_pid + PIDS)]
    pending = dict(forged, pending=True)
    as_nobody(
        textwrap.dedent(
            """
            import json, os, sys
            shm, forged, pending, *names = sys.argv[1:]
            for name, body in zip(names, [forged, forged, pending]):
                with open(os.path.join(shm, name), "w") as f:
                    f.write(body)
                os.chmod(os.path.join(shm, name), 0o644)
            os.symlink("/etc/hostname", os.path.join(shm, names[3]))
            open(os.path.join(shm, names[4]), "w").close()
            for name in names[5:7]:
                os.mkfifo(os.path.join(shm, name), 0o666)
            for name in names[7:]:
                open(os.path.join(shm, name), "w").close()
            """
        ),
        str(SHM), json.dumps(forged), json.dumps(pending), *names,
    )  # fmt: skip
    return names


@ROOT_ONLY
@pytest.mark.timeout(RUN_TIMEOUT)
def test_names_another_user_planted_do_not_stop_a_record_nor_are_taken_for_ours(tmp_path):
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"]
    root = tmp_path / "root"
    names = plant(prefix, records.hold_key(root, 0))
    try:
        assert records.find(root, 0) is None  # theirs are not ours (nor waited on: the FIFOs)
        assert records.holds() == []
        assert records.wait_for_holders(root, 0, 0.0)  # their "pending" one does not hold us
        info = records.HoldInfo(str(root), 0, 1, "ours", 5, False, 60.0, None, False)
        path = records.publish(records.pending_record(info), os.getpid(), None, None)
        assert path.name not in names
        assert (path.stat().st_uid, path.stat().st_mode & 0o777) == (0, 0o600)
        assert not records.wait_for_holders(root, 0, 0.0)  # ours, pending, alive: waited for
        record = dict(records.pending_record(info), pending=False, segment={"name": "s"})
        assert records.publish(record, os.getpid(), None, None) == path  # replaces the pending
        assert records.wait_for_holders(root, 0, 0.0)
        assert records.find(root, 0)["name"] == "ours"
        assert records.collect_stale() == []  # its holder (this process) lives; theirs: not ours
        claimed = records.claim(path)
        assert claimed is not None
        assert claimed["name"] == "ours"
        assert records.find(root, 0) is None
        planted = sorted(n for n in names if "-held-" in n)
        assert sorted(p.name for p in SHM.glob(f"{prefix}-held-*")) == planted
    finally:
        for name in names:
            (SHM / name).unlink(missing_ok=True)


# A holder that publishes a pending record of ROOT, then the whole one after DELAY seconds, or
# dies (SIGKILL) with the pending one out; prints when it is pending.
HOLDER = textwrap.dedent(
    """
    import os, signal, sys, time

    from pyshmckpt.tiers import records

    root, then, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    info = records.HoldInfo(root, 0, 1, "step-9", 9, False, 60.0, None, False)
    records.publish(records.pending_record(info), os.getpid(), None, None)
    print("pending", flush=True)
    time.sleep(delay)
    if then == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    record = dict(records.pending_record(info), pending=False, segment={"name": "none"})
    path = records.publish(record, os.getpid(), None, None)
    print("held", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("then", ["hold", "die"])
def test_a_restore_waits_for_a_pending_holder_until_it_holds_or_dies(tmp_path, then):
    root = tmp_path / "root"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), then, "1.5"],
        stdout=subprocess.PIPE, text=True, env=child_env(), cwd="/",  # not the checkout
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "pending"
        started = time.monotonic()
        assert records.wait_for_holders(root, 0, RUN_TIMEOUT)
        waited = time.monotonic() - started
        assert 0.5 < waited < RUN_TIMEOUT / 2
        if then == "hold":
            assert records.find(root, 0)["name"] == "step-9"
        else:  # a holder that died is proven gone by its lock: its record no longer counts
            assert holder.wait(timeout=RUN_TIMEOUT) == -signal.SIGKILL
            assert records.find(root, 0) is None
            left = records.record_paths(root, 0)
            assert len(left) == 1  # its pending record stays until collected
            assert records.collect_stale() == left
            assert records.record_paths(root, 0) == []
    finally:
        holder.kill()
        holder.wait(timeout=RUN_TIMEOUT)
        if holder.stdout is not None:
            holder.stdout.close()
        for path in records.record_paths(root, 0):
            path.unlink(missing_ok=True)


TRAINER = textwrap.dedent(
    """
    import os, signal, sys

    import torch

    import pyshmckpt

    ck = pyshmckpt.Checkpointer(sys.argv[1], hold_timeout=120)
    ck.save({"w": torch.arange(10.0), "step": 7}, name="step-7", persist=False).result(timeout=60)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_collection_leaves_a_record_being_published(tmp_path):
    """A temporary of a record not locked yet (its publisher between creating and locking it)
    is left alone; one left by a publisher that died long ago is removed."""
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"]
    key = records.hold_key(tmp_path, 0)
    young = SHM / f"{prefix}-held-{key}-{'e' * 32}.{'f' * 16}.tmp"
    old = SHM / f"{prefix}-held-{key}-{'e' * 32}.{'0' * 16}.tmp"
    try:
        for path in (young, old):
            path.write_bytes(b"{}")
            path.chmod(0o600)
        an_hour_ago = time.time() - 3600
        os.utime(old, (an_hour_ago, an_hour_ago))
        assert records.collect_stale() == [old]
        assert young.exists()
    finally:
        young.unlink(missing_ok=True)
        old.unlink(missing_ok=True)


@ROOT_ONLY
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_checkpoint_is_held_and_restored_beside_names_another_user_planted(tmp_path):
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"]
    root = tmp_path / "root"
    names = plant(prefix, records.hold_key(root, 0))
    try:
        done = subprocess.run(
            [sys.executable, "-c", TRAINER, str(root)],
            capture_output=True, text=True, env=child_env(), cwd="/", timeout=RUN_TIMEOUT,
        )  # fmt: skip
        assert done.returncode == -signal.SIGKILL, done.stderr
        wait_until(lambda: records.find(root, 0) is not None, RUN_TIMEOUT, "the hold")
        state = pyshmckpt.load(root, source="memory")
        assert state["step"] == 7
        assert state["w"].tolist() == list(range(10))
        with pyshmckpt.Checkpointer(root) as ck:  # takes it over, then frees it on close
            assert ck.load()["step"] == 7
    finally:
        for found in records.holds():
            records.release(*found)
        for name in names:
            (SHM / name).unlink(missing_ok=True)
    assert sorted(p.name for p in SHM.glob(f"{prefix}-held-*")) == []
