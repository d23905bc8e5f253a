"""Layer 7, tools: the ``pyshmckpt`` command (``demo``, ``bench``, ``gc``, ``verify``, ``inspect``,
``cuda-info``; docs/reference/cli.md).

`commands` parses the command line; `bench` runs the benchmark suite; `demo` trains a small GPT
and checkpoints it through pyshmckpt and torch's transport side by side. Nothing in the library
imports this package.
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
