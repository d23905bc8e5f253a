"""ShmStager (pyshmckpt/stager.py): staging, slots, growth, failure recovery, protocols."""

from __future__ import annotations

import collections
import gc
import pickle
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions on ForkingPickler)

import pyshmckpt
from pyshmckpt import (
    CapacityError,
    ShmStager,
    SlotsBusyError,
    SlotState,
    StagerClosedError,
    UnsupportedValueError,
)
from pyshmckpt.shm import Slot
from pyshmckpt.staging import stager as stager_module
from pyshmckpt.staging.manifest import build, rebuild

from helpers import assert_same_tree, wait_until

MIB = 1 << 20


def state(scale: float = 1.0) -> dict:
    return {
        "w": torch.full((64, 64), scale),
        "b": torch.arange(64, dtype=torch.int64),
        "nested": [torch.ones(3, dtype=torch.bfloat16) * scale, {"step": 7}],
    }


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_works_with_no_arguments():
    with ShmStager() as s:
        assert s.arena is None  # sized from the first state dict
        staged = s.stage(state())
        assert s.arena is not None
        # The stage made the slot it needed; the other is made in the background after it.
        assert len(s.arena.slots) == 2
        wait_until(lambda: all(slot.ready for slot in s.arena.slots), 30, "the second slot")
        assert torch.equal(staged["w"], state()["w"])
        assert staged["nested"][1] == {"step": 7}


def test_the_first_stage_into_a_new_slot_writes_through_its_file(monkeypatch):
    # The arena made by the first stage leaves its first slot's pages unallocated; that stage
    # writes them through the slot's file (host tensors only); the background thread then
    # allocates and maps the rest of the slot; later stages copy through the mapping.
    fills: list[int] = []
    real = Slot.fill_from_host

    def counted(slot: Slot, rows: Any, nbytes: int) -> None:
        fills.append(nbytes)
        real(slot, rows, nbytes)

    monkeypatch.setattr(Slot, "fill_from_host", counted)
    with ShmStager(slots=2, pin=False) as s:
        staged = s.stage(state())
        first = s.arena.slots[0]
        size = first.manifest.size
        assert fills == [size]
        assert first.reserved >= size
        assert_same_tree(state(), staged)
        wait_until(
            lambda: first.reserved == first.capacity and all(x.ready for x in s.arena.slots),
            30, "the rest of the first slot and the second slot",
        )  # fmt: skip
        again = s.stage(state(2.0))
        s.release(staged)
        del staged
        third = s.stage(state(3.0))
        assert fills == [size], "a later stage wrote through the file"
        assert_same_tree(state(2.0), again)
        assert_same_tree(state(3.0), third)


def test_a_first_stage_that_gathers_allocates_the_pages_it_needs(monkeypatch):
    # A tensor with gaps between its elements is copied densely through the mapping: the pages
    # it lands in are allocated first (never touched unallocated, which a full /dev/shm would
    # answer with a SIGBUS).
    fills: list[int] = []
    monkeypatch.setattr(Slot, "fill_from_host", lambda *args: fills.append(1))
    gathered = {"strided": torch.arange(4096.0)[::2], "w": torch.ones(1024)}
    with ShmStager(slots=2, pin=False) as s:
        staged = s.stage(gathered)
        first = s.arena.slots[0]
        assert fills == []
        assert first.reserved >= first.manifest.size
        assert_same_tree(gathered, staged)


def test_capacity_given_creates_the_arena_in_the_constructor():
    with ShmStager(capacity_bytes=3 * MIB, slots=3) as s:
        arena = s.arena
        assert arena is not None
        assert arena.slot_capacity >= 3 * MIB
        assert len(arena.slots) == 3
        s.stage(state())
        assert s.arena is arena  # no new arena for a state dict that fits


def test_staged_tensors_view_the_slot_through_one_storage_per_block(stager, tmp_path):
    source = state()
    staged = stager.stage(source)
    slot = stager.handle(staged).slot
    start, end = slot.storage.data_ptr(), slot.storage.data_ptr() + slot.storage.nbytes()
    tensors = [staged["w"], staged["b"], staged["nested"][0]]
    for t, s in zip(tensors, [source["w"], source["b"], source["nested"][0]], strict=True):
        assert t.device.type == "cpu"
        assert start <= storage_ptr(t) < end  # zero-copy: the slot's own bytes
        assert t.untyped_storage().nbytes() == s.nbytes  # its block, not the slot
    assert len({storage_ptr(t) for t in tensors}) == 3
    # An ordinary state dict to torch.save: three dtypes, each tensor's bytes once.
    torch.save(staged, tmp_path / "staged.pt")
    assert (tmp_path / "staged.pt").stat().st_size < sum(t.nbytes for t in tensors) + 4096
    loaded = torch.load(tmp_path / "staged.pt", weights_only=True)
    for key in ("w", "b"):
        assert torch.equal(loaded[key], source[key])
    assert torch.equal(loaded["nested"][0], source["nested"][0])


def test_snapshot_semantics(stager):
    source = state()
    staged = stager.stage(source)
    source["w"].add_(100)
    source["nested"][0].zero_()
    source["nested"][1]["step"] = 8
    assert torch.equal(staged["w"], torch.ones(64, 64))
    assert torch.equal(staged["nested"][0], torch.ones(3, dtype=torch.bfloat16))
    assert staged["nested"][1]["step"] == 7


def test_two_slots_alternate_while_staged_dicts_are_held(stager):
    first = stager.stage(state(1.0))
    second = stager.stage(state(2.0))
    assert storage_ptr(first["w"]) != storage_ptr(second["w"])
    assert float(first["w"][0, 0]) == 1.0
    assert float(second["w"][0, 0]) == 2.0
    with pytest.raises(SlotsBusyError):
        stager.stage(state(3.0))  # both slots are referenced; slot_timeout=0.5
    assert float(first["w"][0, 0]) == 1.0  # nothing was overwritten
    del first
    third = stager.stage(state(3.0))
    assert float(third["w"][0, 0]) == 3.0
    assert float(second["w"][0, 0]) == 2.0


def test_slots_are_reused_when_results_are_dropped(stager):
    names = set()
    for i in range(6):
        staged = stager.stage(state(float(i)))
        names.add(stager.handle(staged).slot.name)
        assert float(staged["w"][0, 0]) == float(i)
        del staged
    assert len(names) <= 2
    assert len(stager.arena.slots) == 2


def test_release_frees_a_slot_that_is_still_referenced(stager):
    first = stager.stage(state(1.0))
    stager.stage(state(2.0))  # dropped at once: its slot is free again
    held = stager.stage(state(3.0))
    stager.release(first)
    assert stager.handle(first) is None
    fourth = stager.stage(state(4.0))
    assert stager.handle(fourth) is not None
    # release() allowed the overwrite: the released dict now shows newer data.
    assert float(first["w"][0, 0]) == 4.0
    assert float(held["w"][0, 0]) == 3.0
    stager.release({"not": "staged"})  # unknown objects are ignored


def test_handle_reports_generation_and_manifest(stager):
    a = stager.stage(state())
    b = stager.stage(state())
    ha, hb = stager.handle(a), stager.handle(b)
    assert hb.generation == ha.generation + 1
    assert ha.slot.state is SlotState.READY
    assert len(ha.manifest) == 3
    assert ha.manifest.paths() == [("w",), ("b",), ("nested", 0)]


def test_growth_moves_to_a_larger_arena_and_frees_the_old_one():
    with ShmStager(capacity_bytes=2 * MIB) as s:
        small = s.arena
        old_names = [slot.name for slot in small.slots]
        big = {"x": torch.ones(3 * MIB // 4)}  # 3 MiB of float32
        staged = s.stage(big)
        assert s.arena is not small
        assert s.arena.slot_capacity >= 3 * MIB
        assert torch.equal(staged["x"], big["x"])
        assert small.closed  # nothing in it was in use
        assert not any(name in pyshmckpt_segments() for name in old_names)


def test_old_arena_stays_while_its_slot_is_in_use():
    with ShmStager(capacity_bytes=2 * MIB) as s:
        small = s.arena
        held = s.stage(state())
        s.stage({"x": torch.ones(3 * MIB // 4)})
        assert not small.closed  # `held` still views it
        assert torch.equal(held["w"], torch.ones(64, 64))
        del held
        s.stage(state())  # the next stage collects the idle old arena
        assert small.closed


def test_growth_disabled_gives_a_capacity_error_and_stays_usable():
    with ShmStager(capacity_bytes=2 * MIB, allow_growth=False) as s:
        with pytest.raises(CapacityError, match="growth is disabled"):
            s.stage({"x": torch.ones(3 * MIB // 4)})
        assert all(slot.state is SlotState.FREE for slot in s.arena.slots)
        assert torch.equal(s.stage(state())["w"], torch.ones(64, 64))


def test_bad_tensor_stages_nothing_and_names_the_key_path(stager):
    good = stager.stage(state())
    del good
    bad = {"model": {"layers": [torch.ones(2), torch.ones(2).to_sparse()]}}
    with pytest.raises(UnsupportedValueError, match=r"\['model'\]\['layers'\]\[1\]"):
        stager.stage(bad)
    assert isinstance(UnsupportedValueError("p", "r"), TypeError)
    assert stager.arena.idle()
    assert not any(slot.state is SlotState.STAGING for slot in stager.arena.slots)
    assert torch.equal(stager.stage(state())["b"], torch.arange(64))


def test_validate_sees_the_manifest_and_refuses_before_any_slot_is_taken():
    seen = []

    def validate(manifest):
        seen.append(len(manifest))
        if any(path == ("secret",) for path in manifest.paths()):
            raise PermissionError("no secrets")

    with ShmStager(slots=1, validate=validate) as s:
        with pytest.raises(PermissionError, match="no secrets"):
            s.stage({"secret": torch.ones(1024)})
        assert s.arena is None, "a refused stage allocated the arena"
        staged = s.stage(state())
        assert torch.equal(staged["w"], torch.ones(64, 64))
    assert seen == [1, 3]  # tensors in each state dict


def test_the_validator_runs_with_automatic_garbage_collection_paused():
    # It may allocate per tensor (the JSON check of a Checkpointer does): a full collection,
    # whose cost grows with every object of the process, landed in a save (90 ms at 8,192 tensors).
    enabled_inside = []
    with ShmStager(slots=1, validate=lambda manifest: enabled_inside.append(gc.isenabled())) as s:
        assert gc.isenabled()
        s.stage(state())
        s.stage(state())  # a reused plan is validated too
    assert enabled_inside == [False, False]
    assert gc.isenabled()


def test_failure_during_copy_frees_the_slot(stager, monkeypatch):
    stager.stage(state())
    arena = stager.arena

    def broken(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(stager_module, "rebuild", broken)
    with pytest.raises(RuntimeError, match="injected"):
        stager.stage(state())
    monkeypatch.undo()
    assert arena.idle()
    assert torch.equal(stager.stage(state(5.0))["w"], torch.full((64, 64), 5.0))


def test_gaps_between_blocks_hold_zeros_not_an_earlier_stage():
    """The alignment padding between blocks is written on every stage: bytes staged earlier in the
    same slot (here -1.0, 0xBF80 0000) never survive there."""
    with ShmStager(slots=1) as stager:
        secret = stager.stage({"secret": torch.full((1000,), -1.0)})
        slot = stager.handle(secret).slot
        del secret
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        source = {"a": torch.ones(3), "g": x[:, ::4], "b": torch.ones(5), "c": torch.ones(2)}
        staged = stager.stage(source)
        handle = stager.handle(staged)
        assert handle.slot is slot  # the one slot, reused
        manifest = handle.manifest
        data = slot.base(torch.uint8)[slot.offset : slot.offset + manifest.size]
        in_block = torch.zeros(manifest.size, dtype=torch.bool)
        for offset, nbytes in manifest.blocks.tolist():
            in_block[offset : offset + nbytes] = True
        assert int((~in_block).sum()) > 0  # there are gaps to check
        assert torch.count_nonzero(data[~in_block]).item() == 0
        for key, value in source.items():
            assert torch.equal(staged[key], value)
        del staged, data


@pytest.mark.gpu
def test_gaps_between_cuda_blocks_are_zeroed_too():
    """Blocks copied from the device still get their gaps zeroed by the host copy engine."""
    with ShmStager(slots=1) as stager:
        stager.stage({"secret": torch.full((1000,), -1.0)})  # dropped at once: the slot is free
        source = {
            "a": torch.ones(3, device="cuda"),
            "b": torch.ones(5, device="cuda"),
            "c": torch.ones(7),
        }
        staged = stager.stage(source)
        handle = stager.handle(staged)
        manifest = handle.manifest
        slot = handle.slot
        data = slot.base(torch.uint8)[slot.offset : slot.offset + manifest.size]
        in_block = torch.zeros(manifest.size, dtype=torch.bool)
        for offset, nbytes in manifest.blocks.tolist():
            in_block[offset : offset + nbytes] = True
        assert int((~in_block).sum()) > 0
        assert torch.count_nonzero(data[~in_block]).item() == 0
        for key, value in source.items():
            assert torch.equal(staged[key], value.cpu())
        del staged, data


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"capacity_bytes": "1"}, pyshmckpt.ConfigTypeError),
        ({"capacity_bytes": 1.5}, pyshmckpt.ConfigTypeError),
        ({"capacity_bytes": True}, pyshmckpt.ConfigTypeError),
        ({"capacity_bytes": 0}, pyshmckpt.ConfigError),
        ({"capacity_bytes": -5}, pyshmckpt.ConfigError),
        ({"slots": 0}, pyshmckpt.ConfigError),
        ({"slots": "2"}, pyshmckpt.ConfigError),
        ({"slot_timeout": -1}, pyshmckpt.ConfigError),
        ({"slot_timeout": "1"}, pyshmckpt.ConfigTypeError),
        ({"headroom": 0.5}, pyshmckpt.ConfigError),
        ({"headroom": "2"}, pyshmckpt.ConfigTypeError),
        ({"headroom": True}, pyshmckpt.ConfigTypeError),
        ({"validate": "yes"}, pyshmckpt.ConfigTypeError),
    ],
)
def test_bad_constructor_arguments(kwargs, error):
    with pytest.raises(error):
        ShmStager(**kwargs)


def test_capacity_larger_than_free_shared_memory_is_a_clean_oserror():
    import errno
    import os

    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(pyshmckpt.PyshmckptOSError) as info:
        ShmStager(capacity_bytes=free + (1 << 30), slots=1)
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOSPC


def test_close_is_idempotent_and_closed_stager_refuses_work():
    s = ShmStager(capacity_bytes=MIB)
    s.stage(state())
    s.close()
    s.close()
    assert s.closed
    with pytest.raises(StagerClosedError):
        s.stage(state())


def test_staged_tensors_survive_close():
    s = ShmStager()
    staged = s.stage(state(9.0))
    s.close()
    assert torch.equal(staged["w"], torch.full((64, 64), 9.0))


def test_dropping_the_stager_frees_its_segments():
    s = ShmStager(capacity_bytes=MIB)
    s.stage(state())
    names = [slot.name for slot in s.arena.slots]
    assert all(name in pyshmckpt_segments() for name in names)
    del s
    gc.collect()
    assert not any(name in pyshmckpt_segments() for name in names)


def test_async_staging_returns_a_future():
    with ShmStager(async_staging=True) as s:
        future = s.stage(state(4.0))
        assert isinstance(future, Future)
        staged = future.result(timeout=30)
        assert torch.equal(staged["w"], torch.full((64, 64), 4.0))
        s.synchronize_staging()
        assert not s.should_synchronize_after_execute


def test_async_staging_reports_errors_at_call_time():
    with ShmStager(async_staging=True) as s, pytest.raises(UnsupportedValueError):
        s.stage({"m": torch.empty(2, device="meta")})


def test_stage_accepts_keyword_arguments_as_torch_passes_them(stager):
    staged = stager.stage(state_dict=state(), path="ignored", extra=1)
    assert torch.equal(staged["b"], torch.arange(64))


def test_implements_torch_stager_protocols():
    from torch.distributed.checkpoint._experimental.staging import CheckpointStager
    from torch.distributed.checkpoint.staging import AsyncStager

    with ShmStager() as s:
        assert isinstance(s, AsyncStager)
        assert isinstance(s, CheckpointStager)
        assert s.should_synchronize_after_execute


def test_torch_pickler_sends_one_descriptor_per_slot(stager):
    """torch.multiprocessing sends storages by fd; a staged dict must need exactly one."""
    staged = stager.stage({f"t{i}": torch.full((16,), float(i)) for i in range(50)})
    buf = ForkingPickler.dumps(staged)
    # Each shared storage is reduced to a (rebuild_storage_fd, DupFd) pair; count them.
    assert bytes(buf).count(b"rebuild_storage_fd") == 1
    assert bytes(buf).count(b"DupFd") == 1
    restored = pickle.loads(buf)
    assert all(torch.equal(restored[f"t{i}"], torch.full((16,), float(i))) for i in range(50))


def test_containers_and_aliases_survive(stager):
    w = torch.randn(8, 8)
    source = collections.OrderedDict(
        a=w, b=w, c=w.t(), d=(w[0], [w[1:3]]), e=collections.defaultdict(int, k=torch.ones(1))
    )
    staged = stager.stage(source)
    assert type(staged) is collections.OrderedDict
    assert staged["a"] is staged["b"]
    assert isinstance(staged["d"], tuple)
    assert isinstance(staged["d"][1], list)
    assert staged["e"].default_factory is int
    ptr = storage_ptr(staged["a"])
    assert storage_ptr(staged["c"]) == ptr
    assert storage_ptr(staged["d"][0]) == ptr
    staged["a"][0, 0] = 123.0
    assert float(staged["c"][0, 0]) == 123.0
    assert float(staged["d"][0][0]) == 123.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_async_save_with_shm_stager(tmp_path):
    import torch.distributed.checkpoint as dcp

    source = {"w": torch.randn(32, 32), "b": torch.arange(10)}
    with ShmStager() as s:
        response = dcp.async_save(source, checkpoint_id=str(tmp_path), async_stager=s)
        result = response.upload_completion if hasattr(response, "upload_completion") else response
        result.result(timeout=60)
    target = {"w": torch.zeros(32, 32), "b": torch.zeros(10, dtype=torch.int64)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    assert torch.equal(target["w"], source["w"])
    assert torch.equal(target["b"], source["b"])


def pyshmckpt_segments() -> set[str]:
    from conftest import our_segments

    return our_segments()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize(
    "dtype", [torch.complex32, torch.complex64, torch.complex128, torch.float64, torch.bool]
)
def test_views_with_gaps_of_every_item_size_are_gathered(stager, dtype):
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8).to(dtype)
    source = {"gaps": x[:, ::3], "conj": x.conj()[::2] if x.is_complex() else x[::2]}
    staged = stager.stage(source)
    for key, value in source.items():
        assert staged[key].is_contiguous()
        expected = value.resolve_conj()
        if dtype is torch.complex32:  # torch has no comparison kernels for ComplexHalf
            staged_value, expected = staged[key].to(torch.complex64), expected.to(torch.complex64)
        else:
            staged_value = staged[key]
        assert torch.equal(staged_value, expected)


# -- reusing the layout of the previous state dict ----------------------------------------------


def test_a_repeated_state_dict_reuses_its_layout_and_stages_fresh_values(stager):
    sd = state()
    first = stager.stage(sd)
    key = stager.handle(first).manifest.layout_key
    del first
    with torch.no_grad():
        sd["w"].add_(1)
    sd["nested"][1]["step"] = 8
    staged = stager.stage(sd)
    stats = stager.plan_stats
    assert (stats.plans, stats.reuses) == (1, 1)
    assert torch.equal(staged["w"], sd["w"])
    assert staged["nested"][1] == {"step": 8}
    handle = stager.handle(staged)
    assert handle.manifest.layout_key == key
    assert handle.manifest.tree is not None
    # Still a snapshot.
    sd["nested"][1]["step"] = 9
    with torch.no_grad():
        sd["w"].add_(1)
    assert staged["nested"][1] == {"step": 8}
    assert not torch.equal(staged["w"], sd["w"])


def test_a_changed_layout_is_planned_in_full_with_a_new_layout_key(stager):
    sd = state()
    key = stager.handle(stager.stage(sd)).manifest.layout_key
    sd["w"] = torch.full((32, 64), 3.0)
    staged = stager.stage(sd)
    assert (stager.plan_stats.plans, stager.plan_stats.reuses) == (2, 0)
    assert stager.handle(staged).manifest.layout_key != key
    assert torch.equal(staged["w"], sd["w"])


def _requires_grad(sd: dict) -> None:
    sd["w"].requires_grad_(True)


def _lazy_conjugate(sd: dict) -> None:
    sd["z"] = sd["z"].conj()


def _lazy_negation(sd: dict) -> None:
    sd["z"] = torch._neg_view(sd["z"])


@pytest.mark.parametrize("lease", [False, True], ids=["stage", "stage_leased"])
@pytest.mark.parametrize("change", [_requires_grad, _lazy_conjugate, _lazy_negation])
def test_a_flag_changed_after_reuse_is_caught_while_copying_and_staged_in_full(
    stager, change, lease
):
    # The copies of a reused plan start before the tensors' flags are checked: a changed flag
    # abandons them and stages again from a full plan, so the result is the state of the moment.
    sd = {"w": torch.randn(4, 4), "z": torch.randn(3, dtype=torch.complex64), "n": torch.ones(2)}
    stager.stage_leased(sd).give_back()
    stager.stage_leased(sd).give_back()
    change(sd)
    if lease:
        handle = stager.stage_leased(sd)
        staged = rebuild(handle.manifest, handle.slot.storage, handle.slot.offset)
    else:
        staged = stager.stage(sd)
    stats = stager.plan_stats
    assert (stats.plans, stats.reuses) == (2, 1)
    assert "requires_grad or lazy conj/neg bit changed" in stats.last_replan
    assert staged["w"].requires_grad == sd["w"].requires_grad
    for key in sd:
        assert torch.equal(staged[key].detach(), sd[key].detach()), key
    if lease:
        handle.give_back()
    # The flags of the moment are those of the layout reused next.
    stager.stage_leased(sd).give_back()
    assert (stager.plan_stats.plans, stager.plan_stats.reuses) == (2, 2)


def test_an_async_stage_checks_the_flags_before_returning():
    # An asynchronous stage copies after stage() returned, while the caller may change the state
    # dict: its plan is checked in full (flags included) in stage(), never on the stage thread.
    with ShmStager(async_staging=True, slot_timeout=5) as s:
        sd = {"w": torch.randn(4, 4), "n": torch.ones(2)}
        for _ in range(2):
            s.stage(sd).result()
        sd["w"].requires_grad_(True)
        staged = s.stage(sd).result()
        assert (s.plan_stats.plans, s.plan_stats.reuses) == (2, 1)
        assert "requires_grad" in s.plan_stats.last_replan
        assert staged["w"].requires_grad
        assert torch.equal(staged["w"].detach(), sd["w"].detach())


def test_stage_leased_reuses_layouts_too(stager):
    sd = state()
    for step in range(3):
        sd["nested"][1]["step"] = step
        handle = stager.stage_leased(sd)
        rebuilt = build(handle.manifest.tree, [None] * len(handle.manifest))
        assert rebuilt["nested"][1]["step"] == step  # the leaf of this save, not the first's
        handle.give_back()
    assert (stager.plan_stats.plans, stager.plan_stats.reuses) == (1, 2)


def test_reuse_plans_false_lays_out_every_state_dict():
    with ShmStager(reuse_plans=False, slot_timeout=0.5) as s:
        sd = state()
        s.stage(sd)
        s.stage(sd)
        assert (s.plan_stats.plans, s.plan_stats.reuses) == (2, 0)


def test_untying_a_storage_after_reuse_stages_both_tensors(stager):
    w = torch.randn(8, 8)
    sd = {"embed": w, "head": w.detach()}
    stager.stage(sd)
    stager.stage(sd)
    sd["head"] = w.clone()
    with torch.no_grad():
        sd["head"].fill_(5)
    staged = stager.stage(sd)
    assert stager.plan_stats.plans == 2
    assert torch.equal(staged["embed"], w)
    assert torch.equal(staged["head"], torch.full((8, 8), 5.0))
    assert staged["embed"].data_ptr() != staged["head"].data_ptr()


def test_a_dtensor_placement_change_is_planned_in_full(stager):
    dist = pytest.importorskip("torch.distributed")
    tensor = pytest.importorskip("torch.distributed.tensor")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of another test")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = dist.device_mesh.DeviceMesh("cpu", [0])
        x = torch.arange(12.0).reshape(4, 3)
        sharded = tensor.distribute_tensor(x, mesh, [tensor.Shard(0)])
        replicated = tensor.distribute_tensor(x, mesh, [tensor.Replicate()])
        staged = stager.stage({"w": sharded})
        key = stager.handle(staged).manifest.layout_key
        del staged
        staged = stager.stage({"w": sharded})
        assert stager.plan_stats.reuses == 1
        assert staged["w"].placements == (tensor.Shard(0),)
        del staged
        staged = stager.stage({"w": replicated})
        assert (stager.plan_stats.plans, stager.plan_stats.reuses) == (2, 1)
        assert staged["w"].placements == (tensor.Replicate(),)
        assert torch.equal(staged["w"].to_local(), x)
        assert stager.handle(staged).manifest.layout_key != key
        del staged
    finally:
        dist.destroy_process_group()
