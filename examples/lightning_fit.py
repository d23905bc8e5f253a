"""Lightning training with checkpoints written asynchronously by pyshmckpt's ShmCheckpointIO.

ModelCheckpoint decides what is saved and kept, as usual; ShmCheckpointIO makes each save return
once the state is staged in shared memory, a writer process writing it in the background. The
script trains for --epochs epochs, saving at the end of each, then a new Trainer resumes from
``last.ckpt`` and trains on to twice as many epochs.

    python examples/lightning_fit.py --output checkpoints/lightning
"""

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import pyshmckpt
from pyshmckpt.integrations.lightning import ShmCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, width: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
        )

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g)  # 4 steps per epoch
    return DataLoader(TensorDataset(x, x.sin().sum(dim=1, keepdim=True)), batch_size=32)


def trainer(output: Path, epochs: int) -> L.Trainer:
    # At the end of each epoch: the 2 best by loss, and last.ckpt.
    checkpoint = ModelCheckpoint(dirpath=output, save_top_k=2, monitor="train_loss", save_last=True)
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        # Given the directory, the writer process starts now, before the first save.
        plugins=[ShmCheckpointIO(output)],
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("checkpoints/lightning"))
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Regressor()
    first = trainer(args.output, args.epochs)
    first.fit(model, data())  # teardown at the end of fit waits until every save is durable
    kept = sorted(p.name for p in args.output.iterdir() if p.name.endswith(".ckpt"))
    print(f"trained to step {first.global_step}; kept: {', '.join(kept)}")

    # Each .ckpt is a pyshmckpt checkpoint directory, readable without Lightning too.
    last = args.output / "last.ckpt"
    # allow_pickle: values Lightning saves that are not plain data (hyper-parameters of your own
    # types, callback state) are pickled; load only checkpoints you trust, as with torch.load.
    saved = pyshmckpt.load(last, allow_pickle=True)
    same = all(
        torch.equal(saved["state_dict"][key], value) for key, value in model.state_dict().items()
    )
    print(f"last.ckpt: global step {saved['global_step']}, equal to the trained model: {same}")

    # Resume in a new Trainer from last.ckpt and train on.
    resumed = Regressor(width=model.hparams.width)
    second = trainer(args.output, 2 * args.epochs)
    second.fit(resumed, data(), ckpt_path=last)
    print(f"resumed from step {saved['global_step']}, trained to step {second.global_step}")
    kept = sorted(p.name for p in args.output.iterdir() if p.name.endswith(".ckpt"))
    print(f"kept: {', '.join(kept)}")


if __name__ == "__main__":
    main()
