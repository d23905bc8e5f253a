"""A Checkpointer's root, whichever store holds it: a directory on a filesystem (`commit`,
`shared_commit`) or a prefix in object storage (`object_commit`). The Checkpointer asks the root;
the writers commit under it by the same path string.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

from ..errors import from_os_error, os_error
from . import commit, object_commit, shared_commit
from .object_store import ObjectPath


class DirectoryRoot:
    """A checkpoint root on a local or shared filesystem."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.remover: Callable[..., None] = commit.remove_checkpoint
        self.cleaner: Callable[..., object] | None = None  # `open` cleans up, in the trainer

    def open(self, rank: int) -> None:
        """Create the root if missing and check it; rank 0 removes what crashed saves left."""
        try:
            if not (self.path.exists() or self.path.is_symlink()):
                self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise from_os_error(exc, f"cannot create checkpoint root {self.path}") from None
        commit.check_root(self.path)
        if rank == 0:
            commit.clean_leftovers(self.path)  # other ranks' temporaries may be in progress

    def check(self) -> None:
        commit.check_root(self.path)

    def committed(self) -> list[tuple[int, str]]:
        return commit.committed(self.path) if self.path.is_dir() else []

    def taken(self, name: str) -> bool:
        """Whether `name` is in use under the root (a new automatic name must not be)."""
        return (self.path / name).exists()

    def check_target(self, name: str, overwrite: bool, chosen: bool) -> None:
        """Raise unless a save may write checkpoint `name` (`overwrite`: may replace it;
        `chosen`: the caller named it, else it is a new automatic name)."""
        target = self.path / name
        if target.exists() or target.is_symlink():
            if not overwrite:
                raise os_error(errno.EEXIST, f"checkpoint {target} already exists", str(target))
            commit.check_replaceable(target)

    def latest(self) -> Path | None:
        return commit.latest(self.path)

    def abandon(self, name: str, attempt: str, rank: int, world_size: int, reason: str) -> None:
        shared_commit.abandon(self.path, name, attempt, rank, world_size, reason)


class ObjectRoot:
    """A checkpoint root in object storage. Whether a name is taken is found by the writer when
    it saves (a request per save on the training thread is not worth it)."""

    def __init__(self, path: ObjectPath) -> None:
        self.path = path
        self.remover: Callable[..., None] = object_commit.remove_checkpoint
        # Leftovers are removed in the writer process (requests, not the trainer's time).
        self.cleaner: Callable[..., object] | None = object_commit.clean_leftovers

    def open(self, rank: int) -> None:
        """Nothing to create; the bucket's existence and the credentials are checked by the
        first listing (`committed`)."""

    def check(self) -> None:
        """Nothing to check per save: the writer's requests report what fails."""

    def committed(self) -> list[tuple[int, str]]:
        return object_commit.committed(self.path)

    def taken(self, name: str) -> bool:
        return False

    def check_target(self, name: str, overwrite: bool, chosen: bool) -> None:
        """A name the caller chose is looked up (one request); an automatic one is new (the
        writer refuses a name taken meanwhile: `object_commit.save`)."""
        if chosen and not overwrite and object_commit.record_of(self.path / name) is not None:
            target = self.path / name
            raise os_error(errno.EEXIST, f"checkpoint {target} already exists", str(target))

    def latest(self) -> ObjectPath | None:
        return object_commit.latest(self.path)

    def abandon(self, name: str, attempt: str, rank: int, world_size: int, reason: str) -> None:
        object_commit.abandon(str(self.path), name, attempt, rank, world_size, reason)


def root_of(path: Path | ObjectPath) -> DirectoryRoot | ObjectRoot:
    return ObjectRoot(path) if isinstance(path, ObjectPath) else DirectoryRoot(path)
