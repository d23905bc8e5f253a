"""A checkpoint held in memory restored into DTensors (`reader._shards_into`), with real ranks.

Two ranks (gloo, CPU) train a tiny FSDP2 model one step with AdamW, save model and optimizer
state in shared memory only (``persist=False``) and SIGKILL themselves: their writers hold the
checkpoint. Two new ranks build the same model (another seed) and load the held checkpoint
``into=`` their state dicts, sharded as when it was saved: bitwise what was saved, once with the
ranks agreeing (every checksum checked first) and once with ``rank=`` given (checksums checked
as the bytes are read). Targets sharded otherwise (Replicate, Shard(1)) need bytes of the other
rank's shards, which its memory copy does not hold: NotSupportedError, and nothing is written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pyshmckpt.tiers import records

from helpers import SHM, child_env, free_port, pid_running

RUN_TIMEOUT = 180  # seconds one launch of the ranks may take (seconds on an idle machine)
HOLD_WAIT = 30  # seconds the writers may take to hold the checkpoint once their trainers died
EXIT_TIMEOUT = 15  # seconds a writer may take to end its hold and exit once released
HOLD_TIMEOUT = 600  # the holds this test ends itself: a bound should the test die

pytestmark = pytest.mark.slow

# One rank: `save ROOT OUT` (saves in memory only, writes its local shards to OUT, dies) or
# `load ROOT OUT` (loads the held checkpoint into its own state and checks it; exits non-zero on
# a failed check).
RANK = textwrap.dedent(
    """
    import faulthandler, os, signal, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import pyshmckpt

    mode, root, out, hold_timeout = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    faulthandler.dump_traceback_later(%(hang)d, exit=True)  # a hang fails with its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")  # checkpoint collectives never meet training's
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))


    def check(ok, message):
        if not ok:
            raise SystemExit(f"rank {rank}: {message}")


    def build(seed):
        # 5 and 3 rows on 2 ranks: uneven shards (FSDP2 pads the local tensors)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
        )
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(seed)
        loss = model(torch.randn(6, 4, generator=g)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return model, optimizer


    def state_of(model, optimizer, step):
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
            "step": step,
        }


    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t


    def tensors(tree, prefix=""):
        if isinstance(tree, dict):
            return {k: v for key, value in tree.items()
                    for k, v in tensors(value, f"{prefix}{key}.").items()}
        if isinstance(tree, (list, tuple)):
            return {k: v for i, value in enumerate(tree)
                    for k, v in tensors(value, f"{prefix}{i}.").items()}
        return {prefix: tree} if isinstance(tree, torch.Tensor) else {}


    def raw(t):
        return local(t).detach().reshape(-1).contiguous().view(torch.uint8)


    def same(state, expected, what):
        got = tensors(state)
        check(sorted(got) == sorted(expected), f"{what}: keys {sorted(got)} != {sorted(expected)}")
        for key, value in got.items():
            check(local(value).dtype == expected[key].dtype, f"{what}: {key}: dtype")
            check(torch.equal(raw(value), raw(expected[key])), f"{what}: {key} differs")


    if mode == "save":
        model, optimizer = build(0)
        state = state_of(model, optimizer, 1)
        check(any(isinstance(t, DTensor) for t in tensors(state).values()), "no DTensor saved")
        checkpointer = pyshmckpt.Checkpointer(
            root, process_group=group, hold_timeout=float(hold_timeout)
        )
        checkpointer.save(state, name="step1", persist=False).result(timeout=60)
        torch.save({k: local(v).clone() for k, v in tensors(state).items()},
                   out / f"rank{rank}.pt")
        dist.barrier()  # both ranks saved
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: the writer holds the checkpoint

    expected = torch.load(out / f"rank{rank}.pt", weights_only=True)
    model, optimizer = build(1)
    state = state_of(model, optimizer, 0)
    check(not torch.equal(raw(state["model"]["0.weight"]), raw(expected["model.0.weight."])),
          "the new model starts where the saved one was")

    # Agreed by both ranks (each memory copy checked whole first).
    loaded = pyshmckpt.load(root, into=state, process_group=group)
    check(loaded is state, "load did not return into")
    check(state["step"] == 1, f"step {state['step']}")
    same(state, expected, "agreed load")
    same({"model": get_model_state_dict(model)}, {k: v for k, v in expected.items()
         if k.startswith("model.")}, "the model's own parameters")

    # This rank alone: its memory copy's checksums checked as the bytes are read.
    with torch.no_grad():
        for t in tensors(state).values():
            local(t).zero_()
    state["step"] = 0
    pyshmckpt.load(root, into=state, rank=rank)
    check(state["step"] == 1, f"step {state['step']}")
    same(state, expected, "load with rank given")

    # Sharded otherwise: needs the other rank's shards, which are not in this rank's memory.
    shape = tuple(state["model"]["0.weight"].shape)
    for placement in (Replicate(), Shard(1)):
        target = {"model": {"0.weight": distribute_tensor(torch.zeros(shape), mesh, [placement])}}
        try:
            pyshmckpt.load(root, into=target, rank=rank)
        except pyshmckpt.NotSupportedError as exc:
            message = str(exc)
            check("0.weight" in message and "source='disk'" in message, message)
            check("other ranks' shards" in message, message)
        else:
            check(False, f"a {placement} target loaded from one rank's memory copy")
        check(not local(target["model"]["0.weight"]).any(), f"the {placement} target was written")
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()
    """
) % {"hang": RUN_TIMEOUT - 10}


def launch(script: Path, mode: str, root: Path, out: Path, env: dict[str, str]) -> list[int]:
    """Run both ranks in `mode` (logs in OUT); returns their exit codes."""
    env = env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    processes = []
    with contextlib.ExitStack() as logs:
        for rank in (0, 1):
            log = logs.enter_context((out / f"{mode}-rank{rank}.log").open("w"))
            command = [sys.executable, str(script), mode, str(root), str(out), str(HOLD_TIMEOUT)]
            processes.append(
                subprocess.Popen(
                    command,
                    env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        try:
            deadline = time.monotonic() + RUN_TIMEOUT
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    return [process.returncode for process in processes]


def logs(out: Path, mode: str) -> str:
    return "\n".join(
        f"--- rank {r}:\n{(out / f'{mode}-rank{r}.log').read_text()[-3000:]}" for r in (0, 1)
    )


def ours(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefix + "-"))


def held(root: Path, rank: int, prefix: str) -> bool:
    """Whether a writer holds rank `rank`'s checkpoint of `root` (its whole record is out)."""
    found = (records.read_record(p) for p in records.record_paths(root, rank, prefix=prefix))
    return any(r is not None and not r.get("pending") for r in found)


def end_holds(prefix: str) -> None:
    """Free every hold under `prefix`, end its holders (SIGKILL after a grace period) and wait
    until nothing of `prefix` is left in /dev/shm."""
    pids = []
    for path, record in records.holds(prefix):
        if records.holder_alive(path):
            pids.append(int(record["holder"][0]))
        records.release(path, record)
    deadline = time.monotonic() + EXIT_TIMEOUT
    while any(pid_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if pid_running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + EXIT_TIMEOUT
    while ours(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.timeout(2 * RUN_TIMEOUT + HOLD_WAIT + 2 * EXIT_TIMEOUT + 30)
def test_a_held_checkpoint_loads_into_dtensors_sharded_as_saved(tmp_path: Path) -> None:
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-dtensors"  # the leak check covers it
    env = child_env() | {"PYSHMCKPT_SEGMENT_PREFIX": prefix}
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    try:
        codes = launch(script, "save", root, out, env)
        assert codes == [-signal.SIGKILL] * 2, f"save: exit codes {codes}\n{logs(out, 'save')}"
        deadline = time.monotonic() + HOLD_WAIT
        while not all(held(root, r, prefix) for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(held(root, r, prefix) for r in (0, 1)), f"no hold records: {ours(prefix)}"
        assert not (root / "step1").exists()  # in memory only

        codes = launch(script, "load", root, out, env)
        assert codes == [0, 0], f"load: exit codes {codes}\n{logs(out, 'load')}"
    finally:
        end_holds(prefix)
    assert not ours(prefix)
