"""The memory tier with GPU state (marked gpu: skipped without a GPU): a CUDA state saved to
memory only, its trainer killed, restored from memory into CUDA tensors bit for bit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import pyshmckpt
from pyshmckpt.tiers import records

from helpers import child_env

pytestmark = pytest.mark.gpu

TRAINER = textwrap.dedent(
    """
    import os, signal, torch, pyshmckpt
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(1024, 1024, device="cuda", generator=g),
             "b": torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16), "step": 5}
    ck = pyshmckpt.Checkpointer("root", hold_timeout=60)
    ck.save(state, persist=False).result(timeout=60)
    torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}, "expected.pt")
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.timeout(180)
def test_cuda_state_restored_from_memory_into_cuda_tensors(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", TRAINER], cwd=tmp_path, env=child_env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == -9, done.stderr
    try:
        expected = torch.load(tmp_path / "expected.pt")
        target = {
            "w": torch.zeros(1024, 1024, device="cuda"),
            "b": torch.zeros(4096, device="cuda", dtype=torch.bfloat16),
            "step": 0,
        }
        pyshmckpt.load(tmp_path / "root", into=target, source="memory")
        assert torch.equal(target["w"].cpu(), expected["w"])
        assert torch.equal(target["b"].cpu(), expected["b"])
        assert target["step"] == 5
        assert not (tmp_path / "root" / "step-00000001").exists()
    finally:
        found = records.newest(tmp_path / "root", 0)
        if found is not None:
            records.release(*found)
