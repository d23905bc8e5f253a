"""DeepSpeed tags copied back from a mirror (``ShmCheckpointEngine(mirror=...)``) into a save
directory, for a new node to resume from with DeepSpeed's own loader. Does not import DeepSpeed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import CheckpointNotFoundError
from ..storage import locations, object_commit, object_download
from ..storage.commit import check_name
from ..storage.object_store import ObjectPath
from .deepspeed_latest import write_latest

logger = logging.getLogger(__name__)


def fetch(
    mirror: str | ObjectPath, save_dir: str | os.PathLike[str], tag: str | None = None
) -> str:
    """Copy a tag from a mirror (``ShmCheckpointEngine(mirror=...)``) into `save_dir` and make
    ``latest`` there name it, so that ``engine.load_checkpoint(save_dir)`` resumes from it: on
    a new node, before DeepSpeed loads. Call it once per filesystem that DeepSpeed reads
    (one process; the others wait for it, for instance behind a barrier).

    Every file of every rank is read with parallel ranged GETs into its place (on condition
    that the object is the one committed), its size and CRC32C checked, fsynced and renamed in;
    ``latest`` is written last. Files of that tag already in `save_dir` are replaced.

    Args:
        mirror: the mirror's root (``s3://bucket/prefix``).
        save_dir: DeepSpeed's save directory (created if missing).
        tag: the tag to fetch (None: the mirror's newest committed one).

    Returns:
        The tag fetched.

    Raises:
        CheckpointNotFoundError: the mirror holds no committed tag (or not `tag`).
        CheckpointCorruptError: an object changed since it was committed, or does not match
            its size or CRC32C.
        ObjectStoreError: (a subclass) object storage failed or refused a request.
        UnsupportedLocationError: `mirror` is a URL pyshmckpt does not read, or `save_dir` a
            URL.
        ConfigError: `mirror` is a local path.
        PyshmckptOSError: `save_dir` cannot be written.
    """
    root = locations.object_root(mirror)
    if tag is not None:
        check_name(tag)
    if tag is None:
        found = object_commit.newest(root)
    else:
        record = object_commit.record_of(root / tag)
        found = None if record is None else (root / tag, record)
    if found is None:
        what = "no tag is committed there" if tag is None else f"tag {tag!r} is not committed"
        raise CheckpointNotFoundError(str(root), f"checkpoint missing: {what}")
    checkpoint, record = found
    directory = Path(locations.local_path(save_dir, "save_dir"))
    object_download.download(checkpoint, record, directory / checkpoint.name)
    write_latest(directory, checkpoint.name)
    logger.info("fetched %s into %s", checkpoint, directory)
    return checkpoint.name
