"""Start the writer process as a fresh interpreter that runs only pyshmckpt's writer code.

multiprocessing's "spawn" child imports the trainer's ``__main__`` (a training script: torch, the
model, the data loaders) before it runs anything, and unpickles its arguments through whatever
they name. The Checkpointer's writers are importable by module name, so their process can start
as ``python -c "...launcher import main; main()"`` instead: it imports the writer's modules only
(for the default safetensors writer: no torch, some 20 MiB of private memory instead of 200, and
a fraction of a second instead of seconds to start).

The trainer's end is a `multiprocessing.connection.Connection` over a socket pair, as
``Pipe(duplex=True)`` makes; the child gets its end, the spool and the write end of a pipe whose
EOF tells the trainer it exited (what a multiprocessing Process's sentinel is) by ``pass_fds``.
It first receives the trainer's ``sys.path`` (as a spawned child does), then the arguments of
`child.writer_main`. `InterpreterProcess` offers what the trainer uses of a multiprocessing
Process: pid, sentinel, is_alive, exitcode, join, kill, terminate.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from .child import writer_main
from .spool import close_quietly

# What the child runs: no `-m` (runpy would import the module a second time as __main__). `-c`
# puts the working directory first on sys.path, where a source checkout of pyshmckpt (without its
# compiled extension) may lie: the directory of this very package goes before it (argv[1]).
_ENTRY = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from pyshmckpt.transport.launcher import main; main()"
)


class InterpreterProcess:
    """A writer process started by `launch`, with the parts of multiprocessing's Process API
    the trainer uses (exit codes as multiprocessing gives them: -N for signal N)."""

    name = "pyshmckpt-writer"
    daemon = True

    def __init__(self, popen: subprocess.Popen[bytes], sentinel: int) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.sentinel = sentinel  # readable (EOF) once the process exited
        self._finalizer = weakref.finalize(self, close_quietly, sentinel)
        # Not at exit: the Checkpointer's own exit-time close still waits on the sentinel then.
        self._finalizer.atexit = False

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` s for the process to exit, and reap it once it has."""
        if self._popen.returncode is not None or wait([self.sentinel], timeout):
            self._popen.wait()

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        # Popen never signals a process it has reaped (its pid may be someone else's by now).
        with contextlib.suppress(ProcessLookupError):
            self._popen.send_signal(signum)

    def close(self) -> None:
        """Release the sentinel (the process is not touched). Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"<InterpreterProcess {self.name} pid={self.pid} exitcode={self.exitcode}>"


class _MainFinder(pickle.Pickler):
    """Pickles into nothing, noting whether anything is pickled by reference to ``__main__``."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.names_main = False

    def reducer_override(self, obj: Any) -> Any:
        # Called for classes and functions too (pickled by module and name), not for plain
        # containers and scalars, whose contents are visited one by one.
        if getattr(obj, "__module__", None) == "__main__" and (
            isinstance(obj, type) or callable(obj)
        ):
            self.names_main = True
        return NotImplemented


def needs_main(*objects: Any) -> bool:
    """Whether a writer process must import the trainer's ``__main__`` to unpickle `objects`:
    something among them is a class or function of the training script. Objects that cannot be
    pickled at all count too (multiprocessing's spawn then reports why, as it would anyway)."""
    finder = _MainFinder()
    try:
        finder.dump(objects)
    except Exception:
        return True
    return finder.names_main


def launch(args: tuple[Any, ...], *, spool_fd: int) -> tuple[InterpreterProcess, Connection]:
    """Start a writer process that runs ``writer_main(conn, spool_fd, *args)``; returns it and
    the trainer's end of its control channel. Unpicklable arguments raise here (the child is
    killed and reaped first), as they would from a multiprocessing start."""
    ours, theirs = socket.socketpair()
    exit_r, exit_w = os.pipe()
    # The directory of the package this module came from: the child imports this very pyshmckpt.
    root = str(Path(__file__).resolve().parents[2])
    command = [
        sys.executable,
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        _ENTRY,
        root,
        str(theirs.fileno()),
        str(spool_fd),
        str(exit_w),
    ]
    # numpy's OpenBLAS starts a thread per core at import, CPU time that the writer (which does
    # no linear algebra) would take from a first save staging on the same cores; a setting of the
    # user's own is kept.
    env = {"OPENBLAS_NUM_THREADS": "1", **os.environ}
    try:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(), spool_fd, exit_w),
            env=env,
            start_new_session=True,  # see child.writer_main
        )
    except BaseException:
        ours.close()
        close_quietly(exit_r)
        raise
    finally:
        theirs.close()
        close_quietly(exit_w)
    process = InterpreterProcess(popen, exit_r)
    conn = Connection(ours.detach())
    try:
        conn.send(list(sys.path))
        conn.send(args)
    except BaseException:
        conn.close()
        process.kill()
        process.join(5.0)
        process.close()
        raise
    return process, conn


def main() -> None:
    """The writer process (see `launch`): argv is the channel, the spool and the exit pipe."""
    channel, spool_fd, exit_w = (int(arg) for arg in sys.argv[2:5])
    for fd in (channel, spool_fd, exit_w):  # ours alone, not a process the writer may start
        os.set_inheritable(fd, False)
    # Its log records carry the name a spawned writer has (they are forwarded to the trainer).
    multiprocessing.current_process().name = InterpreterProcess.name
    conn = Connection(channel)
    try:
        sys.path[:] = conn.recv()  # before the arguments name modules to import
        args = conn.recv()
    except (EOFError, OSError):  # the trainer died while starting us: nothing was handed over
        os._exit(1)
    writer_main(conn, spool_fd, *args)
    sys.exit(0)
