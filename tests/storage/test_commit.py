"""The single-rank commit protocol of `storage/commit.py`, step by step, and a crash at each step:
a process is SIGKILLed (``os._exit``, nothing cleaned up) at that point of a save, and what a
restart then sees (after `clean_leftovers`, which every Checkpointer runs on opening its root) is
checked: only whole checkpoints, under their names, and `latest` naming a whole one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pyshmckpt.storage import commit

from helpers import child_env

# Runs one save of checkpoint "new" (replacing it when it exists) under ROOT, killed at STEP.
CRASHING_SAVE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from pyshmckpt.storage import commit

    root, step = Path(sys.argv[1]), sys.argv[2]

    def die():
        os._exit(9)

    def fill(temp):
        (temp / "data").write_text("new")
        if step == "fill":
            die()
        return None

    if step == "record":  # the commit record written and fsynced, the rename not done
        fsync = commit.fsync_path
        def fsync_then_die(path):
            fsync(path)
            if Path(path).name == commit.COMMIT_RECORD:
                die()
        commit.fsync_path = fsync_then_die
    elif step == "rename":  # renamed into place, `latest` not moved
        commit.update_latest = lambda root, name: die()
    elif step == "latest":  # `latest` moved, retention not run
        commit.retain = lambda *args, **kwargs: die()
    elif step == "aside":  # replacing without RENAME_EXCHANGE: the old one moved aside, no more
        commit._exchange = lambda a, b: False
        rename = Path.rename
        def rename_then_die(self, target):
            moved = rename(self, target)
            if Path(target).name.startswith(commit.REPLACED_PREFIX):
                die()
            return moved
        Path.rename = rename_then_die
    commit.commit_directory(root / "new", fill, keep_last=1, replace=(root / "new").exists())
    """
)


def save(root: Path, name: str, text: str, **options: object) -> None:
    def fill(temp: Path) -> None:
        (temp / "data").write_text(text)

    commit.commit_directory(root / name, fill, None, **options)  # type: ignore[arg-type]


def crash_during_save(tmp_path: Path, root: Path, step: str) -> None:
    script = tmp_path / "crashing_save.py"
    script.write_text(CRASHING_SAVE)
    done = subprocess.run(
        [sys.executable, str(script), str(root), step],
        env=child_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 9, done.stderr


def seen_after_restart(root: Path) -> tuple[list[str], str | None, list[str]]:
    """(committed names in commit order, what `latest` names, hidden entries) once a restarted
    job has opened the root."""
    commit.clean_leftovers(root)
    assert commit.wait_for_deletions(30)
    latest = commit.latest(root)
    hidden = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    return [name for _, name in commit.committed(root)], latest and latest.name, hidden


def test_each_step_of_a_commit(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    save(root, "a", "a")
    record = json.loads((root / "a" / commit.COMMIT_RECORD).read_text())
    assert record["sequence"] == 1
    assert record["name"] == "a"
    assert commit.latest(root) == root / "a"
    save(root, "b", "b")
    assert [name for _, name in commit.committed(root)] == ["a", "b"]
    assert commit.latest(root) == root / "b"
    # Replacing keeps the name holding one whole checkpoint and gives it a newer sequence.
    save(root, "a", "a2", replace=True)
    assert commit.wait_for_deletions(30)
    assert [name for _, name in commit.committed(root)] == ["b", "a"]
    assert (root / "a" / "data").read_text() == "a2"
    assert commit.latest(root) == root / "a"
    # Without a link, the newest commit is the latest.
    save(root, "c", "c", link_latest=False)
    assert commit.latest(root) == root / "a"  # the link still names a
    (root / commit.LATEST).unlink()
    assert commit.latest(root) == root / "c"
    # Retention keeps the newest and never what `latest` names.
    commit.update_latest(root, "b")
    assert commit.retain(root, 1) == ["a"]
    assert [name for _, name in commit.committed(root)] == ["b", "c"]
    # A name that exists is never overwritten without replace.
    with pytest.raises(FileExistsError):
        save(root, "c", "again")
    assert sorted(p.name for p in root.iterdir()) == ["b", "c", "latest"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("step", "committed", "latest"),
    [
        ("fill", ["old"], "old"),  # half-written: removed, the old checkpoint stays latest
        ("record", ["old"], "old"),  # complete but not renamed: removed
        ("rename", ["old", "new"], "old"),  # committed whole; `latest` not moved yet
        ("latest", ["old", "new"], "new"),  # retention had not run: the next save runs it
    ],
)
def test_a_crash_at_each_step_of_a_new_checkpoint(tmp_path, step, committed, latest):
    root = tmp_path / "root"
    root.mkdir()
    save(root, "old", "old")
    crash_during_save(tmp_path, root, step)
    assert seen_after_restart(root) == (committed, latest, [])
    for name in committed:
        assert (root / name / "data").read_text() == name


@pytest.mark.timeout(120)
def test_a_crash_between_the_two_renames_of_a_replacement_puts_the_old_one_back(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    save(root, "new", "the old one")
    crash_during_save(tmp_path, root, "aside")
    assert not (root / "new").exists()  # the name was empty when it died
    assert seen_after_restart(root) == (["new"], "new", [])
    assert (root / "new" / "data").read_text() == "the old one"
