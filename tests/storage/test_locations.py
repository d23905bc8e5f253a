"""A URL is never a local path: every entry point that takes a checkpoint location refuses a URL
it does not read and write (``az://``, ``https://``, an ``s3://`` URL a Path collapsed to
``s3:/``, ``s3://`` where a directory is needed) with `UnsupportedLocationError` (a
`NotSupportedError`), before anything is created, instead of writing into a directory named
``s3:`` of the current directory. (``s3://`` itself: tests/objects.)"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyshmckpt
from pyshmckpt.storage import locations

from helpers import SAVE_TIMEOUT, child_env, opened

URLS = [
    "az://container/run",
    "gcs://bucket/run",
    "https://host/run",
    "s3:/bucket/run",
    "gs:/bucket/run",
]


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory, so that a URL taken for a relative path would show up there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("url", URLS)
def test_a_checkpointer_refuses_a_url_root_and_creates_nothing(in_tmp: Path, url: str) -> None:
    for root in (url, Path(url)):  # a Path collapses "//": "az:/container/run"
        with pytest.raises(pyshmckpt.UnsupportedLocationError) as caught:
            pyshmckpt.Checkpointer(root)
        assert isinstance(caught.value, pyshmckpt.NotSupportedError)
        assert caught.value.location == os.fspath(root)
        assert "not supported" in str(caught.value)
    with pytest.raises(
        pyshmckpt.UnsupportedLocationError, match="pass 's3://bucket/prefix' as a str"
    ):
        pyshmckpt.Checkpointer(Path("s3://bucket/run"))
    assert list(in_tmp.iterdir()) == []


def test_the_error_names_the_object_store_and_survives_pickling() -> None:
    with pytest.raises(pyshmckpt.UnsupportedLocationError, match="Azure Blob Storage") as caught:
        locations.local_path("az://b/k", "checkpoint root")
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is pyshmckpt.UnsupportedLocationError
    assert (again.location, str(again)) == (caught.value.location, str(caught.value))


def test_a_directory_is_needed_where_object_storage_is_not_taken() -> None:
    with pytest.raises(pyshmckpt.UnsupportedLocationError, match="object storage is not supported"):
        locations.local_path("s3://bucket/run", "output_dir")


@pytest.mark.parametrize("url", ["az://container/run", "s3:/bucket/run/step-1"])
def test_load_verify_and_the_command_line_refuse_a_url(in_tmp: Path, url: str) -> None:
    with pytest.raises(pyshmckpt.UnsupportedLocationError):
        pyshmckpt.load(url)
    with pytest.raises(pyshmckpt.UnsupportedLocationError):
        pyshmckpt.load(url, source="disk")
    with pytest.raises(pyshmckpt.UnsupportedLocationError):
        pyshmckpt.verify(url)
    for command in ("verify", "inspect"):
        done = subprocess.run(
            [sys.executable, "-m", "pyshmckpt", command, url], cwd=in_tmp, env=child_env(),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode != 0, done.stdout
        assert "not supported" in done.stderr, done.stderr
    assert list(in_tmp.iterdir()) == []


def test_a_file_url_is_the_local_path_it_names(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0)}
    with opened(tmp_path / "ckpt") as ck:
        path = ck.save(state, name="one").result(timeout=SAVE_TIMEOUT)
    assert locations.local_path(f"file://{tmp_path}/ckpt") == tmp_path / "ckpt"
    assert torch.equal(pyshmckpt.load(f"file://{path}")["w"], state["w"])
    with pytest.raises(pyshmckpt.UnsupportedLocationError, match="another host"):
        locations.local_path("file://elsewhere/ckpt")


def test_plain_paths_stay_paths(tmp_path: Path) -> None:
    assert locations.local_path(tmp_path / "a:b") == tmp_path / "a:b"  # a colon inside a name
    assert locations.local_path("relative/dir") == Path("relative/dir")
    with pytest.raises(pyshmckpt.ConfigTypeError):
        locations.local_path(42)
