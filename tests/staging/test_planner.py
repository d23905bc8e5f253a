"""Reusing the last layout for the next state dict (pyshmckpt/staging/planner.py): a reused plan
is what a full plan of the same state dict is, and any difference falls back to a full plan.

Every check raises explicitly (``check``/``same``) instead of using ``assert``, so the suite still
checks something under ``python -O`` (PYTHONOPTIMIZE=1).
"""

from __future__ import annotations

import collections
import gc
import math
import weakref
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from pyshmckpt import UnsupportedValueError
from pyshmckpt.staging import layout
from pyshmckpt.staging.manifest import (
    Leaf,
    build,
)
from pyshmckpt.staging.planner import Planner

from layout_checks import (
    assert_identity_and_aliasing,
    assert_manifests_equal,
    assert_same,
    check,
    check_plan,
    execute,
    quiet,
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


# -- Planner: reusing the last layout -------------------------------------------------------------


def base_state() -> dict[str, Any]:
    """A state dict with tied storages, a repeated object, views, leaves and nested containers."""
    w = torch.randn(6, 4)
    buf = torch.arange(32, dtype=torch.float32)
    params = collections.OrderedDict(w=torch.nn.Parameter(torch.randn(3)), b=torch.zeros(2))
    params._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "embed": w,
        "head": w.detach(),  # tied: another object over w's storage
        "again": [w],  # the same object a second time
        "low": buf[:16],
        "high": buf[16:].view(4, 4),  # two views of one buffer
        "wide": torch.randn(5, 2).t(),  # non-contiguous, but dense
        "strided": torch.randn(8)[::2],  # gathered
        "half": torch.ones(3, dtype=torch.float16),
        "empty": torch.empty(0, 3),
        "params": params,
        "point": Counted(torch.ones(2), 2),
        "opt": {"step": 10, "lr": 0.5, "name": "adam", "betas": (0.9, 0.99), "extra": {"k": [1]}},
        # Only tensors, each once: the planner checks such a container's children in one go.
        "layer": {"w": torch.randn(2, 3), "b": torch.randn(3), "g": torch.ones(3)},
    }


class Counted(NamedTuple):
    t: torch.Tensor
    n: int


def assert_plans_equal(got: layout.StagingPlan, want: layout.StagingPlan) -> None:
    """A reused plan must be what a full plan of the same state dict is."""
    assert_manifests_equal(got.manifest, want.manifest)
    same(got.manifest.layout_key, want.manifest.layout_key, "layout key")
    check(np.array_equal(got.host, want.host), f"host rows: {got.host!r} != {want.host!r}")
    same(sorted(got.device), sorted(want.device), "devices")
    same([i for i, _ in got.gathers], [i for i, _ in want.gathers], "gathered tensors")
    for (_, a), (_, b) in zip(got.gathers, want.gathers, strict=True):
        check(a is b, "a gather reads another tensor than a full plan's")
    same(len(got.sources), len(want.sources), "number of sources")
    for a, b in zip(got.sources, want.sources, strict=True):
        check(a is b, "a source is another tensor than a full plan's")


def plan_again(state_dict: Any) -> tuple[Planner, layout.StagingPlan]:
    """A planner that saw `state_dict` once, and its second plan of it."""
    planner = Planner()
    planner.plan(state_dict)
    return planner, planner.plan(state_dict)


def test_planner_reuses_the_layout_of_an_unchanged_state_dict():
    state = base_state()
    planner, again = plan_again(state)
    same((planner.stats.plans, planner.stats.reuses), (1, 1), "plans, reuses")
    check(planner.stats.last_replan is None, "a reason for a replan that did not happen")
    assert_plans_equal(again, layout.plan(state))
    check_plan(again)
    staged, _ = execute(again)
    assert_same(staged, state)
    assert_identity_and_aliasing(staged, state, again)


def test_reused_plans_stage_the_values_of_the_moment():
    state = base_state()
    planner = Planner()
    planner.plan(state)
    with torch.no_grad():
        state["embed"].mul_(2)
        state["low"].fill_(-1.5)
        state["params"]["w"].add_(3)
    state["opt"]["step"] = 11
    state["opt"]["extra"]["k"][0] = 2  # appending would change the structure: a full plan
    state["point"] = Counted(state["point"].t, 3)
    again = planner.plan(state)
    same(planner.stats.reuses, 1, "reuses")
    staged, _ = execute(again)
    assert_same(staged, state)
    same(staged["opt"]["step"], 11, "a changed leaf")
    same(staged["opt"]["extra"], {"k": [2]}, "a changed leaf inside nested containers")
    same(staged["point"].n, 3, "a changed named tuple leaf")
    same(staged["params"]._metadata, {"": {"version": 1}}, "module metadata")
    # Leaves are snapshots: changing them after planning changes nothing staged.
    state["opt"]["betas"] = (0.5, 0.5)
    state["params"]._metadata[""]["version"] = 2
    staged, _ = execute(again)
    same(staged["opt"]["betas"], (0.9, 0.99), "a leaf changed after planning")
    same(staged["params"]._metadata, {"": {"version": 1}}, "metadata changed after planning")


def test_a_tensor_replaced_by_another_of_the_same_layout_is_read_from_its_own_memory():
    state = base_state()
    planner = Planner()
    planner.plan(state)
    state["half"] = torch.full((3,), 7, dtype=torch.float16)
    w = torch.randn(6, 4)  # a new tied pair, at new addresses
    state["embed"], state["head"], state["again"] = w, w.detach(), [w]
    state["params"]["w"].data = torch.randn(3)  # .data swaps the storage of the same object
    again = planner.plan(state)
    same(planner.stats.reuses, 1, "reuses")
    assert_plans_equal(again, layout.plan(state))
    staged, _ = execute(again)
    assert_same(staged, state)
    assert_identity_and_aliasing(staged, state, again)


def test_a_storage_freed_and_reallocated_at_the_same_address_is_planned_right():
    # Addresses repeat after a free: the check compares the sharing pattern of the new addresses,
    # never the new addresses with the old ones.
    a, b = torch.randn(1024), torch.randn(1024)
    planner = Planner()
    planner.plan({"a": a, "b": b})
    address = b.data_ptr()
    del b
    c = torch.randn(1024)  # likely at b's old address
    state = {"a": a, "b": c}
    again = planner.plan(state)
    same(planner.stats.reuses, 1, "reuses")
    assert_plans_equal(again, layout.plan(state))
    staged, _ = execute(again)
    assert_same(staged, state)
    # b's old address, now as a view of a: the pattern changed, so a full plan.
    state = {"a": a, "b": a[:1024]}
    again = planner.plan(state)
    same(planner.stats.plans, 2, f"plans (old address reused: {c.data_ptr() == address})")
    assert_plans_equal(again, layout.plan(state))


def _tie(state: dict[str, Any]) -> None:
    state["low"] = state["embed"].view(-1)[:16]  # was an independent view of another buffer


def _untie(state: dict[str, Any]) -> None:
    state["head"] = state["embed"].clone()


def _merge_objects(state: dict[str, Any]) -> None:
    state["head"] = state["embed"]  # two tensors of one storage become one object twice


def _split_object(state: dict[str, Any]) -> None:
    state["again"] = [state["embed"].detach()]  # one object twice becomes two objects


def _resize(state: dict[str, Any]) -> None:
    state["half"].resize_(4)


def _resize_same_shape(state: dict[str, Any]) -> None:
    # The same shape again, but in new memory (set_ keeps the object, swaps the storage).
    half = state["half"]
    half.set_(torch.full((3,), 9, dtype=torch.float16))


def _transpose_in_place(state: dict[str, Any]) -> None:
    state["high"].t_()


def _unsqueeze_in_place(state: dict[str, Any]) -> None:
    state["half"].unsqueeze_(0)


def _set_data_other_dtype(state: dict[str, Any]) -> None:
    state["params"]["w"].data = torch.randn(3, dtype=torch.float64)


def _requires_grad(state: dict[str, Any]) -> None:
    state["half"].requires_grad_(True)


def _to_parameter(state: dict[str, Any]) -> None:
    state["half"] = torch.nn.Parameter(state["half"], requires_grad=False)


def _storage_offset(state: dict[str, Any]) -> None:
    state["low"] = state["low"]._base[1:17] if state["low"]._base is not None else None


def _conj(state: dict[str, Any]) -> None:
    state["complex"] = torch.randn(3, dtype=torch.complex64).conj()


def _neg_bit(state: dict[str, Any]) -> None:
    state["half"] = torch._neg_view(state["half"])


def _leaf_to_tensor(state: dict[str, Any]) -> None:
    state["opt"]["step"] = torch.tensor(10)


def _tensor_to_leaf(state: dict[str, Any]) -> None:
    state["half"] = 3


def _container_type(state: dict[str, Any]) -> None:
    state["opt"] = collections.OrderedDict(state["opt"])


def _list_to_tuple(state: dict[str, Any]) -> None:
    state["again"] = tuple(state["again"])


class _Subclass(torch.Tensor):
    pass


def _reorder(state: dict[str, Any]) -> None:
    state["embed"] = state.pop("embed")


CHANGES = {
    "new key": lambda s: s.update(new=torch.ones(2)),
    "key removed": lambda s: s.pop("half"),
    "keys reordered": _reorder,
    "new key in an OrderedDict": lambda s: s["params"].update(c=torch.ones(1)),
    "list grows": lambda s: s["again"].append(torch.ones(1)),
    "shape": lambda s: s.update(half=torch.ones(4, dtype=torch.float16)),
    "dtype": lambda s: s.update(half=torch.ones(3, dtype=torch.bfloat16)),
    "stride": lambda s: s.update(wide=torch.randn(2, 5)),
    "storage offset": _storage_offset,
    "contiguous becomes gathered": lambda s: s.update(half=torch.ones(6, dtype=torch.float16)[::2]),
    "tied storage untied": _untie,
    "independent storages tied": _tie,
    "two objects become one": _merge_objects,
    "one object becomes two": _split_object,
    "in-place resize": _resize,
    "in-place transpose": _transpose_in_place,
    "in-place unsqueeze": _unsqueeze_in_place,
    ".data of another dtype": _set_data_other_dtype,
    "requires_grad": _requires_grad,
    "tensor becomes a Parameter": _to_parameter,
    "lazy conjugate": _conj,
    "lazy negation": _neg_bit,
    "leaf becomes a tensor": _leaf_to_tensor,
    "tensor becomes a leaf": _tensor_to_leaf,
    "container type": _container_type,
    "list becomes a tuple": _list_to_tuple,
    "tensor of an all-tensor dict becomes a subclass": lambda s: s["layer"].update(
        b=s["layer"]["b"].as_subclass(_Subclass)
    ),
    "tensor of an all-tensor dict becomes a leaf": lambda s: s["layer"].update(g=1.0),
    "two tensors of an all-tensor dict become one": lambda s: s["layer"].update(b=s["layer"]["g"]),
    "all-tensor dict grows": lambda s: s["layer"].update(z=torch.ones(1)),
    "meta tensor": lambda s: s.update(half=torch.ones(3, dtype=torch.float16, device="meta")),
}


def test_planning_runs_no_automatic_garbage_collection():
    # A plan allocates per tensor; the collections that would trigger cost in proportion to every
    # object of the process, not to the state dict.
    state = {f"w{i}": torch.ones(2) for i in range(256)}
    started: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    def collections_during(call: Any) -> int:
        gc.collect()  # counts from zero: a collection every 100 allocations, but in the pause
        del started[:]
        call()
        return len(started)

    planner = Planner()
    threshold = gc.get_threshold()
    gc.set_threshold(100)
    gc.callbacks.append(note)
    try:
        # Thousands of allocations each; at most the one young collection they were owed, once
        # the pause ends.
        check(collections_during(lambda: layout.plan(state)) <= 1, "collections in plan()")
        check(collections_during(lambda: planner.plan(state)) <= 1, "collections, full plan")
        check(collections_during(lambda: planner.plan(state)) <= 1, "collections in a reuse")
        same(gc.isenabled(), True, "collection re-enabled after planning")
        unpaused = collections_during(lambda: [[i] for i in range(1000)])
        check(unpaused > 1, "one collection for 1,000 allocations (the check could not fail)")
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*threshold)
    same(planner.stats.reuses, 1, "reuses")


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_every_change_of_layout_is_planned_in_full(change):
    state = base_state()
    planner = Planner()
    planner.plan(state)
    CHANGES[change](state)
    try:
        want = layout.plan(state)
    except UnsupportedValueError as exc:  # a change to something unstageable
        with pytest.raises(UnsupportedValueError) as raised:
            planner.plan(state)
        same(str(raised.value), str(exc), "error of a planner")
        same(planner.stats.reuses, 0, "reuses")
        return
    got = planner.plan(state)
    same((planner.stats.plans, planner.stats.reuses), (2, 0), "plans, reuses")
    check(planner.stats.last_replan, "no reason given for the full plan")
    assert_plans_equal(got, want)
    staged, _ = execute(got)
    assert_same(staged, state)
    assert_identity_and_aliasing(staged, state, got)
    # The new layout is the one reused next.
    again = planner.plan(state)
    same(planner.stats.reuses, 1, "reuses of the new layout")
    assert_plans_equal(again, layout.plan(state))


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_with_deferred_flags_every_change_is_planned_in_full_or_caught_by_the_recheck(change):
    state = base_state()
    planner = Planner()
    planner.plan(state, defer_flags=True)
    CHANGES[change](state)
    try:
        want = layout.plan(state)
    except UnsupportedValueError:
        with pytest.raises(UnsupportedValueError):
            planner.plan(state, defer_flags=True)
        return
    got = planner.plan(state, defer_flags=True)
    if planner.stats.reuses:  # only a flag may differ, and the recheck must say so
        check(got.recheck is not None, "a reused plan without its recheck")
        reason = got.recheck()
        check(reason is not None, "the recheck missed the change")
        got = planner.replan(state, got, reason)
        same(planner.stats.last_replan, reason, "reason of the replan")
    same((planner.stats.plans, planner.stats.reuses), (2, 0), "plans, reuses")
    assert_plans_equal(got, want)
    # A full plan replanned takes back no reuse (it was never counted as one).
    planner.replan(state, got, "asked again")
    same((planner.stats.plans, planner.stats.reuses), (3, 0), "plans, reuses")


def test_a_deferred_recheck_of_an_unchanged_state_dict_passes():
    state = base_state()
    planner = Planner()
    check(
        planner.plan(state, defer_flags=True).recheck is None, "a full plan has nothing to recheck"
    )
    again = planner.plan(state, defer_flags=True)
    same(planner.stats.reuses, 1, "reuses")
    same(again.recheck(), None, "recheck")
    assert_plans_equal(again, layout.plan(state))


def test_same_layout_after_a_change_of_storage_is_reused():
    state = base_state()
    planner = Planner()
    planner.plan(state)
    _resize_same_shape(state)
    got = planner.plan(state)
    same(planner.stats.reuses, 1, "reuses")
    assert_plans_equal(got, layout.plan(state))
    staged, _ = execute(got)
    same(staged["half"].tolist(), [9.0, 9.0, 9.0], "bytes of the new storage")


def test_equal_but_different_leaves_are_taken_fresh():
    planner = Planner()
    planner.plan({"x": 0.0, "t": torch.ones(1), "b": 1})
    got = planner.plan({"x": -0.0, "t": torch.ones(1), "b": True})
    same(planner.stats.reuses, 1, "reuses")
    staged = build(got.manifest.tree, got.sources)
    same(math.copysign(1.0, staged["x"]), -1.0, "sign of a zero")
    check(staged["b"] is True, f"{staged['b']!r} instead of True")


def test_a_failed_plan_leaves_nothing_to_reuse():
    planner = Planner()
    good = {"a": torch.ones(2)}
    planner.plan(good)
    with pytest.raises(UnsupportedValueError, match=r"\['a'\]"):
        planner.plan({"a": torch.ones(2).to_sparse()})
    planner.plan(good)
    same((planner.stats.plans, planner.stats.reuses), (2, 0), "plans, reuses")


def test_planner_without_reuse_and_forget():
    state = base_state()
    planner = Planner(reuse=False)
    planner.plan(state)
    planner.plan(state)
    same((planner.stats.plans, planner.stats.reuses), (2, 0), "plans, reuses without reuse")
    planner = Planner()
    planner.plan(state)
    planner.forget()
    planner.plan(state)
    same((planner.stats.plans, planner.stats.reuses), (2, 0), "plans, reuses after forget")


def test_the_planner_keeps_no_tensor_alive():
    planner = Planner()
    t = torch.randn(16)
    ref = weakref.ref(t)
    planner.plan({"t": t, "views": [t[:4]]})
    del t
    gc.collect()
    check(ref() is None, "the planner keeps a planned tensor alive")


def test_pickled_values_are_taken_fresh_on_reuse():
    planner = Planner(pickle_unsupported=True)
    with quiet():
        sparse = torch.eye(3).to_sparse()
        planner.plan({"s": sparse, "t": torch.ones(2)})
        sparse.mul_(2)
        got = planner.plan({"s": sparse, "t": torch.ones(2)})
    same(planner.stats.reuses, 1, "reuses")
    staged = build(got.manifest.tree, got.sources)
    check(torch.equal(staged["s"].to_dense(), 2 * torch.eye(3)), "a stale pickled value")
    # A tensor that travelled pickled and now can be staged: a full plan.
    planner.plan({"s": torch.eye(3), "t": torch.ones(2)})
    same(planner.stats.plans, 2, "plans")


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(first=state_dicts(), second=state_dicts())
def test_property_a_planner_plans_as_plan_does(first, second):
    planner = Planner()
    planner.plan(first)
    for state in (second, second, first):
        got = planner.plan(state)
        assert_plans_equal(got, layout.plan(state))
        staged, _ = execute(got)
        assert_same(staged, state)


def test_a_key_of_another_type_that_compares_equal_is_planned_in_full():
    planner = Planner()
    planner.plan({1: torch.ones(2), "x": 3})
    got = planner.plan({True: torch.ones(2), "x": 3})  # True == 1, and hashes alike
    same(planner.stats.reuses, 0, "reuses")
    staged, _ = execute(got)
    same([type(key) for key in staged], [bool, str], "the keys' types")


def test_containers_of_tensors_seen_once_are_matched_in_one_slice():
    # Only containers whose children are all tensors appearing nowhere else qualify: "layer" (a
    # dict) and "params" (an OrderedDict); not "again" (w is also at "embed"), nor the root or
    # "point" (they hold other values too).
    planner, _ = plan_again(base_state())
    template = planner._template
    runs = template.tensor_runs()
    matched = sorted(node.keys for node in _containers(template.manifest.tree) if id(node) in runs)
    same(matched, [("w", "b"), ("w", "b", "g")], "containers matched in one slice")


def _containers(node: Any) -> list[Any]:
    if type(node) is int or type(node) is Leaf:
        return []
    return [node, *(c for child in node.children for c in _containers(child))]
