"""Resume training after a crash from the newest checkpoint.

Each run opens the checkpoint directory, restores the newest checkpoint if there is one, and
trains up to --steps, saving every --save-every steps. With --crash-at-step K the run kills
itself (SIGKILL: no cleanup, like the OOM killer or a lost node) right after step K; a save
staged before that is still written and committed by pyshmckpt's writer process, which
outlives the trainer. Run it again without the option and it resumes from there:

    python examples/restore_after_crash.py --output checkpoints/crash --crash-at-step 20
    python examples/restore_after_crash.py --output checkpoints/crash
"""

import argparse
import os
import signal
from pathlib import Path

import torch

import pyshmckpt


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    # The batch depends on the step alone, so a resumed run sees the data it would have seen.
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
    parser.add_argument("--output", type=Path, default=Path("checkpoints/crash"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--crash-at-step", type=int, default=None, metavar="K")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Opening the root also removes what an interrupted save left behind (never a checkpoint
    # that a writer of the crashed run is still finishing).
    with pyshmckpt.Checkpointer(args.output, keep_last=args.keep_last) as checkpointer:
        # The newest checkpoint, from memory when the crashed run's writer still holds it, else
        # from disk; every checksum verified. None on a first start.
        state = checkpointer.load(missing_ok=True)
        if state is None:
            step = 0
            print(f"no checkpoint in {args.output}: training from step 0")
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
            print(f"resumed from step {step}")

        while step < args.steps:
            step += 1
            loss = train_step(model, optimizer, step)
            if step % args.save_every == 0 or step == args.steps:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                checkpointer.save({**state, "step": step}, name=f"step-{step:06d}")
                # save() has returned: this checkpoint will be committed even if we die now.
                print(f"step {step:4d}  loss {loss:.5f}  checkpoint staged", flush=True)
            if step == args.crash_at_step:
                print(f"crashing at step {step} (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    print(f"finished at step {step}; newest checkpoint: {checkpointer.latest()}")


if __name__ == "__main__":
    main()
