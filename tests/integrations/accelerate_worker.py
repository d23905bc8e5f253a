"""Training with Accelerate, saved through ShmStateSaver while training goes on, loaded into fresh
objects and resumed: the checks of test_accelerate.py, run in its process (one process) and on 2
processes under torchrun (DDP over gloo): ``python accelerate_worker.py DIRECTORY [URL]`` (with
a URL, the checkpoint goes to object storage there).
"""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from pyshmckpt.integrations.accelerate import ShmStateSaver
from pyshmckpt.storage import object_store
from pyshmckpt.storage.object_store import ObjectPath

from helpers import SAVE_TIMEOUT, assert_same_tree, bounded_config, end_distributed

STEPS = 2  # training steps before the save, and again after it


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


@dataclass
class Run:
    accelerator: Accelerator
    model: Any
    optimizer: Any
    scheduler: Any
    counter: Counter


def build(seed: int, **accelerator_options: Any) -> Run:
    """A prepared model (with dropout: the RNG matters), AdamW, a scheduler and a custom object,
    initialised from `seed`; each process's RNGs then seeded apart."""
    accelerator = Accelerator(cpu=True, **accelerator_options)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    rank = accelerator.process_index
    torch.manual_seed(seed * 100 + rank)
    random.seed(seed * 100 + rank)
    np.random.seed(seed * 100 + rank)
    return Run(accelerator, model, optimizer, scheduler, counter)


def train(run: Run, steps: int = STEPS) -> None:
    for _ in range(steps):
        with run.accelerator.accumulate(run.model):
            loss = run.model(torch.randn(4, 6)).pow(2).mean()
            run.accelerator.backward(loss)
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad()
        run.counter.count += 1


def snapshot(run: Run) -> dict[str, Any]:
    """Everything save_state saves, copied."""
    return copy.deepcopy(
        {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "count": run.counter.count,
            "step": run.accelerator.step,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
    ) | {
        "numpy_rng": [
            torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v
            for v in np.random.get_state()
        ]
    }


def stored_files(path: Path | ObjectPath) -> list[str]:
    """The names of the files (or objects) of a checkpoint."""
    if isinstance(path, Path):
        return sorted(p.name for p in path.iterdir())
    return sorted(entry["Key"].rpartition("/")[2] for entry in object_store.listing(path))


def save_load_resume(directory: Path | ObjectPath) -> None:
    """Save after STEPS steps, train STEPS more (the uninterrupted run), then load the checkpoint
    into fresh objects: bitwise what was saved, and STEPS more steps end bitwise alike."""
    run = build(seed=1)
    train(run)
    saved = snapshot(run)
    path = directory / "ck"
    with ShmStateSaver(run.accelerator, config=bounded_config()) as saver:
        future = saver.save_state(path)
        train(run)  # changes everything the save is writing
        if future.result(timeout=SAVE_TIMEOUT) != path:
            raise AssertionError(f"saved {future.result()}, not {path}")
    world = run.accelerator.num_processes
    files = stored_files(path)
    expected = sorted(
        ["commit.json"] + [f"rank{r}.{x}" for r in range(world) for x in ("json", "safetensors")]
    )
    if files != expected:
        raise AssertionError(f"{path} holds {files}, expected {expected}")
    uninterrupted = snapshot(run)

    fresh = build(seed=2)
    with ShmStateSaver(fresh.accelerator) as loader:
        if loader.load_state(path) != path:
            raise AssertionError("load_state returned another directory")
    assert_same_tree(saved, snapshot(fresh))
    train(fresh)
    assert_same_tree(uninterrupted, snapshot(fresh))


if __name__ == "__main__":
    where = Path(sys.argv[1]).resolve() if len(sys.argv) == 2 else object_store.parse(sys.argv[2])
    save_load_resume(where)
    end_distributed()
