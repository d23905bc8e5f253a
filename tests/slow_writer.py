"""The default writer on a slow disk, for the tests that act while a save is being written.

A module of its own: a writer process imports the module of its writer class, and this one
loads neither torch nor pytest (helpers.py loads both: seconds per writer started).
"""

from __future__ import annotations

import time
from typing import Any

from pyshmckpt.storage import WriterSpec, register_writer, writer_spec
from pyshmckpt.storage.safetensors_writer import SafetensorsWriter

SLOW_WRITE_SECONDS = 1.5


class SlowSafetensorsWriter(SafetensorsWriter):
    """The default writer on a slow disk: each write first sleeps SLOW_WRITE_SECONDS, so a save
    is certainly still being written when the test acts (kills the trainer, closes)."""

    def write_slot(self, path: str, slot: Any, manifest: Any, **kwargs: Any) -> None:
        time.sleep(SLOW_WRITE_SECONDS)
        super().write_slot(path, slot, manifest, **kwargs)


def register_slow_writer() -> str:
    """Make SlowSafetensorsWriter selectable as ``Checkpointer(writer=...)``; returns its name."""
    spec = writer_spec("safetensors")
    register_writer(
        WriterSpec(
            "slow-safetensors",
            SlowSafetensorsWriter,
            "safetensors after a pause (tests)",
            options=spec.options,
            multi_rank=True,
        )  # fmt: skip
    )
    return "slow-safetensors"
