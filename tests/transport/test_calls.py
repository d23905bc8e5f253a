"""`CheckpointProcess.call`: a method of the writer run in the writer process, in order with the
writes handed over before it, whether they were sent, spooled while it started, or left behind by
a trainer that died."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pyshmckpt
from pyshmckpt import CheckpointProcess, CheckpointProcessConfig
from pyshmckpt.transport import RankInfo, no_init

from helpers import child_env, failure_of, pid_running, wait_until
from writer_side import JournalWriter

TIMEOUT = 60


def entries(journal: Path) -> list[str]:
    return journal.read_text().splitlines() if journal.exists() else []


def journal_process(journal: Path, **config: object) -> CheckpointProcess:
    settings = {"subprocess_init_timeout_secs": TIMEOUT, "write_timeout_secs": TIMEOUT, **config}
    return CheckpointProcess(
        RankInfo(0, 1), CheckpointProcessConfig(**settings), no_init, (),
        JournalWriter, {"journal": str(journal)},
    )  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait_for_start", [True, False])
def test_calls_run_in_order_with_the_writes_and_return_what_the_method_returned(
    tmp_path, wait_for_start
):
    journal = tmp_path / "journal"
    with journal_process(journal, wait_for_start=wait_for_start) as process:
        first = process.write({"w": torch.ones(1000)}, str(tmp_path / "a.pt"))
        noted = process.call("note", text="after a")
        second = process.write({"w": torch.zeros(10)}, str(tmp_path / "b.pt"))
        assert noted.result(TIMEOUT) == "AFTER A"
        first.result(TIMEOUT)
        second.result(TIMEOUT)
    assert entries(journal) == ["wrote a.pt", "note after a", "wrote b.pt"]


@pytest.mark.timeout(120)
def test_a_call_that_raises_fails_its_future_and_the_writer_goes_on(tmp_path):
    journal = tmp_path / "journal"
    with journal_process(journal) as process:
        error = failure_of(process.call("fail"), TIMEOUT)
        assert isinstance(error, pyshmckpt.WriterError)
        assert "on purpose" in str(error)
        missing = failure_of(process.call("no_such_method"), TIMEOUT)
        assert isinstance(missing, pyshmckpt.WriterError)
        process.write({"w": torch.ones(3)}, str(tmp_path / "c.pt")).result(TIMEOUT)
    assert entries(journal) == ["wrote c.pt"]


TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from pyshmckpt import CheckpointProcess, CheckpointProcessConfig
    from pyshmckpt.transport import RankInfo, no_init
    from writer_side import JournalWriter

    target, journal = sys.argv[1], sys.argv[2]
    process = CheckpointProcess(
        RankInfo(0, 1), CheckpointProcessConfig(subprocess_init_timeout_secs=60), no_init, (),
        JournalWriter, {"journal": journal},
    )
    process.write({"w": torch.arange(1 << 20, dtype=torch.float32)}, target)
    process.call("note", text="sealed")
    print(json.dumps({"writer": process.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_call_made_before_the_trainer_was_killed_still_runs_after_its_write(tmp_path):
    script, journal, target = tmp_path / "trainer.py", tmp_path / "journal", tmp_path / "w.pt"
    script.write_text(TRAINER)
    with (tmp_path / "stderr").open("w") as stderr:
        trainer = subprocess.Popen(
            [sys.executable, str(script), str(target), str(journal)],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env(), cwd=str(tmp_path),
        )  # fmt: skip
    try:
        line = trainer.stdout.readline()  # type: ignore[union-attr]
        assert trainer.wait(timeout=120) == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.stdout.close()  # type: ignore[union-attr]
    writer = json.loads(line)["writer"]
    wait_until(lambda: not pid_running(writer), TIMEOUT, "the orphaned writer to exit")
    assert entries(journal) == ["wrote w.pt", "note sealed"], (tmp_path / "stderr").read_text()
    assert torch.equal(torch.load(target)["w"], torch.arange(1 << 20, dtype=torch.float32))
