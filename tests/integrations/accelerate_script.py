# An Accelerate training script as people write them: no main guard, no close() at the end (run
# by test_accelerate.py).
#
#     python accelerate_script.py PROJECT_DIR save|resume
#
# save: train 2 steps, save, train 2, save (automatic naming: checkpoint_0, checkpoint_1), end.
# resume: load_state() with no input_dir must restore step 4 of an uninterrupted run bitwise, and
# the next step and save continue it; prints "resumed <loaded>, saved <next>".
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from pyshmckpt.integrations.accelerate import ShmStateSaver

project_dir, mode = sys.argv[1], sys.argv[2]


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True),
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train(model, optimizer, first, steps):
    for step in range(first, first + steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def parameters(model):
    return [p.detach().clone() for p in model.parameters()]


if mode == "save":
    accelerator, model, optimizer = build(seed=0)
    saver = ShmStateSaver(accelerator)
    train(model, optimizer, 0, 2)
    saver.save_state()
    train(model, optimizer, 2, 2)
    saver.save_state()
else:
    accelerator, model, optimizer = build(seed=0)
    train(model, optimizer, 0, 5)
    expected = parameters(model)  # step 5 of the uninterrupted run
    accelerator, model, optimizer = build(seed=1)
    saver = ShmStateSaver(accelerator)
    loaded = saver.load_state()
    train(model, optimizer, 4, 1)
    if not all(map(torch.equal, parameters(model), expected)):
        raise SystemExit("the step after resuming differs from the uninterrupted run's")
    saved = saver.save_state().result(timeout=120)
    print(f"resumed {loaded.name}, saved {saved.name}", flush=True)
