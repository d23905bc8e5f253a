"""NumPy and CuPy arrays as leaves of a state dict (pyshmckpt/staging/arrays.py, and the layout,
planner, manifest and stager around it): staged as the tensors that view them, into the same slot
rows as tensors, and given back as NumPy arrays over the slot.

CuPy needs a GPU: here an object with ``__cuda_array_interface__`` stands in for one, to check that
it is recognised and refused with a typed error where CUDA cannot be used (the real CuPy round
trip is in tests/test_arrays_checkpoint.py, marked ``gpu``).

Every check raises explicitly (``check``/``same``) instead of using ``assert``, so the suite still
checks something under ``python -O`` (PYTHONOPTIMIZE=1).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch

import pyshmckpt
from pyshmckpt import CudaUnavailableError, UnsupportedValueError
from pyshmckpt.staging import arrays, layout
from pyshmckpt.staging.manifest import (
    ARRAY_DTYPES,
    CUPY,
    NUMPY,
    PARAMETER,
    REQUIRES_GRAD,
    Pickled,
    dtype_name,
)
from pyshmckpt.staging.planner import Planner

from layout_checks import assert_manifests_equal, assert_same, check, check_plan, execute, same

DTYPES = [np.float32, np.int64, np.bool_, np.float16, np.uint8, np.complex64]


def random_array(dtype: Any, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def stage(state: Any) -> tuple[Any, layout.StagingPlan]:
    """Plan `state`, check the plan's invariants, and rebuild it from a filled buffer."""
    plan = layout.plan(state)
    check_plan(plan)
    staged, _ = execute(plan)
    return staged, plan


def check_array(got: Any, want: np.ndarray, where: str) -> None:
    same(type(got), np.ndarray, f"{where} type")
    same(got.dtype, want.dtype, f"{where} dtype")
    same(got.shape, want.shape, f"{where} shape")
    check(np.array_equal(got, want), f"{where}: values differ")


class FakeCudaArray:
    """Stands in for a CuPy array: the CUDA array interface (version 3) of some device memory."""

    def __init__(self, shape: tuple[int, ...] = (4,), typestr: str = "<f4") -> None:
        self.shape = shape
        self.typestr = typestr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.typestr,
            "data": (0x7F0000000000, False),
            "version": 3,
            "strides": None,
            "stream": 1,
        }


# -- NumPy arrays through a plan ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_arrays_of_each_dtype_come_back_as_arrays(dtype):
    state = {"a": random_array(dtype, (3, 5)), "t": torch.ones(2)}
    staged, plan = stage(state)
    check_array(staged["a"], state["a"], "array")
    same(type(staged["t"]), torch.Tensor, "a tensor beside it")
    same(plan.manifest.flags.tolist(), [NUMPY, 0], "flags")
    entry = plan.manifest.entry(0)
    same(entry.array, "numpy", "entry.array")
    same(entry.dtype, dtype_name(torch.from_numpy(state["a"]).dtype), "entry dtype")
    same(plan.manifest.entry(1).array, None, "entry.array of a tensor")


def test_every_dtype_torch_views_is_staged():
    names = set()
    for (kind, size), dtype in arrays.NUMPY_TO_TORCH.items():
        a = np.arange(6).astype(np.dtype(f"{kind}{size}"))
        staged, plan = stage({"a": a})
        check_array(staged["a"], a, f"dtype {a.dtype}")
        same(plan.manifest.dtypes, (dtype_name(dtype),), f"torch dtype of {a.dtype}")
        names.add(plan.manifest.dtypes[0])
    check(names <= ARRAY_DTYPES, f"dtypes the loader would refuse: {names - ARRAY_DTYPES}")


def test_zero_d_empty_and_strided_arrays():
    base = random_array(np.float32, (6, 8), seed=1)
    state = {
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.int64),
        "empty_view": base[:, 8:],
        "strided": base[::2, 1::3],  # gaps between elements: gathered into a block of its own
        "transposed": base.T,  # dense, not C-contiguous
        "column": base[:, 2],
        "broadcast": np.broadcast_to(np.arange(3, dtype=np.int16), (4, 3)),  # stride 0
        "fortran": np.asfortranarray(random_array(np.int64, (3, 4), seed=2)),
    }
    staged, _ = stage(state)
    for key, want in state.items():
        check_array(staged[key], want, key)
    same(staged["scalar"].ndim, 0, "0-d")
    same(staged["transposed"].strides, base.T.strides, "strides of a dense view")


def test_arrays_viewing_one_buffer_come_back_sharing_memory():
    buf = np.arange(24, dtype=np.float32)
    state = {
        "whole": buf,
        "head": buf[:8],
        "tail": buf[8:].reshape(4, 4),
        "ints": buf[4:8].view(np.int32),  # another dtype over the same bytes
        "again": buf,  # the same object twice
    }
    staged, plan = stage(state)
    for key in ("whole", "head", "tail", "ints"):
        check_array(staged[key], state[key], key)
    same(len(plan.manifest.blocks), 1, "one block for the buffer")
    check(staged["again"] is staged["whole"], "an array appearing twice is one object")
    for key in ("head", "tail", "ints"):
        check(np.shares_memory(staged["whole"], staged[key]), f"{key} shares the buffer")
    staged["head"][5] = -1.0
    same(float(staged["whole"][5]), -1.0, "a write through one view, seen through the other")


def test_views_of_a_view_share_the_root_buffer():
    root = np.arange(40, dtype=np.int64)
    middle = root[10:30]
    state = {"a": middle[:5], "b": middle[3:9], "c": root[25:]}
    staged, plan = stage(state)
    same(len(plan.manifest.blocks), 1, "one block")
    check(np.shares_memory(staged["a"], staged["b"]), "views of a view share memory")
    check(not np.shares_memory(staged["a"], staged["c"]), "disjoint views stay disjoint")
    for key in state:
        check_array(staged[key], state[key], key)


def test_an_array_and_a_tensor_over_its_memory_share_it_again():
    a = random_array(np.float32, (4, 4), seed=3)
    t = torch.from_numpy(a)
    owned = torch.arange(12, dtype=torch.int32)
    state = {"array": a, "tensor": t, "owned": owned, "owned_array": owned.numpy()[2:]}
    staged, plan = stage(state)
    check_array(staged["array"], a, "array")
    same(type(staged["tensor"]), torch.Tensor, "tensor type")
    check(np.shares_memory(staged["array"], staged["tensor"].numpy()), "array and tensor")
    check(
        np.shares_memory(staged["owned"].numpy(), staged["owned_array"]),
        "an array over a tensor's memory (tensor.numpy())",
    )
    same(len(plan.manifest.blocks), 2, "one block per buffer")
    same(plan.manifest.flags.tolist(), [NUMPY, 0, 0, NUMPY], "flags")


def test_read_only_and_foreign_buffers_are_staged_without_warning():
    frozen = np.arange(5, dtype=np.float64)
    frozen.flags.writeable = False
    from_bytes = np.frombuffer(b"\x01\x02\x03\x04\x05\x06\x07\x08", dtype=np.uint16)
    unaligned = np.frombuffer(bytearray(range(17)), dtype=np.uint8)[1:].view(np.int32)
    state = {"frozen": frozen, "bytes": from_bytes, "unaligned": unaligned}
    staged, _ = stage(state)  # filterwarnings=error: torch's read-only warning would fail it
    for key in state:
        check_array(staged[key], state[key], key)
        check(staged[key].flags.writeable, f"{key}: a staged array is writable")


def test_a_plan_holds_the_memory_of_arrays_dropped_after_planning():
    state = {"a": random_array(np.float32, (64,), seed=4)}
    want = state["a"].copy()
    plan = layout.plan(state)
    del state
    gc.collect()
    staged, _ = execute(plan)
    check_array(staged["a"], want, "array")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (np.array([{"x": 1}, None], dtype=object), "dtype '|O'"),
        (np.zeros(3, dtype=[("x", "<f4"), ("y", "<i8")]), "structured"),
        (np.arange(4, dtype=">f4"), "dtype '>f4'"),
        (np.array(["ab", "c"]), "string"),
        (np.arange(6)[::-1], "negative strides"),
        (np.zeros(4, dtype=[("x", "<f4"), ("y", "<f8")])["y"], "not multiples of its element"),
    ],
    ids=["object", "structured", "big-endian", "string", "reversed", "record-field"],
)
def test_arrays_torch_cannot_view_are_refused_naming_the_key_path(value, reason):
    state = {"opt": {"x": value}}
    with pytest.raises(UnsupportedValueError) as info:
        layout.plan(state)
    same(info.value.path, "state_dict['opt']['x']", "path")
    check(reason in info.value.reason, f"reason {info.value.reason!r} lacks {reason!r}")


def test_arrays_torch_cannot_view_travel_pickled_on_request():
    objects = np.array([{"x": 1}, None], dtype=object)
    reversed_ = np.arange(6)[::-1]
    state = {"objects": objects, "reversed": reversed_, "ok": np.ones(2)}
    plan = layout.plan(state, pickle_unsupported=True)
    same(len(plan.manifest), 1, "only the array torch can view is staged")
    staged, _ = execute(plan)
    same(staged["objects"].tolist(), [{"x": 1}, None], "object array")
    check_array(staged["reversed"], reversed_, "reversed array")
    check_array(staged["ok"], np.ones(2), "staged array")


def test_numpy_scalars_and_subclasses_stay_copied_leaves():
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    state = {"scalar": np.int64(3), "masked": masked}
    staged, plan = stage(state)
    same(len(plan.manifest), 0, "nothing staged")
    same(staged["scalar"], np.int64(3), "scalar")
    same(type(staged["masked"]), np.ma.MaskedArray, "masked array")
    same(staged["masked"].mask.tolist(), [False, True], "mask")


# -- the planner ----------------------------------------------------------------------------------


def array_state(seed: int = 0) -> dict[str, Any]:
    buf = random_array(np.float32, (32,), seed=seed)
    return {
        "w": torch.randn(4, 4),
        "arrays": {"a": random_array(np.int64, (3, 3), seed=seed), "b": buf[:8], "c": buf[8:]},
        "layer": {"x": torch.ones(3), "y": torch.zeros(3)},
        "mixed": [np.float16(1.0), random_array(np.bool_, (5,), seed=seed)],
        "step": 1,
    }


def test_the_planner_reuses_a_layout_with_arrays():
    planner = Planner()
    first = array_state(0)
    planner.plan(first)
    second = array_state(1)  # new arrays of the same dtypes, shapes and sharing
    again = planner.plan(second)
    same((planner.stats.plans, planner.stats.reuses), (1, 1), "plans, reuses")
    assert_manifests_equal(again.manifest, layout.plan(second).manifest)
    check(np.array_equal(again.host, layout.plan(second).host), "host rows")
    check_plan(again)
    staged, _ = execute(again)
    assert_same(staged, second)
    blocks = again.manifest.block.tolist()
    same(blocks[2], blocks[3], "two views of one buffer in one block")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda s: s["arrays"].update(a=torch.from_numpy(s["arrays"]["a"])),
            "array is now a tensor",
        ),
        (lambda s: s["layer"].update(x=s["layer"]["x"].numpy()), "tensor is now an array"),
        (lambda s: s.update(w=s["w"].numpy()), "tensor is now an array"),
        (lambda s: s.update(step=np.arange(2)), "leaf is now"),
        (lambda s: s["arrays"].update(a=s["arrays"]["a"].astype(np.int32)), "dtype"),
        (lambda s: s["arrays"].update(c=s["arrays"]["c"].copy()), "offset"),  # another buffer
        (lambda s: s["arrays"].update(a=np.arange(9)[::-1].reshape(3, 3)), "no longer be staged"),
    ],
    ids=[
        "array-to-tensor",
        "tensor-to-array-in-a-run",
        "tensor-to-array",
        "leaf-to-array",
        "dtype",
        "unshared",
        "unstageable",
    ],  # fmt: skip
)
def test_the_planner_lays_out_again_when_arrays_and_tensors_trade_places(change, reason):
    planner = Planner()
    planner.plan(array_state(0))
    state = array_state(1)
    change(state)
    try:
        got = planner.plan(state)
    except UnsupportedValueError:
        same(reason, "no longer be staged", "refused by the full plan")
        same(planner.stats.reuses, 0, "reuses")
        return
    same((planner.stats.plans, planner.stats.reuses), (2, 0), "plans, reuses")
    last = planner.stats.last_replan or ""
    check(reason in last, f"last replan {last!r} lacks {reason!r}")
    assert_manifests_equal(got.manifest, layout.plan(state).manifest)
    staged, _ = execute(got)
    assert_same(staged, state)


def test_the_planner_reuses_a_layout_with_pickled_arrays():
    planner = Planner(pickle_unsupported=True)
    planner.plan({"o": np.array([1, None], dtype=object), "t": torch.ones(1)})
    again = planner.plan({"o": np.array([2, None], dtype=object), "t": torch.ones(1)})
    same(planner.stats.reuses, 1, "reuses")
    staged, _ = execute(again)
    same(staged["o"].tolist(), [2, None], "the pickled array of the moment")
    # An array that can now be staged is laid out again.
    planner.plan({"o": np.arange(2), "t": torch.ones(1)})
    same(planner.stats.reuses, 1, "no reuse once the array can be staged")


# -- ShmStager ------------------------------------------------------------------------------------


def in_slot(array: np.ndarray, slot: Any) -> bool:
    start = slot.storage.data_ptr()
    address = array.__array_interface__["data"][0]
    return start <= address < start + slot.storage.nbytes()


def test_stage_gives_back_arrays_over_the_slot(stager):
    buf = random_array(np.float32, (16,), seed=5)
    want = buf.copy()
    state = {"head": buf[:4], "all": buf, "t": torch.from_numpy(buf), "n": np.array(7)}
    staged = stager.stage(state)
    handle = stager.handle(staged)
    check(handle is not None, "the stager finds the slot of a state dict of arrays")
    for key in ("head", "all", "n"):
        same(type(staged[key]), np.ndarray, f"{key} type")
        check(in_slot(staged[key], handle.slot), f"{key} views the slot")
        check(np.array_equal(staged[key], state[key]), f"{key} values")
    check(np.shares_memory(staged["all"], staged["head"]), "views of one buffer")
    check(np.shares_memory(staged["all"], staged["t"].numpy()), "the array and the tensor")
    buf[:] = 0  # a snapshot: the source changes, the staged copy does not
    check(np.array_equal(staged["all"], want), "the staged copy changed with its source")
    stager.release(staged)


def test_a_staged_array_keeps_its_slot_busy(stager):
    staged = stager.stage({"a": np.arange(1000, dtype=np.int64), "t": torch.ones(3)})
    slot = stager.handle(staged).slot
    kept = staged["a"]
    del staged
    gc.collect()
    check(slot.referenced(), "a staged array still held keeps the slot referenced")
    same(int(kept[999]), 999, "the kept array")
    del kept
    gc.collect()
    check(not slot.referenced(), "the slot is free once the array is dropped")


def test_stage_reuses_the_layout_with_arrays_and_stages_new_values(stager):
    state = {"a": np.zeros(8, dtype=np.float32), "t": torch.ones(2)}
    first = stager.stage(state)
    state = {"a": np.full(8, 2.0, dtype=np.float32), "t": torch.ones(2)}
    second = stager.stage(state)
    same(stager.plan_stats.reuses, 1, "reuses")
    same(second["a"].tolist(), [2.0] * 8, "new values")
    same(first["a"].tolist(), [0.0] * 8, "the first stage's values")
    stager.release(first)
    stager.release(second)


def test_async_stage_of_arrays():
    with pyshmckpt.ShmStager(async_staging=True, slot_timeout=0.5) as stager:
        a = random_array(np.complex64, (3, 2), seed=6)
        staged = stager.stage({"a": a}).result(timeout=30)
        check_array(staged["a"], a, "array")
        del staged


def test_stage_leased_reads_arrays_through_the_manifest(stager):
    handle = stager.stage_leased({"a": np.arange(6, dtype=np.uint8)})
    try:
        same(handle.manifest.entry(0).array, "numpy", "the manifest marks the array")
        same(int(handle.manifest.flags[0]), NUMPY, "flags")
    finally:
        handle.give_back()


# -- CuPy: an object with __cuda_array_interface__ ------------------------------------------------


def test_an_object_with_the_cuda_array_interface_is_recognised():
    same(arrays.array_flag(FakeCudaArray()), CUPY, "a CUDA array")
    same(arrays.array_flag(np.zeros(1)), NUMPY, "a NumPy array")
    same(arrays.array_flag(torch.zeros(1)), 0, "a tensor is not an array")
    same(arrays.array_flag(np.float32(1)), 0, "a NumPy scalar is not an array")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks staging where CUDA cannot be used")
def test_a_cuda_array_without_cuda_is_refused_naming_the_key_path(stager):
    state = {"model": {"w": torch.ones(2)}, "extra": [1, FakeCudaArray()]}
    with pytest.raises(CudaUnavailableError) as info:
        stager.stage(state)
    check(isinstance(info.value, UnsupportedValueError), "an UnsupportedValueError too")
    same(info.value.path, "state_dict['extra'][1]", "path")
    check("needs CUDA" in info.value.reason, f"reason: {info.value.reason!r}")
    check(stager.arena is None, "nothing was staged")
    # The stager stays usable.
    staged = stager.stage({"w": torch.ones(2)})
    stager.release(staged)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks staging where CUDA cannot be used")
def test_a_cuda_array_without_cuda_travels_pickled_on_request():
    planner = Planner(pickle_unsupported=True)
    plan = planner.plan({"x": FakeCudaArray((2, 3))})
    same(len(plan.manifest), 0, "nothing staged")
    leaf = plan.manifest.tree.children[0]
    check(isinstance(leaf.value, Pickled), "a pickled leaf")
    same(leaf.value.value.shape, (2, 3), "the object, unpickled")
    planner.plan({"x": FakeCudaArray((2, 3))})
    same(planner.stats.reuses, 1, "the layout is reused")


def test_array_rows_never_carry_parameter_flags():
    plan = layout.plan({"p": torch.nn.Parameter(torch.ones(2)), "a": np.ones(2)})
    same(plan.manifest.flags.tolist(), [PARAMETER | REQUIRES_GRAD, NUMPY], "flags")


class CudaArrayOf:
    """A CUDA tensor's memory through ``__cuda_array_interface__`` alone, as CuPy exposes its own."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.tensor.__cuda_array_interface__


@pytest.mark.gpu
def test_cuda_arrays_are_staged_from_the_device(stager):
    source = torch.randn(64, 3, device="cuda")
    shared_buffer = torch.arange(32, dtype=torch.int32, device="cuda")
    state = {
        "x": CudaArrayOf(source),
        "whole": CudaArrayOf(shared_buffer),
        "t": torch.ones(4, device="cuda"),
    }
    staged = stager.stage(state)
    check_array(staged["x"], source.cpu().numpy(), "a CUDA array")
    check_array(staged["whole"], shared_buffer.cpu().numpy(), "another CUDA array")
    same(stager.handle(staged).manifest.flags.tolist(), [CUPY, CUPY, 0], "flags")
    source.fill_(0)  # a snapshot
    check(not np.array_equal(staged["x"], np.zeros((64, 3), np.float32)), "staged copy changed")
    stager.release(staged)
    again = stager.stage({**state, "x": CudaArrayOf(torch.ones(64, 3, device="cuda"))})
    same(stager.plan_stats.reuses, 1, "the layout is reused")
    check_array(again["x"], np.ones((64, 3), np.float32), "the new values")
    stager.release(again)
