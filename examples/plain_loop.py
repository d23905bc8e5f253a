"""A plain PyTorch training loop checkpointed asynchronously with pyshmckpt.Checkpointer.

Trains a small MLP with AdamW, saving model, optimizer and step every few steps (keeping the
newest few checkpoints), then restores the newest checkpoint into a fresh model and optimizer and
continues training from it.

    python examples/plain_loop.py --output checkpoints/plain
"""

import argparse
import time
from pathlib import Path

import torch

import pyshmckpt


def build(seed: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    # The batch depends on the step alone, so a restored run sees the same data.
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=g)
    y = x.sin().sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("checkpoints/plain"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--more-steps", type=int, default=5, help="steps after restoring")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    model, optimizer = build(seed=0, width=args.width)

    # The writer process starts in the background; the first save does not wait for it.
    with pyshmckpt.Checkpointer(args.output, keep_last=args.keep_last) as checkpointer:
        for step in range(1, args.steps + 1):
            loss = train_step(model, optimizer, step)
            if step % args.save_every == 0 or step == args.steps:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                started = time.perf_counter()
                # Returns once the state is copied into shared memory: training goes on at once,
                # and the writer process makes it durable in the background.
                checkpointer.save({**state, "step": step}, name=f"step-{step:06d}")
                blocked = (time.perf_counter() - started) * 1000
                print(f"step {step:4d}  loss {loss:.5f}  checkpoint staged in {blocked:.1f} ms")
        checkpointer.wait()  # every save durable (or the first failure raised)
        kept = sorted(p.name for p in args.output.iterdir() if p.name.startswith("step-"))
        print(f"durable; kept (keep_last={args.keep_last}): {', '.join(kept)}")
        print(f"latest: {checkpointer.latest()}")

    # Restore: a fresh model and optimizer (another seed), loaded from the newest checkpoint.
    state = pyshmckpt.load(args.output)  # a root loads its `latest`; every checksum verified
    restored, restored_optimizer = build(seed=1, width=args.width)
    restored.load_state_dict(state["model"])
    restored_optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), restored.parameters(), strict=True)
    )
    print(f"restored step {start}: parameters equal to the trained model's: {same}")
    if not same:
        raise SystemExit("the restored parameters differ from the ones saved")

    # Continue both; the restored run takes exactly the steps the original would.
    for step in range(start + 1, start + 1 + args.more_steps):
        original_loss = train_step(model, optimizer, step)
        restored_loss = train_step(restored, restored_optimizer, step)
        print(f"step {step:4d}  loss {restored_loss:.5f}  (uninterrupted: {original_loss:.5f})")
        if restored_loss != original_loss:
            raise SystemExit("the restored run diverged from the uninterrupted one")


if __name__ == "__main__":
    main()
