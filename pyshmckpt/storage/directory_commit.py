"""Writing a whole checkpoint directory under a root and committing it: by one rank with
`commit`'s steps, or by several ranks together through `shared_commit`. The writers call this."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import ConfigError
from . import commit
from .shared_commit import SharedCommit


def commit_directory(
    path: str | os.PathLike[str],
    fill: commit.Fill,
    keep_last: int | None,
    *,
    rank: int = 0,
    world_size: int = 1,
    attempt: str | None = None,
    barrier_timeout: float = 600.0,
    replace: bool = False,
    link_latest: bool = True,
) -> Path:
    """Write a checkpoint with `fill(temp_dir)`, then commit it as `path`, update `latest`
    (unless `link_latest` is False), and apply retention. Nothing is visible under the root
    until the rename; on any failure the temporary directory is removed and earlier
    checkpoints are untouched.

    `fill` returns the files it wrote (None: every file in the directory), which are fsynced.
    With `replace`, a committed checkpoint at `path` is replaced atomically (see `commit`).
    With world_size > 1, every rank calls this with the same `path` and `attempt`, the run's
    secret id and the save's number as ``<run>.<number>`` (see `shared_commit`); `attempt` must
    be unique to this save among all saves into the root.
    """
    final = Path(path)
    root = final.parent
    commit.check_root(root)
    if world_size > 1:
        if not attempt or not isinstance(attempt, str) or "/" in attempt or "-" in attempt:
            raise ConfigError(
                f"a multi-rank save needs an attempt id without '-' or '/', not {attempt!r}"
            )
        shared = SharedCommit(final, rank, world_size, attempt, barrier_timeout, replace)
        return shared.run(fill, keep_last, link_latest)
    if replace and (final.exists() or final.is_symlink()):
        commit.check_replaceable(final)  # before writing anything
    temp = commit.new_temp_dir(root, final.name)
    try:
        with commit.in_use(temp):
            commit.fill_and_sync(temp, fill)
            commit.commit(temp, final, replace=replace)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    if link_latest:
        commit.update_latest(root, final.name)
    if keep_last is not None:
        commit.retain(root, keep_last, background=True)
    return final
