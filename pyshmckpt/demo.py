"""``pyshmckpt demo``: train a small GPT and checkpoint it through two transports, side by side.

At every checkpoint step the same state ({"model", "optim", "step"}) goes through

1. pyshmckpt: ``ShmStager.stage`` into a POSIX shared-memory slot, then
   ``pyshmckpt.CheckpointProcess.write``, whose writer subprocess persists it with
   ``SafetensorsWriter`` straight from the slot (fsync, atomic commit into a directory);
2. torch's ``_experimental`` transport: ``DefaultStager`` (shared memory, synchronous), then
   torch's ``CheckpointProcess.write``, which pickles the staged state dict through its pipe to a
   subprocess running torch's ``CheckpointWriter`` (``torch.save``).

Ours runs first, then torch's, and each is durable before the other starts, so they never
compete for CPU or disk. Per checkpoint the demo measures the time the training loop is blocked
(staging + handing over), the time until the write is durable (its future resolved), the
throughput (state bytes / durable time) and the peak shared memory (``Shmem:`` of
/proc/meminfo, sampled in a background thread; it also counts torch's shared memory, which is
unlinked at once and never shows in /dev/shm; and, as a cross-check that other processes do not
disturb, ``RssShmem:`` of the training process). Finally the last checkpoint of each transport is
restored into a fresh model and optimizer, compared bit for bit with the state that was saved,
and one more training step from it must reproduce the uninterrupted run's step exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the writer subprocesses import this module: keep its import cheap
    import torch

    from .gpt import GPT

INIT_TIMEOUT = 120.0  # seconds a writer subprocess may take to start (python + torch import)
SHUTDOWN_TIMEOUT = 15.0  # seconds a writer subprocess may take to exit when closed
WRITE_TIMEOUT = 600.0  # seconds one checkpoint may take until durable
SAMPLE_INTERVAL = 0.002  # seconds between two samples of /proc/meminfo
LR = 1e-3
MIB = 1 << 20


class DemoError(Exception):
    """The demo could not run to the end (a checkpoint failed or timed out, a bad output dir)."""


def _say(*parts: object, file: Any = None) -> None:
    """print() that flushes at once, so progress shows in pipes and logs as it happens."""
    print(*parts, file=file if file is not None else sys.stdout, flush=True)


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags to `parser` (the ``demo`` subcommand's parser)."""
    parser.description = (
        "Train a small GPT with AdamW and checkpoint it every --interval steps through pyshmckpt "
        "(ShmStager + CheckpointProcess + SafetensorsWriter) and through torch's _experimental "
        "transport (DefaultStager + CheckpointProcess + CheckpointWriter), one after the other; "
        "print blocked time, time until durable, throughput and peak shared memory of each; then "
        "restore the last checkpoint of each into a fresh model and optimizer and check that it "
        "is bit-exact and resumes training exactly."
    )
    model = parser.add_argument_group(
        "model (the defaults make ~290 MB of state: many parameters, little compute)"
    )
    model.add_argument(
        "--layers", type=_positive_int, default=10, help="transformer blocks (default 10)"
    )
    model.add_argument(
        "--width", type=_positive_int, default=384, help="embedding width (default 384)"
    )
    model.add_argument(
        "--heads",
        type=_positive_int,
        default=6,
        help="attention heads; must divide --width (default 6)",
    )
    model.add_argument(
        "--vocab", type=_positive_int, default=16384, help="vocabulary size (default 16384)"
    )
    model.add_argument(
        "--seq-len", type=_positive_int, default=32, help="tokens per sequence (default 32)"
    )
    model.add_argument(
        "--batch-size", type=_positive_int, default=4, help="sequences per step (default 4)"
    )
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=_positive_int, default=50, help="training steps (default 50)")
    run.add_argument(
        "--interval", type=_positive_int, default=10,
        help="checkpoint every N steps, and at the last step (default 10)",
    )  # fmt: skip
    run.add_argument(
        "--keep", type=_positive_int, default=2,
        help="checkpoints kept per transport; older ones are deleted between checkpoints "
        "(default 2)",
    )  # fmt: skip
    run.add_argument(
        "--slots", type=_positive_int, default=1,
        help="shared-memory slots of pyshmckpt's stager (default 1: the demo waits for each "
        "checkpoint; 2 lets training stage the next one while one is written)",
    )  # fmt: skip
    run.add_argument(
        "--direct-io", action=argparse.BooleanOptionalAction, default=True,
        help="pyshmckpt's writer writes tensor data with O_DIRECT where the filesystem allows it "
        "(default; --no-direct-io: through the page cache, like torch's writer)",
    )  # fmt: skip
    run.add_argument(
        "--output", metavar="DIR", default=None,
        help="directory for the checkpoints (kept; must be empty or not exist). Default: a "
        "temporary directory, removed at the end",
    )  # fmt: skip
    run.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where to train (auto: CUDA when available to torch and pyshmckpt)",
    )  # fmt: skip
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's initialization and the data (default 0)",
    )
    parser.set_defaults(demo_parser=parser)


def _usage_error(args: argparse.Namespace, message: str) -> None:
    """Exit with status 2 and `message`, the way argparse reports a bad flag."""
    parser = getattr(args, "demo_parser", None)
    if isinstance(parser, argparse.ArgumentParser):
        parser.error(message)  # raises SystemExit(2)
    _say(f"pyshmckpt demo: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_arguments(args: argparse.Namespace) -> None:
    """Checks that involve more than one flag, or the machine (argparse errors, exit status 2)."""
    if args.width % args.heads:
        _usage_error(args, f"--heads {args.heads} must divide --width {args.width}")
    if args.interval > args.steps:
        _usage_error(args, f"--interval {args.interval} is larger than --steps {args.steps}")
    if args.output is not None:
        out = Path(args.output)
        if out.exists() and not out.is_dir():
            _usage_error(args, f"--output {out} is not a directory")
        if out.is_dir() and any(out.iterdir()):
            _usage_error(args, f"--output {out} is not empty")
    if args.device == "cuda" and not _cuda_usable():
        _usage_error(
            args,
            "--device cuda: CUDA is not usable here (pyshmckpt needs its CUDA build, a device "
            "and a CUDA build of torch)",
        )


def _cuda_usable() -> bool:
    """Whether both transports can stage from a GPU here (pyshmckpt's CUDA path included)."""
    from .cuda import cuda_available

    return cuda_available()


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------


def _read_kib(path: str, key: bytes) -> int | None:
    """The ``key: N kB`` line of a /proc file in bytes, or None."""
    try:
        data = b"\n" + Path(path).read_bytes()
    except OSError:
        return None
    start = data.find(b"\n" + key + b":")
    if start < 0:
        return None
    start += len(key) + 2
    fields = data[start : data.find(b"\n", start)].split()
    try:
        return int(fields[0]) * (1024 if fields[1:] == [b"kB"] else 1)
    except (IndexError, ValueError):
        return None


def read_shmem() -> int | None:
    """Shared memory in use on the whole machine (``Shmem:`` of /proc/meminfo), in bytes."""
    return _read_kib("/proc/meminfo", b"Shmem")


def read_process_shmem() -> int | None:
    """Shared memory mapped by this process (``RssShmem:`` of /proc/self/status), in bytes."""
    return _read_kib("/proc/self/status", b"RssShmem")


# What the monitor samples. "machine" (Shmem:) counts all shared memory, torch's included, which
# is unlinked as soon as it is made and so never shows in /dev/shm; other processes on the
# machine move it too. "trainer" (RssShmem:) counts what this process maps: both transports
# allocate and map every staged byte here (their writers map the same pages), and nothing else
# moves it, so it backs the machine-wide figure up on a busy machine.
GAUGES: dict[str, Callable[[], int | None]] = {"machine": read_shmem, "trainer": read_process_shmem}


class ShmemMonitor:
    """Samples the GAUGES every few ms in a daemon thread and keeps the highest of a window.

    ``begin()`` starts a window and returns the current levels; ``end()`` returns (highest levels
    seen since begin, current levels). Levels are bytes by gauge name, None where unreadable.
    """

    def __init__(self, interval: float = SAMPLE_INTERVAL) -> None:
        self.interval = interval
        self.baseline = self._read()
        self.available = any(v is not None for v in self.baseline.values())
        self._lock = threading.Lock()
        self._high = dict(self.baseline)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _read() -> dict[str, int | None]:
        return {name: read() for name, read in GAUGES.items()}

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="pyshmckpt-demo-shmem", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._note(self._read())

    def _note(self, levels: dict[str, int | None]) -> None:
        with self._lock:
            for name, value in levels.items():
                high = self._high.get(name)
                if value is not None:
                    self._high[name] = value if high is None else max(high, value)

    def begin(self) -> dict[str, int | None]:
        levels = self._read()
        with self._lock:
            self._high = dict(levels)
        return levels

    def end(self) -> tuple[dict[str, int | None], dict[str, int | None]]:
        levels = self._read()
        self._note(levels)
        with self._lock:
            return dict(self._high), levels


@dataclass
class ShmAccount:
    """The shared memory one transport accounts for, by gauge.

    Only the two transports change this run's shared memory, and only one of them is active at a
    time, so during a transport's checkpoint a gauge moves by what that transport allocates or
    frees; what it still holds between its checkpoints (ours: its slots; torch: its cached staging
    storages) is carried over. The peak is the most it held at any moment.
    """

    held: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)

    def add_window(
        self, start: dict[str, int | None], high: dict[str, int | None], end: dict[str, int | None]
    ) -> None:
        for name in GAUGES:
            s, h, e = start.get(name), high.get(name), end.get(name)
            if s is None or h is None or e is None:
                continue
            held = self.held.get(name, 0)
            self.peak[name] = max(self.peak.get(name, 0), held + h - s)
            self.held[name] = max(0, held + e - s)


@dataclass
class Transport:
    """One way of checkpointing, its measurements and its resources."""

    name: str
    label: str
    root: Path = Path()
    blocked: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    shm: ShmAccount = field(default_factory=ShmAccount)
    paths: list[Path] = field(default_factory=list)
    process: Any = None
    stager: Any = None


def _writer_init(*_: object) -> None:
    """Runs first in both writer subprocesses: Ctrl-C in a terminal reaches every process of the
    group, and the demo itself shuts its writers down, so they ignore SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread, and so in the threads started meanwhile and the writer
    subprocesses they spawn (until _writer_init ignores it there). A SIGINT that arrives
    meanwhile is delivered here when the block ends."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Let a Ctrl-C during cleanup wait until the cleanup is done, then raise it."""
    if threading.current_thread() is not threading.main_thread():
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


# --------------------------------------------------------------------------------------------
# state helpers
# --------------------------------------------------------------------------------------------


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def _nbytes(tree: Any) -> int:
    """Bytes of the distinct storages under `tree` (a tied weight counts once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in _tensors(tree):
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _snapshot(tree: Any) -> Any:
    """A CPU copy of `tree` (tensors cloned, containers rebuilt, tied tensors stay tied)."""
    import copy

    import torch

    clones: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy_of(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            # state_dict() gives each name of a tied weight its own tensor object over the same
            # memory: one clone for the same view of the same memory keeps them tied.
            view = (
                str(node.device), node.untyped_storage().data_ptr(), node.storage_offset(),
                tuple(node.shape), node.stride(), node.dtype,
            )  # fmt: skip
            if view not in clones:
                clones[view] = node.detach().to("cpu", copy=True)
            return clones[view]
        if isinstance(node, dict):
            out = copy.copy(node)  # keeps the type (OrderedDict) and its attributes
            for key, value in node.items():
                out[key] = copy_of(value)
            return out
        if isinstance(node, (list, tuple)):
            return type(node)(copy_of(value) for value in node)
        return copy.deepcopy(node)

    return copy_of(tree)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().to("cpu").contiguous().reshape(-1)
    b = b.detach().to("cpu").contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@dataclass
class Comparison:
    """What _compare found: equal tensors (and their distinct bytes), tied tensors that are
    still one tensor, other equal leaves, and every difference."""

    tensors: int = 0
    nbytes: int = 0  # of distinct tensors (a tied weight counts once)
    tied: int = 0
    others: int = 0
    mismatches: list[str] = field(default_factory=list)
    first: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (path, restored ptr)


def _compare(
    expected: Any, actual: Any, path: str = "state", result: Comparison | None = None
) -> Comparison:
    """Compare two state trees: every tensor bit for bit, every other leaf with ==."""
    import torch

    result = Comparison() if result is None else result
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            result.mismatches.append(
                f"{path}: a tensor was saved, {type(actual).__name__} came back"
            )
        elif not _same_bits(expected, actual):
            result.mismatches.append(
                f"{path}: saved {expected.dtype} {tuple(expected.shape)}, "
                f"restored {actual.dtype} {tuple(actual.shape)} with different bits"
            )
        else:
            result.tensors += 1
            first = result.first.get(id(expected))
            if first is None:
                result.first[id(expected)] = (path, actual.data_ptr())
                result.nbytes += expected.nbytes
            elif first[1] == actual.data_ptr():
                result.tied += 1
            else:
                result.mismatches.append(
                    f"{path} is {first[0]} (tied) in the saved state, a separate copy restored"
                )
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or set(expected) != set(actual):
            got = sorted(map(repr, actual)) if isinstance(actual, dict) else type(actual).__name__
            result.mismatches.append(
                f"{path}: keys {sorted(map(repr, expected))} saved, {got} restored"
            )
        else:
            for key, value in expected.items():
                _compare(value, actual[key], f"{path}[{key!r}]", result)
    elif isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            result.mismatches.append(f"{path}: {expected!r} saved, {actual!r} restored")
        else:
            for i, (value, other) in enumerate(zip(expected, actual, strict=True)):
                _compare(value, other, f"{path}[{i}]", result)
    elif type(actual) is not type(expected) or actual != expected:
        result.mismatches.append(f"{path}: {expected!r} saved, {actual!r} restored")
    else:
        result.others += 1
    return result


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _fmt_rate(bytes_per_second: float) -> str:
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    return f"{bytes_per_second / 1e6:.0f} MB/s"


def _fs_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path` (from /proc/self/mounts), or None."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, kind = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


class Demo:
    """One run of the demo; ``close()`` frees every process, segment and temporary file."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        if args.device == "auto":
            self.device = torch.device("cuda" if _cuda_usable() else "cpu")
        else:
            self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.temporary = args.output is None
        self.out = Path()
        self.created_output = False
        self.ours = Transport("pyshmckpt", "pyshmckpt (shared-memory slot)")
        self.theirs = Transport("torch", "torch _experimental (pipe)")
        self.monitor = ShmemMonitor()
        self.cleanup_errors: list[str] = []

    # -- set-up -------------------------------------------------------------------------------

    def _open_output(self) -> None:
        if self.temporary:
            self.out = Path(tempfile.mkdtemp(prefix="pyshmckpt-demo-"))
            self.created_output = True
        else:
            self.out = Path(self.args.output)
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DemoError(f"cannot create --output {self.out}: {exc}") from None
        for transport in (self.ours, self.theirs):
            transport.root = self.out / transport.name
            try:
                transport.root.mkdir()
            except OSError as exc:
                raise DemoError(f"cannot create {transport.root}: {exc}") from None

    def _start_transports(self) -> None:
        from torch.distributed.checkpoint._experimental.checkpoint_process import (
            CheckpointProcess as TorchCheckpointProcess,
        )
        from torch.distributed.checkpoint._experimental.checkpoint_process import (
            CheckpointProcessConfig as TorchCheckpointProcessConfig,
        )
        from torch.distributed.checkpoint._experimental.checkpoint_writer import (
            CheckpointWriter,
            CheckpointWriterConfig,
        )
        from torch.distributed.checkpoint._experimental.staging import (
            CheckpointStagerConfig,
            DefaultStager,
        )
        from torch.distributed.checkpoint._experimental.types import RankInfo

        import pyshmckpt
        from pyshmckpt.file_writer import SafetensorsWriter

        rank = RankInfo(global_rank=0, global_world_size=1)
        # The first process spawned starts multiprocessing's resource tracker, and the thread that
        # starts it unblocks SIGINT when done: start it here, so the writers are spawned blocked.
        resource_tracker.ensure_running()
        with _sigint_blocked():
            self.ours.stager = pyshmckpt.ShmStager(slots=self.args.slots, headroom=1.0)
            self.ours.process = pyshmckpt.CheckpointProcess(
                rank,
                pyshmckpt.CheckpointProcessConfig(
                    subprocess_init_timeout_secs=INIT_TIMEOUT,
                    subprocess_shutdown_timeout_secs=SHUTDOWN_TIMEOUT,
                    write_timeout_secs=WRITE_TIMEOUT,
                ),
                _writer_init, (), SafetensorsWriter, {"direct_io": self.args.direct_io},
            )  # fmt: skip
            self.theirs.stager = DefaultStager(
                CheckpointStagerConfig(
                    use_pinned_memory=self.cuda,
                    use_shared_memory=True,
                    use_async_staging=False,
                    use_non_blocking_copy=self.cuda,
                )
            )
            self.theirs.process = TorchCheckpointProcess(
                rank,
                TorchCheckpointProcessConfig(
                    subprocess_init_timeout_secs=int(INIT_TIMEOUT),
                    subprocess_shutdown_timeout_secs=int(SHUTDOWN_TIMEOUT),
                ),
                _writer_init, (), CheckpointWriter, {"config": CheckpointWriterConfig()},
            )  # fmt: skip

    def _wait_ready(self) -> float:
        started = time.perf_counter()
        deadline = started + INIT_TIMEOUT + 5.0
        for transport in (self.ours, self.theirs):
            try:
                transport.process.process_creation_future.result(
                    timeout=max(0.0, deadline - time.perf_counter())
                )
            except (FutureTimeoutError, TimeoutError):  # distinct classes before Python 3.11
                raise DemoError(
                    f"the {transport.name} writer process did not start in {INIT_TIMEOUT:.0f} s"
                ) from None
            except Exception as exc:
                raise DemoError(
                    f"the {transport.name} writer process failed to start: {exc}"
                ) from exc
        return time.perf_counter() - started

    # -- training -------------------------------------------------------------------------------

    def _model(self, seed: int) -> tuple[GPT, torch.optim.Optimizer]:
        import torch

        from . import gpt

        a = self.args
        torch.manual_seed(seed)
        config = gpt.GPTConfig(
            vocab=a.vocab, seq_len=a.seq_len, width=a.width, layers=a.layers, heads=a.heads
        )
        model = gpt.GPT(config).to(self.device)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    def _step(self, model: GPT, optimizer: torch.optim.Optimizer, step: int) -> float:
        from . import gpt

        a = self.args
        inputs, targets = gpt.batch(
            step, a.batch_size, a.seq_len, a.vocab, device=self.device, seed=a.seed
        )
        loss = model.loss(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def _checkpoint(
        self, transport: Transport, state: dict[str, Any], step: int
    ) -> tuple[float, float]:
        """Save `state` through `transport`; returns (blocked, durable) seconds."""
        path = transport.root / f"step-{step:08d}"
        window = self.monitor.begin()
        started = time.perf_counter()
        staged = transport.stager.stage(state)
        future: Future[None] = transport.process.write(staged, str(path))
        blocked = time.perf_counter() - started
        del staged  # ours: the slot frees itself once written and no longer referenced
        try:
            future.result(timeout=WRITE_TIMEOUT)
        except (FutureTimeoutError, TimeoutError):  # distinct classes before Python 3.11
            raise DemoError(
                f"{transport.name}: checkpoint {path} was not durable after {WRITE_TIMEOUT:.0f} s"
            ) from None
        except Exception as exc:
            raise DemoError(
                f"{transport.name}: checkpoint {path} failed: {type(exc).__name__}: {exc}"
            ) from exc
        durable = time.perf_counter() - started
        high, end = self.monitor.end()
        transport.shm.add_window(window, high, end)
        transport.blocked.append(blocked)
        transport.durable.append(durable)
        transport.paths.append(path)
        return blocked, durable

    def _retain(self) -> None:
        """Delete all but the newest --keep checkpoints of each transport (between checkpoints,
        not timed)."""
        from . import commit

        keep = self.args.keep
        commit.retain(self.ours.root, keep)  # ours are committed checkpoints under a root
        for old in self.theirs.paths[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for transport in (self.ours, self.theirs):
            del transport.paths[:-keep]

    # -- the whole run ----------------------------------------------------------------------------

    def run(self) -> int:
        import torch

        from . import gpt

        a = self.args
        self._open_output()
        self.monitor.start()
        self._start_transports()

        model, optimizer = self._model(a.seed)
        params = gpt.parameter_count(model)
        where = (
            f"{self.out} (temporary, removed at the end)"
            if self.temporary
            else f"{self.out} (kept)"
        )
        _say(
            f"pyshmckpt demo: GPT with {a.layers} layers, width {a.width}, {a.heads} heads, "
            f"vocab {a.vocab}, seq-len {a.seq_len}, batch {a.batch_size}: "
            f"{params / 1e6:.2f} M parameters, AdamW, on {self.device}",
        )
        _say(f"checkpoints every {a.interval} steps (and at step {a.steps}) into {where}")
        if _fs_type(self.out) in ("tmpfs", "ramfs"):
            _say("warning: the output is on tmpfs, where checkpoint files count as shared memory")
        ready = self._wait_ready()
        _say(f"writer processes ready ({ready:.1f} s more after building the model)")
        _say(
            "at each checkpoint pyshmckpt runs first, then torch; each is durable before the other "
            "starts, so the two never compete for CPU or disk",
        )

        checkpoint_steps = sorted(
            {s for s in range(a.interval, a.steps + 1, a.interval)} | {a.steps}
        )
        width = len(str(a.steps + 1))
        state_bytes = 0
        snapshot: Any = None
        started = time.perf_counter()
        for step in range(1, a.steps + 1):
            step_started = time.perf_counter()
            loss = self._step(model, optimizer, step)
            took = time.perf_counter() - step_started
            _say(f"step {step:{width}d}/{a.steps}  loss {loss:.4f}  ({took:.2f} s)")
            if step not in checkpoint_steps:
                continue
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
            state_bytes = _nbytes(state)
            ours = self._checkpoint(self.ours, state, step)
            theirs = self._checkpoint(self.theirs, state, step)
            _say(
                f"  checkpoint {len(self.ours.durable)} at step {step} "
                f"({_fmt_bytes(state_bytes)}): "
                f"pyshmckpt blocked {ours[0] * 1e3:.1f} ms, durable {ours[1] * 1e3:.0f} ms | "
                f"torch blocked {theirs[0] * 1e3:.1f} ms, durable {theirs[1] * 1e3:.0f} ms",
            )
            if step == a.steps:
                snapshot = _snapshot(state)
            del state
            self._retain()
        elapsed = time.perf_counter() - started
        last = {t.name: t.paths[-1] for t in (self.ours, self.theirs)}

        # One more step of the uninterrupted run, the reference for the resumed ones.
        next_step = a.steps + 1
        next_loss = self._step(model, optimizer, next_step)
        next_params = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        del model, optimizer

        self.close_transports()  # frees the shared memory before the table is printed
        self._print_table(state_bytes, elapsed)

        _say(
            f"\nrestore the last checkpoint (step {a.steps}) of each transport into a fresh model "
            "and AdamW:"
        )
        ok = True
        for name, path in last.items():
            ok &= self._check_restore(name, path, snapshot, next_step, next_loss, next_params)
        del snapshot
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _say("all checks passed" if ok else "SOME CHECKS FAILED")
        return 0 if ok else 1

    def _print_table(self, state_bytes: int, elapsed: float) -> None:
        count = len(self.ours.durable)
        _say(
            f"\n{count} checkpoint(s) per transport of {_fmt_bytes(state_bytes)} each "
            f"(training + checkpoints took {elapsed:.1f} s); medians per checkpoint:"
        )
        header = (
            f"{'transport':30s} {'blocked ms':>10s} {'durable ms':>10s} {'throughput':>10s}"
            f" {'peak shm MiB':>12s} {'in trainer':>10s}"
        )
        _say(header)
        _say("-" * len(header))
        rows = {}
        for t in (self.ours, self.theirs):
            blocked = statistics.median(t.blocked)
            durable = statistics.median(t.durable)
            rows[t.name] = (blocked, durable)
            shm = [
                f"{t.shm.peak[g] / MIB:.1f}" if g in t.shm.peak else "n/a"
                for g in ("machine", "trainer")
            ]
            _say(
                f"{t.label:30s} {blocked * 1e3:10.1f} {durable * 1e3:10.0f} "
                f"{_fmt_rate(state_bytes / durable):>10s} {shm[0]:>12s} {shm[1]:>10s}"
            )
        ours, theirs = rows["pyshmckpt"], rows["torch"]
        _say(
            f"{'speed-up of pyshmckpt':30s} {theirs[0] / ours[0]:9.1f}x {theirs[1] / ours[1]:9.1f}x"
        )
        _say(
            "blocked: from the start of staging until control returns to the training loop; "
            "durable: "
            "until the write's\nfuture resolved (pyshmckpt's includes fsync and the atomic commit; "
            "torch's CheckpointWriter returns after\ntorch.save, without fsync). throughput: state "
            "bytes / durable time.\npyshmckpt's writer "
            + ("used O_DIRECT where the filesystem allowed it (--no-direct-io: the page cache)."
               if self.args.direct_io else "went through the page cache (--no-direct-io).")
        )
        if self.monitor.available:
            base = self.monitor.baseline.get("machine")
            _say(
                "peak shm: the most shared memory the transport held at once, from Shmem: in "
                f"/proc/meminfo sampled every {SAMPLE_INTERVAL * 1e3:.0f} ms\n(machine-wide, "
                f"{(base or 0) / MIB:.1f} MiB before the run: other processes' use shows in it "
                "too); "
                "in trainer: the same from RssShmem\nof this process (shared memory it maps)."
            )

    def _check_restore(
        self,
        name: str,
        path: Path,
        snapshot: Any,
        next_step: int,
        next_loss: float,
        next_params: dict[str, torch.Tensor],
    ) -> bool:
        import torch

        import pyshmckpt

        started = time.perf_counter()
        if name == "pyshmckpt":
            restored = pyshmckpt.load(path)
            how = "pyshmckpt.load, checksums verified"
        else:
            restored = torch.load(path / "checkpoint_0.pt", map_location="cpu", weights_only=True)
            how = "torch.load, weights_only=True"
        took = time.perf_counter() - started
        _say(f"  {name:9s}  {path}  loaded in {took:.2f} s ({how})")
        ok = True
        compared = _compare(snapshot, restored)
        if compared.mismatches:
            ok = False
            _say(
                f"    MISMATCH  {len(compared.mismatches)} value(s) differ from the saved state, "
                "e.g.:"
            )
            for line in compared.mismatches[:5]:
                _say(f"              {line}")
        else:
            _say(
                f"    OK        {compared.tensors} tensors ({_fmt_bytes(compared.nbytes)}) bitwise "
                f"equal to the state saved at step {snapshot['step']} ({compared.tied} tied still "
                f"shared), {compared.others} other values equal"
            )
        try:
            model, optimizer = self._model(self.args.seed + 1)  # different initial values
            model.load_state_dict(restored["model"])
            optimizer.load_state_dict(restored["optim"])
            del restored
            loss = self._step(model, optimizer, next_step)
        except Exception as exc:  # a restore that does not even load is a failed check
            _say(f"    MISMATCH  resuming failed: {type(exc).__name__}: {exc}")
            return False
        params = model.state_dict()
        differ = [k for k, v in next_params.items() if not _same_bits(v, params[k])]
        same_loss = loss == next_loss
        verdict = "OK      " if same_loss and not differ else "MISMATCH"
        _say(
            f"    {verdict}  next step ({next_step}): loss {loss:.6f} "
            f"{'==' if same_loss else '!='} {next_loss:.6f} of the uninterrupted run; "
            f"{len(next_params) - len(differ)}/{len(next_params)} weights bitwise equal after the "
            "AdamW update"
        )
        return ok and same_loss and not differ

    # -- cleanup --------------------------------------------------------------------------------

    def close_transports(self, abort: bool = False) -> None:
        """Close both writers and both stagers (abort: kill the writers at once). Idempotent;
        errors are collected in cleanup_errors."""
        for transport in (self.ours, self.theirs):
            process, transport.process = transport.process, None
            if process is not None:
                try:
                    if transport is self.theirs:
                        _close_torch_process(process, abort)
                    else:
                        process.close(abort=abort)
                except Exception as exc:
                    self.cleanup_errors.append(
                        f"closing the {transport.name} writer: {type(exc).__name__}: {exc}"
                    )
            stager, transport.stager = transport.stager, None
            if stager is not None:
                try:
                    stager.close()
                except Exception as exc:
                    self.cleanup_errors.append(
                        f"closing the {transport.name} stager: {type(exc).__name__}: {exc}"
                    )

    def close(self, abort: bool = False) -> None:
        """Free everything: writers, stagers, the sampler thread, the temporary directory."""
        self.close_transports(abort)
        self.monitor.stop()
        if self.created_output:
            shutil.rmtree(self.out, ignore_errors=True)
            self.created_output = False


def _close_torch_process(process: Any, abort: bool) -> None:
    """Close torch's CheckpointProcess; with `abort`, kill its subprocess first, so that close()
    (which waits for a pending write) returns at once."""
    if not abort:
        process.close()
        return
    # Its pipe breaks when the child is killed; torch logs that as an error, which it is not here.
    logger = logging.getLogger("torch.distributed.checkpoint._experimental.checkpoint_process")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        context = getattr(process, "process", None)
        for child in getattr(context, "processes", None) or []:
            if child.is_alive():
                child.kill()
                child.join(SHUTDOWN_TIMEOUT)
        process.close()
    finally:
        logger.setLevel(level)


class _Terminated(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C, so that everything is cleaned up."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into _Terminated while the demo runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (0 every check passed, 1 a failure, 130 Ctrl-C,
    143 SIGTERM)."""
    _check_arguments(args)
    demo: Demo | None = None
    status = 1
    try:
        with _sigterm_unwinds():
            demo = Demo(args)
            aborted = True
            try:
                status = demo.run()
                aborted = False
            finally:
                with _sigint_deferred():
                    demo.close(abort=aborted)
    except KeyboardInterrupt:
        _say("\ninterrupted: writers stopped, shared memory freed", file=sys.stderr)
        status = 130
    except _Terminated:
        _say("\nterminated: writers stopped, shared memory freed", file=sys.stderr)
        status = 143
    except DemoError as exc:
        _say(f"pyshmckpt demo: error: {exc}", file=sys.stderr)
        status = 1
    for error in demo.cleanup_errors if demo is not None else []:
        _say(f"error while cleaning up: {error}", file=sys.stderr)
        status = max(status, 1)
    return status


__all__ = ["DemoError", "add_arguments", "main"]
