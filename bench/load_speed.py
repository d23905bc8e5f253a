"""Load speed (issue 14): pyshmckpt.load against torch.load and safetensors, then every byte read.

    python bench/load_speed.py                       # warm page cache, 1 GiB / 8,192 tensors + GPT
    python bench/load_speed.py --cache cold          # drop the page cache before every load (root)
    python bench/load_speed.py --gib 0.25 --rounds 3 # smaller, quicker

Two states are saved once each way into --dir (a temporary directory by default): ``flat``
(--gib of float32 in --tensors equal tensors) and ``gpt`` (a small GPT with tied embeddings and
its AdamW state after one step, about 200 MiB). pyshmckpt's copy is written by a Checkpointer
(safetensors writer), torch's by ``torch.save``. Then, in every round, each reader runs once, in
an order rotated from round to round, and its time includes reading every byte of what it
returned (a CRC32C over each distinct storage, single-threaded, the same for every reader):

* ``ours``            pyshmckpt.load(verify=True) (the default mmap setting) + read
* ``ours_mmap``       pyshmckpt.load(verify=True, mmap=True) + read
* ``ours_nommap``     pyshmckpt.load(verify=True, mmap=False) + read
* ``torch``           torch.load(mmap=False, weights_only=True) + read
* ``torch_mmap``      torch.load(mmap=True, weights_only=True) + read
* ``safetensors``     safetensors.torch.load_file (pyshmckpt's file; flat state only) + read
* ``ours_into``       pyshmckpt.load(into=target, verify=True): the target filled in place
* ``torch_into``      torch.load + copy into the target (model.load_state_dict + the optimizer's
                      load_state_dict for gpt; tensor.copy_ per key for flat)

Prints the median of each and its speed relative to torch; --json writes them. With ``--cache
cold`` the page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``) before each load; with
``warm`` (default) every file was read once before the first round and stays cached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import pyshmckpt
from pyshmckpt.shm.native import crc32c

GIB = 1 << 30
MIB = 1 << 20


def make_flat(total: int, count: int) -> dict[str, torch.Tensor]:
    per = total // 4 // count
    g = torch.Generator().manual_seed(count)
    return {f"layers.{i}.weight": torch.rand(per, generator=g) for i in range(count)}


class GPT(torch.nn.Module):
    """A small GPT (pre-norm blocks, tied embeddings): the shape of a real model's state."""

    def __init__(self, vocab: int = 16384, d: int = 384, layers: int = 6, ctx: int = 512) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, 6, 4 * d, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_gpt(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 16384, (2, 64))).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def gpt_state(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


def tensors_of(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return out


def read_every_byte(obj: Any) -> int:
    """CRC32C of every distinct storage the tensors of `obj` use: each byte read once."""
    seen: set[int] = set()
    value = 0
    for t in tensors_of(obj):
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or not storage.nbytes():
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        value ^= crc32c(raw.numpy())
    return value


def nbytes_of(obj: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors_of(obj):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def copy_into(target: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, t in target.items():
            t.copy_(loaded[key])


def save_both(state: Any, directory: Path, name: str) -> tuple[Path, Path]:
    """Our checkpoint directory and torch's file for `state`."""
    root = directory / f"ours-{name}"
    with pyshmckpt.Checkpointer(root, keep_last=1) as checkpointer:
        ours = checkpointer.save(state, name).result()
    theirs = directory / f"{name}.pt"
    torch.save(state, theirs)
    return ours, theirs


def readers(kind: str, ours: Path, theirs: Path, flat_size: tuple[int, int]) -> dict[str, Any]:
    """name -> (setup() -> target or None, run(target) -> None)."""
    from safetensors.torch import load_file

    st_file = ours / "rank0.safetensors"

    def plain(fn: Callable[[], Any]) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        return (lambda: None), (lambda _t: read_every_byte(fn()))

    out: dict[str, Any] = {
        "ours": plain(lambda: pyshmckpt.load(ours, verify=True)),
        "ours_mmap": plain(lambda: pyshmckpt.load(ours, verify=True, mmap=True)),
        "ours_nommap": plain(lambda: pyshmckpt.load(ours, verify=True, mmap=False)),
        "torch": plain(lambda: torch.load(theirs, mmap=False, weights_only=True)),
        "torch_mmap": plain(lambda: torch.load(theirs, mmap=True, weights_only=True)),
    }
    if kind == "flat":
        out["safetensors"] = plain(lambda: load_file(st_file))

        def flat_target() -> dict[str, torch.Tensor]:
            total, count = flat_size
            return {f"layers.{i}.weight": torch.zeros(total // 4 // count) for i in range(count)}

        out["ours_into"] = (
            flat_target,
            lambda target: pyshmckpt.load(ours, verify=True, into=target),
        )
        out["torch_into"] = (
            flat_target,
            lambda target: copy_into(target, torch.load(theirs, mmap=False, weights_only=True)),
        )
    else:

        def gpt_target() -> tuple[GPT, torch.optim.Optimizer]:
            return make_gpt(seed=1)

        def ours_into(target: tuple[GPT, torch.optim.Optimizer]) -> None:
            pyshmckpt.load(ours, verify=True, into=gpt_state(*target))

        def torch_into(target: tuple[GPT, torch.optim.Optimizer]) -> None:
            loaded = torch.load(theirs, mmap=False, weights_only=True)
            target[0].load_state_dict(loaded["model"])
            target[1].load_state_dict(loaded["optimizer"])

        out["ours_into"] = (gpt_target, ours_into)
        out["torch_into"] = (gpt_target, torch_into)
    return out


def measure(
    kind: str, ours: Path, theirs: Path, rounds: int, cold: bool, flat_size: tuple[int, int]
) -> dict[str, list[float]]:
    table = readers(kind, ours, theirs, flat_size)
    names = list(table)
    for name in names:  # warm-up: imports, the page cache (warm), allocator pools
        setup, run = table[name]
        run(setup())
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            setup, run = table[name]
            target = setup()
            if cold:
                drop_caches()
            started = time.perf_counter()
            run(target)
            times[name].append(time.perf_counter() - started)
            del target
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="flat state size (default 1)")
    parser.add_argument("--tensors", type=int, default=8192, help="flat state tensors")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm")
    parser.add_argument("--states", nargs="+", default=["flat", "gpt"], choices=("flat", "gpt"))
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp)")
    parser.add_argument("--json", default=None, help="write the medians here")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="load-speed-", dir=args.dir))
    total = int(args.gib * GIB) // 4096 * 4096
    results: dict[str, Any] = {
        "cache": args.cache, "rounds": args.rounds, "threads": pyshmckpt.shm.native.copy_threads(),
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "states": {},
    }  # fmt: skip
    try:
        for kind in args.states:
            if kind == "flat":
                state: Any = make_flat(total, args.tensors)
            else:
                state = gpt_state(*make_gpt())
            size = nbytes_of(state)
            count = len(tensors_of(state))
            ours, theirs = save_both(state, directory, kind)
            del state
            times = measure(
                kind, ours, theirs, args.rounds, args.cache == "cold", (total, args.tensors)
            )
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            print(f"\n{kind}: {size / MIB:.0f} MiB in {count} tensors, {args.cache} cache, "
                  f"{args.rounds} rounds (median; speed relative to torch.load = torch / reader)")  # fmt: skip
            for name, median in medians.items():
                base = medians["torch_into"] if name.endswith("_into") else medians["torch"]
                print(f"  {name:12s} {median * 1e3:9.1f} ms  {size / GIB / median:6.2f} GiB/s  "
                      f"{base / median:5.2f}x  (min {min(times[name]) * 1e3:.1f})")  # fmt: skip
            results["states"][kind] = {"bytes": size, "tensors": count, "medians_s": medians,
                                       "times_s": times}  # fmt: skip
            shutil.rmtree(ours.parent, ignore_errors=True)
            theirs.unlink()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
