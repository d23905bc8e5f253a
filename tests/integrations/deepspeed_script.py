# A DeepSpeed training script written the way DeepSpeed's examples are: no main guard, no
# engine.destroy() at the end (run by test_deepspeed.py, alone or under torchrun).
#
#     python deepspeed_script.py SAVE_DIR STAGE save|save-kill|resume
#
# save: train 3 steps, save tag s3, train 3, save s6 through pyshmckpt, then simply end.
# save-kill: the same, but the trainer SIGKILLs itself right after save_checkpoint("s6") returned
# (it first writes its writer's pid to SAVE_DIR/../writer-rank<r>).
# resume: a fresh engine (another seed) with pyshmckpt's engine loads load_checkpoint(SAVE_DIR)
# with no tag; it must be at step 6 with the parameters of an uninterrupted run, bitwise, and
# its next step equal that run's next step. Prints "resumed" on success.
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

from pyshmckpt import CheckpointProcessConfig
from pyshmckpt.integrations.deepspeed import use_pyshmckpt

save_dir, stage, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

# DeepSpeed's CPU backend would compile a shared-memory all-reduce op first (half a minute).
deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train(engine, steps):
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
        loss = engine(torch.randn(2, 16, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def parameters(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def fail(message):
    raise SystemExit(f"rank {rank}: {message}")


config = CheckpointProcessConfig(subprocess_init_timeout_secs=60, write_timeout_secs=60)

if mode in ("save", "save-kill"):
    engine = build(seed=0)
    shm = use_pyshmckpt(engine, config=config, commit_timeout=60)
    train(engine, 3)
    engine.save_checkpoint(str(save_dir), tag="s3")
    train(engine, 3)
    engine.save_checkpoint(str(save_dir), tag="s6")
    if mode == "save-kill":
        (save_dir.parent / f"writer-rank{rank}").write_text(str(shm.checkpoint_process.pid))
        os.kill(os.getpid(), signal.SIGKILL)
else:
    uninterrupted = build(seed=0)
    train(uninterrupted, 6)
    at_six = parameters(uninterrupted)
    train(uninterrupted, 1)
    at_seven = parameters(uninterrupted)
    engine = build(seed=1)
    use_pyshmckpt(engine, config=config, commit_timeout=60)
    path, _ = engine.load_checkpoint(str(save_dir))
    if path is None:
        fail("load_checkpoint found no checkpoint")
    if engine.global_steps != 6:
        fail(f"resumed at step {engine.global_steps}, not 6")
    if not all(map(torch.equal, parameters(engine), at_six)):
        fail("the resumed parameters differ from the uninterrupted run's")
    train(engine, 1)
    if not all(map(torch.equal, parameters(engine), at_seven)):
        fail("the step after resuming differs from the uninterrupted run's")
    print(f"rank {rank}: resumed", flush=True)
