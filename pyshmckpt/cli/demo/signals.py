"""How the demo and its writer subprocesses treat SIGINT (Ctrl-C) and SIGTERM.

Ctrl-C in a terminal reaches every process of the foreground group, writers included; the demo
itself stops its writers and frees their shared memory, so the writers ignore SIGINT
(writer_init), are spawned with it blocked (sigint_blocked), and a Ctrl-C during the demo's
cleanup waits until the cleanup is done (sigint_deferred). SIGTERM unwinds like Ctrl-C
(sigterm_unwinds raises Terminated). Handlers can only be set in the main thread: elsewhere the
context managers change nothing.

writer_init reaches the writer subprocesses by reference, so they import this module; it
imports nothing beyond the standard library.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


def writer_init(*_: object) -> None:
    """Runs first in both writer subprocesses: Ctrl-C in a terminal reaches every process of the
    group, and the demo itself shuts its writers down, so they ignore SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread, and so in the threads started meanwhile and the writer
    subprocesses they spawn (until writer_init ignores it there). A SIGINT that arrives
    meanwhile is delivered here when the block ends."""
    if not _in_main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Let a Ctrl-C during cleanup wait until the cleanup is done, then raise it."""
    if not _in_main_thread():
        yield
        return
    hits: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if hits:
            raise KeyboardInterrupt


class Terminated(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C, so that everything is cleaned up."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into Terminated while the demo runs (main thread only)."""
    if not _in_main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["Terminated", "sigint_blocked", "sigint_deferred", "sigterm_unwinds", "writer_init"]
