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
and one more training step from it must reproduce the uninterrupted run's step exactly. Both
restores are timed as on a restart: each checkpoint's files are flushed and evicted from the
page cache first (ours were written with O_DIRECT, torch's through the cache), and the line says
so (or that the filesystem keeps them cached, as tmpfs does).

This module is the command: its flags, the run and its report. The model is in gpt, the
shared-memory gauges in shm_usage, the snapshot and bitwise comparison of restored state in
checks, the handling of SIGINT and SIGTERM in signals.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch

from ... import _torch_private
from ...shm import cuda_available
from ...staging import ShmStager
from ...storage import SafetensorsWriter, commit
from ...tiers import load
from ...transport import CheckpointProcess, CheckpointProcessConfig
from . import gpt
from .checks import compare, same_bits, snapshot, state_nbytes
from .shm_usage import ShmAccount, ShmemMonitor, on_shmem_filesystem
from .signals import Terminated, sigint_blocked, sigint_deferred, sigterm_unwinds, writer_init

logger = logging.getLogger(__name__)

INIT_TIMEOUT = 120.0  # seconds a writer subprocess may take to start (python + torch import)
SHUTDOWN_TIMEOUT = 15.0  # seconds a writer subprocess may take to exit when closed
WRITE_TIMEOUT = 600.0  # seconds one checkpoint may take until durable
LR = 1e-3
MIB = 1 << 20


class _DemoFailed(Exception):
    """The demo could not run to the end (a checkpoint failed or timed out, a bad output dir);
    main() reports it on stderr."""


def _evict_from_page_cache(directory: Path) -> bool:
    """Flush and drop the page cache of every file under `directory`, so that both restores are
    timed from the same state, as on a restart (the checkpoints are written one through the
    page cache, one with O_DIRECT). False where a file could not be evicted, or where memory is
    the storage (tmpfs)."""
    if on_shmem_filesystem(directory):
        return False
    evicted = True
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            evicted = False
            continue
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            evicted = False
        finally:
            os.close(fd)
    return evicted


def _say(*parts: object, file: Any = None) -> None:
    """print() that flushes at once, so progress shows in pipes and logs as it happens."""
    print(*parts, file=file if file is not None else sys.stdout, flush=True)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


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


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _fmt_rate(bytes_per_second: float) -> str:
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    return f"{bytes_per_second / 1e6:.0f} MB/s"


class Demo:
    """One run of the demo; ``close()`` frees every process, segment and temporary file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.device == "auto":
            self.device = torch.device("cuda" if cuda_available() else "cpu")
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
                raise _DemoFailed(f"cannot create --output {self.out}: {exc}") from None
        for transport in (self.ours, self.theirs):
            transport.root = self.out / transport.name
            try:
                transport.root.mkdir()
            except OSError as exc:
                raise _DemoFailed(f"cannot create {transport.root}: {exc}") from None

    def _start_transports(self) -> None:
        experimental = _torch_private.experimental
        TorchCheckpointProcess = experimental("checkpoint_process", "CheckpointProcess")
        TorchCheckpointProcessConfig = experimental("checkpoint_process", "CheckpointProcessConfig")
        CheckpointWriter = experimental("checkpoint_writer", "CheckpointWriter")
        CheckpointWriterConfig = experimental("checkpoint_writer", "CheckpointWriterConfig")
        CheckpointStagerConfig = experimental("staging", "CheckpointStagerConfig")
        DefaultStager = experimental("staging", "DefaultStager")
        RankInfo = experimental("types", "RankInfo")

        rank = RankInfo(global_rank=0, global_world_size=1)
        # The first process spawned starts multiprocessing's resource tracker, and the thread that
        # starts it unblocks SIGINT when done: start it here, so the writers are spawned blocked.
        resource_tracker.ensure_running()
        with sigint_blocked():
            self.ours.stager = ShmStager(slots=self.args.slots, headroom=1.0)
            self.ours.process = CheckpointProcess(
                rank,
                CheckpointProcessConfig(
                    subprocess_init_timeout_secs=INIT_TIMEOUT,
                    subprocess_shutdown_timeout_secs=SHUTDOWN_TIMEOUT,
                    write_timeout_secs=WRITE_TIMEOUT,
                ),
                writer_init, (), SafetensorsWriter, {"direct_io": self.args.direct_io},
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
                writer_init, (), CheckpointWriter, {"config": CheckpointWriterConfig()},
            )  # fmt: skip

    def _wait_ready(self) -> float:
        started = time.perf_counter()
        deadline = started + INIT_TIMEOUT + 5.0
        for transport in (self.ours, self.theirs):
            _outcome(
                transport.process.process_creation_future,
                max(0.0, deadline - time.perf_counter()),
                late=f"the {transport.name} writer process did not start in {INIT_TIMEOUT:.0f} s",
                failed=f"the {transport.name} writer process failed to start",
            )
        return time.perf_counter() - started

    # -- training -------------------------------------------------------------------------------

    def _model(self, seed: int) -> tuple[gpt.GPT, torch.optim.Optimizer]:
        a = self.args
        torch.manual_seed(seed)
        config = gpt.GPTConfig(
            vocab=a.vocab, seq_len=a.seq_len, width=a.width, layers=a.layers, heads=a.heads
        )
        model = gpt.GPT(config).to(self.device)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    def _step(self, model: gpt.GPT, optimizer: torch.optim.Optimizer, step: int) -> float:
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
        _outcome(
            future,
            WRITE_TIMEOUT,
            late=f"{transport.name}: checkpoint {path} was not durable after {WRITE_TIMEOUT:.0f} s",
            failed=f"{transport.name}: checkpoint {path} failed",
        )
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
        keep = self.args.keep
        commit.retain(self.ours.root, keep)  # ours are committed checkpoints under a root
        for old in self.theirs.paths[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for transport in (self.ours, self.theirs):
            del transport.paths[:-keep]

    # -- the whole run ----------------------------------------------------------------------------

    def run(self) -> int:
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
        if on_shmem_filesystem(self.out):
            _say("warning: the output is on tmpfs, where checkpoint files count as shared memory")
        ready = self._wait_ready()
        _say(f"writer processes ready ({ready:.1f} s more after building the model)")
        _say(
            "at each checkpoint pyshmckpt runs first, then torch; each is durable before the other "
            "starts, so the two never compete for CPU or disk",
        )

        checkpoint_steps = set(range(a.interval, a.steps + 1, a.interval)) | {a.steps}
        width = len(str(a.steps + 1))
        state_bytes = 0
        saved: Any = None
        started = time.perf_counter()
        for step in range(1, a.steps + 1):
            step_started = time.perf_counter()
            loss = self._step(model, optimizer, step)
            took = time.perf_counter() - step_started
            _say(f"step {step:{width}d}/{a.steps}  loss {loss:.4f}  ({took:.2f} s)")
            if step not in checkpoint_steps:
                continue
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
            state_bytes = state_nbytes(state)
            ours = self._checkpoint(self.ours, state, step)
            theirs = self._checkpoint(self.theirs, state, step)
            _say(
                f"  checkpoint {len(self.ours.durable)} at step {step} "
                f"({_fmt_bytes(state_bytes)}): "
                f"pyshmckpt blocked {ours[0] * 1e3:.1f} ms, durable {ours[1] * 1e3:.0f} ms | "
                f"torch blocked {theirs[0] * 1e3:.1f} ms, durable {theirs[1] * 1e3:.0f} ms",
            )
            if step == a.steps:
                saved = snapshot(state)
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
            ok &= self._check_restore(name, path, saved, next_step, next_loss, next_params)
        del saved
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
            + (
                "used O_DIRECT where the filesystem allowed it (--no-direct-io: the page cache)."
                if self.args.direct_io
                else "went through the page cache (--no-direct-io)."
            )
        )
        if self.monitor.available:
            base = self.monitor.baseline.get("machine")
            _say(
                "peak shm: the most shared memory the transport held at once, from Shmem: in "
                f"/proc/meminfo sampled every {self.monitor.interval * 1e3:.0f} ms\n(machine-wide, "
                f"{(base or 0) / MIB:.1f} MiB before the run: other processes' use shows in it "
                "too); "
                "in trainer: the same from RssShmem\nof this process (shared memory it maps)."
            )

    def _check_restore(
        self,
        name: str,
        path: Path,
        saved: Any,
        next_step: int,
        next_loss: float,
        next_params: dict[str, torch.Tensor],
    ) -> bool:
        cold = _evict_from_page_cache(path)
        started = time.perf_counter()
        if name == "pyshmckpt":
            restored = load(path)
            how = "pyshmckpt.load, checksums verified"
        else:
            restored = torch.load(path / "checkpoint_0.pt", map_location="cpu", weights_only=True)
            how = "torch.load, weights_only=True"
        took = time.perf_counter() - started
        cache = (
            "from storage, its files evicted from the page cache first"
            if cold
            else ("its files stay in memory here (tmpfs, or not evictable)")
        )
        _say(f"  {name:9s}  {path}  loaded in {took:.2f} s ({how}; {cache})")
        ok = True
        compared = compare(saved, restored)
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
                f"equal to the state saved at step {saved['step']} ({compared.tied} tied still "
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
        differ = [k for k, v in next_params.items() if not same_bits(v, params[k])]
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
                close_process = (
                    partial(_close_torch_process, process, abort)
                    if transport is self.theirs
                    else partial(process.close, abort=abort)
                )
                self._closing(f"the {transport.name} writer", close_process)
            stager, transport.stager = transport.stager, None
            if stager is not None:
                self._closing(f"the {transport.name} stager", stager.close)

    def _closing(self, what: str, close: Callable[[], object]) -> None:
        """Run `close`; its error goes to cleanup_errors, so that the rest of the cleanup runs."""
        try:
            close()
        except Exception as exc:
            self.cleanup_errors.append(f"closing {what}: {type(exc).__name__}: {exc}")

    def close(self, abort: bool = False) -> None:
        """Free everything: writers, stagers, the sampler thread, the temporary directory."""
        self.close_transports(abort)
        self.monitor.stop()
        if self.created_output:
            shutil.rmtree(self.out, ignore_errors=True)
            self.created_output = False


def _outcome(future: Future[Any], timeout: float, *, late: str, failed: str) -> None:
    """Wait for `future`; a timeout or a failure becomes a _DemoFailed with the given words."""
    try:
        future.result(timeout=timeout)
    except (FutureTimeoutError, TimeoutError):  # distinct classes before Python 3.11
        raise _DemoFailed(late) from None
    except Exception as exc:
        raise _DemoFailed(f"{failed}: {type(exc).__name__}: {exc}") from exc


def _quiet_fd_server() -> None:
    """From now on, drop the connection errors that multiprocessing's file-descriptor server
    thread reports through sys.excepthook. That thread (``multiprocessing.resource_sharer``)
    hands torch's writer the descriptor of each tensor it unpickles; killing the writer in the
    middle of one cuts the connection, and the thread would print the traceback of an error that
    is none here. Kept until the demo exits: the thread may report after the kill returned."""
    previous = sys.excepthook
    if getattr(previous, "fd_server_quiet", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        outermost = tb.tb_frame.f_code if tb is not None else None
        if (
            issubclass(kind, (ConnectionError, EOFError))
            and outermost is not None
            and outermost.co_name == "_serve"
            and Path(outermost.co_filename).name == "resource_sharer.py"
        ):
            logger.debug("multiprocessing's descriptor server: %s (torch's writer killed)", value)
            return
        previous(kind, value, tb)

    hook.fd_server_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _close_torch_process(process: Any, abort: bool) -> None:
    """Close torch's CheckpointProcess; with `abort`, kill its subprocess first, so that close()
    (which waits for a pending write) returns at once."""
    if not abort:
        process.close()
        return
    # Its pipe breaks when the child is killed; torch logs that as an error, which it is not here.
    torch_logger = logging.getLogger(f"{_torch_private.EXPERIMENTAL_PACKAGE}.checkpoint_process")
    level = torch_logger.level
    torch_logger.setLevel(logging.CRITICAL)
    _quiet_fd_server()
    try:
        context = getattr(process, "process", None)
        for child in getattr(context, "processes", None) or []:
            if child.is_alive():
                child.kill()
                child.join(SHUTDOWN_TIMEOUT)
        process.close()
    finally:
        torch_logger.setLevel(level)


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (0 every check passed, 1 a failure, 130 Ctrl-C,
    143 SIGTERM). The flags were checked first (`options.check`)."""
    demo: Demo | None = None
    status = 1
    try:
        with sigterm_unwinds():
            demo = Demo(args)
            aborted = True
            try:
                status = demo.run()
                aborted = False
            finally:
                with sigint_deferred():
                    demo.close(abort=aborted)
    except KeyboardInterrupt:
        _say("\ninterrupted: writers stopped, shared memory freed", file=sys.stderr)
        status = 130
    except Terminated:
        _say("\nterminated: writers stopped, shared memory freed", file=sys.stderr)
        status = 143
    except _DemoFailed as exc:
        _say(f"pyshmckpt demo: error: {exc}", file=sys.stderr)
        status = 1
    for error in demo.cleanup_errors if demo is not None else []:
        _say(f"error while cleaning up: {error}", file=sys.stderr)
        status = max(status, 1)
    return status


__all__ = ["main"]
