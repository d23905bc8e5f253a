"""ShmCheckpointEngine with real DeepSpeed on CPU (gloo), and the TorchFileWriter it writes with.

The DeepSpeed tests run deepspeed_worker.py (one process, or two ranks under torchrun) bounded by
a timeout; its checks run in the processes and fail their exit status (its docstring lists
them). DeepSpeed itself is never imported here: it would share the test process's
torch.distributed state and warnings filters.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyshmckpt import CheckpointCorruptError, CheckpointProcess, WriterOSError
from pyshmckpt.integrations.deepspeed_mirror import fetch
from pyshmckpt.storage import TorchFileWriter

from helpers import (
    SAVE_TIMEOUT,
    bounded_config,
    child_env,
    failure_of,
    free_port,
    pid_running,
    same_bytes,
    wait_until,
)

WORKER = Path(__file__).with_name("deepspeed_worker.py")
RUN_TIMEOUT = 240  # seconds one run may take (about 8 s for one rank, 20 s for two here)

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"
)


def run(command: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).splitlines()
        pytest.fail(f"{' '.join(command[-3:])} failed:\n" + "\n".join(lines[-40:]))
    assert "passed" in done.stdout


@needs_deepspeed
@pytest.mark.slow
def test_stage0_one_rank_files_match_deepspeeds_and_resume_bitwise(tmp_path):
    env = child_env()
    env.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu",
    )  # fmt: skip
    run([sys.executable, str(WORKER), str(tmp_path), "resume0"], env)


@needs_deepspeed
@pytest.mark.slow
def test_stage1_two_ranks_resume_latest_only_when_durable_and_a_killed_writer(tmp_path):
    # One launch for several checks: each launch costs seconds of start-up.
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(WORKER), str(tmp_path), "resume1", "commit",
    ]  # fmt: skip
    run(command, {**child_env(), "DS_ACCELERATOR": "cpu"})


@needs_deepspeed
@pytest.mark.slow
def test_two_ranks_mirror_their_tags_and_a_new_node_resumes_from_the_mirror(tmp_path, bucket):
    from pyshmckpt.storage import object_commit, object_store

    url = bucket.url("deepspeed")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(WORKER), str(tmp_path), "mirror",
    ]  # fmt: skip
    run(command, {**child_env(), "DS_ACCELERATOR": "cpu", "MIRROR": url})
    root = object_store.parse(url)
    assert [name for _, name in object_commit.committed(root)] == ["step2", "step3"]
    record = object_commit.record_of(root / "step3")
    assert record["world_size"] == 2
    assert all(isinstance(entry["crc32c"], int) for entry in record["objects"].values())
    assert bucket.keys("deepspeed/.pending/") == []
    (tmp_path / "fetched" / "step3" / "mp_rank_00_model_states.pt").unlink()
    damaged = bucket.client.put_object(
        Bucket=bucket.name, Key="deepspeed/step3/mp_rank_00_model_states.pt", Body=b"not it"
    )
    assert damaged["ETag"] != record["objects"]["mp_rank_00_model_states.pt"]["etag"]
    with pytest.raises(CheckpointCorruptError, match="changed"):
        fetch(url, tmp_path / "again")
    assert not (tmp_path / "again" / "latest").exists()


SCRIPT = WORKER.with_name("deepspeed_script.py")


def launch_script(
    tmp_path: Path, ranks: int, stage: int, mode: str
) -> subprocess.CompletedProcess[str]:
    """Run deepspeed_script.py as a user would: alone, or under torchrun on `ranks` ranks."""
    env = {**child_env(), "DS_ACCELERATOR": "cpu"}
    args = [str(SCRIPT), str(tmp_path / "ckpt"), str(stage), mode]
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))  # fmt: skip
        command = [sys.executable, *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--max-restarts", "0", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *args,
        ]  # fmt: skip
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=tmp_path
    )


def output(done: subprocess.CompletedProcess[str]) -> str:
    return "\n".join((done.stdout + done.stderr).splitlines()[-40:])


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 120)
@pytest.mark.parametrize(
    ("stage", "ranks", "ending"),
    [(0, 1, "save"), (1, 2, "save"), (1, 2, "save-kill")],
    ids=["ends-zero0-1rank", "ends-zero1-2ranks", "killed-zero1-2ranks"],
)
def test_an_unguarded_script_resumes_from_its_last_tag_however_it_ended(
    tmp_path, stage, ranks, ending
):
    """No main guard, no destroy(): the run simply ends, or its trainers are SIGKILLed right
    after the last save_checkpoint returned (on two ranks: each orphaned writer finishes, and
    rank 0's waits for rank 1's). `latest` names the last tag once the writers are
    done, the save directory holds what DeepSpeed's default engine leaves, and a new launch
    resumes from it with load_checkpoint(save_dir), bitwise."""
    save_dir = tmp_path / "ckpt"
    done = launch_script(tmp_path, ranks, stage, ending)
    if ending == "save":
        assert done.returncode == 0, output(done)
    else:
        assert done.returncode != 0, output(done)
        writers = [int((tmp_path / f"writer-rank{r}").read_text()) for r in range(ranks)]
        for pid in writers:  # orphaned, they finish the writes and the seal, then exit
            wait_until(lambda pid=pid: not pid_running(pid), RUN_TIMEOUT, f"writer {pid} to exit")
    assert (save_dir / "latest").read_text() == "s6"
    # (ZeRO stages >= 1 also get DeepSpeed's conversion scripts, zero_to_fp32.py and others.)
    assert sorted(p.name for p in save_dir.iterdir() if p.suffix != ".py") == ["latest", "s3", "s6"]
    assert [str(p) for p in save_dir.rglob(".*")] == []  # no marker, no temporary left
    resumed = launch_script(tmp_path, ranks, stage, "resume")
    assert resumed.returncode == 0, output(resumed)
    assert resumed.stdout.count("resumed") == ranks, output(resumed)


# -- TorchFileWriter --------------------------------------------------------------------------


def no_init() -> None:
    pass


class FullDiskInWriter:
    """A leaf that pickles in the trainer but fails to be saved in the writer process, as
    torch.save meeting a full disk half-way through a file."""

    def __init__(self, trainer: int) -> None:
        self.trainer = trainer

    def __reduce__(self) -> tuple[object, ...]:
        if os.getpid() != self.trainer:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return FullDiskInWriter, (self.trainer,)


def test_torch_file_writer_replaces_the_file_at_its_path_atomically(tmp_path, trained):
    model, _ = trained
    path = tmp_path / "model.pt"
    path.write_bytes(b"the previous file")
    process = CheckpointProcess(None, bounded_config(), no_init, (), TorchFileWriter, {})
    try:
        process.write(model.state_dict(), str(path)).result(timeout=SAVE_TIMEOUT)
        loaded = torch.load(path, weights_only=True)
        assert list(loaded) == list(model.state_dict())
        assert all(same_bytes(loaded[k], v) for k, v in model.state_dict().items())
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]

        # A write failing half-way leaves the previous file and no temporary.
        before = path.read_bytes()
        state = {"x": torch.ones(1000), "full": FullDiskInWriter(os.getpid())}
        failure = failure_of(process.write(state, str(path)))
        assert isinstance(failure, WriterOSError)
        assert failure.errno == errno.ENOSPC
        assert path.read_bytes() == before
        assert TorchFileWriter.temporaries(path) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]

        # The directory is the caller's to make.
        missing = tmp_path / "missing" / "model.pt"
        failure = failure_of(process.write({"x": torch.ones(2)}, str(missing)))
        assert isinstance(failure, WriterOSError)
        assert failure.errno == errno.ENOENT
    finally:
        process.close()
