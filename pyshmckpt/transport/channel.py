"""The control channel between the trainer and its writer process.

Requests and responses are small pickled messages over a duplex pipe; each request carries an id
and, for writes, the slot generation, which the response must repeat. The writer also sends its
log records (kind LOG) so that they reach the trainer's logging. Every wait here is bounded and
wakes at once when the peer process exits: the pipe is waited on together with the process
sentinel (`multiprocessing.connection.wait`), never by sleeping and polling.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import signal
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..staging import Manifest


class Kind(enum.Enum):
    INIT = "init"  # child -> parent once: the writer is built (or failed to build)
    WRITE = "write"  # persist one staged slot
    TERMINATE = "terminate"  # finish queued work, close the writer, exit
    ADOPT = "adopt"  # parent -> child once it is ready: serve the spool's first `count` records
    LOG = "log"  # child -> parent, unasked: one log record of the writer process
    CALL = "call"  # run one method of the writer, in order with the writes
    PROGRESS = "progress"  # child -> parent, unasked: the write in hand moved on
    KEEP = "keep"  # parent -> child: descriptors of new slot segments follow (see keeper)


@dataclasses.dataclass
class Request:
    kind: Kind
    id: int
    generation: int = -1
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Response:
    kind: Kind
    id: int
    ok: bool
    generation: int = -1
    error: str | None = None  # the child's formatted traceback
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ManifestRef:
    """Sent instead of a full manifest when the writer already holds one of the same layout for
    that slot: only the structure (keys, leaves) travels."""

    tree: Any
    layout_key: bytes

    @classmethod
    def of(cls, manifest: Manifest) -> ManifestRef:
        return cls(manifest.tree, manifest.layout_key)


class Closed:
    """What `receive` returns when the peer closed its end or its process exited."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3', 'signal SIGKILL' or 'still running' for a multiprocessing exitcode."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def receive(conn: Connection, sentinel: int, timeout: float | None) -> Response | Closed | None:
    """Wait up to `timeout` s for a message; None on timeout, `Closed` when the peer's end is
    closed or its process exited with nothing left to read (a message sent just before the exit
    is still returned)."""
    ready = wait([conn, sentinel], timeout)
    if not ready:
        return None
    if conn in ready or conn.poll(0):
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            return Closed(str(exc) or type(exc).__name__)
    return Closed("the peer process exited")


def send(conn: Connection, message: Request | Response) -> bool:
    """Send a message; False when the peer is gone. Unpicklable payloads raise as pickle does."""
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
        return False
    return True


def wakeup_pipe() -> tuple[int, int]:
    """A non-blocking pipe used to interrupt a dispatcher waiting in `wait()`."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w
