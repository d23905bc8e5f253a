"""A small Lightning training run, shared by the Lightning tests and their DDP worker."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

STEPS_PER_EPOCH = 4


class Hyper:
    """Hyper-parameters as an object of the user's (not plain data: it travels pickled)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hyper) and other.width == self.width

    def __hash__(self) -> int:
        return hash(self.width)


class Regressor(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.05, hyper: Hyper | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def batches(world_size: int = 1) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * STEPS_PER_EPOCH * world_size, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)


def fit(
    dirpath: Path,
    plugins: list[Any],
    *,
    max_steps: int = 3 * STEPS_PER_EPOCH,
    ckpt_path: str | Path | None = None,
    **checkpointing: Any,
) -> tuple[Regressor, ModelCheckpoint, L.Trainer]:
    """Train from seed 0 (or resume from `ckpt_path`); returns the model, the callback and the
    trainer. Extra keywords go to ModelCheckpoint."""
    torch.manual_seed(0)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: DDP over its processes
    model = Regressor(hyper=Hyper(16))
    callback = ModelCheckpoint(dirpath=dirpath, **checkpointing)
    trainer = L.Trainer(
        max_steps=max_steps,
        callbacks=[callback],
        plugins=plugins,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        deterministic=True,
        strategy="ddp" if ranks > 1 else "auto",
        devices=ranks,
    )
    trainer.fit(model, batches(trainer.world_size), ckpt_path=ckpt_path)
    return model, callback, trainer


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def checkpoint_names(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.iterdir() if p.name.endswith(".ckpt"))
