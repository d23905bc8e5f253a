"""No writer process runs the training script: scripts as people write them, without an
``if __name__ == "__main__":`` guard, that bind a port at the top (as ``init_process_group`` or
``deepspeed.init_distributed`` does) and would fail if run a second time.

With torch's own ``CheckpointWriter`` (importable by module name) the drop-in starts its writer
as a fresh interpreter; with a writer class defined in the script itself it must use
multiprocessing's spawn, and the start-up error then names the likely cause.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from helpers import child_env, free_port

HEADER = textwrap.dedent(
    """
    import os, socket, sys
    import torch
    import pyshmckpt
    from torch.distributed.checkpoint._experimental.checkpoint_writer import (
        CheckpointWriter, CheckpointWriterConfig,
    )
    from torch.distributed.checkpoint._experimental.types import RankInfo

    # What a rendezvous does: a second run of this script fails with EADDRINUSE.
    port = socket.socket()
    port.bind(("127.0.0.1", int(sys.argv[2])))
    port.listen()
    print("script ran in", os.getpid(), flush=True)

    def no_init():
        pass

    config = pyshmckpt.CheckpointProcessConfig(
        subprocess_init_timeout_secs=120, write_timeout_secs=120
    )
    """
)

TORCH_WRITER = HEADER + textwrap.dedent(
    """
    process = pyshmckpt.CheckpointProcess(
        RankInfo(0, 1), config, pyshmckpt.transport.no_init, (), CheckpointWriter,
        {"config": CheckpointWriterConfig(), "rank_info": RankInfo(0, 1)},
    )
    state = {"w": torch.arange(12.0).reshape(3, 4), "n": torch.tensor(7)}
    process.write(state, sys.argv[1]).result(timeout=120)
    loaded = torch.load(sys.argv[1] + "/checkpoint_0.pt", weights_only=True)
    print("same", torch.equal(loaded["w"], state["w"]) and int(loaded["n"]) == 7, flush=True)
    """
)

SCRIPT_WRITER = HEADER + textwrap.dedent(
    """
    class ScriptWriter:
        def __init__(self, **kwargs):
            pass

        def write(self, path, state_dict, **kwargs):
            torch.save(state_dict, path)

    process = pyshmckpt.CheckpointProcess(
        RankInfo(0, 1), config, no_init, (), ScriptWriter, {}
    )
    try:
        process.write({"w": torch.ones(4)}, sys.argv[1]).result(timeout=120)
    except pyshmckpt.WriterStartError as exc:
        print("start failed:", exc, flush=True)
    """
)


def run(tmp_path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(free_port())],
        capture_output=True, text=True, env=child_env(), cwd=str(tmp_path), timeout=240,
        check=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchs_writer_in_an_unguarded_script_starts_without_running_it_again(tmp_path):
    proc = run(tmp_path, TORCH_WRITER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("script ran in") == 1, proc.stdout + proc.stderr
    assert "same True" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_writer_of_an_unguarded_script_fails_to_start_with_the_reason(tmp_path):
    proc = run(tmp_path, SCRIPT_WRITER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    failed = [line for line in proc.stdout.splitlines() if line.startswith("start failed:")]
    assert failed, proc.stdout + proc.stderr
    assert "__main__" in failed[0], failed[0]
    assert "guard" in failed[0], failed[0]
    assert not (tmp_path / "ckpt").exists()
