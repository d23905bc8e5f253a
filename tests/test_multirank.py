"""Checkpoints written by several ranks together: one directory, committed once every rank's
files are durable, failing on every rank when any rank fails.

The ranks are Checkpointers in this process (rank=, world_size=), each with its own stager and
writer subprocess, sharing a root as ranks on different hosts share a network filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pyshmckpt
from pyshmckpt import Checkpointer, CommitError, CommitTimeoutError, cli
from pyshmckpt.storage import reader
from pyshmckpt.storage.safetensors_writer import file_names

from helpers import (
    SAVE_TIMEOUT,
    failure_of,
    heartbeats,
    hidden,
    link_target,
    opened,
    same_bytes,
    small_tmpfs,
    visible,
    wait_until,
)


@contextlib.contextmanager
def ranks(root: Path, world_size: int, **kwargs: Any) -> Iterator[list[Checkpointer]]:
    """One Checkpointer per rank (rank 0 first, as it removes leftovers when it opens the root)."""
    kwargs.setdefault("run_id", "r" + secrets.token_hex(4))
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(opened(root, rank=r, world_size=world_size, **kwargs))
            for r in range(world_size)
        ]


def rank_state(rank: int, step: int, numel: int = 1000) -> dict[str, Any]:
    return {
        "model": {
            "w": torch.full((numel,), float(rank * 100 + step)),
            "rank_id": torch.tensor([rank]),
        },
        "step": step,
        "rank": rank,
    }


def test_every_rank_writes_its_files_into_one_committed_checkpoint(tmp_path):
    with ranks(tmp_path, 3) as cks:
        assert len(heartbeats(tmp_path)) == 3  # one per rank, beaten while it is open
        futures = [ck.save(rank_state(r, 1), name="step-1") for r, ck in enumerate(cks)]
        paths = [f.result(timeout=SAVE_TIMEOUT) for f in futures]
        assert paths == [tmp_path / "step-1"] * 3
        checkpoint = paths[0]
        record = json.loads((checkpoint / "commit.json").read_text())
        assert record["world_size"] == 3
        expected = {"commit.json"} | {name for r in range(3) for name in file_names(r)}
        assert {p.name for p in checkpoint.iterdir()} == expected  # no markers left behind
        assert visible(tmp_path) == ["step-1"]
        assert hidden(tmp_path) == []
        assert link_target(tmp_path / "latest") == "step-1"
        for r in range(3):
            loaded = pyshmckpt.load(checkpoint, rank=r)
            assert same_bytes(loaded["model"]["w"], rank_state(r, 1)["model"]["w"])
            assert loaded["rank"] == r
            assert loaded["step"] == 1
            assert json.loads((checkpoint / f"rank{r}.json").read_text())["world_size"] == 3
        assert reader.ranks(checkpoint) == [0, 1, 2]
        assert all(ck.latest() == checkpoint for ck in cks)

        # Automatic names agree when every rank saves equally often.
        futures = [ck.save(rank_state(r, 2)) for r, ck in enumerate(cks)]
        second = {f.result(timeout=SAVE_TIMEOUT) for f in futures}
        assert len(second) == 1
        assert second != {checkpoint}
        assert cks[0].latest() == second.pop()

        # Overwriting: each rank returns once this attempt (not the old checkpoint of that name)
        # is committed, and the name holds every rank's new files.
        futures = [
            ck.save(rank_state(r, 3), name="step-1", overwrite=True) for r, ck in enumerate(cks)
        ]
        assert [f.result(timeout=SAVE_TIMEOUT) for f in futures] == [checkpoint] * 3
        for r in range(3):
            assert pyshmckpt.load(checkpoint, rank=r)["step"] == 3
        assert cks[0].latest() == checkpoint
    assert heartbeats(tmp_path) == [], "a closed rank left its heartbeat behind"


def test_every_entry_of_a_save_takes_the_mode_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("PYSHMCKPT_FILE_MODE", "640")  # the writer processes inherit it
    with ranks(tmp_path, 2) as cks:
        futures = [ck.save(rank_state(r, 1), name="c") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in futures} == {tmp_path / "c"}
        entries = [tmp_path / "c", *(tmp_path / "c").iterdir()]
        entries += [tmp_path / name for name in heartbeats(tmp_path)]
        assert len(entries) == 1 + 5 + 2  # commit.json and two files per rank; two heartbeats
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in entries}
        assert modes == {p.name: 0o750 if p.is_dir() else 0o640 for p in entries}


def test_cli_verify_checks_every_rank_and_names_a_corrupt_one(tmp_path, capsys):
    with ranks(tmp_path, 2) as cks:
        for f in [ck.save(rank_state(r, 1), name="c") for r, ck in enumerate(cks)]:
            f.result(timeout=SAVE_TIMEOUT)
    assert cli.main(["verify", str(tmp_path / "c")]) == 0
    assert "2 ranks" in capsys.readouterr().out
    data = tmp_path / "c" / "rank1.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert "rank1.safetensors" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "c"), "--rank", "0"]) == 0
    (tmp_path / "c" / "rank1.json").unlink()
    with pytest.raises(pyshmckpt.CheckpointCorruptError, match="rank1.json"):
        pyshmckpt.verify(tmp_path / "c", rank=1)


def test_a_rank_that_never_saves_times_the_checkpoint_out_everywhere(tmp_path):
    with ranks(tmp_path, 3, barrier_timeout=2.0) as cks:
        first = [ck.save(rank_state(r, 1), name="ok") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in first} == {tmp_path / "ok"}

        zero = cks[0].save(rank_state(0, 2), name="partial")
        two = cks[2].save(rank_state(2, 2), name="partial")  # rank 1 does not save
        exc0 = failure_of(zero)
        assert type(exc0) is CommitTimeoutError, repr(exc0)  # the type, whichever process found it
        assert "ranks [1]" in str(exc0), exc0
        exc2 = failure_of(two)
        assert type(exc2) is CommitError, repr(exc2)
        assert "abandoned: rank 0 waited" in str(exc2), exc2
        assert visible(tmp_path) == ["ok"]
        assert [n for n in hidden(tmp_path) if not n.startswith(".failed-partial-")] == []
        assert link_target(tmp_path / "latest") == "ok"

        # Rank 1 comes late to that attempt: it stops at the tombstone without writing anything.
        late = cks[1].save(rank_state(1, 2), name="partial")
        assert "abandoned: rank 0 waited" in str(failure_of(late))
        assert not any(n.startswith(".tmp-partial-") for n in hidden(tmp_path))

        again = [ck.save(rank_state(r, 3), name="again") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in again} == {tmp_path / "again"}
        assert pyshmckpt.load(tmp_path / "again", rank=1)["step"] == 3
        assert hidden(tmp_path) == [], "the dead attempt's tombstone outlived a later commit"


def test_a_rank_that_runs_out_of_disk_fails_the_save_on_every_rank(tmp_path):
    with small_tmpfs(tmp_path / "small") as root, ranks(root, 3) as cks:
        first = [ck.save(rank_state(r, 1), name="fits") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in first} == {root / "fits"}
        before = {p.name: p.read_bytes() for p in (root / "fits").iterdir()}

        # Ranks 0 and 2 finish their files first (else rank 1's partial file may fill the disk
        # under them, and they fail on their own ENOSPC), then rank 1 writes 4 MB on 2 MB.
        zero, two = (cks[r].save(rank_state(r, 2), name="full") for r in (0, 2))

        def marked() -> set[str]:
            return {m.name for m in root.glob(".tmp-full-*/.rank*.done")}

        wait_until(
            lambda: {".rank0.done", ".rank2.done"} <= marked(),
            SAVE_TIMEOUT,
            "ranks 0 and 2 to finish their files",
        )
        one = cks[1].save(rank_state(1, 2, numel=1_000_000), name="full")
        errors = [failure_of(f) for f in (zero, one, two)]
        assert isinstance(errors[1], pyshmckpt.WriterOSError), repr(errors[1])
        assert errors[1].errno == errno.ENOSPC, errors[1]
        for exc in (errors[0], errors[2]):  # both report rank 1's own error
            assert type(exc) is CommitError, repr(exc)
            text = str(exc)
            assert "rank 1 failed to write its files" in text, text
            assert "No space left" in text or "Errno 28" in text, text
        assert visible(root) == ["fits"]
        assert [n for n in hidden(root) if not n.startswith(".failed-full-")] == []
        assert {p.name: p.read_bytes() for p in (root / "fits").iterdir()} == before

        again = [ck.save(rank_state(r, 3), name="again") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in again} == {root / "again"}
        assert hidden(root) == []


def test_torch_writer_across_ranks_uses_torch_file_names(tmp_path):
    with ranks(tmp_path, 2, writer="torch") as cks:
        futures = [ck.save(rank_state(r, 1), name="t") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in futures} == {tmp_path / "t"}
    for r in range(2):
        loaded = torch.load(tmp_path / "t" / f"checkpoint_{r}.pt", weights_only=True)
        assert loaded["rank"] == r
        assert same_bytes(loaded["model"]["w"], rank_state(r, 1)["model"]["w"])


def test_only_rank_zero_removes_leftovers(tmp_path):
    leftover = tmp_path / ".tmp-step-9"
    leftover.mkdir()
    with opened(tmp_path, rank=1, world_size=2, run_id="x"):
        assert leftover.exists(), "rank 1 removed a temporary another rank may be writing"
    with opened(tmp_path, rank=0, world_size=2, run_id="x"):
        assert not leftover.exists()


def test_a_rank_zero_failure_stops_a_late_rank_before_it_writes(tmp_path):
    with small_tmpfs(tmp_path / "small") as root, ranks(root, 2, barrier_timeout=120.0) as cks:
        too_big = cks[0].save(rank_state(0, 1, numel=1_000_000), name="c")  # 4 MB on 2 MB
        assert "No space left" in str(failure_of(too_big)) or "Errno 28" in str(failure_of(too_big))
        started = time.monotonic()
        late = failure_of(cks[1].save(rank_state(1, 1), name="c"))
        assert time.monotonic() - started < 30, "rank 1 waited for the barrier timeout"
        assert "abandoned: rank 0 failed to write its files" in str(late), late
        assert [n for n in hidden(root) if not n.startswith(".failed-c-")] == []


def test_files_of_another_attempt_are_never_committed(tmp_path):
    with ranks(tmp_path, 2, run_id="now") as cks:
        stale = tmp_path / ".tmp-c-before.1"  # another run's attempt at the same name, all "done"
        stale.mkdir()
        (stale / "rank1.safetensors").write_bytes(b"OLD")
        (stale / ".rank1.done").touch()
        zero = cks[0].save(rank_state(0, 1), name="c")
        time.sleep(0.5)  # rank 0 is waiting for rank 1 now; the stale marker must not satisfy it
        assert not zero.done()
        one = cks[1].save(rank_state(1, 1), name="c")
        assert {zero.result(timeout=SAVE_TIMEOUT), one.result(timeout=SAVE_TIMEOUT)} == {
            tmp_path / "c"
        }
        assert pyshmckpt.load(tmp_path / "c", rank=1)["rank"] == 1
        assert stale.exists(), "another run's temporary is only removed when a root is opened"


def test_a_rank_that_gives_up_withdraws_and_rank_zero_does_not_commit(tmp_path):
    with ranks(tmp_path, 2, barrier_timeout=1.0) as cks:
        gave_up = failure_of(cks[1].save(rank_state(1, 1), name="c"))
        assert type(gave_up) is CommitTimeoutError, repr(gave_up)
        (marker,) = [p.name for p in tmp_path.glob(".tmp-c-*/.rank1.*")]
        assert marker == ".rank1.withdrawn"
        late_zero = failure_of(cks[0].save(rank_state(0, 1), name="c"))
        assert "abandoned: rank 1 waited" in str(late_zero), late_zero
        assert visible(tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"rank": 2, "world_size": 2}, ValueError),
        ({"rank": -1, "world_size": 2}, ValueError),
        ({"rank": 0, "world_size": 0}, ValueError),
        ({"rank": "0", "world_size": 2}, TypeError),
        ({"rank": 0, "world_size": 2.0}, TypeError),
        ({"rank": 0, "world_size": 2, "barrier_timeout": 0}, ValueError),
        ({"rank": 0, "world_size": 2, "writer": "dcp"}, NotImplementedError),
        ({"rank": 0, "world_size": 2}, ValueError),  # no torch.distributed and no run_id
        ({"rank": 0, "world_size": 2, "run_id": "a-b"}, ValueError),
        ({"rank": 0, "world_size": 2, "run_id": ""}, ValueError),
    ],
)
def test_bad_rank_arguments_are_refused_before_any_process_starts(tmp_path, kwargs, error):
    if "run_id" not in kwargs and kwargs.get("world_size") == 2 and error is not ValueError:
        kwargs = {**kwargs, "run_id": "x"}
    with pytest.raises(error):
        Checkpointer(tmp_path, **kwargs)


def test_commit_error_is_exported():
    assert issubclass(CommitError, pyshmckpt.PyshmckptError)
    assert issubclass(CommitError, RuntimeError)


# --------------------------------------------------------------------------------------------
# a rank whose processes are gone: noticed through its heartbeat, in seconds
# --------------------------------------------------------------------------------------------

HEARTBEAT_TIMEOUT = 2.0


@pytest.fixture
def quick_heartbeat(monkeypatch: pytest.MonkeyPatch) -> float:
    """A heartbeat timeout of 2 s, here and in the writer processes started from here."""
    monkeypatch.setenv("PYSHMCKPT_HEARTBEAT_TIMEOUT", str(HEARTBEAT_TIMEOUT))
    return HEARTBEAT_TIMEOUT


def test_a_rank_that_is_gone_fails_the_save_on_every_rank_with_commit_error(
    tmp_path, quick_heartbeat
):
    with ranks(tmp_path, 3, barrier_timeout=600.0) as cks:
        first = [ck.save(rank_state(r, 1), name="ok") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in first} == {tmp_path / "ok"}
        cks[1].close()  # its trainer and writer are gone: nothing beats for rank 1 any more
        started = time.monotonic()
        zero, two = (cks[r].save(rank_state(r, 2), name="lost") for r in (0, 2))
        errors = [failure_of(f) for f in (zero, two)]
        took = time.monotonic() - started
        for exc in errors:
            assert type(exc) is CommitError, repr(exc)  # not a timeout, not a WriterError
            assert "rank 1" in str(exc), exc
        assert "are gone" in str(errors[0]), errors[0]
        assert "heartbeat" in str(errors[0]), errors[0]
        assert took < 120, f"the survivors waited {took:.0f} s, as for the barrier timeout"
        assert visible(tmp_path) == ["ok"]


def test_a_slow_rank_that_is_alive_is_waited_for(tmp_path, quick_heartbeat):
    # Neither the heartbeat timeout nor the stall timeout cuts rank 0's wait for a live rank.
    with ranks(tmp_path, 2, barrier_timeout=600.0, stall_timeout=quick_heartbeat) as cks:
        zero = cks[0].save(rank_state(0, 1), name="c")
        time.sleep(3 * quick_heartbeat)  # rank 1 computes on: its trainer beats meanwhile
        assert not zero.done(), zero
        one = cks[1].save(rank_state(1, 1), name="c")
        assert {zero.result(timeout=SAVE_TIMEOUT), one.result(timeout=SAVE_TIMEOUT)} == {
            tmp_path / "c"
        }


def test_a_rank_zero_that_is_gone_fails_the_others_with_commit_error(tmp_path, quick_heartbeat):
    with ranks(tmp_path, 2, barrier_timeout=600.0) as cks:
        cks[0].close()
        exc = failure_of(cks[1].save(rank_state(1, 1), name="c"))
        assert type(exc) is CommitError, repr(exc)
        assert "rank 0 is gone" in str(exc), exc
        assert visible(tmp_path) == []


def test_a_rank_whose_writer_dies_mid_save_stops_the_others_at_once(tmp_path):
    # The default heartbeat timeout (10 s) and a long barrier: rank 1's trainer lives on and
    # says at once that its part of the attempt is lost.
    with ranks(tmp_path, 2, barrier_timeout=600.0) as cks:
        cks[1].wait_for_writer(SAVE_TIMEOUT)
        writer = cks[1].writer_pid
        assert writer is not None
        os.kill(writer, signal.SIGSTOP)  # holds the save it is handed
        one = cks[1].save(rank_state(1, 1), name="c")
        zero = cks[0].save(rank_state(0, 1), name="c")
        started = time.monotonic()
        os.kill(writer, signal.SIGKILL)
        assert isinstance(failure_of(one), pyshmckpt.WriterDiedError)
        exc = failure_of(zero)
        took = time.monotonic() - started
        assert type(exc) is CommitError, repr(exc)
        assert "rank 1's write failed: WriterDiedError" in str(exc), exc
        assert took < 60, f"rank 0 waited {took:.0f} s"
        again = [ck.save(rank_state(r, 2), name="again") for r, ck in enumerate(cks)]
        assert {f.result(timeout=SAVE_TIMEOUT) for f in again} == {tmp_path / "again"}
