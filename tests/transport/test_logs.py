"""Logging as a library does it: records of the writer process reach the trainer's loggers, the
failures that matter are WARNINGs there, fallbacks warn once, and nothing is printed unless the
application configures logging."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import pyshmckpt
from pyshmckpt import _log
from pyshmckpt.transport import logs

from helpers import child_env, failure_of, wait_until

TIMEOUT = 60.0


class HangingWriter:
    """Logs, says where it is, then hangs in write() (a writer to be killed)."""

    def __init__(self, rank_info=None, *, marker: str) -> None:
        self.marker = Path(marker)

    def write(self, path: str, state_dict, **kwargs) -> None:
        logging.getLogger("tests.hanging_writer").warning("writing %s", Path(path).name)
        ready = self.marker.with_suffix(".tmp")  # renamed into place: never read half written
        ready.write_text(str(os.getpid()))
        ready.replace(self.marker)
        time.sleep(600)


def no_init() -> None:
    pass


def make_process(tmp_path: Path, **config) -> pyshmckpt.CheckpointProcess:
    settings = {"subprocess_init_timeout_secs": 60, "subprocess_shutdown_timeout_secs": 5, **config}
    return pyshmckpt.CheckpointProcess(
        None, pyshmckpt.CheckpointProcessConfig(**settings), no_init, (),
        HangingWriter, {"marker": str(tmp_path / "writing")},
    )  # fmt: skip


def records(caplog: pytest.LogCaptureFixture, logger: str, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno == level]


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_write_leaves_a_warning_and_its_own_records(tmp_path, caplog):
    caplog.set_level(logging.INFO)  # before the writer starts: it takes the trainer's levels
    process = make_process(tmp_path)
    try:
        future = process.write({"w": torch.ones(8)}, str(tmp_path / "step-1"))
        wait_until((tmp_path / "writing").exists, TIMEOUT, "the writer to start writing")
        pid = int((tmp_path / "writing").read_text())
        os.kill(pid, signal.SIGKILL)
        assert isinstance(failure_of(future, TIMEOUT), pyshmckpt.WriterDiedError)
    finally:
        process.close(abort=True)
    died = records(caplog, "pyshmckpt.transport.parent", logging.WARNING)
    assert any("died" in r.getMessage() and "SIGKILL" in r.getMessage() for r in died), caplog.text
    forwarded = records(caplog, "tests.hanging_writer", logging.WARNING)
    assert [r.getMessage() for r in forwarded] == ["writing step-1"]
    assert forwarded[0].process == pid != os.getpid()
    assert forwarded[0].processName == "pyshmckpt-writer"
    ready = records(caplog, "pyshmckpt.transport.parent", logging.INFO)
    assert any("ready" in r.getMessage() for r in ready), caplog.text


@pytest.mark.timeout(120)
def test_a_write_timeout_is_logged_as_a_warning_before_it_fails(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    process = make_process(tmp_path, write_timeout_secs=1.0)
    try:
        future = process.write({"w": torch.ones(8)}, str(tmp_path / "step-1"))
        assert isinstance(failure_of(future, TIMEOUT), pyshmckpt.WriteTimeoutError)
    finally:
        process.close(abort=True)
    kills = records(caplog, "pyshmckpt.transport.parent", logging.WARNING)
    assert any(
        "killing writer process" in r.getMessage() and "deadline" in r.getMessage() for r in kills
    )


UNCONFIGURED = textwrap.dedent(
    """
    import sys, torch, pyshmckpt
    from test_logs import make_process
    from pathlib import Path

    if __name__ == "__main__":
        process = make_process(Path(sys.argv[1]), write_timeout_secs=1.0)
        future = process.write({"w": torch.ones(8)}, sys.argv[1] + "/step-1")
        try:
            future.result(timeout=60)
        except pyshmckpt.WriteTimeoutError:
            print("timed out as expected")
        process.close(abort=True)
    """
)


@pytest.mark.timeout(120)
def test_nothing_is_printed_unless_the_application_configures_logging(tmp_path):
    script = tmp_path / "unconfigured.py"
    script.write_text(UNCONFIGURED)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=child_env(), cwd=tmp_path,
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "timed out as expected"
    # pyshmckpt's WARNING about killing the writer is not printed; the user's writer's own WARNING
    # is, as Python prints any unconfigured WARNING (it reached the trainer's logging intact).
    assert done.stderr == "writing step-1\n", done.stderr


def test_warn_once_warns_once_per_cause(caplog):
    caplog.set_level(logging.DEBUG)
    logger = logging.getLogger("pyshmckpt.tests.warn_once")
    assert _log.warn_once(logger, "cause A", "fallback %d", 1)
    assert not _log.warn_once(logger, "cause A", "fallback %d", 2)
    assert _log.warn_once(logger, "cause B", "fallback %d", 3)
    levels = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger.name]
    assert levels == [
        (logging.WARNING, "fallback 1"),
        (logging.DEBUG, "fallback 2"),
        (logging.WARNING, "fallback 3"),
    ]


def test_forwarded_records_keep_what_a_handler_needs(caplog):
    caplog.set_level(logging.DEBUG)
    sent: list[dict] = []
    handler = logs.ForwardingHandler(lambda fields: sent.append(fields) or True)
    source = logging.getLogger("pyshmckpt.tests.source")
    source.addHandler(handler)
    source.propagate = False
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            source.exception("write of %s failed", "step-3", extra={"object": object()})
    finally:
        source.removeHandler(handler)
        source.propagate = True
    (fields,) = sent
    logs.emit_forwarded(fields)
    (record,) = [r for r in caplog.records if r.name == "pyshmckpt.tests.source"]
    assert record.getMessage() == "write of step-3 failed"
    assert record.levelno == logging.ERROR
    assert "No space left on device" in record.exc_text
    assert record.object.startswith("<object object")


def test_a_record_that_cannot_be_forwarded_is_reported_as_logging_reports_it(capsys):
    def broken(fields: dict) -> bool:
        raise RuntimeError("the channel broke on purpose")

    handler = logs.ForwardingHandler(broken)
    handler.emit(logging.LogRecord("tests.logs", logging.WARNING, __file__, 1, "hi", None, None))
    err = capsys.readouterr().err
    assert "Logging error" in err
    assert "the channel broke on purpose" in err
