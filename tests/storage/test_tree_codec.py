"""The JSON check of a manifest's tree (pyshmckpt/storage/tree_codec.py): its fast path agrees
with encoding the tree."""

from __future__ import annotations

import collections
import math
from typing import Any, NamedTuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyshmckpt import UnsupportedValueError
from pyshmckpt.staging import layout
from pyshmckpt.storage import tree_codec


class Pair(NamedTuple):
    a: Any
    b: Any


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x

    def __deepcopy__(self, memo: dict[int, Any]) -> Opaque:
        return Opaque(self.x)


class Name(str):
    pass


def _with_attribute(items: dict[str, Any], attribute: Any) -> collections.OrderedDict[str, Any]:
    """An OrderedDict with an attribute, as a module's state dict has its ``_metadata``."""
    odict = collections.OrderedDict(items)
    odict._metadata = attribute  # type: ignore[attr-defined]
    return odict


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
keys = st.one_of(scalars.filter(lambda k: k == k), st.binary(max_size=3), st.just(Name("n")))
leaves = st.one_of(
    scalars,
    st.binary(max_size=4),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.builds(lambda n: torch.Size([n, 2]), st.integers(0, 3)),
    st.builds(lambda n: torch.ones(n), st.integers(0, 3)),
    st.builds(Opaque, st.integers()),
    st.builds(lambda n: collections.Counter(a=n), st.integers()),
    st.just(Name("subclass")),
)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(collections.OrderedDict),
        st.builds(_with_attribute, st.dictionaries(st.text(max_size=2), inner, max_size=2), inner),
        st.builds(Pair, inner, inner),
    ),
    max_leaves=12,
)


def _encodes(tree: Any) -> bool:
    try:
        tree_codec.encode(tree)
    except UnsupportedValueError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(trees)
def test_check_plain_refuses_exactly_what_encoding_refuses(state):
    tree = layout.plan({"state": state}).manifest.tree
    plain = _encodes(tree)
    if tree_codec._only_plain_values(tree):  # the fast path only ever says yes to plain trees
        assert plain
    try:
        tree_codec.check_plain(tree)
    except UnsupportedValueError:
        assert not plain
    else:
        assert plain


def test_usual_state_dicts_take_the_fast_path():
    state: dict[str, Any] = {f"layer{i}.weight": torch.ones(1) for i in range(100)}
    state["model"] = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)).state_dict()
    state["optimizer"] = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(1)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "name": None}],
    }
    state["step"], state["loss"] = 7, math.inf
    assert tree_codec._only_plain_values(layout.plan(state).manifest.tree)
    odict_with_object = collections.OrderedDict(a=1)
    odict_with_object.extra = Opaque(2)  # type: ignore[attr-defined]
    for unusual in (b"bytes", torch.float16, Opaque(1), (1, Pair(1, 2)), odict_with_object):
        assert not tree_codec._only_plain_values(layout.plan({"x": unusual}).manifest.tree)
