"""How much slower training runs while checkpointing every N steps.

    python bench/training_overhead.py [--steps 60 --every 1 5 20 --repeats 3 --plot out.png]

Trains the demo's GPT (on the CPU, or on a GPU with --device cuda) for --steps steps per run, with
a checkpoint every N steps through each way below, and without checkpoints; runs are interleaved
(every repeat runs every way and N in a rotating order) and each figure is the median over
--repeats. With --start warm (the default) the ways that run a writer process have it ready before
the timed steps, as in a job that builds its checkpointer at set-up (the start-up is a one-time
cost, which bench/first_save.py measures); with --start cold it starts when the run does and its
start-up (a Python interpreter importing torch on the same cores) falls inside the timed steps.
Slowdown = a run's wall time / the median run without checkpoints - 1. A save is started every N
steps and training goes on; before the next save (and at the end) the previous one must be
durable, as a training loop that keeps one checkpoint in flight does.

  pyshmckpt         pyshmckpt.Checkpointer (safetensors files, keep_last=2)
  pyshmckpt-memory  pyshmckpt.Checkpointer.save(state, persist=False): the memory tier, each
                    checkpoint kept in shared memory only (a restarted trainer restores the
                    newest); nothing is written to disk
  pyshmckpt-overlap, pyshmckpt-memory-overlap
                    the same with Checkpointer(overlap=True): save() returns before the copies,
                    which run while the next step's forward and backward do (its optimizer step
                    waits for them)
  torch_checkpointing
                    Meta's torch_checkpointing (0.1.1) CheckpointManager, its defaults but
                    use_direct_io=False (O_DIRECT fails on ext4); save() returns while its thread
                    stages, and the loop wraps optimizer.step() in `with manager.lock():` as its
                    documentation asks; it does not fsync (nor does torch-exp)
  torch-exp         torch's _experimental DefaultStager + CheckpointProcess + CheckpointWriter
  dcp               torch.distributed.checkpoint.async_save with its default stager

"ours / best other" compares pyshmckpt (persisted) with the best of torch-exp and dcp.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import pyshmckpt
from pyshmckpt import _torch_private
from pyshmckpt.cli.demo import gpt

import transports  # bench/transports.py: the sides every benchmark compares

WAYS = (
    "pyshmckpt",
    "pyshmckpt-memory",
    "pyshmckpt-overlap",
    "pyshmckpt-memory-overlap",
    "torch_checkpointing",
    "torch-exp",
    "dcp",
)
# Other libraries: what "ours / best other" compares against.
OTHERS = ("torch_checkpointing", "torch-exp", "dcp")


class Saver:
    """One way of checkpointing: start(state, path) returns something to wait on."""

    def __init__(self, way: str, root: Path, warm: bool) -> None:
        self.way = way
        self.root = root
        self.count = 0
        self.close: Callable[[], None] = lambda: None
        # What the loop wraps optimizer.step() in (a library that stages while training runs
        # may ask for it).
        self.guard: Callable[[], Any] = contextlib.nullcontext
        if way.startswith("pyshmckpt"):
            checkpointer = pyshmckpt.Checkpointer(
                root, keep_last=2, overlap=way.endswith("-overlap")
            )
            if warm:
                checkpointer.wait_for_writer()
            persist = "memory" not in way
            self.start: Callable[[Any], Any] = lambda state: checkpointer.save(
                state, persist=persist
            )
            self.close = checkpointer.close
        elif way == "torch_checkpointing":
            from torch_checkpointing import CheckpointManager
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

            storage = LocalFileSystemStorageConfig(use_direct_io=False)
            manager = CheckpointManager(CheckpointManager.Config(storage_config=storage))
            self.start = self._torch_checkpointing
            self.manager = manager
            self.guard = manager.lock
            self.close = manager.close
        elif way == "torch-exp":
            self.start, self.close = _torch_experimental(root, warm)
        elif way == "dcp":
            self.start = self._dcp
        else:
            raise SystemExit(f"unknown way {way}")

    def _torch_checkpointing(self, state: Any) -> Any:
        self.count += 1
        return self.manager.save(str(self.root / f"tc-{self.count}"), state)

    def _dcp(self, state: Any) -> Any:
        self.count += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled" and the like
            return dcp.async_save(state, checkpoint_id=str(self.root / f"dcp-{self.count}"))


def _torch_experimental(root: Path, warm: bool) -> tuple[Callable[[Any], Any], Callable[[], None]]:
    """torch's transport as bench/transports.py builds it, with torch's own CheckpointWriter."""
    writer_class = _torch_private.experimental("checkpoint_writer", "CheckpointWriter")
    writer_config = _torch_private.experimental("checkpoint_writer", "CheckpointWriterConfig")
    process = transports.torch_process(writer_class, {"config": writer_config()}, started=warm)
    stager = transports.torch_stager()
    count = [0]

    def start(state: Any) -> Any:
        count[0] += 1
        staged = stager.stage(state)
        return process.write(staged, str(root / f"exp-{count[0]}"))

    def close() -> None:
        process.close()
        stager.close()

    return start, close


def _wait(pending: Any) -> None:
    if pending is None:
        return
    getattr(pending, "upload_completion", pending).result(timeout=600)


def train(args: argparse.Namespace, way: str | None, every: int, root: Path) -> float:
    """Wall seconds of --steps training steps, checkpointing every `every` steps with `way`."""
    config = gpt.GPTConfig(
        vocab=args.vocab, seq_len=args.seq_len, width=args.width, layers=args.layers, heads=8
    )
    torch.manual_seed(0)
    model = gpt.GPT(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saver = Saver(way, root, args.start == "warm") if way is not None else None
    pending = None
    try:
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            inputs, targets = gpt.batch(
                step, args.batch_size, config.seq_len, config.vocab, device=args.device
            )
            loss = model.loss(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if saver is None:
                optimizer.step()
            else:
                with saver.guard():
                    optimizer.step()
            if saver is not None and step % every == 0:
                _wait(pending)  # one checkpoint in flight at a time
                state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
                pending = saver.start(state)
        _wait(pending)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started
    finally:
        if saver is not None:
            saver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--start", choices=("warm", "cold"), default="warm",
        help="writer processes ready before the timed steps (warm) or starting with them (cold)",
    )  # fmt: skip
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    args = parser.parse_args()
    runs: dict[tuple[str, int], list[float]] = {}
    ways = args.ways
    cases = [(None, 0)] + [(way, n) for n in args.every for way in ways]
    for repeat in range(args.repeats):
        shift = repeat % len(cases)
        for way, every in cases[shift:] + cases[:shift]:
            root = Path(tempfile.mkdtemp(prefix="pyshmckpt-overhead-"))
            try:
                seconds = train(args, way, every, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            runs.setdefault((way or "none", every), []).append(seconds)
            print(
                f"repeat {repeat} {way or 'none':10s} every {every:3d}: {seconds:.2f} s", flush=True
            )
    base = statistics.median(runs[("none", 0)])
    table = {
        f"{way}@{n}": statistics.median(runs[(way, n)]) / base - 1
        for way in ways
        for n in args.every
    }
    print(f"\nno checkpoints: {base:.2f} s for {args.steps} steps (median of {args.repeats})")
    print(f"writer processes: {args.start} start")
    widths = [max(10, len(way)) for way in ways]
    print(
        f"{'every N':>8s} "
        + " ".join(f"{way:>{w}s}" for way, w in zip(ways, widths, strict=True))
        + "  ours / best other"
    )
    for n in args.every:
        slow = [table[f"{way}@{n}"] for way in ways]
        others = [table[f"{way}@{n}"] for way in OTHERS if way in ways]
        best_other = min(others, default=float("nan"))
        ours = table.get(f"pyshmckpt@{n}", float("nan"))
        ratio = ours / best_other if best_other > 0 else float("nan")
        cells = [f"{s * 100:{w - 1}.1f}%" for s, w in zip(slow, widths, strict=True)]
        print(f"{n:8d} " + " ".join(cells) + f"  {ratio:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"base_seconds": base, "slowdown": table, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
        }}, indent=1))  # fmt: skip
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for way in ways:
            ax.plot(args.every, [100 * table[f"{way}@{n}"] for n in args.every], "o-", label=way)
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint every N steps")
        ax.set_ylabel("training slowdown (%)")
        ax.set_title(
            f"GPT width {args.width}, {args.layers} layers, {args.device}, {args.start} start"
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
