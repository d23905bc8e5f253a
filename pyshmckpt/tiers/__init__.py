"""Layer 4, tiers: where a checkpoint lives besides disk, and which place a restore reads.

A checkpoint lives in up to three places, newest first: this node's memory (the slot a writer
holds after its trainer died: `holding`, described by a hold record, `records`, read like a
rank's files, `held`, and taken over by a new trainer, `takeover`), a replica in another node's
memory (`replication` sends and keeps them, writer to writer, over `wire`; `replicas` moves one;
`topology` says which node is whose buddy), and disk (the storage layer below). `restore`
chooses the newest checkpoint every rank can restore and where each rank reads it
(`peer_restore` fetches a copy from another node); `loading` is ``pyshmckpt.load``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from .loading import load

# Imported on first use (see _lazy): the writer process loads only the modules it runs.
__getattr__, __dir__ = exports(__name__, {"load": "loading"})

__all__ = ["load"]
