"""Code that runs in the writer process of the transport tests: writers and init functions.

A writer process imports the module that defines its writer and init function. Kept apart from
the test modules, that is this module and torch, not pytest and the trainer's side of
pyshmckpt (which loads torch.distributed.checkpoint): a second or more less per writer started.
No bare ``assert``: it would vanish under ``python -O``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from pyshmckpt.storage import progress


def no_init() -> None:
    pass


def torch_writer(**kwargs: Any) -> Any:
    """torch's own CheckpointWriter (its module imported here, in the writer, only when used)."""
    from torch.distributed.checkpoint._experimental.checkpoint_writer import (
        CheckpointWriter,
        CheckpointWriterConfig,
    )

    return CheckpointWriter(config=CheckpointWriterConfig(), rank_info=kwargs["rank_info"])


def describe(node: Any) -> Any:
    """A JSON description of a tree: structure, tensor dtypes, shapes and sums, and where each
    tensor lives (``cpu``, ``ptr``)."""
    if isinstance(node, torch.Tensor):
        return {
            "tensor": [str(node.dtype), list(node.shape)],
            "sum": float(node.double().sum()) if node.numel() else 0.0,
            "cpu": node.device.type == "cpu",
            "ptr": node.data_ptr(),
        }
    if isinstance(node, dict):
        return {
            "type": type(node).__name__,
            "items": [[repr(k), describe(v)] for k, v in node.items()],
        }
    if isinstance(node, (list, tuple)):
        return {"type": type(node).__name__, "items": [describe(v) for v in node]}
    return {"leaf": repr(node)}


class DescribingWriter:
    """Writes a JSON description of what it received (`describe`)."""

    def __init__(self, rank_info: Any, tag: str = "") -> None:
        self.rank_info = rank_info
        self.tag = tag

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        out = {
            "tree": describe(state_dict),
            "kwargs": {k: repr(v) for k, v in kwargs.items()},
            "rank": self.rank_info.global_rank,
            "tag": self.tag,
            "pid": os.getpid(),
        }
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "description.json").write_text(json.dumps(out))


def digest_tree(tree: Any) -> dict[str, Any]:
    """dtype, shape and sha256 of the bytes of every tensor (and repr of every other leaf)."""
    out: dict[str, Any] = {}

    def visit(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            flat = node.detach().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes()
            out[path] = {
                "dtype": str(node.dtype),
                "shape": list(node.shape),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
        elif isinstance(node, dict):
            for key, value in node.items():
                visit(value, f"{path}/{key}")
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                visit(value, f"{path}/{index}")
        else:
            out[path] = repr(node)

    visit(tree, "")
    return out


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def hang() -> None:
    while True:
        time.sleep(0.05)


class RecordingWriter:
    """A checkpoint writer whose behaviour is chosen per process (`mode`) or per write (kwargs).

    Each write first appends to ``<out_dir>/log.txt`` and leaves ``<path>.started`` (holding the
    writer's pid), then sleeps `delay` s and does what `mode` says; "ok" saves a json record of
    the pid, rank_info, remaining kwargs and `digest_tree` of the state dict at `path`.
    """

    def __init__(
        self,
        rank_info: Any,
        out_dir: str,
        mode: str = "ok",
        delay: float = 0.0,
        close_error: str | None = None,
        close_mode: str = "ok",
    ) -> None:
        if mode == "fail_init":
            raise LookupError("RecordingWriter cannot find its storage backend")
        self.rank_info = rank_info
        self.out_dir = Path(out_dir)
        self.mode = mode
        self.delay = delay
        self.close_error = close_error
        self.close_mode = close_mode

    def _log(self, text: str) -> None:
        with (self.out_dir / "log.txt").open("a") as log:
            log.write(f"{os.getpid()} {text}\n")

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        mode = kwargs.pop("mode", self.mode)
        delay = kwargs.pop("delay", self.delay)
        target = Path(path)
        if mode == "hang_ignoring_sigterm":  # before the marker, so the parent never races it
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._log(f"start {target.name}")
        atomic_write(Path(f"{target}.started"), str(os.getpid()))
        if delay:
            time.sleep(delay)
        if mode == "raise":
            raise ValueError(f"writer refused {target.name}: disk on fire")
        if mode == "hang":
            hang()
        if mode == "hang_ignoring_sigterm":
            hang()
        if mode == "exit":
            os._exit(7)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            hang()
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            hang()  # continued by mistake: still never answers
        if mode != "ok":
            raise ValueError(f"unknown mode {mode!r}")
        record = {
            "pid": os.getpid(),
            "rank_info": self.rank_info,
            "kwargs": kwargs,
            "digest": digest_tree(state_dict),
        }
        atomic_write(target, json.dumps(record))
        self._log(f"done {target.name}")

    def close(self) -> None:
        if self.close_mode == "hang_ignoring_sigterm":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        atomic_write(self.out_dir / f"closed-{os.getpid()}", "closed")
        if self.close_mode != "ok":
            hang()
        if self.close_error is not None:
            raise RuntimeError(self.close_error)


class ProgressingWriter(RecordingWriter):
    """A RecordingWriter that reports progress as pyshmckpt's own writers do. Mode "crawl": the
    write takes `delay` s, moving on every 0.2 s (a slow disk that keeps going), then saves."""

    reports_progress = True

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None:
        mode = kwargs.pop("mode", self.mode)
        delay = kwargs.pop("delay", self.delay)
        if mode == "crawl":
            atomic_write(Path(f"{path}.started"), str(os.getpid()))
            until = time.monotonic() + delay
            while time.monotonic() < until:
                progress.advance(4096)
                time.sleep(0.2)
            mode, delay = "ok", 0.0
        super().write(path, state_dict, mode=mode, delay=delay, **kwargs)


def init_ok(*args: Any) -> None:
    pass


def init_raise(message: str) -> None:
    raise OSError(message)


def init_sleep(seconds: float) -> None:
    time.sleep(seconds)


def init_exit(code: int) -> None:
    os._exit(code)


def wait_for_file(path: str) -> None:
    """A writer's init function that blocks until `path` exists: the writer stays 'starting'."""
    deadline = time.monotonic() + 60.0
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def fail_init() -> None:
    raise RuntimeError("the writer's init failed on purpose")


def die_in_init() -> None:
    os._exit(3)


class TensorFileWriter:
    """Writes the state dict with torch.save to path (a file)."""

    def __init__(self, rank_info: object) -> None:
        self.rank_info = rank_info

    def write(self, path: str, state_dict: object, **kwargs: object) -> None:
        torch.save(state_dict, path)


class JournalWriter:
    """torch.save to each path; every write and every `note` is appended to a journal file."""

    def __init__(self, rank_info: object, journal: str) -> None:
        self.journal = Path(journal)

    def _log(self, entry: str) -> None:
        with self.journal.open("a") as journal:
            journal.write(entry + "\n")

    def write(self, path: str, state_dict: object, **kwargs: object) -> None:
        torch.save(state_dict, path)
        self._log(f"wrote {Path(path).name}")

    def note(self, text: str) -> str:
        self._log(f"note {text}")
        return text.upper()

    def fail(self) -> None:
        raise ValueError("this call fails on purpose")
