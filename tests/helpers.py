"""Helpers shared by the test modules (imported as ``helpers``; tests/ is on sys.path)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import gc
import hashlib
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pyshmckpt
from pyshmckpt import Checkpointer, CheckpointProcessConfig
from pyshmckpt.storage import commit, liveness

HERE = Path(__file__).resolve().parent
REPO_ROOT = Path(pyshmckpt.__file__).resolve().parent.parent
SHM = Path("/dev/shm")
SAVE_TIMEOUT = 60.0  # seconds a single save may take (they take well under a second here)


def test_dirs() -> list[str]:
    """tests/ and its folders: where pytest imports test modules from (by their base names)."""
    folders = sorted(str(d) for d in HERE.iterdir() if d.is_dir() and d.name[0] not in "._")
    return [str(HERE), *folders]


def child_env() -> dict[str, str]:
    """This environment (the session's segment prefix included), with pyshmckpt, the helpers and
    every test module importable by a child interpreter."""
    # Not a pytest worker: a pytest the child runs (pyshmckpt bench) must not think it is one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(REPO_ROOT), *test_dirs(), *inherited]))
    return env


def end_distributed() -> None:
    """Tear torch.distributed down at the end of a rank's script, then let gloo's threads finish.

    A gloo worker thread frees a finished collective after the caller has returned from it; a
    collective made during backward() holds a Python object (the autograd context torch stashes
    in thread-local state), so freeing it takes the GIL. If the interpreter is finalizing by
    then, the thread is ended mid-destructor and the process aborts ("terminate called without
    an active exception": pytorch/pytorch#117762, seen with DDP over gloo). Sleeping hands the
    GIL over while the interpreter is whole; torch gives no way to wait for those threads.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    time.sleep(0.5)


def free_port() -> int:
    """A TCP port nobody listens on now (for a rendezvous of ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def minor_faults_reading(buffer: Any) -> int:
    """Minor page faults this thread takes to read one byte of every 4 KiB page of `buffer` (this
    thread's only: other threads of a test worker fault pages in meanwhile)."""
    page = 4096
    # The same reduction over private, touched memory first: a worker that has not summed strided
    # bytes yet faults in the library code that does it (15 faults seen in a CI run).
    int(np.ones(16 * page, dtype=np.uint8)[::page].sum())
    with memoryview(buffer) as view:
        pages = np.frombuffer(view, dtype=np.uint8)[::page]
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        int(pages.sum())  # reads one byte per page
        after = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        del pages
    return after - before


def proc_state(pid: int) -> str | None:
    """The /proc state letter of `pid` (R, S, T, Z, ...), None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rfind(")") + 2]


def thread_waits(pid: int) -> str:
    """Each thread of `pid` with the kernel function it sleeps in (for a failure's message)."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            comm = (task / "comm").read_text().strip()
            wchan = (task / "wchan").read_text().strip()
        except OSError:
            continue
        out.append(f"{comm}:{wchan}")
    return ", ".join(out)


def pid_running(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def child_pids() -> set[int]:
    """Every living child process of this process, however it was started (multiprocessing's
    spawn, or the Checkpointer's writer launcher, which multiprocessing does not list)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited meanwhile
    return {pid for pid in pids if pid_running(pid)}


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.01
) -> float:
    """Poll `predicate` until true; returns the seconds it took. Fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - start


def failure_of(future: Future[Any], timeout: float = SAVE_TIMEOUT) -> BaseException:
    """The exception `future` fails with, waiting at most `timeout` s (never confused with a
    TimeoutError of the wait itself)."""
    done, _ = concurrent.futures.wait([future], timeout)
    assert done, f"the future did not resolve within {timeout}s"
    exc = future.exception()
    assert exc is not None, f"the future succeeded ({future.result()!r}) but a failure was expected"
    return exc


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs and -0.0 compared as bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.detach().contiguous().view(-1).view(torch.uint8),
        b.detach().contiguous().view(-1).view(torch.uint8),
    )


def names_in(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir()]


def link_target(link: Path) -> str:
    """Where a symbolic link points, as written (checkpoints link by name)."""
    return str(link.readlink())


def visible(root: Path) -> list[str]:
    """Checkpoint names a reader may see: entries not starting with '.', without `latest`."""
    return sorted(n for n in names_in(root) if not n.startswith(".") and n != commit.LATEST)


def hidden(root: Path) -> list[str]:
    """Hidden entries of a root but the heartbeats of ranks that are open (see `heartbeats`)."""
    return sorted(
        n for n in names_in(root) if n.startswith(".") and not n.startswith(liveness.PREFIX)
    )


def heartbeats(root: Path) -> list[str]:
    """The heartbeat files of multi-rank Checkpointers open on a root."""
    return sorted(n for n in names_in(root) if n.startswith(liveness.PREFIX))


def bounded_config(**overrides: Any) -> CheckpointProcessConfig:
    """Writer settings with every wait bounded well below the test timeout."""
    settings: dict[str, Any] = {
        "subprocess_init_timeout_secs": 60,
        "subprocess_shutdown_timeout_secs": 15,
        "write_timeout_secs": 120,
    }
    settings.update(overrides)
    return CheckpointProcessConfig(**settings)


@contextlib.contextmanager
def opened(root: Path | str, **kwargs: Any) -> Iterator[Checkpointer]:
    """A Checkpointer with bounded writer settings, closed on exit."""
    kwargs.setdefault("config", bounded_config())
    ck = Checkpointer(root, **kwargs)
    try:
        yield ck
    finally:
        ck.close()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "2m", read_only: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of `size` at `path` (skips the test where mounting is not allowed)."""
    path.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        gc.collect()  # loaded tensors map files of this file system
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def buffer_storage(buffer: Any) -> torch.UntypedStorage:
    """A storage over any writable buffer (an attached segment, a bytearray), zero-copy, for
    pyshmckpt.staging.manifest.rebuild; it keeps the buffer exported while it lives."""
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


# -- state dicts and checkpoint files ---------------------------------------------------------


def assert_same_tree(expected: Any, actual: Any, path: str = "state") -> None:
    """Same container types, keys (in order), leaves, and bitwise-equal tensors."""
    assert type(actual) is type(expected), (
        f"{path}: {type(actual).__name__}, expected {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert same_bytes(actual, expected), f"{path}: tensor bytes differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_tree(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_tree(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def snapshot(state: Any) -> Any:
    """A deep copy with every tensor cloned (aliasing kept), taken before anything changes."""
    return copy.deepcopy(state)


def gpt_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3}


def tree_hash(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` (to show it was not touched)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def read_st_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header JSON) of a .safetensors file, parsed independently of pyshmckpt."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8 : 8 + n])


def write_st_header(path: Path, header: dict[str, Any]) -> None:
    """Replace the header of a .safetensors file (data bytes kept), padded to 8 like the writer."""
    start, _ = read_st_header(path)
    data = path.read_bytes()[start:]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def flip_tensor_byte(d: Path) -> None:
    """Flip one byte in the middle of model.pos in the checkpoint directory `d`."""
    st = d / "rank0.safetensors"
    start, header = read_st_header(st)
    begin, end = header["model.pos"]["data_offsets"]
    data = bytearray(st.read_bytes())
    data[start + (begin + end) // 2] ^= 0x5A
    st.write_bytes(bytes(data))


def torchrun(worker: Path, nproc: int, *args: str, timeout: float = 240) -> None:
    """Run `worker` on `nproc` ranks under torchrun (gloo on 127.0.0.1); fail the test with the
    ranks' lines of output when it fails."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(worker), *args,
    ]  # fmt: skip
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "rank" in line]
        pytest.fail(f"{' '.join(args)} on {nproc} ranks failed:\n" + "\n".join(lines[-30:]))


def run_plain(worker: Path, *args: str, timeout: float = 240) -> None:
    """Run `worker` in one process without torchrun; assert it succeeds."""
    done = subprocess.run(
        [sys.executable, str(worker), *args],
        env=child_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
