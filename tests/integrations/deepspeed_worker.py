"""One process of the DeepSpeed tests (a single rank, or one rank under torchrun): DeepSpeed on
CPU with gloo, checkpoints through pyshmckpt's ShmCheckpointEngine.

    python deepspeed_worker.py OUT SCENARIO...

    resume0, resume1  ZeRO stage 0 / 1: train, save at step 3 through ShmCheckpointEngine and
                      through DeepSpeed's TorchCheckpointEngine, train on; both wrote the same
                      files (names, and torch.load contents); loading ours back (into the same
                      engine through ShmCheckpointEngine, and into a fresh one, another seed,
                      through DeepSpeed's default engine) trains on bitwise like the
                      uninterrupted run; save_16bit_model's file is complete when it returns.
                      Rank 0's writer finishes starting late, so its spooled files of step 3
                      (the model file every rank loads among them) are durable well after the
                      other ranks' files: wait() on every rank waits for every rank's files
    commit            the last rank's writer is slow: no step waits for it, `latest` never names
                      the tag before every rank's files are durable, then it does; load() of a
                      file being written waits for it; saving again to the tag `latest` names or
                      to one being written raises NotSupportedError and touches nothing. Then
                      that writer is SIGKILLed during a save: the ranks notice within a few
                      steps, which go on normally (no step skipped: the parameters equal a run
                      that never saved, bitwise), `latest` keeps the previous tag, nothing
                      half-written is left; the next save raises CommitError on every rank
                      before saving anything, and the one after works

Every failed check exits non-zero naming the rank. No bare assert: it runs under python -O too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder  # noqa: E402

from pyshmckpt import CheckpointProcessConfig, CommitError, NotSupportedError  # noqa: E402
from pyshmckpt.integrations.deepspeed import fetch, use_pyshmckpt  # noqa: E402
from pyshmckpt.storage import TorchFileWriter  # noqa: E402

from helpers import end_distributed  # noqa: E402

SLOW_WRITE_SECONDS = 1.5  # how long the slow writer sleeps before each file
LATE_START_SECONDS = 3.0  # how much later than the others rank 0's writer is ready in resume*
BOUND = 30.0  # seconds any wait below may take (also the engines' commit_timeout)
HANG_TIMEOUT = 200  # seconds after which a rank prints every thread's stack and exits


class SlowTorchFileWriter(TorchFileWriter):
    """The default writer, on a slow disk for tags named "slow-*": each of their files'
    temporary stays empty for SLOW_WRITE_SECONDS before torch.save fills it."""

    def serialize(self, state_dict: Any, file: Any) -> None:
        if Path(file.name).parent.name.startswith("slow-"):
            time.sleep(SLOW_WRITE_SECONDS)
        super().serialize(state_dict, file)


class LateTorchFileWriter(TorchFileWriter):
    """The default writer, built LATE_START_SECONDS late in rank 0's writer process: the files
    that rank saves while its writer starts are spooled, and written that much later."""

    def __init__(self, rank_info: Any = None) -> None:
        super().__init__(rank_info)
        if rank_info is not None and rank_info.global_rank == 0:
            time.sleep(LATE_START_SECONDS)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"rank {dist.get_rank()}: {message}")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def build(stage: int, seed: int) -> Any:
    torch.manual_seed(seed)
    model = Net()
    # A plain torch optimizer: DeepSpeed's own (cpu_adam) would be compiled first.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def ours(engine: Any, writer: Any = TorchFileWriter, **options: Any) -> Any:
    config = CheckpointProcessConfig(
        subprocess_init_timeout_secs=60, subprocess_shutdown_timeout_secs=15, write_timeout_secs=60
    )
    return use_pyshmckpt(engine, config=config, commit_timeout=BOUND, writer=writer, **options)


def train(engine: Any, steps: int) -> list[float]:
    """`steps` optimizer steps on data fixed by the step number; returns each step's seconds."""
    seconds = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 * engine.global_steps + dist.get_rank())
        x = torch.randn(2, 16, generator=g)
        started = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - started)
    return seconds


def parameters(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def check_same_parameters(engine: Any, expected: list[torch.Tensor], what: str) -> None:
    actual = parameters(engine)
    check(len(actual) == len(expected), f"{what}: {len(actual)} parameters, not {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        check(a.dtype == e.dtype and torch.equal(a, e), f"{what}: parameter {i} differs")


def same(a: Any, b: Any, where: str = "") -> str | None:
    """Where two torch.load results differ (None: nowhere): tensors bitwise, containers by type
    and keys in order, objects by type and attributes."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return f"{where}: tensors differ"
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)} != {list(b)}"
        pairs = [(a[k], b[k], f"{where}[{k!r}]") for k in a]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: lengths {len(a)} != {len(b)}"
        pairs = [(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True))]
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        return same(vars(a), vars(b), f"{where}.vars")
    else:
        return None if a == b else f"{where}: {a!r} != {b!r}"
    return next((d for x, y, w in pairs if (d := same(x, y, w)) is not None), None)


def names_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def latest(save_dir: Path) -> str | None:
    try:
        return (save_dir / "latest").read_text()
    except FileNotFoundError:
        return None


def tag_files(save_dir: Path, tag: str, stage: int) -> list[Path]:
    """Every file of a tag, all ranks' (ZeRO stage >= 1 writes one optimizer file per rank)."""
    files = [save_dir / tag / "mp_rank_00_model_states.pt"]
    if stage:
        files += [
            save_dir / tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            for r in range(dist.get_world_size())
        ]
    return files


# -- scenarios --------------------------------------------------------------------------------


def resume(out: Path, stage: int) -> None:
    root = out / f"resume{stage}"
    engine = build(stage, seed=0)
    torch_engine = engine.checkpoint_engine  # DeepSpeed's default: TorchCheckpointEngine
    check(type(torch_engine).__name__ == "TorchCheckpointEngine", f"{type(torch_engine)}")
    shm_engine = ours(engine, LateTorchFileWriter)
    train(engine, 3)
    engine.save_checkpoint(str(root / "ours"), tag="step3")
    engine.checkpoint_engine = torch_engine
    engine.save_checkpoint(str(root / "torch"), tag="step3")
    engine.checkpoint_engine = shm_engine
    train(engine, 3)
    reference = parameters(engine)
    # DeepSpeed commits this one at once: the file is complete when the call returns.
    engine.save_16bit_model(str(root / "export"))
    if dist.get_rank() == 0:
        exported = torch.load(root / "export" / "pytorch_model.bin", weights_only=True)
        difference = same(exported, engine.module_state_dict())
        check(difference is None, f"save_16bit_model wrote other values: {difference}")
    # Back to step 3 through ShmCheckpointEngine, in this engine: wait() first, as DeepSpeed
    # lists the tag's directory, where a file appears once durable, and every rank loads the
    # model file rank 0 (whose writer started late) writes.
    shm_engine.wait()
    resume_bitwise(engine, root / "ours", reference, "ShmCheckpointEngine", tag="step3")
    engine.destroy()  # closes shm_engine: every write done, `latest` final
    check(latest(root / "ours") == "step3", f"latest is {latest(root / 'ours')!r}")
    dist.barrier()  # every rank's engine closed: their heartbeat files are gone

    if dist.get_rank() == 0:
        names = names_in(root / "ours"), names_in(root / "torch")
        check(names[0] == names[1], f"save directories differ: {names}")
        files = names_in(root / "ours" / "step3")
        check(files == names_in(root / "torch" / "step3"), f"tag files {files}")
        check([p.name for p in tag_files(root, "step3", stage)] == files, f"files {files}")
        for name in files:
            mine = torch.load(root / "ours" / "step3" / name, weights_only=False)
            theirs = torch.load(root / "torch" / "step3" / name, weights_only=False)
            difference = same(mine, theirs, name)
            check(difference is None, f"torch.load of our file and DeepSpeed's: {difference}")
            # Views are staged with the bytes they reach only, never a whole storage.
            sizes = [(root / d / "step3" / name).stat().st_size for d in ("ours", "torch")]
            check(sizes[0] <= sizes[1] + 4096, f"{name}: {sizes[0]} bytes, DeepSpeed's {sizes[1]}")
    dist.barrier()

    # A fresh engine (another seed) with DeepSpeed's default engine loads `latest`.
    engine = build(stage, seed=1)
    resume_bitwise(engine, root / "ours", reference, "TorchCheckpointEngine")
    engine.destroy()


def resume_bitwise(
    engine: Any, save_dir: Path, reference: list[torch.Tensor], what: str, tag: str | None = None
) -> None:
    """Load the step 3 checkpoint, train 3 steps: the parameters must equal `reference`."""
    path, _ = engine.load_checkpoint(str(save_dir), tag=tag)
    check(path is not None, f"load_checkpoint through {what} found nothing")
    check(engine.global_steps == 3, f"resumed at step {engine.global_steps}")
    train(engine, 3)
    check_same_parameters(engine, reference, f"resumed through {what}")


def step_until_latest(engine: Any, save_dir: Path, tag: str, stage: int) -> None:
    """Train until `latest` names `tag`, checking after every step that it names it only once
    every file of it is on disk."""
    deadline = time.monotonic() + BOUND
    # Every rank must train the same steps (each is a collective): they agree when to stop.
    while not everywhere(latest(save_dir) == tag):
        check(time.monotonic() < deadline, f"latest never named {tag} ({latest(save_dir)!r})")
        train(engine, 1)
        if latest(save_dir) == tag:
            missing = [str(f) for f in tag_files(save_dir, tag, stage) if not f.exists()]
            check(not missing, f"latest names {tag} before these files exist: {missing}")
        time.sleep(0.05)


def everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every rank (a collective)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def own_files(save_dir: Path, tag: str) -> list[Path]:
    """The files of a ZeRO stage 1 tag this rank writes, its optimizer states first."""
    files = tag_files(save_dir, tag, stage=1)
    mine = [files[1 + dist.get_rank()]]
    return [*mine, files[0]] if dist.get_rank() == 0 else mine


def error_of(call: Callable[[], object], error: type[BaseException]) -> BaseException | None:
    """The `error` that call() raised, or None."""
    try:
        call()
    except error as exc:
        return exc
    return None


def refuse_tag(engine: Any, save_dir: Path, tag: str) -> None:
    """Saving to `tag` again raises NotSupportedError and rewrites none of its files."""
    files = [p for p in (save_dir / tag).iterdir() if not p.name.startswith(".")]  # durable ones
    before = {p: p.stat().st_mtime_ns for p in files}
    refused = error_of(lambda: engine.save_checkpoint(str(save_dir), tag=tag), NotSupportedError)
    check(refused is not None and "new tag" in str(refused), f"saved to {tag} again: {refused}")
    after = {p: p.stat().st_mtime_ns for p in before}  # files still being written may appear
    check(after == before, f"the refused save of {tag} rewrote its files")


def slow_rank() -> int:
    return dist.get_world_size() - 1


def commit_scenario(out: Path) -> None:
    """Saves through a writer that is slow on the last rank for tags named "slow-*"."""
    save_dir = out / "commit"
    engine = build(1, seed=0)
    slow = dist.get_rank() == slow_rank()
    shm_engine = ours(engine, SlowTorchFileWriter if slow else TorchFileWriter)
    train(engine, 1)
    engine.save_checkpoint(str(save_dir), tag="fast")
    step_until_latest(engine, save_dir, "fast", stage=1)
    # A tag `latest` names, or one still being written, is never written again in place.
    refuse_tag(engine, save_dir, "fast")

    # A slow write: no step waits for it, `latest` moves only once every rank's files are
    # durable, and load() of a file being written waits for it.
    engine.save_checkpoint(str(save_dir), tag="slow-a")
    refuse_tag(engine, save_dir, "slow-a")
    saved = [t.clone() for t in engine.optimizer.single_partition_of_fp32_groups]
    seconds = train(engine, 2)
    check(latest(save_dir) == "fast", f"latest is {latest(save_dir)!r} during the slow write")
    check(max(seconds) < SLOW_WRITE_SECONDS / 2, f"a step waited for the write: {seconds}")
    if slow:
        path = own_files(save_dir, "slow-a")[0]
        check(not path.exists(), "the slow write finished already")
        loaded = shm_engine.load(str(path), map_location="cpu")
        check(path.exists(), "load() returned before the write")
        fp32 = loaded["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        check(all(map(torch.equal, fp32, saved)), "load() read other values than were saved")
    step_until_latest(engine, save_dir, "slow-a", stage=1)

    # The writer is SIGKILLed during a save: the ranks notice at a step, which goes on normally.
    engine.save_checkpoint(str(save_dir), tag="slow-doomed")
    killed, steps, calls = time.monotonic(), engine.global_steps, 0
    if slow:
        os.kill(shm_engine.checkpoint_process.pid, signal.SIGKILL)
    while shm_engine.failure is None:
        check(time.monotonic() - killed < BOUND / 3, "no step noticed the killed writer")
        train(engine, 1)
        calls += 1
    train(engine, 1)
    calls += 1
    check(engine.global_steps == steps + calls, f"{calls} steps took {engine.global_steps - steps}")
    reference = build(1, seed=0)  # the same steps, never saved: none skipped nor applied twice
    train(reference, engine.global_steps)
    check_same_parameters(engine, parameters(reference), "training on after the failed save")
    reference.destroy()
    expected = "died" if slow else "another rank"
    check(latest(save_dir) == "slow-a", f"latest is {latest(save_dir)!r} after the failed save")
    left = [t for f in own_files(save_dir, "slow-doomed") for t in TorchFileWriter.temporaries(f)]
    check(not left, f"temporaries of the killed write are left: {left}")

    # The next save raises the failure on every rank before saving anything; the next one works.
    failure = error_of(lambda: engine.save_checkpoint(str(save_dir), tag="refused"), CommitError)
    check(failure is not None and expected in str(failure), f"unclear error: {failure}")
    check(not (save_dir / "refused").exists(), "the save that raised the failure saved files")
    check(shm_engine.failure is None, f"the failure is still there: {shm_engine.failure}")
    engine.save_checkpoint(str(save_dir), tag="after")  # through a new writer process
    step_until_latest(engine, save_dir, "after", stage=1)
    for path in tag_files(save_dir, "after", stage=1):
        torch.load(path, weights_only=False)
    engine.destroy()


def mirror_scenario(out: Path) -> None:
    """Tags mirrored to object storage (MIRROR: its URL), fetched into a new save directory
    (a new node's disk) and resumed from there by DeepSpeed's own engine, bitwise."""
    url = os.environ["MIRROR"]
    save_dir, fetched = out / "mirrored", out / "fetched"
    engine = build(1, seed=0)
    ours(engine, mirror=url)
    train(engine, 2)
    engine.save_checkpoint(str(save_dir), tag="step2")
    train(engine, 1)
    engine.save_checkpoint(str(save_dir), tag="step3")
    train(engine, 3)
    reference = parameters(engine)
    engine.destroy()  # waits for the uploads
    dist.barrier()
    if dist.get_rank() == 0:
        check(fetch(url, fetched) == "step3", "the mirror's newest is not step3")
        check(latest(fetched) == "step3", f"fetched latest is {latest(fetched)!r}")
        files = [n for n in names_in(save_dir / "step3") if not n.startswith(".")]
        engine_files = [p.name for p in tag_files(save_dir, "step3", stage=1)]
        check(sorted(engine_files) == files, f"the tag holds {files}")
        check(files == names_in(fetched / "step3"), f"fetched {names_in(fetched / 'step3')}")
        for name in files:
            mine, theirs = save_dir / "step3" / name, fetched / "step3" / name
            check(mine.read_bytes() == theirs.read_bytes(), f"{name} differs from the saved one")
        check(fetch(url, out / "older", tag="step2") == "step2", "fetching step2 by its tag")
    dist.barrier()
    fresh = build(1, seed=1)  # DeepSpeed's own engine, on the fetched directory
    resume_bitwise(fresh, fetched, reference, "the fetched mirror")
    fresh.destroy()


SCENARIOS = {
    "mirror": mirror_scenario,
    "resume0": lambda out: resume(out, 0),
    "resume1": lambda out: resume(out, 1),
    "commit": commit_scenario,
}


def main() -> None:
    out = Path(sys.argv[1])
    faulthandler.dump_traceback_later(HANG_TIMEOUT, exit=True)  # a hang fails with its stacks
    # DeepSpeed's CPU backend compiles a shared-memory all-reduce op with g++ (half a minute)
    # when it initializes; these runs only need gloo.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(dist_backend="gloo")
    for name in sys.argv[2:]:
        started = time.monotonic()
        SCENARIOS[name](out)
        print(f"rank {dist.get_rank()}: {name} passed ({time.monotonic() - started:.1f} s)")
    end_distributed()


if __name__ == "__main__":
    main()
