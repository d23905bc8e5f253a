"""DeepSpeed training with checkpoints written asynchronously by pyshmckpt's checkpoint engine.

``engine.save_checkpoint`` returns once each rank's files are staged in shared memory; a writer
process per rank writes them at DeepSpeed's own paths, and DeepSpeed's ``latest`` names a tag
only once every rank's files are durable. The script trains with ZeRO stage 1, saving every few
steps, then a fresh engine (other initial weights) resumes with ``engine.load_checkpoint`` and
continues exactly as the trained one does. Under a launcher (torchrun or deepspeed); on the CPU:

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed_train.py \\
        --output checkpoints/deepspeed
"""

import argparse
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

import deepspeed
import deepspeed.ops
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from pyshmckpt.integrations.deepspeed import use_pyshmckpt

ON_CPU = get_accelerator().device_name() == "cpu"


def build(seed: int, stage: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    use_pyshmckpt(engine)  # on every rank, right after initialize
    return engine


def train_step(engine: deepspeed.DeepSpeedEngine) -> float:
    # Each rank's batch depends on the step and the rank alone: a resumed run sees the same data.
    g = torch.Generator().manual_seed(1000 * engine.global_steps + dist.get_rank())
    x = torch.randn(8, 16, generator=g)
    y = x.sin().sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
    engine.backward(loss)
    engine.step()
    return loss.item()


def parameters(engine: deepspeed.DeepSpeedEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("checkpoints/deepspeed"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--zero-stage", type=int, default=1)
    args = parser.parse_args()

    if ON_CPU:
        # DeepSpeed's CPU backend would first compile a shared-memory all-reduce op (half a
        # minute with g++); gloo does without it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if ON_CPU else None)
    rank = dist.get_rank()

    engine = build(seed=0, stage=args.zero_stage)
    for _ in range(args.steps):
        loss = train_step(engine)
        step = engine.global_steps
        if step % args.save_every == 0 or step == args.steps:
            # Returns once this rank's files are staged; written in the background.
            engine.save_checkpoint(str(args.output), tag=f"step{step}")
            if rank == 0:
                print(f"step {step:4d}  loss {loss:.5f}  saved tag step{step}")
        elif rank == 0:
            print(f"step {step:4d}  loss {loss:.5f}")
    # Every rank's files durable and `latest` moved (a collective call): needed before loading
    # a tag just saved; a run that simply ended would not need it.
    engine.checkpoint_engine.wait()
    if rank == 0:
        print(f"latest: {(args.output / 'latest').read_text()}")

    # Resume: a fresh engine loads the tag `latest` names.
    resumed = build(seed=1, stage=args.zero_stage)
    path, _ = resumed.load_checkpoint(str(args.output))
    if rank == 0:
        print(f"resumed from step {resumed.global_steps} ({path})")
    same = all(map(torch.equal, parameters(engine), parameters(resumed)))
    loss, resumed_loss = train_step(engine), train_step(resumed)
    if rank == 0:
        print(f"parameters equal to the trained engine's: {same}")
        print(f"next step: loss {resumed_loss:.5f} (the trained engine: {loss:.5f})")
    engine.destroy()  # finishes pending writes and stops the writer process
    resumed.destroy()
    dist.barrier()
    dist.destroy_process_group()
    if not same or resumed_loss != loss:
        raise SystemExit(f"rank {rank}: the resumed engine differs from the one saved")


if __name__ == "__main__":
    main()
