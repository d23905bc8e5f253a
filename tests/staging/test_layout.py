"""Layout of state dicts in a slot (pyshmckpt/staging/layout.py): plan(), Manifest, rebuild().

Most tests run a plan into an ordinary byte buffer (``execute``, from layout_checks, does what
the stager does), so the layout is tested on its own; the ``stager`` tests repeat the important
cases through the real ShmStager and its shared-memory slots.

Every check raises explicitly (``check``/``same``) instead of using ``assert``, so the suite still
checks something when it runs under ``python -O`` (PYTHONOPTIMIZE=1).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import io
import math
import pickle
import threading
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyshmckpt import SlotState, TensorEntry, UnsupportedValueError, knobs
from pyshmckpt.staging import layout
from pyshmckpt.staging.manifest import (
    DTYPES,
    PARAMETER,
    REQUIRES_GRAD,
    Manifest,
    build,
    contiguous_stride,
    dtype_name,
    rebuild,
)

from helpers import buffer_storage
from layout_checks import (
    COMPLEX_DTYPES,
    SLOT_OFFSET,
    Point,
    assert_identity_and_aliasing,
    assert_manifests_equal,
    assert_same,
    check,
    check_plan,
    element_bytes,
    execute,
    quiet,
    random_tensor,
    same,
    state_dicts,
)

# torch warns once per process that ComplexHalf support is experimental (on the first complex32
# tensor, here or in a slot's rebuild base) and that quantized dtypes are deprecated (on the first
# quantized tensor, including torch.empty(dtype=qint8) in a slot's base); which test triggers them
# first depends on the order.
pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
]

QUANTIZED_DTYPES = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPE_NAMES = sorted(DTYPES)
# Dtypes for which torch itself can copy a non-dense tensor (needed for gathered views).
COPYABLE_DTYPES = [
    torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
]  # fmt: skip


# -- checks that survive python -O ------------------------------------------------------------


# -- running a plan without the stager ----------------------------------------------------------


def check_gaps_zeroed(manifest: Manifest, buf: torch.Tensor, slot_offset: int) -> None:
    """Every byte of [0, manifest.size) outside the blocks is zero in a buffer `execute` filled
    (it starts as a poison pattern, as a slot starts with an earlier stage's bytes)."""
    covered = torch.zeros(manifest.size, dtype=torch.bool)
    for offset, nbytes in manifest.blocks.tolist():
        covered[offset : offset + nbytes] = True
    region = buf[slot_offset : slot_offset + manifest.size]
    stale = torch.count_nonzero(region[~covered]).item()
    same(stale, 0, "non-zero bytes in the gaps between blocks")


def roundtrip(state_dict: Any, slot_offset: int = SLOT_OFFSET) -> Any:
    """plan -> fill a buffer -> rebuild, checking the plan and the result on the way."""
    plan = layout.plan(state_dict)
    check_plan(plan)
    staged, buf = execute(plan, slot_offset)
    check_gaps_zeroed(plan.manifest, buf, slot_offset)
    assert_same(staged, state_dict)
    assert_identity_and_aliasing(staged, state_dict, plan)
    return staged


def stage_and_check(stager, state_dict: Any) -> Any:
    staged = stager.stage(state_dict)
    assert_same(staged, state_dict)
    assert_identity_and_aliasing(staged, state_dict, layout.plan(state_dict))
    handle = stager.handle(staged)
    check(handle is not None, "stager.handle() does not know the staged state dict")
    reference = layout.plan(state_dict).manifest
    assert_manifests_equal(handle.manifest, reference)
    return staged


# -- tensors ------------------------------------------------------------------------------------


def make_or_skip(name: str, shape: tuple[int, ...] = (4, 6), seed: int = 0) -> torch.Tensor:
    dtype = DTYPES[name]
    try:
        with quiet():
            return random_tensor(dtype, shape, seed)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch cannot create a CPU tensor of {name}: {exc}")


def dense_views(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The contiguous tensor x (4, 6) and views of it that need no gather (dense or overlapping)."""
    return {
        "x": x,
        "scalar": x[1, 2],  # 0-d, at an element offset
        "rows": x[1:3],  # offset view, contiguous
        "empty": x[:0],  # shape (0, 6)
        "empty_cols": x[:, :0],  # shape (4, 0)
        "transposed": x.t(),  # permuted dense
        "permuted": x.reshape(2, 2, 6).permute(2, 0, 1),
        "expanded": x[1:2].expand(3, 6),  # stride 0
        "broadcast": x[2, 3].expand(2, 5),  # all strides 0
    }


@pytest.mark.parametrize("name", ALL_DTYPE_NAMES)
def test_every_dtype_round_trips_bitwise(name):
    x = make_or_skip(name)
    state = {"dense": dense_views(x), "other": make_or_skip(name, (7,), seed=1)}
    if DTYPES[name] in QUANTIZED_DTYPES:
        # Without its quantizer a quantized dtype cannot be restored: refused up front.
        with pytest.raises(UnsupportedValueError, match="quantized"):
            layout.plan(state)
        return
    plan = layout.plan(state)
    same(plan.gathers, [], "gathers for dense views")
    staged = roundtrip(state)
    same(dtype_name(staged["other"].dtype), name, "dtype name")
    for key, view in state["dense"].items():
        same(staged["dense"][key].stride(), view.stride(), f"stride of {key}")
    # Views of one tensor come back as views of one block, placed as in the source.
    base = staged["dense"]["x"]
    itemsize = x.element_size()
    for key in ("scalar", "rows", "transposed", "expanded", "broadcast"):
        same(
            staged["dense"][key].data_ptr() - base.data_ptr(),
            state["dense"][key].storage_offset() * itemsize,
            f"placement of {key}",
        )


@pytest.mark.parametrize("name", ALL_DTYPE_NAMES)
def test_every_dtype_round_trips_through_the_stager(stager, name):
    x = make_or_skip(name)
    state = {"dense": dense_views(x), "other": make_or_skip(name, (7,), seed=1)}
    if DTYPES[name] in QUANTIZED_DTYPES:
        with pytest.raises(UnsupportedValueError, match="quantized"):
            stager.stage(state)
        check(stager.arena is None or stager.arena.idle(), "no slot was taken")
        return
    staged = stage_and_check(stager, state)
    for key, view in state["dense"].items():
        same(staged["dense"][key].stride(), view.stride(), f"stride of {key}")
    stager.release(staged)


def test_float_nans_signed_zeros_and_infinities_keep_their_bits():
    values = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1.5], dtype=torch.float32
    )
    bits = np.array([0x7FC00001, 0xFFC12345, 0x7F800001], dtype=np.uint32).view(np.int32)
    payload_nan = torch.from_numpy(bits).view(torch.float32)
    state = {
        "f32": values,
        "payloads": payload_nan,
        "f16": values.to(torch.float16),
        "bf16": values.to(torch.bfloat16),
        "f64": values.to(torch.float64),
        "c64": torch.complex(values, values.flip(0)),
        "nan_leaf": math.nan,
        "neg_zero_leaf": -0.0,
    }
    staged = roundtrip(state)
    same(math.copysign(1.0, staged["neg_zero_leaf"]), -1.0, "sign of -0.0 leaf")
    check(
        torch.equal(staged["payloads"].view(torch.int32), payload_nan.view(torch.int32)),
        "NaN payloads",
    )


@pytest.mark.parametrize("dtype", COPYABLE_DTYPES, ids=dtype_name)
def test_non_dense_views_are_gathered_densely(dtype):
    x = random_tensor(dtype, (6, 8), seed=3)
    state = {
        "x": x,
        "step_rows": x[::2],
        "step_cols": x[:, 1::3],
        "block": x[1:4, 2:5],  # offset view with gaps
        "t_step": x.t()[::3],
        "diagonal": x.diagonal(),
    }
    plan = layout.plan(state)
    gathered = {id(source) for _, source in plan.gathers}
    same(gathered, {id(state[k]) for k in state if k != "x"}, "gathered tensors")
    staged = roundtrip(state)
    for key in state:
        check(staged[key].is_contiguous(), f"{key} was not gathered densely")


@pytest.mark.parametrize("slot_offset", [0, 64, 4096 + 16])
def test_slot_offset_of_the_buffer_is_honoured(slot_offset):
    x = torch.arange(40, dtype=torch.float64).reshape(5, 8)
    state = {"x": x, "view": x[1:, 2:].t(), "c": x.to(torch.complex128)[::2].conj(), "b": x > 3}
    roundtrip(state, slot_offset)


def test_zero_dim_and_empty_tensors():
    state = {
        "scalar_f": torch.tensor(3.5),
        "scalar_i": torch.tensor(-7, dtype=torch.int64),
        "scalar_b": torch.tensor(True),
        "scalar_c": torch.tensor(1 + 2j, dtype=torch.complex64),
        "empty": torch.empty(0, 3),
        "empty_1d": torch.empty(0, dtype=torch.int16),
        "empty_mid": torch.empty(2, 0, 4, dtype=torch.bfloat16),
        "empty_param": torch.nn.Parameter(torch.empty(0, 3)),
        "empty_grad": torch.empty(0, requires_grad=True),
    }
    plan = layout.plan(state)
    m = plan.manifest
    staged = roundtrip(state)
    for i, (key, want) in enumerate(state.items()):
        same(m.paths()[i], (key,), f"path of {key}")
        same(staged[key].stride(), want.stride(), f"stride of {key}")
        if want.numel() == 0:
            same(int(m.block[i]), -1, f"block of {key}")
            same(int(m.nbytes[i]), 0, f"nbytes of {key}")
    same(staged["empty_param"].requires_grad, True, "empty parameter requires_grad")

    only_empty = layout.plan({"a": torch.empty(0, 3), "b": [torch.empty(0)]})
    same(only_empty.manifest.size, 0, "size of a state dict of empty tensors")
    same(only_empty.manifest.blocks.shape, (0, 2), "blocks of a state dict of empty tensors")
    same(only_empty.host.shape, (0, 3), "host entries of a state dict of empty tensors")
    roundtrip({"a": torch.empty(0, 3), "b": [torch.empty(0)]})


def test_empty_state_dicts_and_bare_values():
    for state in ({}, [], (), collections.OrderedDict()):
        plan = layout.plan(state)
        same(len(plan.manifest), 0, "tensors")
        same(plan.manifest.size, 0, "size")
        same(plan.manifest.paths(), [], "paths")
        same(plan.manifest.entries(), [], "entries")
        roundtrip(state)
    # The state dict may itself be a tensor or a leaf.
    t = torch.arange(5)
    staged = roundtrip(t)
    same(layout.plan(t).manifest.paths(), [()], "path of a bare tensor")
    check(staged is not t, "a bare tensor was not staged")
    same(roundtrip(42), 42, "bare leaf")


def test_strides_of_expanded_and_permuted_tensors_are_kept():
    x = torch.randn(3, 4)
    nchw = torch.randn(2, 3, 4, 5)
    state = {
        "expanded": torch.randn(3, 1).expand(3, 5),
        "expanded_front": torch.randn(4).expand(2, 3, 4),
        "transposed": x.t(),
        "permuted": torch.randn(2, 3, 4).permute(1, 2, 0),
        "channels_last": nchw.to(memory_format=torch.channels_last),
        "channels_last_3d": torch.randn(2, 3, 2, 2, 2).to(memory_format=torch.channels_last_3d),
        "overlapping": torch.arange(10.0).as_strided((4, 3), (2, 1)),
    }
    plan = layout.plan(state)
    same(plan.gathers, [], "gathers")
    staged = roundtrip(state)
    for key, want in state.items():
        same(staged[key].stride(), want.stride(), f"stride of {key}")
        same(
            plan.manifest.entry(list(state).index(key)).stride,
            want.stride(),
            f"manifest stride {key}",
        )
    # An expanded tensor stages only the bytes it reaches, not numel * itemsize.
    expanded = torch.randn(1, 1).expand(1000, 1000)
    small = layout.plan({"e": expanded}).manifest
    check(int(small.blocks[:, 1].sum()) <= 16, f"expanded tensor staged {small.blocks} bytes")
    same(int(small.nbytes[0]), 1000 * 1000 * 4, "nbytes of the expanded tensor")
    roundtrip({"e": expanded})


def test_a_small_view_of_a_large_storage_stages_only_what_it_reaches():
    big = torch.arange(1 << 20, dtype=torch.float32)
    state = {"tail": big[-3:], "strided": big[5000:6000:500]}
    m = layout.plan(state).manifest
    # tail: one block from 16 bytes below its start; strided: gathered into 2 elements.
    check(m.size <= knobs.alignment() + 16, f"staged {m.size} bytes for 5 elements")
    staged = roundtrip(state)
    same(staged["tail"].tolist(), [float((1 << 20) - k) for k in (3, 2, 1)], "tail values")


@pytest.mark.parametrize("dtype", COMPLEX_DTYPES, ids=dtype_name)
def test_lazy_conj_views_materialize(dtype):
    z = torch.randn(4, 5, dtype=torch.complex128).to(dtype)
    check(z.conj().is_conj(), "torch did not make a lazy conj view")
    state = {
        "z": z,
        "conj": z.conj(),
        "conj_t": z.t().conj(),
        "conj_step": z[::2].conj(),
        "conj_expanded": z[0].conj().expand(3, 5),
        "conj_scalar": z[1, 1].conj(),
    }
    plan = layout.plan(state)
    same(
        {id(s) for _, s in plan.gathers},
        {id(state[k]) for k in state if k != "z"},
        "gathered conj views",
    )
    staged = roundtrip(state)
    for key in state:
        check(not staged[key].is_conj(), f"{key} came back with the conj bit")
    check(
        torch.equal(element_bytes(staged["conj"]), element_bytes(z.conj().resolve_conj())), "conj"
    )
    # The source of the conj views is itself staged unconjugated.
    check(torch.equal(element_bytes(staged["z"]), element_bytes(z)), "base of conj views")


def test_lazy_neg_views_materialize():
    z = torch.randn(3, 4, dtype=torch.complex64)
    imag = z.conj().imag
    neg = torch._neg_view(torch.randn(2, 3))
    check(imag.is_neg() and neg.is_neg(), "torch did not make lazy neg views")
    state = {"imag_of_conj": imag, "neg": neg, "neg_t": torch._neg_view(torch.randn(3, 2)).t()}
    plan = layout.plan(state)
    same(len(plan.gathers), 3, "gathered neg views")
    staged = roundtrip(state)
    check(torch.equal(staged["imag_of_conj"], -z.imag), "imag of conj")
    check(torch.equal(staged["neg"], neg.resolve_neg()), "neg view")
    for key in state:
        check(not staged[key].is_neg(), f"{key} came back with the neg bit")


def test_lazy_views_through_the_stager(stager):
    z = torch.randn(3, 4, dtype=torch.complex64)
    state = {"z": z, "conj": z.conj(), "imag": z.conj().imag, "step": z[:, ::2], "t": z.t()}
    staged = stage_and_check(stager, state)
    check(torch.equal(staged["conj"], z.conj().resolve_conj()), "conj through the stager")
    same(staged["t"].stride(), z.t().stride(), "stride of the transposed view")


# -- containers, keys and leaves ----------------------------------------------------------------


class AttrDict(dict):
    pass


class TaggedList(list):
    pass


class Pair(NamedTuple):
    first: Any
    second: Any


class DefaultDictSub(collections.defaultdict):
    pass


class Box:
    """A custom leaf: copied with copy.deepcopy at plan time."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __eq__(self, other: object) -> bool:
        return type(other) is Box and other.items == self.items

    __hash__ = None  # type: ignore[assignment]


def nested_containers() -> Any:
    t = torch.arange(6.0).reshape(2, 3)
    factory_dd: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    factory_dd["x"].append(1)
    factory_dd["t"] = t  # type: ignore[assignment]
    return {
        "dict": {"a": t, "b": 1},
        "ordered": collections.OrderedDict([("z", torch.ones(2)), ("a", 2)]),
        "defaultdict": factory_dd,
        "attrdict": AttrDict(w=torch.zeros(3), n=None),
        "list": [torch.ones(1), "s", [torch.ones(2)]],
        "tagged": TaggedList([torch.ones(3), 4]),
        "tuple": (torch.ones(2, dtype=torch.int8), (1, (2,))),
        "point": Point(torch.ones(2), Point(3, torch.zeros(1))),
        "pair": Pair(first=[torch.ones(1)], second={"k": torch.ones(1)}),
        "nested": {"l": [({"d": [torch.full((2,), 7.0)]},)]},
    }


def test_container_types_are_preserved_exactly():
    state = nested_containers()
    staged = roundtrip(state)
    same(type(staged["defaultdict"]), collections.defaultdict, "defaultdict type")
    check(staged["defaultdict"].default_factory is list, "default_factory")
    same(staged["defaultdict"]["missing"], [], "default_factory still works")
    same(type(staged["point"]), Point, "namedtuple type")
    same(staged["point"]._fields, ("x", "y"), "namedtuple fields")
    same(type(staged["pair"]), Pair, "typing.NamedTuple type")
    same(type(staged["tagged"]), TaggedList, "list subclass type")
    same(type(staged["attrdict"]), AttrDict, "dict subclass type")
    same(list(staged["ordered"]), ["z", "a"], "OrderedDict order")


def test_deep_nesting():
    depth = 120
    state: Any = torch.arange(3)
    for i in range(depth):
        state = [state] if i % 3 == 0 else ({"k": state} if i % 3 == 1 else (state, i))
    plan = layout.plan(state)
    same(len(plan.manifest.paths()[0]), depth, "length of the deep key path")
    roundtrip(state)


def test_dict_key_types_and_order():
    t = torch.randn(2)
    state = {
        3: t,
        "3": torch.randn(3),
        (1, "a"): torch.randn(1),
        (): 5,
        None: "none key",
        2.5: [t],
        b"bytes": torch.zeros(1),
        frozenset({1}): "fs",
        -1: {("nested", 2): torch.ones(2)},
    }
    staged = roundtrip(state)
    same(list(staged), list(state), "keys")
    same([type(k) for k in staged], [type(k) for k in state], "key types")
    paths = layout.plan(state).manifest.paths()
    same(paths, [(3,), ("3",), ((1, "a"),), (b"bytes",), (-1, ("nested", 2))], "paths")


class Color:
    RED = "red"


def test_leaves_are_kept_and_copied():
    box = Box([1, [2, 3]])
    scalar = np.float32(0.5)  # a NumPy scalar is a leaf (arrays are staged: test_arrays.py)
    mutable = {1, 2}
    state = {
        "none": None,
        "bool": True,
        "int": 1 << 70,
        "float": 2.5,
        "complex": 1 - 2j,
        "str": "text",
        "bytes": b"\x00\xff",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "range": range(3, 9, 2),
        "class": Color,
        "box": box,
        "scalar": scalar,
        "set": mutable,
        "bytearray": bytearray(b"ab"),
    }
    plan = layout.plan(state)
    same(len(plan.manifest), 0, "tensors in a state dict of leaves")
    # Mutating the originals after planning does not change the staged leaves: they are copies.
    box.items[1].append(4)
    mutable.add(3)
    state["bytearray"][0] = ord("z")
    state["int"] = 0
    state["new"] = "added later"
    staged, _ = execute(plan)
    same(list(staged), [k for k in state if k != "new"], "keys")
    same(staged["box"], Box([1, [2, 3]]), "custom object")
    check(staged["box"] is not box, "custom object was not copied")
    same(staged["scalar"], np.float32(0.5), "numpy scalar")
    same(type(staged["scalar"]), np.float32, "type of the numpy scalar")
    same(staged["set"], {1, 2}, "set")
    same(staged["bytearray"], bytearray(b"ab"), "bytearray")
    same(staged["int"], 1 << 70, "int")
    for key in ("none", "bool", "dtype", "size", "device", "range", "class", "str", "bytes"):
        check(staged[key] is state[key] or staged[key] == state[key], f"leaf {key}")
        same(type(staged[key]), type(state[key]), f"type of leaf {key}")
    same(staged["size"], torch.Size([2, 3]), "torch.Size")


def test_structure_is_snapshotted_at_plan_time():
    t = torch.ones(2)
    inner = [t, 1]
    state = {"inner": inner, "d": {"a": 1}}
    plan = layout.plan(state)
    inner.append(torch.zeros(5))
    inner[1] = "changed"
    state["d"]["b"] = 2
    del state["inner"]
    staged, _ = execute(plan)
    same(list(staged), ["inner", "d"], "keys")
    same(len(staged["inner"]), 2, "length of the inner list")
    same(staged["inner"][1], 1, "inner leaf")
    same(staged["d"], {"a": 1}, "inner dict")


def test_a_container_shared_in_two_places_is_not_a_cycle():
    shared = [torch.ones(2), {"x": 1}]
    state = {"a": shared, "b": shared, "c": (shared, shared)}
    staged = roundtrip(state)
    check(staged["a"][0] is staged["b"][0], "the shared tensor is one object")


def test_counter_is_rebuilt_with_its_counts():
    state = {"counts": collections.Counter({"a": 3, "b": 1}), "t": torch.ones(1)}
    staged, _ = execute(layout.plan(state))
    same(staged["counts"], collections.Counter({"a": 3, "b": 1}), "Counter")


def test_defaultdict_subclass_is_rebuilt():
    state = {"dd": DefaultDictSub(list, {"a": torch.ones(2)})}
    staged, _ = execute(layout.plan(state))
    assert_same(staged, state)


# -- aliasing, identity, parameters -------------------------------------------------------------


def test_tied_weights_share_storage_and_writes():
    w = torch.randn(5, 4)
    tied = w.detach()  # another tensor object over the same storage
    check(
        tied is not w and tied.untyped_storage().data_ptr() == w.untyped_storage().data_ptr(),
        "setup",
    )
    state = {"embed": {"weight": w}, "head": {"weight": tied}, "other": torch.randn(5, 4)}
    m = layout.plan(state).manifest
    same(int(m.block[0]), int(m.block[1]), "tied weights share a block")
    check(int(m.block[2]) != int(m.block[0]), "an unrelated tensor got the same block")
    same(len(m.blocks), 2, "number of blocks")
    staged = roundtrip(state)
    a, b, c = staged["embed"]["weight"], staged["head"]["weight"], staged["other"]
    check(a is not b, "tied weights were merged into one object")
    same(a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr(), "shared storage")
    same(a.data_ptr(), b.data_ptr(), "same data pointer")
    a[0, 0] = 1234.5
    same(b[0, 0].item(), 1234.5, "write through the tied weight")
    check(not torch.any(c == 1234.5), "write leaked into an unrelated tensor")


def test_the_same_tensor_object_comes_back_as_one_object():
    t = torch.randn(3)
    p = torch.nn.Parameter(torch.randn(2))
    state = {"a": t, "b": [t, {"c": t}], "p": p, "q": (p,)}
    m = layout.plan(state).manifest
    same(len(m), 2, "distinct tensors")
    same(m.paths(), [("a",), ("p",)], "paths of first occurrences")
    staged = roundtrip(state)
    check(staged["a"] is staged["b"][0] is staged["b"][1]["c"], "identity of t")
    check(staged["p"] is staged["q"][0], "identity of p")


def test_views_of_other_dtypes_over_one_storage():
    x = torch.randn(8, dtype=torch.float64)
    state = {
        "x": x,
        "as_int32": x.view(torch.int32),
        "as_bytes_slice": x.view(torch.uint8)[3:21],
        "as_int16_tail": x.view(torch.int16)[-5:],
        "as_complex": x.view(torch.complex128)[1:3],
        "as_int8_window": x.view(torch.int8)[5:9],
    }
    m = layout.plan(state).manifest
    same(len(set(m.block.tolist())), 1, "one block for all views")
    staged = roundtrip(state)
    staged["as_int32"][0] = 0x01020304
    same(staged["as_bytes_slice"][:1].tolist(), [0x01], "write through an int32 view seen as bytes")
    check(
        torch.equal(staged["x"].view(torch.int32)[0], torch.tensor(0x01020304, dtype=torch.int32)),
        "write through an int32 view seen from the float64 tensor",
    )


def test_views_of_other_dtypes_that_start_at_odd_bytes():
    """A block starts 16-byte aligned within its storage, so wider members stay aligned."""
    x = torch.randn(6, dtype=torch.float64)
    state = {
        "odd_bytes": x.view(torch.uint8)[3:13],
        "wide": x[1:],
        "c": x.view(torch.complex128)[2],
    }
    m = layout.plan(state).manifest
    same(len(m.blocks), 1, "blocks")
    same(int(m.offset[1]) - int(m.offset[0]), 8 - 3, "relative offset of the views")
    staged = roundtrip(state)
    same(staged["wide"].data_ptr() - staged["odd_bytes"].data_ptr(), 5, "placement")
    for key in state:
        same(staged[key].data_ptr() % staged[key].element_size(), 0, f"alignment of {key}")


def test_a_tensor_in_two_places_with_slices_of_it():
    t = torch.arange(24.0).reshape(4, 6)
    state = {
        "w": t,
        "again": [t],
        "rows": t[1:3],
        "cols": t[:, 1:3],  # gaps: gathered
        "row": t[2],
        "elem": t[3, 5],
    }
    staged = roundtrip(state)
    w = staged["w"]
    check(staged["again"][0] is w, "repeated tensor is one object")
    itemsize = t.element_size()
    same(staged["rows"].data_ptr() - w.data_ptr(), 6 * itemsize, "placement of the row slice")
    same(staged["elem"].data_ptr() - w.data_ptr(), 23 * itemsize, "placement of the element")
    staged["rows"][0, 0] = -1.0
    same(w[1, 0].item(), -1.0, "write into a slice seen in its base")
    same(staged["row"].storage_offset() - w.storage_offset(), 12, "storage offset of t[2]")
    check(torch.equal(staged["cols"], t[:, 1:3]), "gathered column slice")


def test_parameters_and_requires_grad_are_kept():
    state = {
        "param": torch.nn.Parameter(torch.randn(3)),
        "frozen": torch.nn.Parameter(torch.randn(3), requires_grad=False),
        "grad": torch.randn(2, requires_grad=True),
        "non_leaf": torch.randn(2, requires_grad=True) * 2,
        "plain": torch.randn(2),
        "param_t": torch.nn.Parameter(torch.randn(3, 2)).t(),  # non-leaf view of a parameter
        "scalar_param": torch.nn.Parameter(torch.tensor(1.5)),
    }
    m = layout.plan(state).manifest
    flags = dict(zip(state, m.flags.tolist(), strict=True))
    same(flags["param"], PARAMETER | REQUIRES_GRAD, "flags of a parameter")
    same(flags["frozen"], PARAMETER, "flags of a frozen parameter")
    same(flags["grad"], REQUIRES_GRAD, "flags of a tensor that requires grad")
    same(flags["plain"], 0, "flags of a plain tensor")
    staged = roundtrip(state)
    same(type(staged["param"]), torch.nn.Parameter, "parameter type")
    same(type(staged["frozen"]), torch.nn.Parameter, "frozen parameter type")
    same(type(staged["grad"]), torch.Tensor, "tensor type")
    for key in state:
        same(staged[key].requires_grad, state[key].requires_grad, f"requires_grad of {key}")
        check(staged[key].is_leaf, f"{key} is not a leaf")
        check(staged[key].grad_fn is None, f"{key} has a grad_fn")


def test_parameters_through_the_stager(stager):
    p = torch.nn.Parameter(torch.randn(3, 4))
    state = {"p": p, "again": p, "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False)}
    state["grad"] = torch.randn(2, requires_grad=True)
    state["plain"] = torch.zeros(2)
    staged = stage_and_check(stager, state)
    check(staged["p"] is staged["again"], "repeated parameter is one object")
    same(type(staged["frozen"]), torch.nn.Parameter, "frozen parameter type")
    check(not staged["plain"].requires_grad, "plain tensor gained requires_grad")
    stager.release(staged)


def test_gathering_a_tensor_that_requires_grad_leaves_others_alone(stager):
    w = torch.randn(4, 8, requires_grad=True)
    state = {"plain": torch.zeros(3), "grad_view": w[:, ::2]}
    staged = stager.stage(state)
    same(staged["grad_view"].requires_grad, True, "requires_grad of the gathered view")
    same(staged["plain"].requires_grad, False, "requires_grad of a plain tensor")
    stager.release(staged)


def test_staged_tensors_of_a_trained_model(trained):
    model, optimizer = trained
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1}
    staged = roundtrip(state)
    emb, head = staged["model"]["embed.weight"], staged["model"]["head.weight"]
    check(emb is not head, "tied weights merged")
    same(emb.data_ptr(), head.data_ptr(), "tied weights share memory")
    with torch.no_grad():
        emb[0, 0] = 42.0
    same(head[0, 0].item(), 42.0, "write through tied weights")
    same(
        staged["optim"]["param_groups"][0]["betas"],
        optimizer.state_dict()["param_groups"][0]["betas"],
        "betas",
    )

    live = {"model": model.state_dict(keep_vars=True)}
    staged_live = roundtrip(live)
    check(
        staged_live["model"]["embed.weight"] is staged_live["model"]["head.weight"],
        "a tied Parameter object comes back as one object",
    )
    same(type(staged_live["model"]["pos"]), torch.nn.Parameter, "parameter type")


def test_trained_model_through_the_stager(stager, trained):
    model, optimizer = trained
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    staged = stage_and_check(stager, state)
    same(
        staged["model"]["embed.weight"].data_ptr(),
        staged["model"]["head.weight"].data_ptr(),
        "tied weights share memory in the slot",
    )
    stager.release(staged)


# -- manifest ------------------------------------------------------------------------------------


def manifest_state() -> Any:
    x = torch.randn(6, 4)
    p = torch.nn.Parameter(torch.randn(3))
    return {
        "x": x,
        "xt": x.t(),
        "gathered": x[:, ::2],
        "p": p,
        "ints": [torch.arange(5, dtype=torch.int16), torch.tensor(7)],
        "empty": torch.empty(0, 2, dtype=torch.bfloat16),
        "point": Point(x, torch.ones(2, dtype=torch.complex64).conj()),
        "dd": collections.defaultdict(int, {"k": torch.zeros(1)}),
        "attr": AttrDict(a=TaggedList([p])),
        (1, "key"): Pair(1.5, None),
    }


def test_block_alignment_and_disjoint_blocks():
    sizes = [1, 3, 7, 15, 16, 17, 63, 64, 65, 100]
    dtypes = [torch.uint8, torch.float16, torch.float32, torch.float64, torch.complex128]
    state = {f"{dtype_name(d)}_{n}": random_tensor(d, (n,), seed=n) for d in dtypes for n in sizes}
    state["odd_view"] = torch.arange(100, dtype=torch.uint8)[3:10]
    plan = layout.plan(state)
    m = plan.manifest
    check_plan(plan)
    same(len(m.blocks), len(state), "one block per storage")
    offsets = m.blocks[:, 0].tolist()
    check(all(o % 64 == 0 for o in offsets), f"unaligned blocks: {offsets}")
    check(offsets == sorted(offsets), "blocks not in slot order")
    ends = (m.blocks[:, 0] + m.blocks[:, 1]).tolist()
    check(all(e <= nxt for e, nxt in zip(ends[:-1], offsets[1:], strict=True)), "blocks overlap")
    check(ends[-1] == m.size, "last block does not end at manifest.size")
    roundtrip(state)


def test_alignment_knob(monkeypatch):
    monkeypatch.setenv("PYSHMCKPT_ALIGNMENT", "4096")
    state = {"a": torch.ones(3), "b": torch.ones(5, dtype=torch.float64), "c": torch.ones(2)[::2]}
    plan = layout.plan(state)
    check(all(o % 4096 == 0 for o in plan.manifest.blocks[:, 0].tolist()), "4096 alignment")
    check_plan(plan)
    roundtrip(state)


def test_gaps_between_blocks_are_zero_filled_by_host_rows():
    """One host row per CPU block, then one per gap: the padding after every block but the last,
    read from zeros. Without them a slot keeps an earlier stage's bytes between blocks."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"a": torch.ones(3), "g": x[:, ::4], "b": torch.ones(16), "c": torch.ones(5)}
    plan = layout.plan(state)
    check_plan(plan)
    m = plan.manifest
    same(len(plan.gathers), 1, "gathered views")
    # Blocks: a (12 bytes), g gathered (8 x 4 bytes), b (64 bytes: no gap), c (20, last).
    same(m.blocks.tolist(), [[0, 12], [64, 32], [128, 64], [192, 20]], "blocks")
    same(len(plan.host), 3 + 2, "host rows: three CPU blocks copied, two gaps zeroed")
    same(plan.host[3:, 1:].tolist(), [[12, 52], [96, 32]], "gap rows (offset, nbytes)")
    same(m.size, 212, "manifest.size ends at the last block's data")
    staged, buf = execute(plan)
    check_gaps_zeroed(m, buf, SLOT_OFFSET)
    same(buf[SLOT_OFFSET + m.size].item(), 0xA5, "nothing written past manifest.size")
    assert_same(staged, state)


def test_gap_rows_cost_nothing_without_gaps():
    plan = layout.plan({f"w{i}": torch.ones(16) for i in range(8)})  # 64 bytes each
    same(len(plan.host), 8, "host rows")
    same(layout.plan({"only": torch.ones(3)}).host.shape, (1, 3), "a single block has no gap")


def test_gaps_wider_than_the_default_zero_buffer(monkeypatch):
    monkeypatch.setenv("PYSHMCKPT_ALIGNMENT", str(1 << 16))
    state = {"a": torch.ones(3), "b": torch.ones(70_000, dtype=torch.uint8), "c": torch.ones(2)}
    plan = layout.plan(state)
    check_plan(plan)  # reads every gap row's source: all zeros
    same(plan.host[3:, 2].tolist(), [(1 << 16) - 12, 2 * (1 << 16) - 70_000], "gap sizes")
    staged, buf = execute(plan)
    check_gaps_zeroed(plan.manifest, buf, SLOT_OFFSET)
    assert_same(staged, state)
    monkeypatch.delenv("PYSHMCKPT_ALIGNMENT")
    check_plan(layout.plan(state))  # smaller alignments keep working after the buffer grew


def test_manifest_pickles_and_rebuilds_the_same():
    state = manifest_state()
    plan = layout.plan(state)
    m = plan.manifest
    clone = pickle.loads(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))
    check(isinstance(clone, Manifest), "unpickled type")
    assert_manifests_equal(clone, m)
    same(clone.paths(), m.paths(), "paths after pickling")
    same(clone.entries(), m.entries(), "entries after pickling")
    staged, buf = execute(plan)
    again = rebuild(clone, buf.untyped_storage(), SLOT_OFFSET)
    assert_same(again, state)
    assert_same(again, staged)
    assert_identity_and_aliasing(again, state, plan)


def test_entries_and_paths_agree_with_the_columns():
    state = manifest_state()
    plan = layout.plan(state)
    m = plan.manifest
    entries = m.entries()
    same(len(entries), len(m), "number of entries")
    same(
        m.paths(),
        [("x",), ("xt",), ("gathered",), ("p",), ("ints", 0), ("ints", 1), ("empty",),
         ("point", 1), ("dd", "k")],
        "paths",
    )  # fmt: skip
    gathered = {i for i, _ in plan.gathers}
    pos = 0
    for i, entry in enumerate(entries):
        check(isinstance(entry, TensorEntry), "entry type")
        same(m.entry(i), entry, f"entry({i})")
        source = plan.sources[i]
        ndim = int(m.ndim[i])
        same(entry.path, m.paths()[i], f"path of {i}")
        same(entry.dtype, m.dtypes[int(m.dtype[i])], f"dtype of {i}")
        same(entry.dtype, dtype_name(source.dtype), f"dtype name of {i}")
        same(entry.shape, tuple(source.shape), f"shape of {i}")
        same(entry.shape, tuple(m.shapes[pos : pos + ndim].tolist()), f"shape column of {i}")
        same(entry.stride, tuple(m.strides[pos : pos + ndim].tolist()), f"stride column of {i}")
        want_stride = contiguous_stride(entry.shape) if i in gathered else source.stride()
        same(entry.stride, want_stride, f"stride of {i}")
        same(entry.offset, int(m.offset[i]), f"offset of {i}")
        same(entry.nbytes, source.numel() * source.element_size(), f"nbytes of {i}")
        same(entry.block, int(m.block[i]), f"block of {i}")
        same(entry.parameter, type(source) is torch.nn.Parameter, f"parameter flag of {i}")
        same(entry.requires_grad, source.requires_grad, f"requires_grad flag of {i}")
        pos += ndim
    same(pos, len(m.shapes), "all shapes consumed")
    with pytest.raises(IndexError):
        m.entry(len(m))
    with pytest.raises(IndexError):
        m.entry(-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entries[0].offset = 1  # type: ignore[misc]


def test_column_dtypes():
    m = layout.plan(manifest_state()).manifest
    expected = {
        "dtype": np.int16, "ndim": np.int16, "shapes": np.int64, "strides": np.int64,
        "offset": np.int64, "nbytes": np.int64, "block": np.int64, "flags": np.uint8,
        "blocks": np.int64,
    }  # fmt: skip
    for name, dtype in expected.items():
        same(getattr(m, name).dtype, np.dtype(dtype), f"dtype of column {name}")
    same(layout.plan(manifest_state()).host.dtype, np.dtype(np.uint64), "host entries dtype")


def test_every_block_is_a_storage_of_its_own():
    """Each block gets a storage that shares the slot's bytes: views of one source share it, and
    torch.save of the staged state writes each block once, whatever the dtypes."""
    x = torch.randn(64, 64)
    state = {
        "x": x, "xt": x.t(), "steps": torch.tensor(7), "half": torch.randn(3, dtype=torch.float16),
        "g": x[:, ::3], "e": torch.empty(0, 2),
    }  # fmt: skip
    staged, buf = execute(layout.plan(state))
    assert_same(staged, state)
    storages = {k: v.untyped_storage() for k, v in staged.items()}
    check(storages["xt"].data_ptr() == storages["x"].data_ptr(), "transposed view shares its block")
    same(storages["x"].nbytes(), x.nbytes, "a block holds the bytes of its source")
    same(storages["steps"].nbytes(), 8, "a scalar's block holds 8 bytes")
    for key in ("x", "steps", "half", "g"):
        start = storages[key].data_ptr() - buf.data_ptr()
        check(SLOT_OFFSET <= start < buf.numel(), f"{key} does not view the slot's bytes")
    staged["x"][0, 0] = 42.0  # shares the bytes: the buffer sees the change
    check(buf[SLOT_OFFSET : SLOT_OFFSET + 4].view(torch.float32).item() == 42.0, "not shared")
    saved = io.BytesIO()
    torch.save(staged, saved)  # mixed dtypes: each block's storage has one dtype
    check(saved.tell() < x.nbytes + 16384, f"torch.save wrote {saved.tell()} bytes")
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    assert_same(loaded, staged)


def test_build_substitutes_tensors():
    state = {"a": [torch.ones(1), (torch.ones(2),)], "b": Point(1, torch.ones(3))}
    m = layout.plan(state).manifest
    replacements = [torch.full((1,), 1.0), torch.full((2,), 2.0), torch.full((3,), 3.0)]
    out = build(m.tree, replacements)
    check(out["a"][0] is replacements[0], "first tensor")
    check(out["a"][1][0] is replacements[1], "second tensor")
    check(out["b"].y is replacements[2], "third tensor")
    same(type(out["b"]), Point, "namedtuple")


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4), (3, 1, 2), (0, 0), (1, 1, 1)])
def test_contiguous_stride_matches_torch(shape):
    same(contiguous_stride(shape), torch.empty(shape).stride(), f"stride of {shape}")


def test_dtype_names():
    for name, dtype in DTYPES.items():
        same(dtype_name(dtype), name, "dtype_name")
        check(DTYPES[dtype_name(dtype)] is dtype, "DTYPES lookup")
    for dtype in (torch.float32, torch.bfloat16, torch.complex32, torch.float8_e4m3fn, torch.bool):
        check(dtype_name(dtype) in DTYPES, f"{dtype} missing from DTYPES")
    same(dtype_name(torch.half), "float16", "alias")


def test_rebuild_over_a_bytearray():
    state = manifest_state()
    plan = layout.plan(state)
    m = plan.manifest
    staged, buf = execute(plan)
    data = bytearray(bytes(buf.numpy().tobytes()))
    again = rebuild(m, buffer_storage(data), SLOT_OFFSET)
    assert_same(again, state)


# -- unsupported values ------------------------------------------------------------------------


class MyT(torch.Tensor):
    pass


def _cycle() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


UNSUPPORTED = {
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
    "sparse_coo_tensor": (
        lambda: torch.sparse_coo_tensor(
            torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2)
        ),
        "sparse_coo",
    ),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
    "sparse_csc": (lambda: torch.eye(3).to_sparse_csc(), "sparse_csc"),
    "meta": (lambda: torch.empty(2, 3, device="meta"), "meta"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    "nested_jagged": (
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "subclass",
    ),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
        "quantized",
    ),
    "subclass": (lambda: torch.ones(2).as_subclass(MyT), "MyT"),
    "uninitialized_parameter": (lambda: torch.nn.parameter.UninitializedParameter(), "subclass"),
    "lock": (threading.Lock, "cannot be copied"),
}


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
def test_unsupported_values_name_their_key_path(kind):
    factory, reason = UNSUPPORTED[kind]
    with quiet():
        bad = factory()
    state = {"model": {"layers": [None, {"w": torch.ones(2), 3: bad}]}, "after": torch.ones(1)}
    with pytest.raises(UnsupportedValueError) as info:
        layout.plan(state)
    err = info.value
    check(isinstance(err, TypeError), "UnsupportedValueError is a TypeError")
    path = "state_dict['model']['layers'][1][3]"
    same(err.path, path, "path")
    check(str(err).startswith(path + ": "), f"message {str(err)!r} does not start with the path")
    check(reason in str(err), f"message {str(err)!r} does not mention {reason!r}")


@pytest.mark.parametrize("kind", ["meta", "subclass", "sparse_coo", "lock"])
def test_unsupported_values_in_other_containers(kind):
    factory, _ = UNSUPPORTED[kind]
    with quiet():
        bad = factory()
    cases = [
        (bad, "state_dict"),
        ([torch.ones(1), bad], "state_dict[1]"),
        ((0, (1, bad)), "state_dict[1][1]"),
        (Point(1, bad), "state_dict[1]"),
        ({(1, "a"): {2: [bad]}}, "state_dict[(1, 'a')][2][0]"),
        (collections.OrderedDict(k=AttrDict(v=TaggedList([bad]))), "state_dict['k']['v'][0]"),
        (collections.defaultdict(list, {b"b": bad}), "state_dict[b'b']"),
    ]
    for state, path in cases:
        with pytest.raises(UnsupportedValueError) as info:
            layout.plan(state)
        same(info.value.path, path, "path")
        check(str(info.value).startswith(path + ": "), f"message {str(info.value)!r}")


def test_first_occurrence_is_named_for_a_repeated_bad_tensor():
    bad = torch.empty(1, device="meta")
    with pytest.raises(UnsupportedValueError) as info:
        layout.plan({"a": [torch.ones(1), bad], "b": bad})
    same(info.value.path, "state_dict['a'][1]", "path")


def test_reference_cycles_are_rejected():
    loop = _cycle()
    with pytest.raises(UnsupportedValueError, match="reference cycle") as info:
        layout.plan({"a": {"b": loop}})
    same(info.value.path, "state_dict['a']['b']", "path of the list in the cycle")
    d: dict[str, Any] = {}
    d["self"] = d
    with pytest.raises(UnsupportedValueError, match=r"^state_dict\['x'\]\[1\]: .*cycle"):
        layout.plan({"x": [0, d]})
    with pytest.raises(UnsupportedValueError, match=r"^state_dict: .*cycle"):
        layout.plan(loop)


def test_an_uncopyable_leaf_is_rejected_with_its_cause():
    with pytest.raises(
        UnsupportedValueError, match=r"^state_dict\['opt'\]\[0\]: value of type"
    ) as info:
        layout.plan({"opt": [threading.Lock()]})
    check(info.value.__cause__ is not None, "the deepcopy error is chained")


@pytest.mark.parametrize("kind", ["meta", "sparse_csr", "subclass", "lock", "nested"])
def test_a_failed_plan_stages_nothing(stager, kind):
    factory, _ = UNSUPPORTED[kind]
    with quiet():
        bad = factory()
    # Before the first stage there is no arena, and a bad state dict does not make one.
    with pytest.raises(UnsupportedValueError):
        stager.stage({"bad": bad})
    check(stager.arena is None, "a rejected state dict created an arena")

    good = {"w": torch.randn(4, 4), "v": [torch.arange(3)]}
    first = stager.stage(good)
    generation = stager.handle(first).generation
    stager.release(first)
    del first
    with pytest.raises(UnsupportedValueError) as info:
        stager.stage({"w": torch.randn(4, 4), "nested": {"bad": bad}})
    same(info.value.path, "state_dict['nested']['bad']", "path")
    same([s.state for s in stager.arena.slots], [SlotState.FREE] * len(stager.arena.slots), "slots")
    staged = stage_and_check(stager, good)
    same(stager.handle(staged).generation, generation + 1, "no generation was used by the failure")
    stager.release(staged)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: random_tensor(torch.qint8, (3,)), id="qint8-dtype-plain-tensor"),
        pytest.param(lambda: random_tensor(torch.quint8, (2, 2)).t(), id="quint8-transposed"),
        pytest.param(lambda: random_tensor(DTYPES["uint4"], (4, 4))[:, ::2], id="uint4-strided"),
        pytest.param(lambda: random_tensor(DTYPES["int3"], (6,))[::3], id="int3-strided"),
    ],
)
def test_plan_accepts_only_what_can_be_staged(stager, make):
    t = make()
    state = {"t": t}
    try:
        layout.plan(state)
    except UnsupportedValueError:
        return  # rejected up front: fine
    staged = stager.stage(state)
    assert_same(staged, state)
    stager.release(staged)


# -- property tests ----------------------------------------------------------------------------


@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(state=state_dicts(), slot_offset=st.sampled_from([0, 16, 64, 4096]))
def test_property_round_trip_through_a_buffer(state, slot_offset):
    roundtrip(state, slot_offset)


@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(state=state_dicts())
def test_property_a_plans_view_arguments_are_those_its_columns_give(state):
    # The plan fills them in from its own lists; a manifest that crossed a process works them
    # out from its columns. Both must view the same elements.
    manifest = layout.plan(state).manifest
    crossed = pickle.loads(pickle.dumps(manifest))
    check("view_args" not in crossed.__dict__, "view arguments crossed with the manifest")
    same(manifest.view_args, crossed.view_args, "view arguments")


@settings(
    max_examples=20,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # one stager serves every example
    ],
)
@given(state=state_dicts())
def test_property_round_trip_through_the_stager(stager, state):
    staged = stage_and_check(stager, state)
    stager.release(staged)
    del staged
    gc.collect()
