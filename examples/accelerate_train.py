"""Accelerate training with checkpoints written asynchronously by pyshmckpt's ShmStateSaver.

``ShmStateSaver(accelerator).save_state()`` saves what ``accelerator.save_state()`` saves (models,
optimizers, schedulers, RNG states, ...) but returns once the state is staged in shared memory;
a writer process makes it durable in the background. With automatic checkpoint naming and
``total_limit`` it keeps the newest checkpoints under ``<output>/checkpoints/``. The script trains
a few epochs, saving after each, then a fresh set of objects resumes with ``load_state()`` and
continues exactly as the trained ones do. One process, or several with ``accelerate launch``:

    python examples/accelerate_train.py --output checkpoints/accelerate
"""

import argparse
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

from pyshmckpt.integrations.accelerate import ShmStateSaver


def build(seed: int, output: Path, keep: int) -> tuple[Accelerator, Any, Any, Any, Any]:
    project = ProjectConfiguration(
        project_dir=str(output), automatic_checkpoint_naming=True, total_limit=keep
    )
    accelerator = Accelerator(project_config=project)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.sin().sum(dim=1, keepdim=True)), batch_size=32)
    return accelerator, *accelerator.prepare(model, optimizer, scheduler, data)


def train_epoch(
    accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, data: Any
) -> float:
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("checkpoints/accelerate"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept (total_limit)")
    args = parser.parse_args()

    accelerator, model, optimizer, scheduler, data = build(0, args.output, args.keep)
    saver = ShmStateSaver(accelerator)  # after prepare(); its writer process starts now
    for epoch in range(args.epochs):
        loss = train_epoch(accelerator, model, optimizer, scheduler, data)
        saver.save_state()  # returns once staged: checkpoints/checkpoint_<i>
        accelerator.print(f"epoch {epoch}  loss {loss:.5f}  checkpoint staged")
    saver.close()  # every save durable (or the first failure raised); stops the writer
    kept = sorted(p.name for p in (args.output / "checkpoints").iterdir())
    accelerator.print(f"kept (total_limit={args.keep}): {', '.join(kept)}")

    # Resume: fresh objects (other initial weights) restored from the newest checkpoint.
    resumed, *objects = build(1, args.output, args.keep)
    resumed_saver = ShmStateSaver(resumed)
    loaded = resumed_saver.load_state()  # no argument: the newest checkpoint
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), objects[0].parameters(), strict=True)
    )
    accelerator.print(
        f"resumed from {loaded.name}: parameters equal to the trained model's: {same}"
    )
    loss = train_epoch(accelerator, model, optimizer, scheduler, data)
    resumed_loss = train_epoch(resumed, *objects)
    accelerator.print(f"next epoch: loss {resumed_loss:.5f} (the trained model: {loss:.5f})")
    resumed_saver.save_state()  # numbering goes on after the loaded checkpoint
    resumed_saver.close()
    kept = sorted(p.name for p in (args.output / "checkpoints").iterdir())
    accelerator.print(f"kept: {', '.join(kept)}")
    if not same or resumed_loss != loss:
        raise SystemExit("the resumed run differs from the trained one")


if __name__ == "__main__":
    main()
