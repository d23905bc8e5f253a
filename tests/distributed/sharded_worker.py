"""One rank of the sharded-state tests, run under torchrun (or `launch` in dist_helpers).

    save OUT       train a small FSDP2 GPT with AdamW, save it through dcp.async_save with
                   ShmStager (THREAD and PROCESS executors) and through the Checkpointer while
                   training goes on; rank 0 writes the full reference state and the next step's
                   loss to OUT; then `load` on the same ranks
    load OUT       build the model again (another seed) on this many ranks, load each checkpoint
                   into it, check every rank's shards bitwise against the same slices of the
                   reference state, and the next step
                   (on another number of ranks, the DCP checkpoints the PROCESS executor wrote
                   are left out: the same files as the THREAD executor's)
    plain OUT      without torch.distributed: load that checkpoint into an unsharded model
    mesh2d OUT     DTensors on a 2x2 mesh (Shard/Replicate, uneven): staged, saved, resharded
    die OUT        every rank saves, rank 1 dies first (SIGKILL): the others' saves fail
    again OUT      a fresh launch saves into the root `die` left: it commits
Every rank exits non-zero on a failed check; checkpoint collectives use their own gloo group.
With OURS_URL set (an s3:// root), `save`, `load` and `plain` use the Checkpointer alone, with
that root in object storage instead of OUT/ours.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing  # noqa: F401  (torch's reductions for ForkingPickler)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import pyshmckpt
from pyshmckpt.cli.demo.gpt import GPT, GPTConfig, batch

CONFIG = GPTConfig(vocab=97, seq_len=8, width=36, layers=2, heads=4)  # 97, 36: uneven on 4 ranks
GLOBAL_BATCH = 8
SAVE_STEP = 3  # steps trained before the saves
TIMEOUT = 120.0


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"rank {dist.get_rank()}: {message}")


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One step on this rank's part of the same global batch, whatever the world size."""
    inputs, targets = batch(step, GLOBAL_BATCH, CONFIG.seq_len, CONFIG.vocab)
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    part = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    loss = model.loss(inputs[part], targets[part])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full (unsharded) state on rank 0, copied: some tensors (AdamW's step) are the
    optimizer's own, which the next step changes."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(
        {
            "model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options),
        }
    )


def flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(flat(v, f"{prefix}{i}."))
        return out
    return {prefix: tree}


def ours(out: Path) -> str:
    """The Checkpointer's root: OUT/ours, or the object storage root OURS_URL names."""
    return os.environ.get("OURS_URL") or str(out / "ours")


def save(out: Path, group: dist.ProcessGroup) -> None:
    model, optimizer = build(seed=0)
    for step in range(SAVE_STEP):
        train_step(model, optimizer, step)
    reference = full_state(model, optimizer)
    stager = pyshmckpt.ShmStager()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}

    # Staged DTensors: the same placements, global shape and local bytes; a snapshot.
    staged = stager.stage(state)
    for key, value in model_sd.items():
        got = staged["model"][key]
        check(type(got) is DTensor, f"{key} staged as {type(got).__name__}")
        check(
            got.placements == value.placements and got.device_mesh == value.device_mesh
            and got.shape == value.shape and got.stride() == value.stride()
            and torch.equal(got.to_local(), value.to_local()),
            f"{key}: staged DTensor differs",
        )  # fmt: skip
    stager.release(staged)
    del staged

    futures = []
    kinds = (
        []
        if "OURS_URL" in os.environ
        else [AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS]
    )
    for kind in kinds:
        future = dcp.async_save(
            state, checkpoint_id=str(out / f"dcp-{kind.value}"), async_stager=stager,
            process_group=group, async_checkpointer_type=kind,
        )  # fmt: skip
        futures.append(future)
        future.result(timeout=TIMEOUT)  # each executor in turn: both reuse the stager's slots
    checkpointer = pyshmckpt.Checkpointer(ours(out), process_group=group, barrier_timeout=60)
    saved = checkpointer.save(state, name="step3")
    # Training goes on while the write runs: the checkpoint is the state at save().
    next_loss = train_step(model, optimizer, SAVE_STEP)
    saved.result(timeout=TIMEOUT)
    checkpointer.close()
    stager.close()
    after = full_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(
            {"state": reference, "after": after, "next_loss": next_loss,
             "world_size": dist.get_world_size()},
            out / "reference.pt",
        )  # fmt: skip
    dist.barrier()
    load(out, group)  # on the ranks that saved: a fresh model in the same processes


def load(out: Path, group: dist.ProcessGroup) -> None:
    expected = torch.load(out / "reference.pt", weights_only=False)
    sources = ["ours"] if "OURS_URL" in os.environ else ["dcp-thread", "dcp-process", "ours"]
    if "dcp-process" in sources and dist.get_world_size() != expected["world_size"]:
        sources.remove("dcp-process")
    # Same world size: the same reductions in the same order, so the same bits after the next
    # step. Another: the gradients are summed in another order (rounding differences).
    exact = dist.get_world_size() == expected["world_size"]
    for source in sources:
        model, optimizer = build(seed=1)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {"model": model_sd, "optim": optim_sd}
        if source == "ours":
            # In object storage, the root: its newest checkpoint, agreed on by the ranks.
            where = ours(out) if "OURS_URL" in os.environ else f"{ours(out)}/step3"
            pyshmckpt.load(where, into=target)
        else:
            dcp.load(target, checkpoint_id=str(out / source), process_group=group)
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
        what = f"{source} on {dist.get_world_size()} ranks"
        same_shards(model, optimizer, expected["state"], what, exact=True)
        loss = train_step(model, optimizer, SAVE_STEP)
        check(
            abs(loss - expected["next_loss"]) <= 1e-6 * max(1.0, abs(loss)),
            f"{source}: next loss {loss} != {expected['next_loss']}",
        )
        same_shards(model, optimizer, expected["after"], f"{what}, the next step", exact=exact)


def same_shards(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: dict, what: str, exact: bool
) -> None:
    """This rank's shards of the model and optimizer state against the same slices of the full
    reference state (cut here, without a collective: every rank has the whole reference)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    mine, reference = flat({"model": model_sd, "optim": optim_sd}), flat(full)
    differ = sorted(mine.keys() ^ reference.keys())[:5]
    check(mine.keys() == reference.keys(), f"{what}: keys differ: {differ}")
    for key, value in mine.items():
        ref = reference[key]
        if isinstance(value, DTensor):
            ref = distribute_tensor(
                ref, value.device_mesh, value.placements, src_data_rank=None
            ).to_local()
            value = value.to_local()
        if not isinstance(value, torch.Tensor):
            check(value == ref, f"{what}: {key}: {value!r} != {ref!r}")
            continue
        # A message only for a failure: formatting every tensor costs more than comparing it.
        if not (
            isinstance(ref, torch.Tensor) and value.dtype == ref.dtype and value.shape == ref.shape
        ):
            check(False, f"{what}: {key}: {value.dtype} {tuple(value.shape)} vs {ref!r:.200}")
        if exact:
            same = torch.equal(value, ref)
        else:
            same = torch.allclose(value, ref, rtol=1e-4, atol=1e-5)
        if not same:
            difference = (value.double() - ref.double()).abs().max()
            check(False, f"{what}: {key} differs by {difference:.3g}")


def plain(out: Path) -> None:
    """No torch.distributed: load the 4-rank checkpoint into an unsharded model."""
    expected = torch.load(out / "reference.pt", weights_only=False)["state"]
    torch.manual_seed(1)
    model = GPT(CONFIG)
    target = {"model": model.state_dict()}
    pyshmckpt.load(f"{ours(out)}/step3", into=target)
    for key, value in target["model"].items():
        if not torch.equal(value, expected["model"][key]):
            raise SystemExit(f"plain load: {key} differs")


def mesh2d(out: Path, group: dist.ProcessGroup) -> None:
    """Shard/Replicate on a 2x2 mesh, uneven sizes; load on a 1-D mesh and into plain tensors."""
    check(dist.get_world_size() == 4, "mesh2d needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(7)
    full = {
        "a": torch.randn(7, 5),  # uneven on both dims
        "b": torch.randn(6, 9, dtype=torch.float64),
        "c": torch.arange(11, dtype=torch.int32),
        "s": torch.tensor(3.5),
    }
    placements = {
        "a": [Shard(0), Shard(1)],
        "b": [Replicate(), Shard(1)],
        "c": [Shard(0), Replicate()],
        "s": [Replicate(), Replicate()],
    }
    state = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    state["plain"] = torch.ones(3)
    stager = pyshmckpt.ShmStager()
    parameter = torch.nn.Parameter(distribute_tensor(torch.randn(5, 3), mesh, placements["a"]))
    staged_parameter = stager.stage({"p": parameter})["p"]
    check(
        isinstance(staged_parameter, torch.nn.Parameter) and staged_parameter.requires_grad
        and torch.equal(staged_parameter.to_local(), parameter.to_local()),
        "a DTensor parameter is staged as a DTensor parameter",
    )  # fmt: skip
    # What DCP's process executor does with a staged state dict (torch crashes on a DTensor
    # whose wrapper carries its local tensor's storage offset).
    ForkingPickler.dumps(staged_parameter)
    del staged_parameter
    staged = stager.stage(state)
    for key, value in state.items():
        if isinstance(value, DTensor):
            got = staged[key]
            check(
                got.placements == value.placements and got.device_mesh == mesh
                and torch.equal(got.to_local(), value.to_local()),
                f"2-D mesh: {key} staged wrongly",
            )  # fmt: skip
    kept = state["a"].to_local().clone()
    with torch.no_grad():
        state["a"].to_local().add_(1)  # staging is a snapshot
    check(torch.equal(staged["a"].to_local(), kept), "the stage is no snapshot")
    stager.close()
    with torch.no_grad():
        state["a"].to_local().copy_(kept)
    (out / "mesh2d").mkdir(exist_ok=True)
    checkpointer = pyshmckpt.Checkpointer(out / "mesh2d", process_group=group, barrier_timeout=60)
    checkpointer.save(state, name="ck").result(timeout=TIMEOUT)
    checkpointer.close()
    path = out / "mesh2d" / "ck"
    flat_mesh = init_device_mesh("cpu", (4,))
    target = {
        "a": distribute_tensor(torch.zeros(7, 5), flat_mesh, [Shard(1)]),
        "b": distribute_tensor(torch.zeros(6, 9, dtype=torch.float64), flat_mesh, [Shard(0)]),
        "c": distribute_tensor(torch.zeros(11, dtype=torch.int32), flat_mesh, [Replicate()]),
        "s": distribute_tensor(torch.tensor(0.0), flat_mesh, [Replicate()]),
        "plain": torch.zeros(3),
    }
    pyshmckpt.load(path, into=target)
    for key, value in full.items():
        check(torch.equal(target[key].full_tensor(), value), f"2-D mesh to 1-D: {key} differs")
    check(torch.equal(target["plain"], torch.ones(3)), "plain tensor differs")
    plain = {k: torch.zeros_like(v) for k, v in full.items()}
    pyshmckpt.load(path, into=plain)
    for key, value in full.items():
        check(torch.equal(plain[key], value), f"2-D mesh to plain: {key} differs")


def die(out: Path, group: dist.ProcessGroup) -> None:
    root = out / "die"
    root.mkdir(exist_ok=True)
    checkpointer = pyshmckpt.Checkpointer(root, process_group=group, barrier_timeout=5)
    dist.barrier(group)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before staging its part
    started = time.monotonic()
    future = checkpointer.save({"x": torch.full((4,), float(dist.get_rank()))}, name="ck")
    try:
        future.result(timeout=TIMEOUT)
    except pyshmckpt.PyshmckptError as exc:
        elapsed = time.monotonic() - started
        (out / f"die-rank{dist.get_rank()}.json").write_text(
            json.dumps({"error": type(exc).__name__, "message": str(exc), "seconds": elapsed})
        )
    else:
        raise SystemExit(f"rank {dist.get_rank()}: the save succeeded without rank 1")
    checkpointer.close(abort=True)
    os._exit(0)  # rank 1 is gone: no collective teardown


def again(out: Path, group: dist.ProcessGroup) -> None:
    root = out / "die"
    checkpointer = pyshmckpt.Checkpointer(root, process_group=group, barrier_timeout=60)
    checkpointer.save({"x": torch.full((4,), float(dist.get_rank()))}, name="ck2").result(
        timeout=TIMEOUT
    )
    checkpointer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["save", "load", "plain", "mesh2d", "die", "again"])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "plain":
        plain(args.out)
        return
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")  # checkpoint collectives never meet training's
    globals()[args.command](args.out, group)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
