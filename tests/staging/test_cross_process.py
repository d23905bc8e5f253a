"""End to end: a transformer + AdamW state staged, checked bitwise, and read from another process."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch

import pyshmckpt
from pyshmckpt import _C
from pyshmckpt.staging.manifest import rebuild

from conftest import train_step
from helpers import buffer_storage, same_bytes

SPAWN_TIMEOUT = 120


def full_state(model, optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


def assert_tree_equal(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert same_bytes(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_tree_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_tree_equal(x, y)
    else:
        assert a == b


def test_transformer_and_adamw_state_round_trip(trained, stager):
    model, optimizer = trained
    source = full_state(model, optimizer)
    staged = stager.stage(source)
    assert_tree_equal(source, staged)

    # Tied embeddings: two keys, one block, and the staged copies alias each other.
    sd = staged["model"]
    assert sd["embed.weight"].untyped_storage() is sd["head.weight"].untyped_storage()
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    manifest = stager.handle(staged).manifest
    paths = manifest.paths()
    i, j = paths.index(("model", "embed.weight")), paths.index(("model", "head.weight"))
    assert manifest.block[i] == manifest.block[j]

    # AdamW's state keeps its structure (int keys, the step tensor, exp_avg(_sq)).
    assert set(staged["optimizer"]["state"]) == set(source["optimizer"]["state"])
    assert staged["optimizer"]["param_groups"] == source["optimizer"]["param_groups"]

    # A fresh model and optimizer accept the staged state.
    fresh = type(model)()
    fresh.load_state_dict(staged["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(staged["optimizer"])


def test_snapshot_while_training_continues(trained, stager):
    model, optimizer = trained
    before = {k: v.clone() for k, v in model.state_dict().items()}
    staged = stager.stage(full_state(model, optimizer))
    train_step(model, optimizer, seed=1)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # training really moved the weights
    for key, value in before.items():
        assert same_bytes(staged["model"][key], value)


def _attach_and_digest(
    name: str, capacity: int, token: bytes, offset: int, manifest_bytes: bytes, queue
) -> None:
    segment = _C.Segment.attach(name, capacity, token)
    manifest = pickle.loads(manifest_bytes)
    view = memoryview(segment)
    staged = rebuild(manifest, buffer_storage(view), offset)
    digest = _digest(staged)
    aliased = (
        staged["model"]["embed.weight"].data_ptr() == staged["model"]["head.weight"].data_ptr()
    )
    queue.put((digest, aliased, staged["step"]))
    del staged
    segment.close()


def _digest(tree) -> dict:
    out = {}

    def visit(node, path):
        if isinstance(node, torch.Tensor):
            out[path] = _C.crc32c(node.contiguous().view(-1).view(torch.uint8).numpy())
        elif isinstance(node, dict):
            for key, value in node.items():
                visit(value, (*path, key))
        elif isinstance(node, (list, tuple)):
            for k, value in enumerate(node):
                visit(value, (*path, k))

    visit(tree, ())
    return out


def run_child(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    try:
        result = queue.get(timeout=SPAWN_TIMEOUT)
        proc.join(SPAWN_TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0
    return result


def test_spawned_process_attaching_the_segment_reads_the_same_bytes(trained, stager):
    model, optimizer = trained
    staged = stager.stage(full_state(model, optimizer))
    handle = stager.handle(staged)
    slot = handle.slot
    digest, aliased, step = run_child(
        _attach_and_digest,
        slot.name,
        slot.segment.size,
        slot.segment.token,
        slot.offset,
        pickle.dumps(handle.manifest),
    )
    assert digest == _digest(staged)
    assert aliased
    assert step == 1


def _receive_through_torch_queue(queue_in, queue_out, saved_path) -> None:
    staged = queue_in.get(timeout=SPAWN_TIMEOUT)
    sizes = {k: v.untyped_storage().nbytes() for k, v in staged["model"].items()}
    queue_out.put((_digest(staged), sizes))
    queue_in.get(timeout=SPAWN_TIMEOUT)  # the trainer changed the staged bytes meanwhile
    queue_out.put(float(staged["model"]["pos"][0, 0]))
    torch.save(staged, saved_path)  # fp32, int64 and bf16 tensors
    queue_out.put("saved")


def test_staged_dict_crosses_torch_multiprocessing_without_copy(trained, stager, tmp_path):
    """torch's multiprocessing pickler (DCP's process executor, torch's CheckpointProcess) hands
    the receiver the slot's own memory: the receiver sees a later change to the staged bytes,
    each tensor still has its block's storage, and torch.save of what it got works."""
    import torch.multiprocessing as tmp

    model, optimizer = trained
    state = full_state(model, optimizer)
    state["extra"] = {"count": torch.arange(5), "half": torch.randn(4, dtype=torch.bfloat16)}
    staged = stager.stage(state)
    ctx = tmp.get_context("spawn")
    queue_in, queue_out = ctx.Queue(), ctx.Queue()
    saved = tmp_path / "received.pt"
    proc = ctx.Process(target=_receive_through_torch_queue, args=(queue_in, queue_out, saved))
    proc.start()
    try:
        queue_in.put(staged)
        digest, sizes = queue_out.get(timeout=SPAWN_TIMEOUT)
        assert digest == _digest(staged)
        assert sizes == {k: v.untyped_storage().nbytes() for k, v in staged["model"].items()}
        # Sent by reference: the staged tensors still view the slot (torch's own pickler would
        # have moved each block's storage into a shared-memory copy of its own).
        slot = stager.handle(staged).slot
        start = slot.storage.data_ptr()
        for tensor in _tensors(staged):
            assert start <= tensor.untyped_storage().data_ptr() < start + slot.storage.nbytes()
        staged["model"]["pos"][0, 0] = 1234.5  # into the slot: shared, so the receiver sees it
        queue_in.put("changed")
        assert queue_out.get(timeout=SPAWN_TIMEOUT) == 1234.5
        assert queue_out.get(timeout=SPAWN_TIMEOUT) == "saved"
        proc.join(SPAWN_TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0
    loaded = torch.load(saved, weights_only=True)
    assert _digest(loaded) == _digest(staged)
    state_bytes = sum(v.nbytes for v in _tensors(staged))
    assert saved.stat().st_size < state_bytes + (64 << 10)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_staged_dict_through_torchs_pickler_under_either_sharing_strategy(stager, strategy):
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    state = {"w": torch.randn(32, 32), "n": torch.arange(7), "h": torch.ones(3, dtype=torch.half)}
    staged = stager.stage(state)
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy(strategy)
    try:
        received = pickle.loads(ForkingPickler.dumps(staged))
    finally:
        tmp.set_sharing_strategy(before)
    assert _digest(received) == _digest(state)
    for key in state:
        assert received[key].untyped_storage().nbytes() == state[key].nbytes
    del received


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = (
        tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else []
    )
    return [t for value in values for t in _tensors(value)]


def test_cuda_availability_tells_the_truth():
    assert pyshmckpt.cuda_available() == (_C.cuda_device_count() > 0 and torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert not pyshmckpt.cuda_available()


@pytest.mark.slow
def test_many_stages_do_not_leak_arenas(stager):
    for i in range(50):
        staged = stager.stage({"x": torch.full((1000,), float(i))})
        assert float(staged["x"][0]) == float(i)
    assert len(stager.arena.slots) == 2
