"""Sharded checkpoints under torchrun: what the training loop is blocked for, per checkpoint.

    torchrun --nproc-per-node 2 bench/sharded.py [--width 1024 --layers 4 --rounds 5]

An FSDP2 GPT with AdamW on every rank (gloo, CPU). Per round, in an interleaved order, each way
of checkpointing saves the same state once:
  dcp-default     dcp.async_save with its default stager (none given; THREAD executor)
  dcp-shm         dcp.async_save with pyshmckpt.ShmStager (THREAD executor)
  dcp-shm-process dcp.async_save with ShmStager and the PROCESS executor
  checkpointer    pyshmckpt.Checkpointer (safetensors per rank, our commit)
"blocked" is the time from the call to its return (what training waits for); "durable" until
the save's future resolves. Rank 0 prints medians over the rounds (the slowest rank's time in
each round) and, for the PROCESS executor's pickling of a staged state dict, the file
descriptors sent: one per slot with ShmStager, against one per tensor with DCP's stager.
Checkpoint collectives run on a gloo group of their own.
"""

from __future__ import annotations

import argparse
import multiprocessing.resource_sharer as resource_sharer
import shutil
import statistics
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import pyshmckpt
from pyshmckpt.cli.demo.gpt import GPT, GPTConfig, batch

WAYS = ("dcp-default", "dcp-shm", "dcp-shm-process", "checkpointer")


def build(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, GPTConfig]:
    config = GPTConfig(vocab=4096, seq_len=16, width=width, layers=layers, heads=8)
    torch.manual_seed(0)
    model = GPT(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = batch(0, 2, config.seq_len, config.vocab)
    model.loss(inputs, targets).backward()
    optimizer.step()  # AdamW's state exists
    optimizer.zero_grad()
    return model, optimizer, config


def sent_descriptors(staged: Any) -> int:
    """File descriptors ForkingPickler registers to send `staged` to another process (what DCP's
    process executor does with the staged state dict)."""
    sharer = resource_sharer._resource_sharer
    before = len(sharer._cache)
    ForkingPickler.dumps(staged)
    count = len(sharer._cache) - before
    return count


class Ways:
    """Each way of saving, with what it keeps across rounds (stagers, Checkpointer)."""

    def __init__(self, root: Path, group: dist.ProcessGroup) -> None:
        self.root = root
        self.group = group
        # What dcp.async_save stages with when given no stager (torch 2.13).
        self.default_stager = DefaultStager(StagingOptions(False, False, False, False))
        self.shm_stager = pyshmckpt.ShmStager()
        self.checkpointer = pyshmckpt.Checkpointer(root / "checkpointer", process_group=group)

    def save(self, way: str, state: dict[str, Any], step: int) -> tuple[float, float]:
        started = time.perf_counter()
        if way == "checkpointer":
            future: Any = self.checkpointer.save(state, name=f"step{step}")
            blocked = time.perf_counter() - started
            future.result(timeout=600)
            return blocked, time.perf_counter() - started
        stager = None if way == "dcp-default" else self.shm_stager  # None: DCP's default
        kind = (
            AsyncCheckpointerType.PROCESS
            if way.endswith("process")
            else AsyncCheckpointerType.THREAD
        )
        response = dcp.async_save(
            state, checkpoint_id=str(self.root / f"{way}-{step}"), async_stager=stager,
            process_group=self.group, async_checkpointer_type=kind,
        )  # fmt: skip
        blocked = time.perf_counter() - started
        upload = getattr(response, "upload_completion", response)
        upload.result(timeout=600)
        return blocked, time.perf_counter() - started

    def close(self) -> None:
        self.checkpointer.close()
        self.shm_stager.close()
        self.default_stager.close()


def slowest(value: float, group: dist.ProcessGroup) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    model, optimizer, config = build(args.width, args.layers)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    local_bytes = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for t in list(model_sd.values())
        + [v for s in optim_sd["state"].values() for v in s.values()]
    )
    tensors = len(model_sd) + sum(len(s) for s in optim_sd["state"].values())
    # Rank 0 makes the root (a local directory: every rank runs on this host) and removes it.
    made = [tempfile.mkdtemp(prefix="pyshmckpt-sharded-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0, group=group)
    root = Path(str(made[0]))
    if dist.get_rank() == 0:
        (root / "checkpointer").mkdir()
    dist.barrier(group)
    try:
        ways = Ways(root, group)
        results: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
        step = 0
        for round_ in range(args.rounds + 1):  # round 0 warms up (first saves, processes)
            order = WAYS[round_ % len(WAYS) :] + WAYS[: round_ % len(WAYS)]
            for way in order:
                step += 1
                blocked, durable = ways.save(way, state, step)
                blocked, durable = slowest(blocked, group), slowest(durable, group)
                if round_:
                    results[way].append((blocked, durable))
        ours = ways.shm_stager.stage(state)
        fds_ours = sent_descriptors(ours)
        ways.shm_stager.release(ours)
        del ours
        theirs = ways.default_stager.stage(state)
        if hasattr(theirs, "result"):
            theirs = theirs.result()
        fds_theirs = sent_descriptors(theirs)
        del theirs
        ways.close()
        dist.barrier(group)
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(
            f"FSDP2 GPT width {args.width}, {args.layers} layers, {world} ranks: "
            f"{local_bytes / 2**20:.0f} MiB and {tensors} tensors per rank; "
            f"median of {args.rounds} rounds (slowest rank)"
        )
        default = statistics.median(b for b, _ in results["dcp-default"])
        print(
            f"{'way':18s} {'blocked ms':>11s} {'durable ms':>11s} {'blocked vs dcp-default':>24s}"
        )
        for way in WAYS:
            blocked = statistics.median(b for b, _ in results[way])
            durable = statistics.median(d for _, d in results[way])
            print(
                f"{way:18s} {blocked * 1e3:11.1f} {durable * 1e3:11.1f} {default / blocked:23.1f}x"
            )
        print(
            f"file descriptors to pickle a staged state dict for the PROCESS executor: "
            f"ShmStager {fds_ours}, DCP's DefaultStager {fds_theirs} ({tensors} tensors)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
