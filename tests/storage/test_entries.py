"""What pyshmckpt creates under a checkpoint root (`storage/entries.py`): the modes the umask or
``PYSHMCKPT_FILE_MODE`` give, for every writer's files and directories, and no entry written
through a link or into a directory that is not ours."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pyshmckpt import ConfigError, knobs
from pyshmckpt.storage import DcpWriter, TorchFileWriter, TorchSaveWriter, commit, entries

NOBODY = 65534
ROOT = os.geteuid() == 0


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def save_with_every_torch_writer(root: Path) -> tuple[list[Path], list[Path]]:
    """Saves with each torch writer (in this process); returns (files, directories) created."""
    state = {"w": torch.arange(4.0), "step": 1}
    TorchSaveWriter().write(str(root / "pt"), state)
    DcpWriter().write(str(root / "dcp"), state)
    (root / "frame").mkdir()  # a framework's directory: TorchFileWriter writes into it
    TorchFileWriter().write(str(root / "frame" / "model.pt"), state)
    directories = [root / "pt", root / "dcp"]
    files = [p for d in directories for p in d.iterdir()] + [root / "frame" / "model.pt"]
    assert {p.name for p in files} >= {"checkpoint_0.pt", "commit.json", ".metadata", "model.pt"}
    return files, directories


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002, 0o000])
def test_files_and_directories_take_the_umask_by_default(tmp_path, monkeypatch, mask):
    monkeypatch.delenv("PYSHMCKPT_FILE_MODE", raising=False)
    with umask(mask):
        files, directories = save_with_every_torch_writer(tmp_path)
    for file in files:
        assert mode_of(file) == 0o666 & ~mask, file  # as torch.save and cp give
    for directory in directories:
        assert mode_of(directory) == 0o777 & ~mask & ~0o002, directory  # never writable by others


@pytest.mark.parametrize(
    ("setting", "mask", "file_mode", "directory_mode"),
    [
        ("640", 0o077, 0o640, 0o750),
        ("0660", 0o000, 0o660, 0o770),
        ("0o600", 0o022, 0o600, 0o700),
        ("666", 0o022, 0o666, 0o775),
    ],
)
def test_the_mode_setting_is_exact_whatever_the_umask(
    tmp_path, monkeypatch, setting, mask, file_mode, directory_mode
):
    monkeypatch.setenv("PYSHMCKPT_FILE_MODE", setting)
    with umask(mask):
        files, directories = save_with_every_torch_writer(tmp_path)
    for file in files:
        assert mode_of(file) == file_mode, file
    for directory in directories:
        assert mode_of(directory) == directory_mode, directory


@pytest.mark.parametrize("setting", ["rw-r-----", "1640", "0400", "-640", "9"])
def test_a_bad_mode_setting_is_refused_when_a_root_is_checked(tmp_path, monkeypatch, setting):
    monkeypatch.setenv("PYSHMCKPT_FILE_MODE", setting)
    with pytest.raises(ConfigError, match="PYSHMCKPT_FILE_MODE"):
        knobs.file_mode()
    with pytest.raises(ConfigError, match="PYSHMCKPT_FILE_MODE"):
        commit.check_root(tmp_path)  # as a Checkpointer opening the root does


def test_a_root_anyone_may_write_without_the_sticky_bit_is_warned_about_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=entries.__name__)
    sticky, open_root = tmp_path / "sticky", tmp_path / "open"
    for path, mode in ((sticky, 0o1777), (open_root, 0o777)):
        path.mkdir()
        path.chmod(mode)
    for _ in range(2):
        commit.check_root(sticky)
        commit.check_root(open_root)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert str(open_root) in warned[0]
    assert "sticky" in warned[0]


# --------------------------------------------------------------------------------------------
# entries of another user (made ours by root's chown, as setpriv would make them)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def shared_root(tmp_path: Path) -> Path:
    """A sticky directory anyone may write, beside a file and a directory only we may write."""
    if not ROOT:
        pytest.skip("needs root, to give entries to another user")
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    (tmp_path / "victim.txt").write_text("precious")
    (tmp_path / "victim").mkdir()
    return root


def plant(path: Path, *, link_to: Path | None = None, directory: bool = False) -> Path:
    """An entry of another user at `path`: a link to `link_to`, a directory, or a file, each
    open to everyone."""
    if link_to is not None:
        path.symlink_to(link_to)
    elif directory:
        path.mkdir()
        path.chmod(0o777)
    else:
        path.write_text("theirs")
        path.chmod(0o666)
    os.lchown(path, NOBODY, NOBODY)
    return path


def test_no_file_is_opened_through_a_link_or_when_another_users(shared_root):
    victim = shared_root.parent / "victim.txt"
    link = plant(shared_root / "link", link_to=victim)
    theirs = plant(shared_root / "theirs")
    for path, why in ((link, "symbolic link"), (theirs, f"owned by uid {NOBODY}")):
        with pytest.raises(FileExistsError, match=why) as caught:
            os.close(entries.open_own_file(path))
        assert str(path) in str(caught.value)
        with pytest.raises(FileExistsError):
            os.close(entries.create_file(path))
        with pytest.raises(FileExistsError, match=why):
            entries.read_own_file(path, 100)
    assert victim.read_text() == "precious"
    assert theirs.read_text() == "theirs"
    mine = shared_root / "mine"
    os.close(entries.open_own_file(mine))
    assert entries.read_own_file(mine, 100) == b""


def test_a_directory_another_rank_made_is_joined_only_when_it_is_ours(shared_root):
    victim = shared_root.parent / "victim"
    refused = {
        plant(shared_root / "link", link_to=victim): "symbolic link",
        plant(shared_root / "theirs", directory=True): f"owned by uid {NOBODY}",
    }
    open_to_all = shared_root / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    refused[open_to_all] = "writable by others"
    for path, why in refused.items():
        with pytest.raises(FileExistsError, match=why) as caught:
            entries.make_or_join_directory(path)
        assert caught.value.filename == str(path)
    ours = shared_root / "ours"
    entries.make_or_join_directory(ours)  # the first rank makes it
    entries.make_or_join_directory(ours)  # the next ones join it
    assert ours.is_dir()
    assert not ours.is_symlink()
    assert list(victim.iterdir()) == []
