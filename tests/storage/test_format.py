"""The checkpoint format's promise (docs/format.md): a checkpoint of format version 1, kept in
tests/data/format-1 as the writer made it, loads as it was saved, and the writer still writes
those bytes for that state (a change of the format changes `FORMAT_VERSION` and adds a fixture
of the new version beside this one, which stays and goes on loading); a manifest of a newer
version is refused, never misread, and one without a version is of version 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pyshmckpt
from pyshmckpt.storage.safetensors_writer import FORMAT_VERSION

from helpers import SAVE_TIMEOUT, assert_same_tree, opened

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "format-1"


def golden_state() -> dict[str, Any]:
    """The state the golden checkpoint was saved from: containers, dtypes, a tied tensor, a view,
    a NumPy array and plain leaves."""
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    return {
        "model": {
            "w": w,
            "b": torch.linspace(-1, 1, 5).to(torch.bfloat16),
            "idx": torch.arange(6, dtype=torch.int64),
        },
        "tied": w,
        "rows": w[1:3],
        "mask": torch.tensor([True, False, True]),
        "half": [torch.full((2, 2), 0.5, dtype=torch.float16), (1, 2.5, "x")],
        "array": np.arange(4, dtype=np.float64),
        "step": 7,
        "lr": 1e-3,
        "name": "golden",
        "none": None,
    }


def test_the_golden_checkpoint_is_of_this_format_version():
    manifest = json.loads((GOLDEN / "step-7" / "rank0.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 1


def test_a_checkpoint_of_format_1_loads_as_it_was_saved(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(GOLDEN, root)
    assert pyshmckpt.verify(root / "step-7") == 7  # tensors checked: every one
    for loaded in (pyshmckpt.load(root / "step-7"), pyshmckpt.load(root, source="disk")):
        expected = golden_state()
        array = loaded.pop("array")
        assert isinstance(array, np.ndarray)
        assert np.array_equal(array, expected.pop("array"))
        assert_same_tree(expected, loaded)
        assert loaded["tied"] is loaded["model"]["w"]  # still tied
        assert loaded["rows"].untyped_storage().data_ptr() == (
            loaded["model"]["w"].untyped_storage().data_ptr()
        )  # still a view of it


def test_the_writer_still_writes_format_1_byte_for_byte(tmp_path):
    with opened(tmp_path / "root") as checkpointer:
        path = checkpointer.save(golden_state(), name="step-7").result(SAVE_TIMEOUT)
    written = (path / "rank0.safetensors").read_bytes()
    assert written == (GOLDEN / "step-7" / "rank0.safetensors").read_bytes()
    manifest = json.loads((path / "rank0.json").read_text())
    golden = json.loads((GOLDEN / "step-7" / "rank0.json").read_text())
    for described in (manifest, golden):
        described.pop("staged_ns")  # when it was staged
    assert manifest == golden


@pytest.mark.parametrize(
    ("version", "error", "match"),
    [
        (FORMAT_VERSION + 1, pyshmckpt.NotSupportedError, "by a newer pyshmckpt"),
        ("1", pyshmckpt.CheckpointCorruptError, "is not one"),
        (0, pyshmckpt.CheckpointCorruptError, "is not one"),
    ],
)
def test_a_manifest_of_another_format_version_is_refused(tmp_path, version, error, match):
    root = tmp_path / "root"
    shutil.copytree(GOLDEN, root)
    manifest_path = root / "step-7" / "rank0.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = version
    manifest_path.write_text(json.dumps(manifest))
    for path in (root / "step-7", root):
        with pytest.raises(error, match=match):
            pyshmckpt.load(path, source="disk")


def test_a_manifest_without_a_format_version_is_of_version_1(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(GOLDEN, root)
    manifest_path = root / "step-7" / "rank0.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["format_version"]
    manifest_path.write_text(json.dumps(manifest))
    assert pyshmckpt.load(root / "step-7")["step"] == 7


def test_the_command_line_says_a_newer_format_is_not_supported(tmp_path, capsys):
    from pyshmckpt.cli import main

    path = tmp_path / "step-7"
    shutil.copytree(GOLDEN / "step-7", path)
    manifest = json.loads((path / "rank0.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (path / "rank0.json").write_text(json.dumps(manifest))
    for command in ("verify", "inspect"):
        assert main([command, str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("NOT SUPPORTED: "), err
        assert "by a newer pyshmckpt" in err, err
