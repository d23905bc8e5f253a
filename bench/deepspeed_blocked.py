"""DeepSpeed: how long the training loop is blocked per checkpoint, ShmCheckpointEngine against
DeepSpeed's default TorchCheckpointEngine.

    python bench/deepspeed_blocked.py [--width 768 --layers 4 --stage 1 --rounds 5 --dir DIR]

One process, DeepSpeed on CPU (gloo), the demo's GPT with AdamW under ZeRO stage --stage; one
engine, whose checkpoint engine is switched between the two ways, so both save the same run's
state (stage 1: ``mp_rank_00_model_states.pt`` and ``zero_pp_rank_0_mp_rank_00_optim_states.pt``).
Per round, in alternating order, each way saves once with ``engine.save_checkpoint``, then
training goes on for at least 2 steps, and until ``latest`` names the new tag:

  torch       TorchCheckpointEngine: torch.save inside save_checkpoint, `latest` written at once
  pyshmckpt   ShmCheckpointEngine: staged inside save_checkpoint, written by the writer
              process; DeepSpeed commits it (and writes `latest`) at a later step

"blocked" = the save_checkpoint call + the time steps spent in DeepSpeed's commit of a decoupled
engine (``_commit_decoupled_checkpoint``; zero for torch). "durable" = from the call until the
files are on disk and `latest` names the tag: for torch its return plus an fsync of its files
(TorchCheckpointEngine does not fsync); for pyshmckpt until a step's commit moved `latest` (so
it includes up to a step). "step" = the median step while the write runs (pyshmckpt's writer
shares the CPU) or after it (torch). Each save is durable, and the page cache flushed, before
the next save starts. Medians over --rounds rounds after a warm-up round (the first saves start
the writer process and size its shared memory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder  # noqa: E402

from pyshmckpt.cli.demo.gpt import GPT, GPTConfig, batch, parameter_count  # noqa: E402
from pyshmckpt.integrations.deepspeed import use_pyshmckpt  # noqa: E402

from blocked_table import fsync_tree, print_blocked  # noqa: E402

WAYS = ("torch", "pyshmckpt")
MIN_STEPS = 2  # steps after each save
BOUND = 120.0  # seconds a save may take to become durable


class LossModel(torch.nn.Module):
    """The GPT with its loss as forward(), as a DeepSpeed engine trains it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss(inputs, targets)


def init_single_process() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    # DeepSpeed's CPU backend compiles a shared-memory all-reduce op (g++, half a minute) when it
    # initializes; one process needs no all-reduce.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(dist_backend="gloo")


def file_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def latest(save_dir: Path) -> str | None:
    try:
        return (save_dir / "latest").read_text()
    except FileNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stage", type=int, default=1, choices=(0, 1))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (a temp dir)")
    args = parser.parse_args()

    init_single_process()
    config = GPTConfig(vocab=4096, seq_len=16, width=args.width, layers=args.layers, heads=8)
    torch.manual_seed(0)
    model = LossModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # DeepSpeed's would be compiled
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    checkpoint_engines: dict[str, Any] = {"torch": engine.checkpoint_engine}
    checkpoint_engines["pyshmckpt"] = use_pyshmckpt(engine)

    # Time the steps spend committing a decoupled engine's checkpoint (DeepSpeed's own method).
    committing: list[float] = []
    commit = engine._commit_decoupled_checkpoint

    def timed_commit() -> None:
        started = time.perf_counter()
        try:
            commit()
        finally:
            committing.append(time.perf_counter() - started)

    engine._commit_decoupled_checkpoint = timed_commit

    def step() -> float:
        started = time.perf_counter()
        inputs, targets = batch(engine.global_steps, 2, config.seq_len, config.vocab)
        engine.backward(engine(inputs, targets))
        engine.step()
        return time.perf_counter() - started

    step()  # AdamW's state exists
    blocked: dict[str, list[float]] = {way: [] for way in WAYS}
    durable: dict[str, list[float]] = {way: [] for way in WAYS}
    steps: dict[str, list[float]] = {way: [] for way in WAYS}
    size = 0
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="deepspeed-bench-") as scratch:
        root = Path(scratch)
        for round_number in range(args.rounds + 1):
            order = WAYS if round_number % 2 == 0 else WAYS[::-1]
            for way in order:
                engine.checkpoint_engine = checkpoint_engines[way]
                save_dir, tag = root / way, f"round{round_number}"
                committing.clear()
                start = time.perf_counter()
                engine.save_checkpoint(str(save_dir), tag=tag)
                saved = time.perf_counter() - start
                if way == "torch":
                    fsync_tree(save_dir / tag)
                    done: float | None = time.perf_counter() - start
                else:
                    done = None
                seconds = []
                while len(seconds) < MIN_STEPS or done is None:
                    seconds.append(step())
                    if done is None and latest(save_dir) == tag:
                        done = time.perf_counter() - start
                    if time.perf_counter() - start > BOUND:
                        raise SystemExit(f"{way}: {tag} not durable after {BOUND:g} s")
                if round_number > 0:
                    blocked[way].append(saved + sum(committing))
                    durable[way].append(done)
                    steps[way].append(statistics.median(seconds))
                size = file_bytes(save_dir / tag)
                shutil.rmtree(save_dir / tag)
                os.sync()  # nothing of this save is written back during the next one
        engine.checkpoint_engine = checkpoint_engines["pyshmckpt"]
        engine.destroy()

    print(
        f"GPT width {args.width}, {args.layers} layers ({parameter_count(model) / 1e6:.1f}M "
        f"parameters), AdamW, ZeRO stage {args.stage}: {size / 2**20:.0f} MiB of checkpoint "
        f"files per tag; {args.rounds} rounds after a warm-up round"
    )
    print_blocked(list(WAYS), blocked, {"durable (s)": durable, "step (s)": steps})
    ratio = statistics.median(blocked["torch"]) / statistics.median(blocked["pyshmckpt"])
    print(f"\ntraining blocked per checkpoint: {ratio:.1f}x less with ShmCheckpointEngine")


if __name__ == "__main__":
    main()
