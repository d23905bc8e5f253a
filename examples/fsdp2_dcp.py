"""FSDP2 training checkpointed with DCP's async_save, staged by pyshmckpt.ShmStager.

Each rank holds its shards of a small MLP (``fully_shard``); every few steps
``torch.distributed.checkpoint.async_save`` saves the sharded model and optimizer, with pyshmckpt
staging the shards into shared memory so that training waits for the copy only. At the end a
freshly built model (other initial weights) loads the newest checkpoint with ``dcp.load`` and
continues exactly as the trained one does. On the CPU with gloo, on GPUs with NCCL:

    torchrun --nproc-per-node 2 examples/fsdp2_dcp.py --output checkpoints/fsdp2
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import pyshmckpt

GLOBAL_BATCH = 32


def build(
    seed: int, width: int, device: torch.device, mesh: DeviceMesh
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters are now DTensors, each rank holding a shard
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, device: torch.device
) -> float:
    """One step on this rank's part of the step's global batch; returns the mean loss."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = x.cos().sum(dim=1, keepdim=True)
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    part = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    loss = torch.nn.functional.mse_loss(model(x[part].to(device)), y[part].to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("checkpoints/fsdp2"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # DCP's collectives for checkpoints run on a gloo group of their own (staged shards are in
    # host memory), apart from training's.
    checkpoint_group = dist.new_group(backend="gloo")

    model, optimizer = build(seed=0, width=args.width, device=device, mesh=mesh)
    stager = pyshmckpt.ShmStager()  # shared-memory slots, sized by the first save
    pending = None
    last_saved = None
    for step in range(1, args.steps + 1):
        loss = train_step(model, optimizer, step, device)
        if step % args.save_every == 0 or step == args.steps:
            if pending is not None:
                pending.result()  # one save in flight at a time
            started = time.perf_counter()
            model_state, optimizer_state = get_state_dict(model, optimizer)
            last_saved = args.output / f"step-{step:06d}"
            pending = dcp.async_save(
                {"model": model_state, "optim": optimizer_state},
                checkpoint_id=last_saved,
                async_stager=stager,
                process_group=checkpoint_group,
            )
            blocked = (time.perf_counter() - started) * 1000
            if rank == 0:
                print(f"step {step:4d}  loss {loss:.5f}  async_save returned in {blocked:.1f} ms")
        elif rank == 0:
            print(f"step {step:4d}  loss {loss:.5f}")
    if pending is not None:
        pending.result()
    stager.close()

    # Load the newest checkpoint into a freshly built model and optimizer (other initial weights).
    restored, restored_optimizer = build(seed=1, width=args.width, device=device, mesh=mesh)
    model_state, optimizer_state = get_state_dict(restored, restored_optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=last_saved, process_group=checkpoint_group)
    set_state_dict(
        restored,
        restored_optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    same = all(  # full_tensor() gathers each parameter's shards: every rank takes part
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), restored.parameters(), strict=True)
    )
    loss = train_step(model, optimizer, args.steps + 1, device)
    restored_loss = train_step(restored, restored_optimizer, args.steps + 1, device)
    if rank == 0:
        print(f"loaded {last_saved} on {dist.get_world_size()} ranks")
        print(f"parameters equal to the trained model's: {same}")
        print(f"next step: loss {restored_loss:.5f} (the trained model: {loss:.5f})")
    dist.barrier()
    dist.destroy_process_group()
    if not same or restored_loss != loss:
        raise SystemExit(f"rank {rank}: the loaded model differs from the one saved")


if __name__ == "__main__":
    main()
