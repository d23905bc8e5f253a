"""The writer's hold after its trainer's death keeps what can be kept: a replica whose record
cannot be published is logged and removed alone; the other replicas are held (and the hold
then ends at its timeout, as always)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import child_env, wait_until

# A writer process's end, in miniature: no newest checkpoint, two replicas received, the first
# of which cannot be published (a value JSON cannot write). hold() silences the process's output,
# so the log goes to a file.
HOLD = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from pyshmckpt.shm import AttachedSegments
    from pyshmckpt.tiers import holding
    logging.basicConfig(level=logging.INFO, filename=sys.argv[2], format="%(levelname)s %(message)s")
    directory = Path(sys.argv[1])
    bad, good = directory / "bad.record", directory / "good.record"
    bad.write_text("{}")  # as the receiver leaves them: a record per replica
    good.write_text("{}")
    replicas = [(bad, {"name": "step-7", "rank": 2, "unwritable": object()}),
                (good, {"name": "step-7", "rank": 1})]
    held = holding.Holder().hold(AttachedSegments(), replicas, limits=(3.0, None))
    logging.info("hold returned %s", held)
    """
)


@pytest.mark.timeout(120)
def test_a_replica_that_cannot_be_held_costs_itself_alone(tmp_path: Path) -> None:
    log = tmp_path / "writer.log"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), str(log)], env=child_env(), cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        good = tmp_path / "good.record"

        def published() -> bool:
            try:
                return json.loads(good.read_text()).get("holder") is not None
            except (OSError, ValueError):
                return False

        wait_until(published, 60, "the good replica's record to be published")
        assert json.loads(good.read_text())["rank"] == 1
        assert not (tmp_path / "bad.record").exists()  # released: its record removed
        assert child.poll() is None  # holding the one it could keep, until the timeout
        started = time.monotonic()
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert time.monotonic() - started < 30
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=10)
    text = log.read_text()
    assert "cannot hold the replica of step-7 (rank 2) in memory: removing it" in text, text
    assert "holding 1 replica(s) of other nodes' ranks" in text, text
    assert "the hold ends: the hold timeout (3 s)" in text, text
    assert "hold returned True" in text, text
    assert not good.exists()  # released when the hold ended
