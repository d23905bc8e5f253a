"""How long a Lightning training loop is blocked per checkpoint: ShmCheckpointIO against Lightning's
default (TorchCheckpointIO: torch.save on the training thread) and its AsyncCheckpointIO (clone
on the training thread, torch.save in a thread), same model, same run, interleaved.

    python bench/lightning_blocked.py --width 2048 --layers 5 --steps 20 --every 5 --repeats 3

"Blocked" is the time ModelCheckpoint's batch-end hook takes on the training thread when it saves
(Lightning collecting the state dict, the CheckpointIO's save_checkpoint, and its
remove_checkpoint of the checkpoint that left the top k): the first save of a run and the
median of the others. "fit" is the wall time of the whole run, the final flush of pending writes
included, against the same run without checkpoints.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from pyshmckpt.integrations.lightning import ShmCheckpointIO


class Net(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        (x,) = batch
        return self.body(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TimedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that records how long each of its checkpoints blocks the training
    thread: its whole batch-end hook (Lightning collecting the state, the CheckpointIO's save,
    and its removal of the checkpoint that fell out of the top k)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocked: list[float] = []
        self._saves = 0

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        self._saves += 1
        super()._save_checkpoint(trainer, filepath)

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        saves, start = self._saves, time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        if self._saves > saves:
            self.blocked.append(time.perf_counter() - start)


VARIANTS = {  # each: the checkpoint directory -> the Trainer's plugins
    "pyshmckpt ShmCheckpointIO": lambda root: [ShmCheckpointIO()],
    "ShmCheckpointIO(dirpath)": lambda root: [ShmCheckpointIO(root)],
    "Lightning default (torch.save)": lambda root: [],
    "Lightning AsyncCheckpointIO": lambda root: [AsyncCheckpointIO()],
}


def fit(
    args: argparse.Namespace, root: Path, make_plugins: Callable[[Path], list[Any]] | None
) -> tuple[float, list[float]]:
    """Train from seed 0 with the plugins `make_plugins` builds (None: no checkpoints); returns
    the wall time from building them to the end of the fit, and the blocked times."""
    start = time.perf_counter()
    plugins = None if make_plugins is None else make_plugins(root)
    torch.manual_seed(0)
    model = Net(args.width, args.layers)
    data = DataLoader(TensorDataset(torch.randn(args.steps * 8, args.width)), batch_size=8)
    callback = TimedCheckpoint(dirpath=root, every_n_train_steps=args.every, save_top_k=1)
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=plugins is not None,
        callbacks=[callback] if plugins is not None else [], plugins=plugins or [],
    )  # fmt: skip
    trainer.fit(model, data)
    return time.perf_counter() - start, callback.blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (a tmp dir)")
    args = parser.parse_args()
    state = args.layers * (args.width * args.width + args.width) * 4 * 3  # params + AdamW moments
    print(f"model + optimizer state: {state / 2**20:.0f} MiB; {args.steps} steps, a checkpoint "
          f"every {args.every}; {args.repeats} interleaved repeats")  # fmt: skip
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="lightning-bench-"))
    fits: dict[str, list[float]] = {"no checkpoints": []}
    first: dict[str, list[float]] = {}
    steady: dict[str, list[float]] = {}
    try:
        for repeat in range(args.repeats):
            fits["no checkpoints"].append(fit(args, base / "none", None)[0])
            for name, plugins in VARIANTS.items():
                root = base / f"{repeat}-{len(first.get(name, []))}-{name.split()[0]}"
                seconds, blocked = fit(args, root, plugins)
                fits.setdefault(name, []).append(seconds)
                first.setdefault(name, []).append(blocked[0])
                steady.setdefault(name, []).extend(blocked[1:])
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    baseline = statistics.median(fits["no checkpoints"])
    print(f"\n{'':32} {'blocked/save':>13} {'first save':>11} {'fit':>8} {'vs none':>8}")
    print(f"{'no checkpoints':32} {'':>13} {'':>11} {baseline:7.2f}s")
    ours = statistics.median(steady["pyshmckpt ShmCheckpointIO"])
    for name in VARIANTS:
        block, fit_s = statistics.median(steady[name]), statistics.median(fits[name])
        print(
            f"{name:32} {block * 1e3:10.1f} ms {statistics.median(first[name]) * 1e3:8.0f} ms "
            f"{fit_s:7.2f}s {100 * (fit_s / baseline - 1):+7.1f}%   ({block / ours:.1f}x ours)"
        )


if __name__ == "__main__":
    main()
