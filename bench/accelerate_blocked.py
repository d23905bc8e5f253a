"""Accelerate: how long the training loop is blocked per checkpoint, ShmStateSaver against
Accelerate's own ``accelerator.save_state``.

    python bench/accelerate_blocked.py [--width 768 --layers 4 --rounds 5 --dir DIR]

The demo's GPT with AdamW, prepared by one ``Accelerator(cpu=True)``; one training step before
every save. Per round, in alternating order, each way saves the same run's state once:
  accelerate   accelerator.save_state(dir): model.safetensors + optimizer.bin (torch.save) + rest
  pyshmckpt    ShmStateSaver(accelerator).save_state(dir): staged, written by the writer process
"blocked" is the time from the call to its return (what training waits for). "durable" is until
the files are on disk: for pyshmckpt until the save's future resolves (its writer fsyncs), for
Accelerate its return plus an fsync of the files it wrote (it does not fsync). Each save finishes
before the next starts, so neither competes with the other's writing. Figures are medians over
--rounds rounds, after one warm-up round (first saves allocate and start processes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from pyshmckpt.cli.demo.gpt import GPT, GPTConfig, batch, parameter_count
from pyshmckpt.integrations.accelerate import ShmStateSaver

from blocked_table import fsync_tree, print_blocked

WAYS = ("accelerate", "pyshmckpt")


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights once
    params = sum(t.numel() * t.element_size() for t in unique.values())
    moments = sum(
        t.numel() * t.element_size()
        for per_param in optimizer.state_dict()["state"].values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )
    return params, moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (a temp dir)")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    config = GPTConfig(vocab=4096, seq_len=16, width=args.width, layers=args.layers, heads=8)
    torch.manual_seed(0)
    model = GPT(config)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step_number = 0

    def train_step() -> None:
        nonlocal step_number
        inputs, targets = batch(step_number, 2, config.seq_len, config.vocab)
        accelerator.backward(model.loss(inputs, targets))
        optimizer.step()
        optimizer.zero_grad()
        step_number += 1

    train_step()  # AdamW's state exists
    params, moments = state_bytes(model, optimizer)
    print(
        f"GPT width {args.width}, {args.layers} layers: {parameter_count(model) / 1e6:.1f}M "
        f"parameters; state {(params + moments) / 2**20:.0f} MiB (model {params / 2**20:.0f} MiB"
        f" + AdamW {moments / 2**20:.0f} MiB); {args.rounds} rounds after a warm-up round"
    )

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="accelerate-bench-") as scratch:
        root = Path(scratch)
        blocked: dict[str, list[float]] = {way: [] for way in WAYS}
        durable: dict[str, list[float]] = {way: [] for way in WAYS}
        with ShmStateSaver(accelerator) as saver:
            for round_number in range(args.rounds + 1):
                order = WAYS if round_number % 2 == 0 else WAYS[::-1]
                for way in order:
                    train_step()
                    target = root / way / f"round{round_number}"
                    start = time.perf_counter()
                    if way == "accelerate":
                        accelerator.save_state(target)
                        returned = time.perf_counter()
                        fsync_tree(target)
                    else:
                        future = saver.save_state(target)
                        returned = time.perf_counter()
                        future.result()
                    done = time.perf_counter()
                    if round_number > 0:
                        blocked[way].append(returned - start)
                        durable[way].append(done - start)
                    shutil.rmtree(target)

    print_blocked(list(WAYS), blocked, {"durable (s)": durable})
    ratio = statistics.median(blocked["accelerate"]) / statistics.median(blocked["pyshmckpt"])
    print(f"\ntraining blocked per checkpoint: {ratio:.1f}x less with ShmStateSaver")


if __name__ == "__main__":
    main()
