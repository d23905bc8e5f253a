"""Placement records of sharded checkpoints: parsing never trusts the file, and the box
arithmetic resharding relies on. (Staging, saving and resharding real DTensors across ranks:
tests/distributed/test_sharded.py.)"""

from __future__ import annotations

import pytest

from pyshmckpt import CheckpointCorruptError
from pyshmckpt.staging.dtensors import ShardInfo
from pyshmckpt.storage import resharding

GOOD = {
    "global_shape": [7, 5],
    "global_stride": [5, 1],
    "global_offset": [4, 3],
    "local_shape": [3, 2],
    "mesh_shape": [2, 2],
    "mesh_dim_names": ["dp", "tp"],
    "coordinate": [1, 1],
    "placements": [["shard", 0], ["shard", 1]],
}


def test_a_placement_round_trips_through_json() -> None:
    info = ShardInfo.from_json(GOOD, "rank3.json")
    assert info.global_offset == (4, 3)
    assert info.local_shape == (3, 2)
    assert info.placements == (("shard", 0), ("shard", 1))
    assert info.is_box
    assert ShardInfo.from_json(info.to_json(), "again") == info


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"global_offset": [5, 3]}, "outside the global tensor"),
        ({"local_shape": [3]}, "outside the global tensor"),
        ({"global_offset": [-1, 0]}, "outside the global tensor"),
        ({"global_shape": "7x5"}, "malformed placement"),
        ({"placements": 3}, "malformed placement"),
        ({"local_shape": [True, 2]}, "malformed placement"),
    ],
)
def test_a_malformed_placement_is_reported_as_corruption(change: dict, message: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=message):
        ShardInfo.from_json({**GOOD, **change}, "rank3.json", "a")
    missing = dict(GOOD)
    del missing["placements"]
    with pytest.raises(CheckpointCorruptError, match="malformed placement"):
        ShardInfo.from_json(missing, "rank3.json", "a")


def test_partial_and_strided_placements_are_not_boxes() -> None:
    assert not ShardInfo.from_json({**GOOD, "placements": [["partial", "sum"]]}, "f").is_box
    strided = {**GOOD, "placements": [["strided_shard", 0, 2], ["shard", 1]]}
    assert not ShardInfo.from_json(strided, "f").is_box


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (((0, 0), (4, 3)), ((0, 3), (4, 2)), None),  # side by side
        (((0, 0), (4, 3)), ((2, 1), (4, 4)), ((2, 1), (4, 3))),
        (((0,), (11,)), ((6,), (5,)), ((6,), (11,))),
        (((), ()), ((), ()), ((), ())),  # scalars
        (((0, 0), (0, 3)), ((0, 0), (4, 3)), None),  # no elements
    ],
)
def test_boxes_overlap_where_both_hold_elements(a, b, expected) -> None:  # type: ignore[no-untyped-def]
    assert resharding._intersect(a, b) == expected
    assert resharding._intersect(b, a) == expected
