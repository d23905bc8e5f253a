"""The state the demo saves and the checks that a restore gives it back bit for bit.

A state is a tree of dicts, lists and tuples with tensors and plain values as leaves (here
{"model", "optim", "step"}). ``snapshot`` keeps a CPU copy of what was saved, ``compare`` checks a
restored tree against it: every tensor bit for bit, tied tensors still one tensor, every other
leaf equal.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def state_nbytes(tree: Any) -> int:
    """Bytes of the distinct storages under `tree` (a tied weight counts once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in _tensors(tree):
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def snapshot(tree: Any) -> Any:
    """A CPU copy of `tree` (tensors cloned, containers rebuilt, tied tensors stay tied)."""
    clones: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy_of(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            # state_dict() gives each name of a tied weight its own tensor object over the same
            # memory: one clone for the same view of the same memory keeps them tied.
            view = (
                str(node.device), node.untyped_storage().data_ptr(), node.storage_offset(),
                tuple(node.shape), node.stride(), node.dtype,
            )  # fmt: skip
            if view not in clones:
                clones[view] = node.detach().to("cpu", copy=True)
            return clones[view]
        if isinstance(node, dict):
            out = copy.copy(node)  # keeps the type (OrderedDict) and its attributes
            for key, value in node.items():
                out[key] = copy_of(value)
            return out
        if isinstance(node, (list, tuple)):
            return type(node)(copy_of(value) for value in node)
        return copy.deepcopy(node)

    return copy_of(tree)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` have the same dtype, shape and bytes (bitwise: a NaN equals the same
    NaN, -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().to("cpu").contiguous().reshape(-1)
    b = b.detach().to("cpu").contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@dataclass
class Comparison:
    """What compare found: equal tensors (and their distinct bytes), tied tensors that are
    still one tensor, other equal leaves, and every difference."""

    tensors: int = 0
    nbytes: int = 0  # of distinct tensors (a tied weight counts once)
    tied: int = 0
    others: int = 0
    mismatches: list[str] = field(default_factory=list)
    first: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (path, restored ptr)


def compare(
    expected: Any, actual: Any, path: str = "state", result: Comparison | None = None
) -> Comparison:
    """Compare two state trees: every tensor bit for bit, every other leaf with ==."""
    result = Comparison() if result is None else result
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            result.mismatches.append(
                f"{path}: a tensor was saved, {type(actual).__name__} came back"
            )
        elif not same_bits(expected, actual):
            result.mismatches.append(
                f"{path}: saved {expected.dtype} {tuple(expected.shape)}, "
                f"restored {actual.dtype} {tuple(actual.shape)} with different bits"
            )
        else:
            result.tensors += 1
            first = result.first.get(id(expected))
            if first is None:
                result.first[id(expected)] = (path, actual.data_ptr())
                result.nbytes += expected.nbytes
            elif first[1] == actual.data_ptr():
                result.tied += 1
            else:
                result.mismatches.append(
                    f"{path} is {first[0]} (tied) in the saved state, a separate copy restored"
                )
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or set(expected) != set(actual):
            got = sorted(map(repr, actual)) if isinstance(actual, dict) else type(actual).__name__
            result.mismatches.append(
                f"{path}: keys {sorted(map(repr, expected))} saved, {got} restored"
            )
        else:
            for key, value in expected.items():
                compare(value, actual[key], f"{path}[{key!r}]", result)
    elif isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            result.mismatches.append(f"{path}: {expected!r} saved, {actual!r} restored")
        else:
            for i, (value, other) in enumerate(zip(expected, actual, strict=True)):
                compare(value, other, f"{path}[{i}]", result)
    elif type(actual) is not type(expected) or actual != expected:
        result.mismatches.append(f"{path}: {expected!r} saved, {actual!r} restored")
    else:
        result.others += 1
    return result


__all__ = ["Comparison", "compare", "same_bits", "snapshot", "state_nbytes"]
