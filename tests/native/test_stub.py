"""The hand-written pyshmckpt/_C.pyi must match the compiled module (mypy's stubtest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ALLOWLIST = Path(__file__).with_name("stubtest_allowlist.txt")


@pytest.mark.skipif(
    sys.flags.optimize > 0, reason="compares signatures, which python -O does not change"
)
def test_stub_matches_module(tmp_path):
    pytest.importorskip("mypy")
    # Run outside the checkout so that the installed package (with its compiled module) is checked.
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "pyshmckpt._C", "--allowlist", str(ALLOWLIST)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
